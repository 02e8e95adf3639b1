// Exclusive, non-following file creation; see exclusive_file.hpp for the rules.
#include "common/core/exclusive_file.hpp"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <random>

namespace zeroplus::fs {
namespace {

// Name components only: a '/' or a dot-name would escape or alias the directory descriptor.
bool validName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos;
}

int checked(int fd, UniqueFd* out) {
  if (fd < 0) return -errno;
  *out = UniqueFd(fd);
  return 0;
}

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

std::string randomSuffix() {
  uint64_t bits = 0;
  // getrandom without flags blocks only before the pool is first initialised (early boot).
  if (::getrandom(&bits, sizeof(bits), 0) != static_cast<ssize_t>(sizeof(bits))) {
    std::random_device rd;  // reads the same kernel source through another path
    bits = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }
  static const char* kHex = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 0; i < 16; ++i) out[static_cast<size_t>(i)] = kHex[(bits >> (4 * i)) & 0xF];
  return out;
}

int openDirectory(const std::string& path, UniqueFd* out) {
  if (path.empty()) return -ENOENT;
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0 && (errno == ELOOP || errno == ENOTDIR)) {
    // The last component may be a symbolic link: follow it only when it is this user's or
    // root's own (a /nvme -> /mnt/nvme0 link), the rule fs.protected_symlinks applies.
    struct stat link {};
    if (::lstat(path.c_str(), &link) != 0) return -errno;
    if (!S_ISLNK(link.st_mode)) return -ENOTDIR;
    if (link.st_uid != ::geteuid() && link.st_uid != 0) return -ELOOP;
    fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  }
  return checked(fd, out);
}

int openDirectoryAt(int dirFd, const std::string& path, bool requireOwner, UniqueFd* out) {
  if (path.empty()) return -ENOENT;
  UniqueFd fd;
  if (const int rc = checked(::openat(dirFd, path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC), &fd);
      rc < 0) {
    return rc == -ELOOP ? -ENOTDIR : rc;  // a symbolic link where a directory was expected
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return -errno;
  if (!S_ISDIR(st.st_mode)) return -ENOTDIR;
  if (requireOwner && st.st_uid != ::geteuid()) return -EPERM;
  *out = std::move(fd);
  return 0;
}

namespace {

// The checks a private directory passes after it was opened by name (O_NOFOLLOW): a directory
// of this effective uid; group/other bits are refused unless `fixMode` (one we just created).
int verifyPrivate(int dirFd, const std::string& name, bool fixMode, UniqueFd* out) {
  UniqueFd fd;
  if (const int rc = openDirectoryAt(dirFd, name, /*requireOwner=*/true, &fd); rc < 0) return rc;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return -errno;
  if ((st.st_mode & 077) != 0) return -EACCES;
  if (fixMode && (st.st_mode & 0700) != 0700 && ::fchmod(fd.get(), 0700) != 0) {
    return -errno;  // a umask took some of the owner's bits from the directory we just made
  }
  *out = std::move(fd);
  return 0;
}

}  // namespace

int createPrivateDirectory(int dirFd, const std::string& name, UniqueFd* out) {
  if (!validName(name)) return -EINVAL;
  if (::mkdirat(dirFd, name.c_str(), 0700) != 0) return -errno;
  const int rc = verifyPrivate(dirFd, name, /*fixMode=*/true, out);
  // rmdir removes only an empty directory, never a link or a file: what we just made, or an
  // empty one swapped in under the name (which the caller could not have used either).
  if (rc < 0) ::unlinkat(dirFd, name.c_str(), AT_REMOVEDIR);
  return rc;
}

int ensurePrivateDirectory(int dirFd, const std::string& name, UniqueFd* out) {
  if (!validName(name)) return -EINVAL;
  if (::mkdirat(dirFd, name.c_str(), 0700) != 0 && errno != EEXIST) return -errno;
  return verifyPrivate(dirFd, name, /*fixMode=*/false, out);
}

int createExclusive(int dirFd, const std::string& name, mode_t mode, int extraFlags, UniqueFd* out) {
  if (!validName(name)) return -EINVAL;
  const int flags = O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | extraFlags;
  UniqueFd fd;
  if (const int rc = checked(::openat(dirFd, name.c_str(), flags, mode), &fd); rc < 0) return rc;
  // O_EXCL already guarantees a new regular file; fstat guards against a file system that
  // ignores O_EXCL (old NFS) handing back something else.
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return -errno;
  if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid() || st.st_nlink != 1) {
    return -EEXIST;
  }
  *out = std::move(fd);
  return 0;
}

int createTemporary(int dirFd, const std::string& prefix, mode_t mode, int extraFlags, UniqueFd* out,
                    std::string* name) {
  for (int attempt = 0; attempt < 16; ++attempt) {
    std::string candidate = prefix + randomSuffix();
    const int rc = createExclusive(dirFd, candidate, mode, extraFlags, out);
    if (rc != -EEXIST) {
      if (rc == 0) *name = std::move(candidate);
      return rc;
    }
  }
  return -EEXIST;  // 16 collisions of 64 random bits: someone is filling the directory
}

int openRegularForReading(int dirFd, const std::string& name, bool requireOwner, UniqueFd* out) {
  if (!validName(name)) return -EINVAL;
  UniqueFd fd;
  const int flags = O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC;
  if (const int rc = checked(::openat(dirFd, name.c_str(), flags), &fd); rc < 0) return rc;
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return -errno;
  if (!S_ISREG(st.st_mode)) return -EINVAL;
  if (requireOwner && st.st_uid != ::geteuid()) return -EPERM;
  *out = std::move(fd);
  return 0;
}

}  // namespace zeroplus::fs
