// Thread-pool engine: the fallback when io_uring is unavailable. Queue depth is emulated by
// threads*queue_depth blocking workers (capped, since each costs a stack and a kernel task).
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "aio/core/engines.hpp"
#include "aio/core/io_job.hpp"

namespace zeroplus::aio::detail {
namespace {
constexpr unsigned kMaxWorkers = 64;
}

ThreadPoolEngine::ThreadPoolEngine(const EngineOptions& options)
    : Engine(options, EngineKind::ThreadPool) {
  const unsigned n = std::clamp(options.threads * options.queue_depth, 1u, kMaxWorkers);
  for (unsigned i = 0; i < n; ++i) threads_.emplace_back([this] { worker(); });
}

ThreadPoolEngine::~ThreadPoolEngine() {
  stopWorkers();
  for (auto& t : threads_) t.join();
}

void ThreadPoolEngine::worker() {
  Request r;
  while (queue_->take(&r, /*block=*/true)) {
    for (;;) {
      const bool read = r.job->op() == OpKind::Read;
      ssize_t n = read ? ::pread(r.fd, r.buf, r.length, static_cast<off_t>(r.offset))
                       : ::pwrite(r.fd, r.buf, r.length, static_cast<off_t>(r.offset));
      if (r.job->applyResult(r, n < 0 ? -errno : n)) break;
    }
    std::shared_ptr<Job> job = std::move(r.job);
    job->requestsDone(1);
  }
}

}  // namespace zeroplus::aio::detail
