#include "aio/core/durability.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "aio/core/io_error.hpp"
#include "common/core/exclusive_file.hpp"

namespace zeroplus::aio {
namespace {

std::string parentDir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

void preallocate(const File& file, uint64_t offset, uint64_t length) {
  if (length == 0) return;
  if (::fallocate(file.bufferedFd(), 0, static_cast<off_t>(offset), static_cast<off_t>(length)) == 0) {
    return;
  }
  const int err = errno;
  if (err != EOPNOTSUPP) throw IoError("fallocate", file.path(), offset, length, err);
  logOnce("no-fallocate", "fallocate not supported on '" + file.path() + "'; extending with ftruncate");
  if (file.size() < offset + length &&
      ::ftruncate(file.bufferedFd(), static_cast<off_t>(offset + length)) != 0) {
    throw IoError("ftruncate", file.path(), offset, length, errno);
  }
}

void syncData(const File& file) {
  if (::fdatasync(file.bufferedFd()) != 0) throw IoError("fdatasync", file.path(), 0, 0, errno);
}

void syncAll(const File& file) {
  if (::fsync(file.bufferedFd()) != 0) throw IoError("fsync", file.path(), 0, 0, errno);
}

void syncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw IoError("open(directory)", dir, 0, 0, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw IoError("fsync(directory)", dir, 0, 0, err);
}

AtomicFile::AtomicFile(const std::string& path, DirectMode direct) : path_(path) {
  dir_ = parentDir(path);
  name_ = path.substr(path.find_last_of('/') + 1);
  if (name_.empty() || name_ == "." || name_ == "..") throw IoError("open", path, 0, 0, EISDIR);
  fs::UniqueFd dir;
  if (const int rc = fs::openDirectory(dir_, &dir); rc < 0) {
    throw IoError("open(directory)", dir_, 0, 0, -rc,
                  rc == -ELOOP ? "a symbolic link owned by another user; not followed" : "");
  }
  // rename() would replace a FIFO, device node or directory entry with a regular file (an
  // atomic write to /dev/nvme0n1 would swap the device node for a file in /dev): refuse. The
  // name is looked at without following a link: the write replaces the entry, not a target.
  struct stat target {};
  const bool exists = ::fstatat(dir.get(), name_.c_str(), &target, AT_SYMLINK_NOFOLLOW) == 0;
  if (exists && !S_ISREG(target.st_mode)) {
    const int err = S_ISDIR(target.st_mode) ? EISDIR : S_ISLNK(target.st_mode) ? ELOOP : EINVAL;
    throw IoError("open", path, 0, 0, err,
                  std::string("an atomic write replaces regular files only") +
                      (S_ISLNK(target.st_mode) ? " (this is a symbolic link)" : ""));
  }
  // Same directory as the target: rename() is atomic only within one file system.
  fs::UniqueFd fd;
  if (const int rc = fs::createTemporary(dir.get(), "." + name_ + ".tmp-", 0644, 0, &fd, &tempName_); rc < 0) {
    throw IoError("open(O_CREAT|O_EXCL)", dir_ + "/." + name_ + ".tmp-*", 0, 0, -rc);
  }
  temp_ = dir_ + "/" + tempName_;
  dirFd_ = dir.release();
  // The replacement keeps the permissions of the file it replaces (a 0600 secret must not
  // become world-readable by being rewritten).
  if (exists && ::fchmod(fd.get(), target.st_mode & 07777) != 0) {
    const int err = errno;
    removeTemp();
    ::close(dirFd_);
    throw IoError("fchmod", temp_, 0, 0, err);
  }
  try {
    file_ = File::adopt(fd.release(), temp_, direct);
  } catch (...) {
    removeTemp();
    ::close(dirFd_);
    throw;
  }
}

void AtomicFile::removeTemp() noexcept { ::unlinkat(dirFd_, tempName_.c_str(), 0); }

AtomicFile::~AtomicFile() {
  if (!committed_) removeTemp();
  ::close(dirFd_);
}

void AtomicFile::commit() {
  if (committed_) return;
  try {
    syncAll(*file_);
    if (::renameat(dirFd_, tempName_.c_str(), dirFd_, name_.c_str()) != 0) {
      throw IoError("rename", temp_ + " -> " + path_, 0, 0, errno);
    }
    committed_ = true;  // the temp name is gone now; never unlink the target
    if (::fsync(dirFd_) != 0) throw IoError("fsync(directory)", dir_, 0, 0, errno);
  } catch (...) {
    if (!committed_) removeTemp();
    committed_ = true;
    throw;
  }
}

}  // namespace zeroplus::aio
