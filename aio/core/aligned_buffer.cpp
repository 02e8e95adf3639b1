#include "aio/core/aligned_buffer.hpp"

#include <sys/mman.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "aio/core/io_error.hpp"

namespace zeroplus::aio {
namespace {
size_t roundUp(size_t n, size_t a) { return (n + a - 1) / a * a; }
}  // namespace

void* allocateAligned(size_t bytes, size_t align, bool lock, bool* locked) {
  *locked = false;
  if (align < kPageSize) align = kPageSize;
  // Rounding up to a page must not wrap around to a tiny allocation.
  if (bytes > SIZE_MAX - kPageSize) return nullptr;
  const size_t total = roundUp(bytes == 0 ? 1 : bytes, kPageSize);
  void* p = nullptr;
  if (::posix_memalign(&p, align, total) != 0) return nullptr;
  std::memset(p, 0, total);
  if (lock) {
    if (::mlock(p, total) == 0) {
      *locked = true;
    } else {
      logOnce("mlock", std::string("mlock failed (") + std::strerror(errno) +
                           "): pinned buffers are not page-locked; raise RLIMIT_MEMLOCK "
                           "(ulimit -l) or grant CAP_IPC_LOCK");
    }
  }
  return p;
}

void freeAligned(void* ptr, size_t bytes, bool locked) noexcept {
  if (!ptr) return;
  if (locked) ::munlock(ptr, roundUp(bytes == 0 ? 1 : bytes, kPageSize));
  std::free(ptr);
}

AlignedBuffer::AlignedBuffer(size_t bytes, size_t align, bool lock) : size_(bytes) {
  data_ = allocateAligned(bytes, align, lock, &locked_);
  if (!data_) throw std::bad_alloc();
}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = o.data_;
    size_ = o.size_;
    locked_ = o.locked_;
    o.data_ = nullptr;
    o.size_ = 0;
    o.locked_ = false;
  }
  return *this;
}

void AlignedBuffer::reset() noexcept {
  freeAligned(data_, size_, locked_);
  data_ = nullptr;
  size_ = 0;
  locked_ = false;
}

}  // namespace zeroplus::aio
