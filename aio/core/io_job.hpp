// Internal: how an Engine splits a Transfer into requests and accounts for their completion.
// Shared by the io_uring and thread-pool engines so both have identical semantics.
//
// A Job is one Transfer. Its bulk part (all of it for buffered files, the O_DIRECT-aligned
// prefix otherwise) is cut into `chunk`-byte Requests that workers take from the JobQueue in
// file order. A Request is finished when its bytes are done or its Job failed; the worker that
// finishes the last request performs the unaligned tail (buffered, synchronous, < 1 block) and
// then marks the Job complete, waking Ticket::wait().
//
// Threading: JobQueue is a mutex-protected FIFO; `next_` of a Job is only touched under that
// mutex; completion accounting is atomic; the error slot is guarded by the Job's mutex.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>

#include "aio/core/engine.hpp"
#include "aio/core/io_error.hpp"

namespace zeroplus::aio::detail {

class Job;

// Largest request handed to the kernel, whatever block_size says (see Job::Job).
constexpr uint64_t kMaxRequestBytes = uint64_t{1} << 30;

// One in-flight request: the part of a chunk that is still to be transferred.
struct Request {
  std::shared_ptr<Job> job;
  char* buf = nullptr;
  uint64_t offset = 0;
  uint64_t length = 0;
  int fd = -1;
  bool direct = false;
  int retries = 0;
};

class Job {
 public:
  // onDone (may be empty): called after the Job completed (Engine::submit's contract).
  Job(const Transfer& t, uint64_t block_size, std::function<void()> onDone = {});

  OpKind op() const noexcept { return op_; }
  const File& file() const noexcept { return *file_; }
  uint64_t requestCount() const noexcept { return n_requests_; }

  // Applies one completion result (bytes transferred, or -errno) to `r`. Returns true when the
  // request is finished (done or failed: the caller then calls requestsDone(1)), false when
  // `r` was advanced or must be retried and has to be submitted again.
  bool applyResult(Request& r, int64_t res);

  // Records the first failure; later ones are dropped (the first is the cause).
  void fail(int err, uint64_t offset, uint64_t length, const char* detail = "");
  bool failed() const noexcept { return failed_.load(std::memory_order_acquire); }

  // Accounts for `n` finished (or never issued) requests; the last one completes the Job.
  void requestsDone(uint64_t n);

  bool ready() const;
  void wait() const;

 private:
  friend class JobQueue;
  void finish();

  OpKind op_;
  std::shared_ptr<const File> file_;
  char* buf_;
  uint64_t offset_;
  uint64_t length_;
  std::function<void()> onDone_;
  uint64_t bulk_;        // bytes moved as requests; the rest is the buffered tail
  uint64_t chunk_;       // bytes per request
  uint64_t n_requests_;  // ceil(bulk_ / chunk_)
  uint64_t next_ = 0;    // next request index to hand out (JobQueue mutex)
  std::atomic<uint64_t> done_{0};
  std::atomic<bool> failed_{false};

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool complete_ = false;
  std::optional<IoError> error_;
};

class JobQueue {
 public:
  void push(std::shared_ptr<Job> job);
  // Takes the next request. When `block`, waits until one is available or stop() was called;
  // returns false when none was taken (empty and not blocking, or stopped and drained).
  bool take(Request* out, bool block);
  void stop();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> jobs_;
  bool stopped_ = false;
};

// Blocking pread/pwrite of exactly `length` bytes, looping over short transfers and EINTR.
// Returns 0 or -errno (-ENODATA when a read reaches end of file).
int64_t fullPio(OpKind op, int fd, char* buf, uint64_t length, uint64_t offset);

}  // namespace zeroplus::aio::detail
