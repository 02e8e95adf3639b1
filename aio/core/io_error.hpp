// zeroplus::aio error policy (torch-free).
//
// Internally every function returns a negative errno (liburing style). At the public edge of
// the core (Engine, File, durability helpers) a failure becomes exactly one exception type,
// IoError, which carries the operation, the path, the file offset and length involved and the
// errno with its strerror text. The torch adapter rethrows it as a c10::Error whose message is
// IoError::what(); Python sees RuntimeError (or OSError-like text) with the same fields.
//
// Threading: IoError is a value type; copying it between threads is safe.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace zeroplus::aio {

class IoError : public std::runtime_error {
 public:
  // `err` is a positive errno value. `detail` adds context beyond strerror (may be empty).
  IoError(std::string op, std::string path, uint64_t offset, uint64_t length, int err,
          std::string detail = {});

  const std::string& op() const noexcept { return op_; }
  const std::string& path() const noexcept { return path_; }
  uint64_t offset() const noexcept { return offset_; }
  uint64_t length() const noexcept { return length_; }
  int error() const noexcept { return err_; }  // positive errno
  const std::string& detail() const noexcept { return detail_; }
  // The same error attributed to the file range of the operation that caused it (an open
  // knows no range; the operation that needed the open does).
  IoError withRange(uint64_t offset, uint64_t length) const {
    return IoError(op_, path_, offset, length, err_, detail_);
  }

 private:
  std::string op_;
  std::string path_;
  uint64_t offset_;
  uint64_t length_;
  int err_;
  std::string detail_;
};

// Throws IoError when `ret` < 0 (a negative errno); returns `ret` otherwise.
int64_t checkErrno(int64_t ret, std::string_view op, std::string_view path, uint64_t offset = 0,
                   uint64_t length = 0);

// Writes "[zeroplus.aio] <msg>" to stderr the first time `key` is seen in this process, so
// fallbacks (no io_uring, no O_DIRECT, no registered buffers) are reported once, not per op.
void logOnce(std::string_view key, std::string_view msg);

}  // namespace zeroplus::aio
