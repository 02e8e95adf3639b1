#include "common/core/full_io.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace zeroplus::fs {
namespace {
constexpr int64_t kMaxTransfer = int64_t{1} << 30;
}  // namespace

int pwriteFull(int fd, const void* data, int64_t n, int64_t offset) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, static_cast<size_t>(std::min(n, kMaxTransfer)), offset);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (w == 0) return -EIO;
    p += w, n -= w, offset += w;
  }
  return 0;
}

int preadFull(int fd, void* data, int64_t n, int64_t offset, int64_t* done, bool* ended) {
  auto* p = static_cast<uint8_t*>(data);
  int64_t got = 0;
  int rc = 0;
  bool eof = false;
  while (got < n) {
    const ssize_t r = ::pread(fd, p + got, static_cast<size_t>(std::min(n - got, kMaxTransfer)), offset + got);
    if (r < 0) {
      if (errno == EINTR) continue;
      rc = -errno;
      break;
    }
    if (r == 0) {
      rc = -EIO;
      eof = true;
      break;
    }
    got += r;
  }
  if (done != nullptr) *done = got;
  if (ended != nullptr) *ended = eof;
  return rc;
}

}  // namespace zeroplus::fs
