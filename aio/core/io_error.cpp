#include "aio/core/io_error.hpp"

#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>

namespace zeroplus::aio {
namespace {

std::string format(const std::string& op, const std::string& path, uint64_t offset,
                   uint64_t length, int err, const std::string& detail) {
  std::string msg = "zeroplus.aio: " + op + " failed on '" + path + "' (offset " +
                    std::to_string(offset) + ", length " + std::to_string(length) +
                    "): " + std::strerror(err) + " (errno " + std::to_string(err) + ")";
  if (!detail.empty()) msg += ": " + detail;
  return msg;
}

}  // namespace

IoError::IoError(std::string op, std::string path, uint64_t offset, uint64_t length, int err,
                 std::string detail)
    : std::runtime_error(format(op, path, offset, length, err, detail)),
      op_(std::move(op)),
      path_(std::move(path)),
      offset_(offset),
      length_(length),
      err_(err),
      detail_(std::move(detail)) {}

int64_t checkErrno(int64_t ret, std::string_view op, std::string_view path, uint64_t offset,
                   uint64_t length) {
  if (ret < 0) {
    throw IoError(std::string(op), std::string(path), offset, length, static_cast<int>(-ret));
  }
  return ret;
}

void logOnce(std::string_view key, std::string_view msg) {
  static std::mutex mu;
  static std::set<std::string, std::less<>> seen;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!seen.emplace(key).second) return;
  }
  std::fprintf(stderr, "[zeroplus.aio] %.*s\n", static_cast<int>(msg.size()), msg.data());
}

}  // namespace zeroplus::aio
