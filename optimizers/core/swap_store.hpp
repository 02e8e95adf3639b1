// zeroplus::swap::SwapStore: the one swap substrate of the C++ engine (DESIGN.md §2: "records,
// pinned buffer pool, write-behind" under the optimizer, parameter and gradient swappers).
// Torch-free: records (swap_record.hpp) of raw bytes, moved by aio's Engine (aio/core/engine.hpp).
//
//   <parent>/<prefix><16 random hex>/      a private directory (0700, created exclusively)
//       <stem>00003.swp                     one file per record id (0600, created exclusively)
//
// A record lives in a pooled, page-aligned buffer while it is being read, held by its user, or
// written; otherwise only in its file:
//   prefetch(key)  starts the read of a record into a free buffer (the read-ahead);
//   fetch(key)     waits for that read (or does it), checks the record and holds the buffer:
//                  the caller works on the payload in place;
//   store(key)     seals the held buffer as generation key.generation and starts its write
//                  (write-behind: the buffer stays busy until the write ends);
//   release(id)    gives a held buffer back unwritten (a reader that changed nothing);
//   overwrite(id)  holds a zero-filled buffer for a record the caller replaces whole (no read:
//                  a checkpoint load), then store()s.
// The pool holds `bufferCount` buffers of `bufferBytes`, allocated on first use. A buffer needed
// when none is free waits for the oldest write in flight. A write that fails keeps its buffer
// (the record stays in memory, "dirty", beyond bufferCount if need be): a fetch of that record
// uses it without a read and its next store writes it again.
//
// Errors are values (liburing style): fetch returns a negative errno and fills a SwapFault
// naming the file; failed writes are reported by poll()/drain(). Only the constructor throws
// (aio::IoError naming the parent directory). Generation 0 means "never written": fetch gives a
// zero-filled payload without a read.
//
// Threading: not thread-safe; one owner calls it (the training thread). The aio workers do the
// I/O. Lifetime: the destructor waits for every transfer in flight, unlinks the files it made
// and removes the directory (errors there are ignored: nothing to report them to).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "aio/core/aligned_buffer.hpp"
#include "aio/core/engine.hpp"
#include "common/core/exclusive_file.hpp"
#include "optimizers/core/swap_record.hpp"

namespace zeroplus::swap {

struct SwapStoreOptions {
  std::string parent;                 // an existing, writable directory
  std::string prefix = "zeroplus-swap-";
  std::string stem = "record-";       // file names: stem + 5-digit id + ".swp"
  size_t bufferBytes = 0;             // capacity of one pooled buffer: the largest record
  size_t bufferCount = 4;
  aio::EngineOptions io;
  aio::DirectMode direct = aio::DirectMode::Auto;
};

struct SwapFault {
  uint64_t id = 0;
  std::string path;
  int err = 0;           // positive errno
  std::string what;      // what failed and why
};

// Counters since construction (a profiler reads differences between two points). Times are
// the caller's thread blocked (or busy) in the store, in nanoseconds of a monotonic clock.
struct SwapStats {
  uint64_t reads = 0, writes = 0, bytesRead = 0, bytesWritten = 0;
  uint64_t waitsForWrite = 0;   // buffers that had to wait for the oldest write
  size_t buffers = 0;           // buffers allocated
  uint64_t readsAhead = 0;      // reads started by prefetch()
  uint64_t readsOnDemand = 0;   // reads started by fetch() itself (nothing read ahead)
  uint64_t fetchesInBuffer = 0; // fetches of a record still in a buffer (being written, dirty): no read
  uint64_t prefetchesRefused = 0;  // prefetch() found no free buffer
  uint64_t readWaitNs = 0;      // fetch() waiting for its read
  uint64_t writeWaitNs = 0;     // waiting for writes: drain(), a buffer from the oldest write, a fetch of a record being written
  uint64_t checksumNs = 0;      // CRC-32 of records read (checkRecord) and written (sealRecord)
  size_t maxInFlight = 0;       // the most transfers (reads + writes) in flight at once
};

class SwapStore {
 public:
  explicit SwapStore(const SwapStoreOptions& options);
  ~SwapStore();
  SwapStore(const SwapStore&) = delete;
  SwapStore& operator=(const SwapStore&) = delete;

  const std::string& directory() const { return dirPath_; }
  std::string pathOf(uint64_t id) const;
  const SwapStats& stats() const { return stats_; }

  // Starts reading `key`'s record unless it is in a buffer already or was never written.
  // Never allocates past bufferCount and never blocks (a write that has not ended keeps its
  // buffer); false when no buffer is free.
  bool prefetch(const RecordKey& key);
  // Holds `key`'s record in a buffer and points *payload at its payload. 0, or a negative errno
  // with *fault filled (the buffer is given back; the record is unusable).
  int fetch(const RecordKey& key, void** payload, SwapFault* fault);
  // Seals the held record of key.id as `key` and starts its write. A record whose file cannot be
  // created stays in memory, dirty, and is reported by the next poll()/drain().
  void store(const RecordKey& key);
  // Gives the held record of `id` back unwritten. A record whose last write failed stays in its
  // buffer, dirty (its file is stale: the buffer is the only copy), as before the fetch.
  void release(uint64_t id);
  // Holds a buffer for record `id` filled with zeros (payloadBytes bytes after the header) without
  // reading the file: the caller replaces the whole payload and store()s it. A read of `id` in
  // flight is waited for and discarded; a write in flight is waited for (its failure is not
  // reported: the record it carried is being replaced). 0, or a negative errno with *fault filled
  // (-EBUSY: the record is held; -EINVAL: larger than a buffer; -ENOMEM).
  int overwrite(uint64_t id, uint64_t payloadBytes, void** payload, SwapFault* fault);
  // Failed writes since the last call; drain() first waits for every write in flight.
  std::vector<SwapFault> poll();
  std::vector<SwapFault> drain();

 private:
  enum class State { kFree, kReading, kHeld, kWriting, kDirty };
  struct Slot {
    aio::AlignedBuffer mem;
    State state = State::kFree;
    uint64_t id = 0;
    uint64_t seq = 0;       // write order (the oldest write is waited for first)
    uint64_t length = 0;    // bytes in flight
    bool dirty = false;     // held, and its last write failed (release() keeps it)
    aio::Ticket ticket;
  };
  // A free buffer: a new one below bufferCount, else the oldest write's once it ended (waited
  // for only with mayWait), else (mayGrow) one past the pool; a negative errno otherwise.
  int acquire(bool mayGrow, bool mayWait);
  void finishWrite(size_t s);
  void noteInFlight();
  void noteFault(uint64_t id, int err, std::string what);
  std::shared_ptr<aio::File> fileFor(uint64_t id, int* err);

  SwapStoreOptions options_;
  std::string dirPath_, dirName_;
  fs::UniqueFd parentFd_, dirFd_;
  std::unique_ptr<aio::Engine> engine_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::map<uint64_t, size_t> slotOf_;  // id -> slot, while the record is in a buffer
  std::map<uint64_t, std::shared_ptr<aio::File>> files_;
  std::vector<uint64_t> createdIds_;   // files this store created (removed by the destructor)
  std::vector<SwapFault> faults_;
  uint64_t seq_ = 0;
  SwapStats stats_;
};

}  // namespace zeroplus::swap
