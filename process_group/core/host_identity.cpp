// Host and network identities; see host_identity.hpp.
#include "process_group/core/host_identity.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>

#include "common/core/exclusive_file.hpp"

namespace zeroplus::pg::detail {
namespace {

constexpr const char* kTokenName = "zeroplus-host-token";  // in /dev/shm

std::string firstLine(const char* path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line.empty() ? std::string("?") : line;
}

std::string linkTarget(const char* path) {
  char buf[256];
  const ssize_t n = ::readlink(path, buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("?");
}

bool isToken(const std::string& s) {
  return s.size() == 32 && std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
}

// Reads the token through `dir`: the name must be a regular file (never a symbolic link, a
// FIFO or a device: O_NOFOLLOW|O_NONBLOCK, then fstat) holding exactly 32 hex digits. Any
// user's process may have created it (a host has one token for all users), so the owner is
// not checked: the token is no secret, only a name for this /dev/shm. Returns the token, ""
// when the name does not exist, or sets *malformed when something else sits there.
std::string readToken(int dir, bool* malformed) {
  fs::UniqueFd fd;
  const int rc = fs::openRegularForReading(dir, kTokenName, /*requireOwner=*/false, &fd);
  if (rc == -ENOENT) return {};
  if (rc < 0) {
    *malformed = true;
    return {};
  }
  char buf[33];
  ssize_t n = 0;
  while (n < 33) {
    const ssize_t got = ::read(fd.get(), buf + n, sizeof(buf) - static_cast<size_t>(n));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    n += got;
  }
  std::string token(buf, static_cast<size_t>(std::max<ssize_t>(n, 0)));
  if (!isToken(token)) {
    *malformed = true;
    return {};
  }
  return token;
}

// The identity of the /dev/shm mount itself (device and inode of its root): the fallback when
// no token can be read or created. Equal for every process that sees the same tmpfs instance.
std::string mountIdentity(int dir) {
  struct stat st {};
  if (dir < 0 || ::fstat(dir, &st) != 0) return "no-shm";
  return "dev" + std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
}

// The /dev/shm token: read it, or create it. The file is written under an unpredictable
// temporary name created exclusively (common/core/exclusive_file.hpp) and then link()ed into
// place, which fails with EEXIST if another process won the race; a reader thus never sees a
// half-written token. Nothing is ever opened by a name someone else could have planted, and
// an existing token name is never rewritten: a malformed one (a symbolic link, a FIFO, wrong
// contents) is left alone, reported once, and the mount identity used instead; every process
// on this /dev/shm then sees the same malformed entry and makes the same choice.
std::string shmToken() {
  fs::UniqueFd dir;
  // /dev/shm itself is root's (a symbolic link there, /dev/shm -> /run/shm, is root's too).
  if (::access("/dev/shm", F_OK) != 0 || fs::openDirectory("/dev/shm", &dir) < 0) return "no-shm";
  bool malformed = false;
  if (std::string t = readToken(dir.get(), &malformed); !t.empty()) return t;
  if (malformed) {
    static std::once_flag once;
    std::call_once(once, [] {
      std::fprintf(stderr,
                   "zeroplus: /dev/shm/%s is not a regular file of 32 hex digits; leaving it alone and using the "
                   "/dev/shm mount as this host's identity (remove the file to restore the token)\n",
                   kTokenName);
    });
    return mountIdentity(dir.get());
  }
  char token[33];
  std::snprintf(token, sizeof(token), "%s%s", fs::randomSuffix().c_str(), fs::randomSuffix().c_str());
  fs::UniqueFd fd;
  std::string tmp;
  if (fs::createTemporary(dir.get(), std::string(kTokenName) + ".", 0644, 0, &fd, &tmp) == 0) {
    // 0644 (less the umask): other users' jobs on this host read the same token.
    ::fchmod(fd.get(), 0644);
    const bool written = ::write(fd.get(), token, 32) == 32;
    const bool linked = written && ::linkat(dir.get(), tmp.c_str(), dir.get(), kTokenName, 0) == 0;
    ::unlinkat(dir.get(), tmp.c_str(), 0);
    if (linked) return token;
    if (std::string t = readToken(dir.get(), &malformed); !t.empty()) return t;
  }
  // /dev/shm is read-only or full, or lost the race to a malformed entry: the mount itself
  // still tells file systems apart.
  return mountIdentity(dir.get());
}

}  // namespace

std::string hostLabel() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) < 0) return "localhost";
  return buf;
}

std::string networkIdentity() {
  return hostLabel() + "/" + firstLine("/proc/sys/kernel/random/boot_id") + "/" + linkTarget("/proc/self/ns/net");
}

std::string hostIdentity() {
  return firstLine("/proc/sys/kernel/random/boot_id") + "/" + shmToken();
}

}  // namespace zeroplus::pg::detail
