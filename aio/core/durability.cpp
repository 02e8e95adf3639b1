#include "aio/core/durability.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>

#include "aio/core/io_error.hpp"

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
  static std::atomic<uint64_t> counter{0};
  // rename() would replace a FIFO, device node or directory entry with a regular file (an
  // atomic write to /dev/nvme0n1 would swap the device node for a file in /dev): refuse.
  struct stat target {};
  const bool exists = ::stat(path.c_str(), &target) == 0;
  if (exists && !S_ISREG(target.st_mode)) {
    throw IoError("open", path, 0, 0, S_ISDIR(target.st_mode) ? EISDIR : EINVAL,
                  "an atomic write replaces regular files only");
  }
  const std::string dir = parentDir(path);
  const std::string name = path.substr(path.find_last_of('/') + 1);
  // Same directory as the target: rename() is atomic only within one file system.
  temp_ = dir + "/." + name + ".tmp-" + std::to_string(::getpid()) + "-" +
          std::to_string(counter.fetch_add(1));
  OpenOptions o;
  o.write = o.create = o.truncate = true;
  o.direct = direct;
  o.mode = 0644;
  file_ = File::open(temp_, o);
  // The replacement keeps the permissions of the file it replaces (a 0600 secret must not
  // become world-readable by being rewritten).
  if (exists && ::fchmod(file_->bufferedFd(), target.st_mode & 07777) != 0) {
    const int err = errno;
    ::unlink(temp_.c_str());
    throw IoError("fchmod", temp_, 0, 0, err);
  }
}

AtomicFile::~AtomicFile() {
  if (!committed_) ::unlink(temp_.c_str());
}

void AtomicFile::commit() {
  if (committed_) return;
  try {
    syncAll(*file_);
    if (::rename(temp_.c_str(), path_.c_str()) != 0) {
      throw IoError("rename", temp_ + " -> " + path_, 0, 0, errno);
    }
    committed_ = true;  // the temp name is gone now; never unlink the target
    syncDirectory(parentDir(path_));
  } catch (...) {
    if (!committed_) ::unlink(temp_.c_str());
    committed_ = true;
    throw;
  }
}

}  // namespace zeroplus::aio
