#include "aio/core/file.hpp"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>

#include "aio/core/io_error.hpp"

namespace zeroplus::aio {
namespace {

// Logical block size of the device holding the file. For a partition, sysfs has no queue/
// directory of its own, so look in the parent (whole-disk) directory as well.
uint64_t sysfsLogicalBlockSize(dev_t dev) {
  const std::string base = "/sys/dev/block/" + std::to_string(major(dev)) + ":" +
                           std::to_string(minor(dev));
  for (const char* rel : {"/queue/logical_block_size", "/../queue/logical_block_size"}) {
    std::ifstream in(base + rel);
    uint64_t v = 0;
    if (in >> v && v > 0) return v;
  }
  return 0;
}

}  // namespace

int queryDirectAlignment(int fd, uint64_t* offset_align, uint64_t* mem_align, bool* supported) {
  *supported = true;
  struct statx stx {};
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0) {
    if (stx.stx_mask & STATX_DIOALIGN) {
      if (stx.stx_dio_offset_align == 0) {  // the file system says: no direct I/O here
        *supported = false;
        return 0;
      }
      *offset_align = stx.stx_dio_offset_align;
      *mem_align = stx.stx_dio_mem_align ? stx.stx_dio_mem_align : stx.stx_dio_offset_align;
      return 0;
    }
    uint64_t lbs = sysfsLogicalBlockSize(makedev(stx.stx_dev_major, stx.stx_dev_minor));
    *offset_align = *mem_align = lbs ? lbs : 4096;
    return 0;
  }
  if (errno != ENOSYS && errno != EINVAL) return -errno;
  struct stat st {};
  if (fstat(fd, &st) != 0) return -errno;
  uint64_t lbs = sysfsLogicalBlockSize(st.st_dev);
  *offset_align = *mem_align = lbs ? lbs : 4096;
  return 0;
}

namespace {

const char* fileTypeName(mode_t m) {
  if (S_ISFIFO(m)) return "FIFO";
  if (S_ISSOCK(m)) return "socket";
  if (S_ISCHR(m)) return "character device";
  return "special file";
}

// Opens without blocking (O_NONBLOCK: a FIFO with no writer would block open() forever) and
// refuses anything but a regular file or a block device before any byte moves: pread/pwrite on
// a FIFO, socket or character device either blocks, fails with ESPIPE, or (io_uring ignores
// the offset of stream files) "succeeds" into a pipe buffer that is discarded on close.
// O_NONBLOCK is then cleared: io_uring would otherwise return EAGAIN instead of waiting.
int openChecked(const std::string& path, int flags, mode_t mode, const char* op, const struct stat* same_as) {
  const int fd = ::open(path.c_str(), flags | O_NONBLOCK, mode);
  if (fd < 0) throw IoError(op, path, 0, 0, errno);
  struct stat st {};
  int err = 0;
  std::string detail;
  if (::fstat(fd, &st) != 0) {
    err = errno;
  } else if (S_ISDIR(st.st_mode)) {
    err = EISDIR;
  } else if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode)) {
    err = EINVAL;
    detail = std::string("not a regular file or block device (it is a ") + fileTypeName(st.st_mode) + ")";
  } else if (same_as && (st.st_dev != same_as->st_dev || st.st_ino != same_as->st_ino)) {
    err = ESTALE;
    detail = "the path was replaced between the buffered and the O_DIRECT open";
  } else if (::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) {
    err = errno;
  }
  if (err != 0) {
    ::close(fd);
    throw IoError(op, path, 0, 0, err, detail);
  }
  return fd;
}

}  // namespace

