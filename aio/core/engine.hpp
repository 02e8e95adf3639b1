// zeroplus::aio::Engine: asynchronous file reads and writes of raw host memory (torch-free).
//
// A Transfer (one buffer <-> one file range) is split into block-size requests. Worker threads
// pull requests from one shared queue, so a large transfer is spread over all threads and many
// small transfers keep every thread's queue depth full.
//   * EngineKind::IoUring: one io_uring per worker thread (never shared, so no locks on the
//     submission path); each keeps up to queue_depth requests in flight, submits in batches
//     (one io_uring_enter per refill) and refills as soon as completions arrive.
//   * EngineKind::ThreadPool: threads*queue_depth (at most 64) workers doing blocking
//     pread/pwrite; same API and semantics, used when io_uring is unavailable.
//   * EngineKind::Auto: io_uring, or the thread pool if io_uring_setup fails with ENOSYS,
//     EPERM or EACCES (seccomp, kernel.io_uring_disabled); the fallback is logged once.
//
// Every completion is checked. Short reads/writes are resubmitted for the remainder (through
// the buffered descriptor when the remainder is no longer O_DIRECT-aligned); EAGAIN/EINTR are
// retried; end of file during a read is ENODATA; anything else fails the transfer. The first
// failure of a transfer is stored and rethrown by Ticket::wait() as IoError; its remaining
// requests are not issued.
//
// A range that ends past the largest file offset (2^63 - 1) is refused by submit() with
// IoError(EOVERFLOW). Requests are at most 1 GiB whatever block_size says.
//
// Alignment (O_DIRECT files only) is validated in submit(), before anything is queued: the
// file offset must be a multiple of File::offsetAlign() and the buffer address of
// File::memAlign(), otherwise IoError(EINVAL) is thrown at once. Lengths are free: the
// aligned prefix goes out with O_DIRECT, the unaligned tail (< one block) is done with buffered
// I/O after the prefix completed (ordering matters when both touch one page).
//
// Registered buffers: registerBuffer() pins a region in every ring (io_uring fixed buffers,
// READ_FIXED/WRITE_FIXED), which saves the per-request page pinning; requests whose memory
// lies inside a registered region use it automatically. Registration failure (ENOMEM under
// RLIMIT_MEMLOCK, EOPNOTSUPP for device memory) is logged once and ignored.
//
// Threading: all methods may be called from any thread. Ownership: the caller keeps `buf`
// valid and unaltered until the Ticket is ready; the File is kept alive by the transfer.
// Blocking: submit() never waits for I/O; Ticket::wait() and run() block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "aio/core/file.hpp"

namespace zeroplus::aio {

enum class EngineKind { Auto, IoUring, ThreadPool };
enum class OpKind { Read, Write };

const char* toString(EngineKind kind);

struct EngineOptions {
  EngineKind kind = EngineKind::Auto;
  uint64_t block_size = 1 << 20;  // bytes per request (rounded down to the file's alignment)
  unsigned queue_depth = 32;      // requests in flight per thread
  unsigned threads = 1;           // worker threads (io_uring: one ring each)
  bool register_buffers = true;   // honour registerBuffer() (io_uring only)
};

struct Transfer {
  OpKind op = OpKind::Read;
  std::shared_ptr<const File> file;
  void* buf = nullptr;
  uint64_t offset = 0;
  uint64_t length = 0;
};

namespace detail {
class Job;
class JobQueue;
}  // namespace detail

// Completion of one submitted transfer. Copyable; all copies observe the same transfer.
class Ticket {
 public:
  Ticket() = default;
  explicit Ticket(std::shared_ptr<detail::Job> job) : job_(std::move(job)) {}
  bool ready() const;
  // Blocks until the transfer finished; throws its IoError if it failed (every time called).
  void wait() const;

 private:
  std::shared_ptr<detail::Job> job_;
};

class Engine {
 public:
  // Throws IoError when an explicitly requested kind cannot be set up, std::invalid_argument
  // for zero knobs.
  static std::unique_ptr<Engine> create(const EngineOptions& options);
  virtual ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  EngineKind kind() const noexcept { return kind_; }
  const EngineOptions& options() const noexcept { return options_; }

  Ticket submit(const Transfer& transfer);
  // As submit(transfer); `onDone` is called once the transfer ended (Ticket::ready() is true by
  // then), on the aio worker that finished it, or inside this call for a transfer done
  // synchronously. It must not block or call into the Engine: a waker (set a flag, notify).
  Ticket submit(const Transfer& transfer, std::function<void()> onDone);
  void run(const Transfer& transfer) { submit(transfer).wait(); }

  // Returns true when the region is now registered with every ring. The caller must not
  // unregister (or free) a region while transfers using it are in flight.
  virtual bool registerBuffer(void* base, size_t length) { return false; }
  virtual void unregisterBuffer(void* base) {}

 protected:
  Engine(const EngineOptions& options, EngineKind kind);
  void stopWorkers();  // called by subclass destructors before their state goes away

  EngineOptions options_;
  EngineKind kind_;
  std::unique_ptr<detail::JobQueue> queue_;
};

}  // namespace zeroplus::aio
