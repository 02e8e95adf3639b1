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
//                  a checkpoint load), then store()s;
//   adopt(id)      the caller replaced the record's file (a rename over it: a crash-consistent
//                  load): the store drops what it buffered of the old one and opens the new one;
//   forget(id)     drops what the store buffered of the record (its file stays).
// A record never outgrows the buffer it is held in: store() refuses one larger than its buffer
// (heldCapacity(id)); an owner whose record grew while held releases it and overwrite()s it into
// a buffer of the new size. adopt/forget/overwrite refuse a record stored with linger until
// release(id) (its payload is still the owner's view).
// The pool holds `bufferCount` buffers of `bufferBytes`, allocated on first use. reserve() raises
// bufferBytes (records that grow: state an optimizer creates later); a free buffer smaller than
// that is replaced when it is next used, so the pool never holds more than bufferCount buffers of
// the largest size reserved. A planned read never waits, never grows the pool past bufferCount
// and never evicts a record read ahead. A fetch that needs a buffer when none is free waits for
// the oldest write in flight, else evicts a record read ahead but not yet fetched, else grows the
// pool. A write that fails keeps its buffer (the record stays in memory, "dirty", beyond
// bufferCount if need be): a fetch of that record uses it without a read and its next store
// writes it again.
//
// keepWritten (an owner that visits its records in alternating orders: the Python engine): a
// record whose write ended stays in its buffer, "cached", and a fetch of that generation takes
// it without a read (stats().cacheHits), as does one released unchanged (release(id) promises
// the payload was not written); the least recently written cached record is the first
// buffer a read or a fetch takes. store(key, linger) keeps the payload readable by the owner
// after the store (a master the owner publishes after the step) until release(id): the buffer
// is not reused before that.
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
// transfer in flight, unlinks the files it made and removes the directory (inPlace: the files
// only; errors there are ignored: nothing to report them to).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
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
  // true: `parent` IS the store's directory, private and owned by the caller (the Python
  // engine's SwapDirectory: its stale-directory sweep and liveness lock); the store creates no
  // directory there and removes only the files it created. It must be a directory (not a link)
  // of this effective uid without group/other permissions: the constructor throws EPERM else.
  bool inPlace = false;
  std::string prefix = "zeroplus-swap-";
  std::string stem = "record-";       // file names: stem + 5-digit id + ".swp"
  size_t bufferBytes = 0;             // capacity of one pooled buffer: the largest record
  size_t bufferCount = 4;
  aio::EngineOptions io;
  aio::DirectMode direct = aio::DirectMode::Auto;
  bool keepWritten = false;           // cache records whose write ended (see above)
  // Called with every pool buffer right after it is allocated and right before it is freed,
  // under the store's mutex (an adapter pins them for CUDA copies: cudaHostRegister). Optional.
  std::function<void(void*, size_t)> onAllocate, onFree;
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
  uint64_t cacheHits = 0;       // fetches of a record cached since its write (keepWritten): no read
  uint64_t bufferBytes = 0;     // bytes of the buffers allocated now
  uint64_t peakBufferBytes = 0; // the most bytes of buffers allocated at once
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
  // Starts a new peak window: stats().peakBufferBytes becomes the bytes allocated now (a caller
  // measuring one phase, a checkpoint save, resets it first).
  void resetPeak();

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
  // the call does not wait). A record larger than the buffer it is held in (heldCapacity: a
  // buffer allocated before a reserve()) is refused: it stays held as it was, and the next
  // poll()/drain() reports an EINVAL fault naming the file ("store refused"). The record's file
  // is created, or, when a file by its name exists that the store has no descriptor for (a
  // failed adopt), that file is used if it is a regular file of this user (never followed when
  // a link). A record whose file cannot be created (or reserved: the file is
  // preallocated to the record's size, so a full disk shows here) stays in memory, dirty, and
  // is reported by the next poll()/drain() with a `what` starting "create failed". linger: the
  // owner still reads the payload (never writes it) until release(id).
  void store(const RecordKey& key, bool linger = false);
  // Gives the held record of `id` back unwritten. A record whose last write failed stays in its
  // buffer, dirty (its file is stale: the buffer is the only copy), as before the fetch. On a
  // record stored with linger: the owner no longer reads its payload.
  void release(uint64_t id);
  // Raises bufferBytes to at least `bytes` (never lowers it). Buffers in use keep their size.
  void reserve(size_t bytes);
  size_t bufferBytes() const;
  // The payload bytes the buffer holding record `id` can take (a store() of a larger record is
  // refused); 0 when `id` is not held.
  size_t heldCapacity(uint64_t id) const;
  // The file of `id` (pathOf(id)) was replaced by the caller: waits for transfers of the record,
  // drops its buffered copy (dirty or not: the file is the record now) and its unreported write
  // faults, and opens the file found there (a regular file of this user, not a link; the
  // destructor removes it). 0, or a negative errno with *fault filled (-EBUSY: held, or stored
  // with linger and not released: nothing is dropped; the file cannot be opened: the next fetch
  // reports it missing, the next store creates it or uses the one found then).
  int adopt(uint64_t id, SwapFault* fault);
  // As adopt, keeping the file as it is: the caller no longer wants the buffered copy. 0, or
  // -EBUSY (held, or stored with linger and not released: nothing is dropped).
  int forget(uint64_t id);
  // "io_uring" or "threads": the engine moving the bytes.
  const char* engineName() const;
  // Holds a buffer for record `id` filled with zeros (payloadBytes bytes after the header) without
  // reading the file: the caller replaces the whole payload and store()s it. A read of `id` in
  // flight is waited for and discarded; a write in flight is waited for (its failure is not
  // reported: the record it carried is being replaced). 0, or a negative errno with *fault filled
  // (-EBUSY: the record is held, or stored with linger and not released; -EINVAL: larger than a
  // buffer; -ENOMEM).
  int overwrite(uint64_t id, uint64_t payloadBytes, void** payload, SwapFault* fault);
  // Failed writes since the last call; drain() first waits for every write in flight (and for
  // stored records not yet submitted).
  std::vector<SwapFault> poll();
  std::vector<SwapFault> drain();

 private:
  // kFree: nothing; kReading: read in flight; kChecking: read ended, the pump is checking it
  // (unlocked); kReady: read and checked (verdict in err/why), not yet fetched; kHeld: the owner
  // works on it; kSeal: stored, waiting for the pump; kSealing: the pump seals it (unlocked);
  // kWriting: write in flight; kDirty: its last write failed, the buffer is the only copy;
  // kCached: written, the buffer equals the file (keepWritten, or a linger not yet released).
  enum class State { kFree, kReading, kChecking, kReady, kHeld, kSeal, kSealing, kWriting, kDirty, kCached };
  struct Slot {
    aio::AlignedBuffer mem;
    State state = State::kFree;
    RecordKey key;          // the record read or written
    uint64_t seq = 0;       // submission order of the transfer in flight (the oldest is waited on first)
    uint64_t length = 0;    // bytes in flight
    bool dirty = false;     // held, and its last write failed (release() keeps it)
    bool keep = false;      // the owner waits for this record's write: keep it in the buffer (kReady)
    bool ahead = false;     // read for a plan or prefetch (evictable while kReady)
    bool linger = false;    // stored with linger, not released: the owner reads the payload
    bool fromWrite = false; // kReady/kCached: the buffer holds what this store wrote (no read)
    int err = 0;            // kReady: 0, or the positive errno of a read that failed or was refused
    std::string why;
    aio::Ticket ticket;
    std::shared_ptr<aio::File> file;  // kSeal/kSealing: where the write goes
  };
  using Lock = std::unique_lock<std::mutex>;
  bool inFlight(State s) const { return s == State::kReading || s == State::kWriting; }
  // A free buffer without waiting: kFree, a new one below bufferCount, or the least recently
  // written cached record's; -EBUSY if none. Sized to bufferBytes_ (fit).
  int freeSlot();
  // Replaces slot s's buffer by one of bufferBytes_ if it is smaller; negative errno on failure.
  int fit(size_t s, size_t bytes);
  int allocate(aio::AlignedBuffer* mem, size_t bytes);
  void deallocate(aio::AlignedBuffer* mem);
  // Owner: waits for the record's transfers and drops its buffered copy and faults (adopt/forget).
  int drop(Lock& lk, uint64_t id);
  // Creates the record's file or grows its reservation to `bytes`.
  std::shared_ptr<aio::File> fileFor(uint64_t id, uint64_t bytes, int* err, std::string* what);
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
  std::map<uint64_t, uint64_t> reserved_;  // bytes preallocated per file
  size_t bufferBytes_ = 0;             // options_.bufferBytes, raised by reserve()
  std::vector<uint64_t> createdIds_;   // files this store created (removed by the destructor)
  std::deque<RecordKey> plan_;
  std::vector<SwapFault> faults_;
  uint64_t seq_ = 0;
  SwapStats stats_;
  std::thread pump_;  // last: started when everything above exists
};

}  // namespace zeroplus::swap
