#include "aio/core/file.hpp"

#include <fcntl.h>
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

std::shared_ptr<File> File::open(const std::string& path, const OpenOptions& o) {
  std::shared_ptr<File> f(new File());
  f->path_ = path;
  f->writable_ = o.write;
  int flags = O_CLOEXEC | (o.write ? O_RDWR : O_RDONLY);
  if (o.write && o.create) flags |= O_CREAT;
  if (o.write && o.truncate) flags |= O_TRUNC;
  f->buffered_fd_ = ::open(path.c_str(), flags, o.mode);
  if (f->buffered_fd_ < 0) throw IoError("open", path, 0, 0, errno);
  if (o.direct == DirectMode::Off) return f;

  // The buffered open above already created/truncated; the direct open must not repeat that.
  int dfd = ::open(path.c_str(), (flags & ~(O_CREAT | O_TRUNC)) | O_DIRECT);
  if (dfd < 0) {
    int err = errno;
    if (err != EINVAL || o.direct == DirectMode::On) {
      throw IoError("open(O_DIRECT)", path, 0, 0, err);
    }
    logOnce("no-odirect", "O_DIRECT refused (EINVAL) for '" + path +
                              "'; using buffered I/O for files on this file system");
    return f;
  }
  f->direct_fd_ = dfd;
  bool supported = true;
  int rc = queryDirectAlignment(dfd, &f->offset_align_, &f->mem_align_, &supported);
  if (rc < 0) throw IoError("statx", path, 0, 0, -rc);
  if (!supported) {
    if (o.direct == DirectMode::On) {
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
  return static_cast<uint64_t>(st.st_size);
}

}  // namespace zeroplus::aio
