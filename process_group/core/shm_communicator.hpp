// Internal: the same-host transport. ShmCommunicator is a Communicator that moves allreduce,
// broadcast, allgather, barrier and agreeMin through POSIX shared memory and delegates every
// other op (and everything when a group spans hosts) to the inner TCP communicator.
//
// Selection (maybeCreate, called by Communicator::connect): every rank publishes
// "<mode>|<chunk bytes>|<host id>" through the rendezvous; the host id joins the host name,
// the kernel boot id and the pid and ipc namespaces, so containers that share a host name but
// not /dev/shm are told apart. Shared memory is used iff no rank asked for ZEROPLUS_SHM=off,
// every host id is equal, and every rank could map every peer's segment (also agreed through
// the rendezvous, so all ranks take the same decision). ZEROPLUS_SHM=on turns "cannot" into a
// CommError at connect.
//
// Layout: one segment per rank = a 4 KiB control block (the rank's phase counter, waiter
// count, failed flag and agreement slots) + 2 slots of {in[C], out[C]} (C = shmChunkBytes).
// A rank writes only its own segment and reads everyone's.
//
// Protocol. Each op is a sequence of chunks; every chunk starts with "write own in[slot],
// publish phase, wait until every peer's phase >= mine" and slot = chunk counter & 1.
//   allreduce, chunk <= kShmSmallBytes: 1 sync; every rank reduces the whole chunk from all
//     in[] slots in rank order 0..n-1 straight into the caller's buffers (identical bits).
//   allreduce, larger chunk: 2 syncs; rank q reduces block q (rank order) into its out[slot],
//     publishes, and everyone copies all blocks out: n ranks use n cores' reduction bandwidth
//     and the copies of chunk k overlap peers still reducing (double-buffered slots).
// Why two slots and these syncs suffice (no "slot free" flag): a rank writes in[s] for chunk j
// only after it saw every peer publish the first phase of chunk j-1, which each peer does after
// it finished reading chunk j-2 (the previous user of slot s); out[s] is written after the
// first phase of chunk j, which peers publish after their copy-out of chunk j-1.
//
// Waiting: spin (bounded by spinMicros, with pause), then sleep on a futex over the peer's
// phase word in 10 ms slices; between slices check abort, the deadline, the peer's failed
// flag and whether the peer's pid still exists (so a SIGKILLed peer is a CommError, not a
// hang). Publishing wakes the futex only when a waiter registered (seq_cst Dekker pair).
//
// Fused allreduce (allreduceFused): chunk 0 also carries each rank's candidate count; all ranks
// reduce the first min(count) candidates, so agreeing on the fusion costs no extra sync.
//
// Mismatch: each op's first sync also compares the op descriptor (op_descriptor.hpp: collective,
// dtype, reduce op, root, count) written next to the phase, and a fused batch compares every
// agreed candidate's count, so ranks that called different collectives or sizes all fail with a
// CommError naming both values instead of reducing each other's unrelated bytes. An op that
// moves no bytes still synchronises once for this check.
//
// Errors and threading: as Communicator. Any failure sets this rank's failed flag (peers stop
// waiting at once), aborts the inner TCP mesh and makes the communicator unusable.
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "process_group/core/communicator.hpp"
#include "process_group/core/op_descriptor.hpp"
#include "process_group/core/shm_segment.hpp"

namespace zeroplus::pg::detail {

inline constexpr size_t kShmSmallBytes = 64 * 1024;
// Most queued allreduces one fused transfer takes (their counts live in the control block).
inline constexpr size_t kShmMaxFusedOps = 192;

class ShmCommunicator final : public Communicator {
 public:
  // Returns nullptr when the group should stay on `inner` alone (see Selection above).
  // Throws CommError("connect") on rendezvous timeout or when ZEROPLUS_SHM=on cannot be met.
  static std::unique_ptr<Communicator> maybeCreate(Rendezvous& rendezvous, const CommunicatorOptions& options,
                                                   std::unique_ptr<Communicator>& inner);
  ~ShmCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string transport() const override { return "shm+" + inner_->transport(); }
  void abort() override;
  void abortBecause(int culprit) override;
  bool usable() const override { return !broken_ && inner_->usable(); }

