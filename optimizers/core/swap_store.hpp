// zeroplus::swap::SwapStore: the one swap substrate of the C++ engine (DESIGN.md §2: "records,
// pinned buffer pool, write-behind" under the optimizer, parameter and gradient swappers).
// Torch-free: records (swap_record.hpp) of raw bytes, moved by aio's Engine (aio/core/engine.hpp).
//
//   <parent>/<prefix><16 random hex>/      a private directory (0700, created exclusively)
//       <stem>00003.swp                     one file per record id (0600, created exclusively)
//
// A record lives in a pooled, page-aligned buffer while it is being read, held by its user, or
// written; otherwise only in its file:
//   planReads(keys) the records wanted next, in order: they are read into buffers as buffers
//                  free up (a write ended), without the owner calling again (the read-ahead);
//   prefetch(key)  starts the read of one record now if a buffer is free;
//   fetch(key)     waits for that read (or starts it), takes the checked record and holds the
//                  buffer: the caller works on the payload in place;
//   store(key)     hands the held buffer back to be sealed as generation key.generation and
//                  written (write-behind: the buffer stays busy until the write ends);
//   release(id)    gives a held buffer back unwritten (a reader that changed nothing);
//   overwrite(id)  holds a zero-filled buffer for a record the caller replaces whole (no read:
//                  a checkpoint load), then store()s.
// The pool holds `bufferCount` buffers of `bufferBytes`, allocated on first use. A planned read
// never waits, never grows the pool and never evicts. A fetch that needs a buffer when none is
// free waits for the oldest write in flight, else evicts a record read ahead but not yet
// fetched, else grows the pool. A write that fails keeps its buffer (the record stays in memory,
// "dirty", beyond bufferCount if need be): a fetch of that record uses it without a read and its
// next store writes it again.
//
// Why a thread: a write that ends during the owner's forward/backward frees its buffer for the
// next planned read at once, not when the owner next calls in; and the CRC-32s (one pass over
// every record read and written, swap_record.hpp) run on that thread, not the owner's. The
// store's pump thread seals stored records and submits their writes, checks finished reads, and
// starts planned reads; it sleeps until a transfer ends (aio's onDone callback) or the owner
// hands it work. The owner never waits on a ticket, only for the pump to move a slot on.
//
// Errors are values (liburing style): fetch returns a negative errno and fills a SwapFault
// naming the file; failed writes are reported by poll()/drain(). Only the constructor throws
// (aio::IoError naming the parent directory; std::system_error when the thread cannot start).
// Generation 0 means "never written": fetch gives a zero-filled payload without a read.
//
// Threading: the public methods are for one owner thread (the training thread; not re-entrant),
// and take the store's mutex; the pump thread and the aio workers do the rest. Lifetime: the
// destructor stops the pump (stored records not yet submitted are dropped), waits for every
// transfer in flight, unlinks the files it made and removes the directory (errors there are
// ignored: nothing to report them to).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
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
  uint64_t readsAhead = 0;      // reads started by prefetch() or a plan
  uint64_t readsOnDemand = 0;   // reads started by fetch() itself (nothing read ahead)
  uint64_t fetchesInBuffer = 0; // fetches of a record still in a buffer (being written, dirty): no read
  uint64_t prefetchesRefused = 0;  // prefetch() found no free buffer
  uint64_t readWaitNs = 0;      // fetch() waiting for its read
  uint64_t writeWaitNs = 0;     // waiting for writes: drain(), a buffer from the oldest write, a fetch of a record being written
  uint64_t checksumNs = 0;      // CRC-32 of records read (checkRecord) and written (sealRecord), on the pump thread
  uint64_t evictions = 0;       // records read ahead, dropped unfetched for a fetch that needed a buffer
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
  // A copy: the pump thread updates them.
  SwapStats stats() const;

  // Replaces the read plan: the records wanted next, in the order they will be fetched. Each is
  // read as soon as a buffer is free (records in a buffer already, never written or without a
  // file are skipped; one being written is read after its write, in its turn). fetch() takes a
  // record out of the plan. Never blocks.
  void planReads(std::vector<RecordKey> keys);
  // Starts reading `key`'s record unless it is in a buffer already or was never written.
  // Never allocates past bufferCount and never blocks (a write that has not ended keeps its
  // buffer); false when no buffer is free.
  bool prefetch(const RecordKey& key);
  // Holds `key`'s record in a buffer and points *payload at its payload. 0, or a negative errno
  // with *fault filled (the buffer is given back; the record is unusable).
  int fetch(const RecordKey& key, void** payload, SwapFault* fault);
  // Seals the held record of key.id as `key` and starts its write (the pump thread does both:
  // the call does not wait). A record whose file cannot be created stays in memory, dirty, and
  // is reported by the next poll()/drain().
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
  // Failed writes since the last call; drain() first waits for every write in flight (and for
  // stored records not yet submitted).
  std::vector<SwapFault> poll();
  std::vector<SwapFault> drain();

 private:
  // kFree: nothing; kReading: read in flight; kChecking: read ended, the pump is checking it
  // (unlocked); kReady: read and checked (verdict in err/why), not yet fetched; kHeld: the owner
  // works on it; kSeal: stored, waiting for the pump; kSealing: the pump seals it (unlocked);
  // kWriting: write in flight; kDirty: its last write failed, the buffer is the only copy.
  enum class State { kFree, kReading, kChecking, kReady, kHeld, kSeal, kSealing, kWriting, kDirty };
  struct Slot {
    aio::AlignedBuffer mem;
    State state = State::kFree;
    RecordKey key;          // the record read or written
    uint64_t seq = 0;       // submission order of the transfer in flight (the oldest is waited on first)
    uint64_t length = 0;    // bytes in flight
    bool dirty = false;     // held, and its last write failed (release() keeps it)
    bool keep = false;      // the owner waits for this record's write: keep it in the buffer (kReady)
    bool ahead = false;     // read for a plan or prefetch (evictable while kReady)
    int err = 0;            // kReady: 0, or the positive errno of a read that failed or was refused
    std::string why;
    aio::Ticket ticket;
    std::shared_ptr<aio::File> file;  // kSeal/kSealing: where the write goes
  };
  using Lock = std::unique_lock<std::mutex>;
  bool inFlight(State s) const { return s == State::kReading || s == State::kWriting; }
  // A free buffer without waiting: kFree, or a new one below bufferCount; -1 if none.
  int freeSlot();
  // A buffer for the owner: freeSlot(), else wait for the oldest write, else evict a record read
  // ahead, else grow the pool. Negative errno on allocation failure.
  int acquireForOwner(Lock& lk, uint64_t keepId);
  int newSlot();
  // Starts the read of `key` into slot s (locked; its file exists). 0, or a negative errno when
  // aio refused it (*why says why).
  int startRead(size_t s, const RecordKey& key, bool ahead, std::string* why);
  void startPlannedReads();
  void completeWrite(size_t s);
  void noteInFlight();
  void noteFault(uint64_t id, int err, std::string what);
  std::shared_ptr<aio::File> fileFor(uint64_t id, int* err);
  void pump();
  void wakePump();
  // Submits the slot's transfer (slot.length bytes at offset 0) with the pump's waker as onDone.
  aio::Ticket submit(aio::OpKind op, std::shared_ptr<aio::File> file, Slot& slot);
  // Owner: waits until record `id` is in neither a transfer nor the pump's hands; keeps it in
  // its buffer when a write is in flight. Returns its slot, or -1 when it is not in a buffer.
  int settle(Lock& lk, uint64_t id);

  SwapStoreOptions options_;
  std::string dirPath_, dirName_;
  fs::UniqueFd parentFd_, dirFd_;
  std::unique_ptr<aio::Engine> engine_;
  mutable std::mutex mu_;
  // Wakes the pump: a transfer ended, the owner handed work over, or stop. Shared with the
  // transfers' onDone callbacks, which may run on an aio worker after the store is gone.
  struct Waker {
    std::mutex mu;
    std::condition_variable cv;
    bool flag = false;
    void wake() {
      {
        std::lock_guard<std::mutex> lk(mu);
        flag = true;
      }
      cv.notify_one();
    }
    void sleep() {
      std::unique_lock<std::mutex> lk(mu);
      cv.wait(lk, [&] { return flag; });
      flag = false;
    }
  };
  std::shared_ptr<Waker> waker_ = std::make_shared<Waker>();
  std::condition_variable ownerCv_;  // the owner: a slot moved on
  bool stop_ = false;
  // The owner waits in fetch/overwrite for a buffer: a buffer a write frees goes to it, not to a
  // planned read of a record needed after the one it waits for (that read would then be evicted
  // and done again: the owner's record first).
  bool ownerNeedsBuffer_ = false;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::map<uint64_t, size_t> slotOf_;  // id -> slot, while the record is in a buffer
  std::map<uint64_t, std::shared_ptr<aio::File>> files_;
  std::vector<uint64_t> createdIds_;   // files this store created (removed by the destructor)
  std::deque<RecordKey> plan_;
  std::vector<SwapFault> faults_;
  uint64_t seq_ = 0;
  SwapStats stats_;
  std::thread pump_;  // last: started when everything above exists
};

}  // namespace zeroplus::swap