std::shared_ptr<File> File::open(const std::string& path, const OpenOptions& o) {
  std::shared_ptr<File> f(new File());
  f->path_ = path;
  f->writable_ = o.write;
  int flags = O_CLOEXEC | (o.write ? O_RDWR : O_RDONLY);
  if (o.write && o.create) flags |= O_CREAT;
  // O_TRUNC is applied only after the type check: truncating is a side effect that must not
  // happen to a file the open then refuses.
  f->buffered_fd_ = openChecked(path, flags, o.mode, "open", nullptr);
  struct stat st {};
  if (::fstat(f->buffered_fd_, &st) != 0) throw IoError("fstat", path, 0, 0, errno);
  if (o.write && o.truncate && S_ISREG(st.st_mode) && ::ftruncate(f->buffered_fd_, 0) != 0) {
    throw IoError("ftruncate", path, 0, 0, errno);
  }
  if (o.direct == DirectMode::Off) return f;
  // The buffered open above already created/truncated; the direct open must not repeat that.
  return attachDirect(f, path, flags & ~O_CREAT, o.direct, st);
}

std::shared_ptr<File> File::adopt(int fd, const std::string& path, DirectMode direct) {
  std::shared_ptr<File> f(new File());
  f->path_ = path;
  f->writable_ = true;
  f->buffered_fd_ = fd;  // owned from here: ~File closes it on every path below
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw IoError("fstat", path, 0, 0, errno);
  if (!S_ISREG(st.st_mode)) throw IoError("open", path, 0, 0, EINVAL, "not a regular file");
  if (direct == DirectMode::Off) return f;
  // A second open file description of the same inode: /proc/self/fd/N names this very file,
  // whatever happens to its directory entry meanwhile.
  const std::string self = "/proc/self/fd/" + std::to_string(fd);
  if (::access(self.c_str(), F_OK) == 0) return attachDirect(f, self, O_CLOEXEC | O_RDWR, direct, st);
  return attachDirect(f, path, O_CLOEXEC | O_RDWR | O_NOFOLLOW, direct, st);
}

std::shared_ptr<File> File::attachDirect(const std::shared_ptr<File>& f, const std::string& openPath, int flags,
                                         DirectMode direct, const struct stat& st) {
  const std::string& path = f->path_;
  int dfd = -1;
  try {
    dfd = openChecked(openPath, flags | O_DIRECT, 0, "open(O_DIRECT)", &st);
  } catch (const IoError& e) {
    // The type was checked by the buffered open, so EINVAL here is the refusal of O_DIRECT.
    if (e.error() != EINVAL || direct == DirectMode::On) throw;
    logOnce("no-odirect", "O_DIRECT refused (EINVAL) for '" + path +
                              "'; using buffered I/O for files on this file system");
    return f;
  }
  f->direct_fd_ = dfd;
  bool supported = true;
  int rc = queryDirectAlignment(dfd, &f->offset_align_, &f->mem_align_, &supported);
  if (rc < 0) throw IoError("statx", path, 0, 0, -rc);
  if (!supported) {
    if (direct == DirectMode::On) {
      throw IoError("open(O_DIRECT)", path, 0, 0, EINVAL, "file system reports no direct I/O");
    }
    logOnce("no-odirect", "no direct I/O for '" + path + "'; using buffered I/O");
    ::close(dfd);
    f->direct_fd_ = -1;
    return f;
  }
  f->direct_ = true;
  return f;
}

File::~File() {
  if (direct_fd_ >= 0) ::close(direct_fd_);
  if (buffered_fd_ >= 0) ::close(buffered_fd_);
}

uint64_t File::size() const {
  struct stat st {};
  if (fstat(buffered_fd_, &st) != 0) throw IoError("fstat", path_, 0, 0, errno);
  if (S_ISBLK(st.st_mode)) {  // st_size is 0 for a block device; ask the device
    uint64_t bytes = 0;
    if (::ioctl(buffered_fd_, BLKGETSIZE64, &bytes) != 0) throw IoError("ioctl(BLKGETSIZE64)", path_, 0, 0, errno);
    return bytes;
  }
  return static_cast<uint64_t>(st.st_size);
}

}  // namespace zeroplus::aio
