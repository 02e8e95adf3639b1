// Page-aligned, page-locked host memory of an exact size (no power-of-two rounding as in
// torch's caching host allocator): the allocation is rounded up only to whole pages, so it can
// be read and written with O_DIRECT and registered with io_uring.
//
// mlock is best effort: it fails beyond RLIMIT_MEMLOCK (often 8 MiB for unprivileged users)
// unless the process has CAP_IPC_LOCK; the buffer is then returned unlocked (locked() false)
// and the first failure is logged once. Memory is zero-filled (this also faults it in).
//
// Ownership: AlignedBuffer is move-only and frees on destruction; release() hands the memory
// to a caller that later calls freeAligned(ptr, size, locked). Thread-safe to create/free.
#pragma once

#include <cstddef>

namespace zeroplus::aio {

constexpr size_t kPageSize = 4096;

// Returns nullptr on allocation failure, including sizes that cannot be rounded up to a page
// without overflow (when bytes == 0 it returns a valid 1-page buffer).
void* allocateAligned(size_t bytes, size_t align, bool lock, bool* locked);
void freeAligned(void* ptr, size_t bytes, bool locked) noexcept;

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // Throws std::bad_alloc when the memory cannot be allocated.
  explicit AlignedBuffer(size_t bytes, size_t align = kPageSize, bool lock = true);
  ~AlignedBuffer() { reset(); }
  AlignedBuffer(AlignedBuffer&& o) noexcept { *this = static_cast<AlignedBuffer&&>(o); }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;

  void* data() const noexcept { return data_; }
  size_t size() const noexcept { return size_; }
  bool locked() const noexcept { return locked_; }
  void reset() noexcept;

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  bool locked_ = false;
};

}  // namespace zeroplus::aio
