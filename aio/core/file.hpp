// An open file prepared for the engine: an O_DIRECT descriptor when the file system accepts
// one, a buffered descriptor for unaligned tails, and the direct-I/O alignment of the file.
//
// Alignment comes from statx(STATX_DIOALIGN) (Linux 6.1+), else from the logical block size
// of the file's device in sysfs, else 4096: never a hard-coded 512, because 4Kn drives reject
// 512-byte direct I/O. With O_DIRECT the engine requires the file offset and the buffer address
// to be multiples of offsetAlign()/memAlign(); lengths may be anything (the unaligned tail goes
// through the buffered descriptor).
//
// Fallback: DirectMode::Auto opens buffered when O_DIRECT is refused (EINVAL, e.g. tmpfs before
// Linux 6.6, FUSE, overlayfs) and logs that once; DirectMode::On turns the refusal into IoError.
//
// File types: only regular files and block devices (raw NVMe namespaces, as DeepSpeed's swap
// may use) are accepted. Directories fail with EISDIR; FIFOs, sockets and character devices
// with EINVAL, at open() and without blocking (a FIFO's open would otherwise wait for a
// writer, and its pread/pwrite either blocks or silently discards data).
//
// Ownership and threading: a File is immutable after open() and shared (shared_ptr) by every
// transfer that uses it, so it stays open until the last in-flight transfer completes. All
// methods are safe to call from any thread. Errors: open() throws IoError.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>

namespace zeroplus::aio {

enum class DirectMode { Auto, On, Off };

struct OpenOptions {
  bool write = false;     // O_RDWR instead of O_RDONLY
  bool create = false;    // O_CREAT (write only)
  bool truncate = false;  // O_TRUNC (write only)
  DirectMode direct = DirectMode::Auto;
  mode_t mode = 0644;
};

class File {
 public:
  static std::shared_ptr<File> open(const std::string& path, const OpenOptions& options);
  // Takes ownership of `fd`, a regular file opened O_RDWR by the caller (AtomicFile creates it
  // exclusively, common/core/exclusive_file.hpp), and adds the O_DIRECT descriptor as open()
  // does. That one is opened through /proc/self/fd (the same file, never a name someone could
  // have replaced), else by `path` with a check that it is still the same file. `path` is for
  // messages. Closes `fd` and throws IoError on failure.
  static std::shared_ptr<File> adopt(int fd, const std::string& path, DirectMode direct);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const noexcept { return path_; }
  // The descriptor for bulk I/O (O_DIRECT when direct()), and one that is always buffered.
  int fd() const noexcept { return direct_ ? direct_fd_ : buffered_fd_; }
  int bufferedFd() const noexcept { return buffered_fd_; }
  bool direct() const noexcept { return direct_; }
  bool writable() const noexcept { return writable_; }
  // Required alignment of file offsets and lengths / of memory addresses for direct I/O
  // (1 when not direct).
  uint64_t offsetAlign() const noexcept { return direct_ ? offset_align_ : 1; }
  uint64_t memAlign() const noexcept { return direct_ ? mem_align_ : 1; }
  // Current size (fstat; BLKGETSIZE64 for a block device). Throws IoError.
  uint64_t size() const;

 private:
  File() = default;
  static std::shared_ptr<File> attachDirect(const std::shared_ptr<File>& f, const std::string& openPath, int flags,
                                            DirectMode direct, const struct stat& st);
  std::string path_;
  int direct_fd_ = -1;
  int buffered_fd_ = -1;
  bool direct_ = false;
  bool writable_ = false;
  uint64_t offset_align_ = 4096;
  uint64_t mem_align_ = 4096;
};

// Direct-I/O alignment for an open descriptor as described above: returns 0 and fills the
// outputs, or a negative errno. `*supported` is false when statx reports no direct I/O.
int queryDirectAlignment(int fd, uint64_t* offset_align, uint64_t* mem_align, bool* supported);

}  // namespace zeroplus::aio
