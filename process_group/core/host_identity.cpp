// Host and network identities; see host_identity.hpp.
#include "process_group/core/host_identity.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <random>
#include <sstream>

namespace zeroplus::pg::detail {
namespace {

constexpr const char* kTokenPath = "/dev/shm/zeroplus-host-token";

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

std::string readToken() {
  std::ifstream f(kTokenPath);
  std::string token;
  std::getline(f, token);
  return token.size() == 32 ? token : std::string();
}

// The /dev/shm token: read it, or create it. The file is written under a private name and then
// link()ed into place, which fails with EEXIST if another process won the race; a reader thus
// never sees a half-written token.
std::string shmToken() {
  if (std::string t = readToken(); !t.empty()) return t;
  std::random_device rd;
  char token[33];
  std::snprintf(token, sizeof(token), "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  const std::string tmp = std::string(kTokenPath) + "." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd >= 0) {
    const ssize_t n = ::write(fd, token, 32);
    ::close(fd);
    const bool linked = n == 32 && ::link(tmp.c_str(), kTokenPath) == 0;
    ::unlink(tmp.c_str());
    if (linked) return token;
    if (std::string t = readToken(); !t.empty()) return t;
  }
  // /dev/shm is read-only or missing: the mount itself still tells file systems apart.
  struct stat st {};
  if (::stat("/dev/shm", &st) != 0) return "no-shm";
  return "dev" + std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
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
