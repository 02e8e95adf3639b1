#include "aio/core/engine.hpp"

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "aio/core/engines.hpp"
#include "aio/core/io_job.hpp"

namespace zeroplus::aio {

const char* toString(EngineKind kind) {
  switch (kind) {
    case EngineKind::Auto: return "auto";
    case EngineKind::IoUring: return "io_uring";
    case EngineKind::ThreadPool: return "threads";
  }
  return "?";
}

bool Ticket::ready() const { return !job_ || job_->ready(); }

void Ticket::wait() const {
  if (job_) job_->wait();
}

Engine::Engine(const EngineOptions& options, EngineKind kind)
    : options_(options), kind_(kind), queue_(std::make_unique<detail::JobQueue>()) {}

Engine::~Engine() = default;

void Engine::stopWorkers() { queue_->stop(); }

std::unique_ptr<Engine> Engine::create(const EngineOptions& options) {
  if (options.block_size == 0 || options.queue_depth == 0 || options.threads == 0) {
    throw std::invalid_argument("zeroplus.aio: block_size, queue_depth and threads must be > 0");
  }
  if (options.kind == EngineKind::ThreadPool) {
    return std::make_unique<detail::ThreadPoolEngine>(options);
  }
  std::unique_ptr<Engine> engine;
  const int rc = detail::UringEngine::create(options, &engine);
  if (rc == 0) return engine;
  // ENOSYS: kernel without io_uring; EPERM/EACCES: seccomp or kernel.io_uring_disabled.
  const bool unavailable = rc == -ENOSYS || rc == -EPERM || rc == -EACCES;
  if (options.kind == EngineKind::IoUring || !unavailable) {
    throw IoError("io_uring_setup", "", 0, 0, -rc);
  }
  logOnce("no-io_uring", std::string("io_uring unavailable (") + std::strerror(-rc) +
                             "); using the thread-pool pread/pwrite engine");
  return std::make_unique<detail::ThreadPoolEngine>(options);
}

Ticket Engine::submit(const Transfer& t) { return submit(t, nullptr); }

Ticket Engine::submit(const Transfer& t, std::function<void()> onDone) {
  if (!t.file) throw std::invalid_argument("zeroplus.aio: Transfer.file is null");
  const char* op = t.op == OpKind::Read ? "read" : "write";
  if (t.length > 0 && t.buf == nullptr) {
    throw IoError(op, t.file->path(), t.offset, t.length, EFAULT, "null buffer");
  }
  // File offsets are off_t (signed 64-bit): a range ending past INT64_MAX would reach the
  // kernel as a negative offset, or wrap around in offset + length.
  constexpr uint64_t kMaxOff = static_cast<uint64_t>(INT64_MAX);
  if (t.offset > kMaxOff || t.length > kMaxOff - t.offset) {
    throw IoError(op, t.file->path(), t.offset, t.length, EOVERFLOW,
                  "offset + length exceeds the largest file offset (2^63 - 1)");
  }
  if (t.op == OpKind::Write && !t.file->writable()) {
    throw IoError(op, t.file->path(), t.offset, t.length, EBADF, "file was opened read-only");
  }
  if (t.file->direct()) {
    // Validated here, up front: a misaligned O_DIRECT request would fail with EINVAL deep in
    // the kernel, after part of the transfer may already have happened.
    const uint64_t oa = t.file->offsetAlign(), ma = t.file->memAlign();
    if (t.offset % oa != 0) {
      throw IoError(op, t.file->path(), t.offset, t.length, EINVAL,
                    "O_DIRECT file offset must be a multiple of " + std::to_string(oa));
    }
    if (reinterpret_cast<uintptr_t>(t.buf) % ma != 0) {
      throw IoError(op, t.file->path(), t.offset, t.length, EINVAL,
                    "O_DIRECT buffer address must be a multiple of " + std::to_string(ma));
    }
  }
  auto job = std::make_shared<detail::Job>(t, options_.block_size, std::move(onDone));
  if (job->requestCount() > 0) queue_->push(job);
  return Ticket(std::move(job));
}

}  // namespace zeroplus::aio
