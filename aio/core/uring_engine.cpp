// io_uring engine: one ring per worker thread, each kept full up to queue_depth requests.
#include <sys/uio.h>

#include <cerrno>
#include <cstring>

#include "aio/core/engines.hpp"
#include "aio/core/io_job.hpp"

namespace zeroplus::aio::detail {
namespace {

int setupRing(unsigned depth, io_uring* ring) {
  io_uring_params p{};
  // A CQ twice the SQ lets completions pile up while the worker is busy refilling.
  // COOP_TASKRUN (5.19+) avoids IPIs for completion task work: the worker enters the kernel
  // often enough anyway. Older kernels reject the flag; retry without it.
  p.flags = IORING_SETUP_CQSIZE | IORING_SETUP_COOP_TASKRUN;
  p.cq_entries = 2 * depth;
  int rc = io_uring_queue_init_params(depth, ring, &p);
  if (rc == -EINVAL) {
    p = io_uring_params{};
    p.flags = IORING_SETUP_CQSIZE;
    p.cq_entries = 2 * depth;
    rc = io_uring_queue_init_params(depth, ring, &p);
  }
  return rc;
}

}  // namespace

int UringEngine::create(const EngineOptions& options, std::unique_ptr<Engine>* out) {
  std::unique_ptr<UringEngine> e(new UringEngine(options));
  e->rings_.resize(options.threads);
  for (unsigned i = 0; i < options.threads; ++i) {
    int rc = setupRing(options.queue_depth, &e->rings_[i]);
    if (rc < 0) {
      for (unsigned j = 0; j < i; ++j) io_uring_queue_exit(&e->rings_[j]);
      e->rings_.clear();
      return rc;
    }
  }
  if (options.register_buffers) {
    // Sparse tables (5.19+) let buffers come and go with one update call per ring.
    e->fixed_buffers_ = true;
    for (auto& ring : e->rings_) {
      if (io_uring_register_buffers_sparse(&ring, kMaxRegions) < 0) e->fixed_buffers_ = false;
    }
    if (!e->fixed_buffers_) logOnce("no-fixed", "io_uring fixed buffers unavailable; not using them");
    e->regions_.resize(kMaxRegions);
  }
  for (unsigned i = 0; i < options.threads; ++i) {
    e->threads_.emplace_back([p = e.get(), i] { p->worker(i); });
  }
  *out = std::move(e);
  return 0;
}

UringEngine::UringEngine(const EngineOptions& options) : Engine(options, EngineKind::IoUring) {}

UringEngine::~UringEngine() {
  stopWorkers();  // workers drain the queue and their in-flight requests, then exit
  for (auto& t : threads_) t.join();
  for (auto& ring : rings_) io_uring_queue_exit(&ring);
}

bool UringEngine::registerBuffer(void* base, size_t length) {
  if (!fixed_buffers_ || length == 0 || length > (1ull << 30)) return false;  // 1 GiB cap
  std::lock_guard<std::mutex> lock(regions_mu_);
  unsigned slot = 0;
  while (slot < kMaxRegions && regions_[slot].begin != regions_[slot].end) ++slot;
  if (slot == kMaxRegions) return false;
  iovec iov{base, length};
  __u64 tag = 0;
  for (unsigned i = 0; i < rings_.size(); ++i) {
    int rc = io_uring_register_buffers_update_tag(&rings_[i], slot, &iov, &tag, 1);
    if (rc < 0) {
      iovec none{nullptr, 0};
      for (unsigned j = 0; j < i; ++j) io_uring_register_buffers_update_tag(&rings_[j], slot, &none, &tag, 1);
      logOnce("register-failed", std::string("io_uring buffer registration failed (") +
                                     std::strerror(-rc) + "; RLIMIT_MEMLOCK?); using plain requests");
      return false;
    }
  }
  regions_[slot] = {reinterpret_cast<uintptr_t>(base), reinterpret_cast<uintptr_t>(base) + length};
  regions_gen_.fetch_add(1, std::memory_order_release);
  return true;
}

void UringEngine::unregisterBuffer(void* base) {
  std::lock_guard<std::mutex> lock(regions_mu_);
  for (unsigned slot = 0; slot < regions_.size(); ++slot) {
    if (regions_[slot].begin != reinterpret_cast<uintptr_t>(base) || regions_[slot].begin == regions_[slot].end) continue;
    iovec none{nullptr, 0};
    __u64 tag = 0;
    for (auto& ring : rings_) io_uring_register_buffers_update_tag(&ring, slot, &none, &tag, 1);
    regions_[slot] = {};
    regions_gen_.fetch_add(1, std::memory_order_release);
    return;
  }
}

void UringEngine::worker(unsigned index) {
  io_uring* ring = &rings_[index];
  const unsigned depth = options_.queue_depth;
  std::vector<Request> slots(depth);
  std::vector<unsigned> free_slots;
  for (unsigned i = depth; i-- > 0;) free_slots.push_back(i);
  // Private snapshot of the registered regions, refreshed when the generation moves. take()
  // synchronises with the submitter through the queue mutex, so a transfer submitted after
  // registerBuffer() returned always sees the new generation here.
  std::vector<Region> regions;
  uint64_t gen = ~0ull;
  unsigned inflight = 0;

  auto prep = [&](unsigned s) {
    Request& r = slots[s];
    io_uring_sqe* sqe = io_uring_get_sqe(ring);  // never null: at most `depth` unsubmitted
    int fixed = -1;
    if (r.direct) {
      const auto b = reinterpret_cast<uintptr_t>(r.buf);
      for (unsigned i = 0; i < regions.size(); ++i) {
        if (b >= regions[i].begin && b + r.length <= regions[i].end) fixed = static_cast<int>(i);
      }
    }
    const auto len = static_cast<unsigned>(r.length);
    if (r.job->op() == OpKind::Read) {
      if (fixed >= 0) io_uring_prep_read_fixed(sqe, r.fd, r.buf, len, r.offset, fixed);
      else io_uring_prep_read(sqe, r.fd, r.buf, len, r.offset);
    } else {
      if (fixed >= 0) io_uring_prep_write_fixed(sqe, r.fd, r.buf, len, r.offset, fixed);
      else io_uring_prep_write(sqe, r.fd, r.buf, len, r.offset);
    }
    io_uring_sqe_set_data64(sqe, s);
  };

  for (;;) {
    // Refill: take as many requests as fit, block only when nothing at all is in flight.
    while (inflight < depth) {
      const unsigned s = free_slots.back();
      if (!queue_->take(&slots[s], /*block=*/inflight == 0)) break;
      free_slots.pop_back();
      ++inflight;
      if (fixed_buffers_ && regions_gen_.load(std::memory_order_acquire) != gen) {
        std::lock_guard<std::mutex> lock(regions_mu_);
        regions = regions_;
        gen = regions_gen_.load(std::memory_order_relaxed);
      }
      prep(s);
    }
    if (inflight == 0) return;  // stopped and drained

    // One syscall submits the whole batch and waits for at least one completion.
    int rc = io_uring_submit_and_wait(ring, 1);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY) {
      // The ring itself is broken: fail what is in flight rather than hang the waiters.
      for (unsigned s = 0; s < depth; ++s) {
        if (!slots[s].job) continue;
        slots[s].job->fail(-rc, slots[s].offset, slots[s].length, "io_uring_enter");
        slots[s].job->requestsDone(1);
        slots[s].job.reset();
        free_slots.push_back(s);
      }
      inflight = 0;
      continue;
    }
    unsigned head, seen = 0;
    io_uring_cqe* cqe;
    io_uring_for_each_cqe(ring, head, cqe) {
      ++seen;
      const auto s = static_cast<unsigned>(io_uring_cqe_get_data64(cqe));
      Request& r = slots[s];
      if (!r.job->applyResult(r, cqe->res)) {
        prep(s);  // remainder of a short transfer, or EAGAIN: goes out with the next submit
        continue;
      }
      std::shared_ptr<Job> job = std::move(r.job);
      free_slots.push_back(s);
      --inflight;
      job->requestsDone(1);
    }
    io_uring_cq_advance(ring, seen);
  }
}

}  // namespace zeroplus::aio::detail