  void broadcast(void* data, size_t bytes, int root, Deadline deadline) override;
  void allreduce(void* data, size_t count, DataType type, ReduceOp op, Deadline deadline) override;
  void allreducev(const std::vector<Span>& spans, DataType type, ReduceOp op, Deadline deadline) override;
  size_t allreduceFused(const std::vector<Span>& candidates, DataType type, ReduceOp op, Deadline deadline) override;
  bool fusesCheaply() const override { return true; }
  uint64_t agreeMin(uint64_t value, Deadline deadline) override;
  void reduce(void* data, size_t count, DataType type, ReduceOp op, int root, Deadline deadline) override;
  void allgather(const void* in, size_t bytes, void* out, Deadline deadline) override;
  void allgatherv(const void* in, void* out, const std::vector<size_t>& counts, const std::vector<size_t>& displs,
                  Deadline deadline) override;
  void gather(const void* in, size_t bytes, void* out, int root, Deadline deadline) override;
  void scatter(const void* in, size_t bytes, void* out, int root, Deadline deadline) override;
  void reduceScatter(const void* in, void* out, size_t count, DataType type, ReduceOp op, Deadline deadline) override;
  void alltoallv(const void* in, const std::vector<size_t>& sendCounts, const std::vector<size_t>& sendDispls,
                 void* out, const std::vector<size_t>& recvCounts, const std::vector<size_t>& recvDispls,
                 Deadline deadline) override;
  void send(const void* data, size_t bytes, int peer, uint32_t tag, Deadline deadline) override;
  void recv(void* data, size_t bytes, int peer, uint32_t tag, Deadline deadline) override;
  void barrier(Deadline deadline) override;

  struct Control;  // the shared control block; defined in shm_communicator.cpp

 private:
  ShmCommunicator(const CommunicatorOptions& options, std::unique_ptr<Communicator> inner,
                  std::vector<ShmSegment> segments, std::vector<int> pids);

  // The funnel of shared-memory ops (see Errors above); `inner` variants delegate with the
  // same failure bookkeeping.
  template <typename Body>
  void run(const char* op, OpDescriptor desc, Deadline deadline, Body&& body);
  template <typename Body>
  void inner(Body&& body);
  [[noreturn]] void fail(int peer, const std::string& what) const;
  // Raises this rank's failed flag (2 + culprit, or 1 without one) unless an earlier failure
  // already did (first cause wins), and wakes peers sleeping on this rank's phase.
  void raiseFailed(int culprit);

  Control& control(int r) const;
  uint8_t* inSlot(int r, unsigned slot) const;
  uint8_t* outSlot(int r, unsigned slot) const;
  void publish();
  void waitAll();
  void waitPeer(int peer, uint32_t target);
  void checkPeer(int peer, bool checkPid);
  void setSpans(const std::vector<Span>& spans);
  template <typename Fn>
  void pieces(size_t a, size_t b, size_t es, Fn&& fn) const;
  void copyIn(unsigned slot, size_t start, size_t count, size_t es);
  // Everything of one allreduce chunk after its first sync: reduce and copy out.
  // ownInSlot: this rank's whole chunk is in its in-slot (else its own block is read from the
  // caller's buffers). copyInChunk copies what peers will read and returns that flag.
  void finishChunk(unsigned slot, size_t start, size_t count, DataType type, ReduceOp op, bool ownInSlot);
  bool copyInChunk(unsigned slot, size_t start, size_t count, size_t es);

  int rank_;
  int size_;
  size_t chunkBytes_;
  std::chrono::microseconds spin_;
  std::unique_ptr<Communicator> inner_;
  std::vector<ShmSegment> segments_;  // [rank]; own segment is segments_[rank_]
  std::vector<int> pids_;
  uint32_t phase_ = 0;   // last phase this rank published
  uint64_t chunk_ = 0;   // chunks started (slot = chunk_ & 1)
  uint64_t agree_ = 0;   // agreeMin calls (proposal slot = agree_ & 1)
  uint64_t ops_ = 0;     // ops run (descriptor slot = ops_ & 1)
  OpDescriptor desc_{};  // the current op's
  bool signaturePending_ = false;  // the current op has not yet compared descriptors
  std::atomic<bool> aborted_{false};
  bool broken_ = false;
  std::string brokenWhat_;
  // Per-op state, valid inside run().
  const char* op_ = "";
  Clock::time_point start_{};
  Deadline deadline_{};
  const std::vector<Span>* spans_ = nullptr;
  std::vector<size_t> prefix_;  // element offsets of spans_
};

}  // namespace zeroplus::pg::detail
