// NVMe optimizer offload of the C++ ZeRO engine (Options::offload_optimizer "nvme"): each
// bucket's elementwise optimizer state, and its fp32 master when the master is a copy (bf16
// training, stage 3 under bf16), lives in one swap record (optimizers/core/swap_store.hpp)
// between steps; in memory there remain only the per-segment `step` scalars and which state
// each segment has. The Python engine's offload/swapper.py, on the shared substrate.
//
// The engine drives it (engine.cpp):
//   prefetchAhead()  zero_grad and end of backward: plans the reads of every bucket's record in
//                    the order the step visits them (0, 1, ...); the store reads them into its
//                    buffers as they free up, on its own thread, with no further call: up to
//                    offload_buffer_count records before the step, the rest as the step's
//                    writes end;
//   beginStep()      waits for the previous step's writes (they ran during forward/backward);
//   fetch(b)         waits for bucket b's record (read and CRC-checked on the store's thread)
//                    and points the stepper's state tensors (and the master) at it;
//   store(b)         after the bucket's publish: copies state the stepper created into the
//                    record and hands it back (the store seals and writes it behind, on its
//                    thread); the state tensors become undefined again, the master an empty tensor;
//   endStep()        after the step's last collective: raises c10::Error naming every file and
//                    bucket that failed this step (a failed read or a corrupt record: that bucket
//                    was not stepped; a failed write: its record stays in memory and is written
//                    again at its next store).
// The tensors keep their identity (set_ on the same TensorImpl), so placement and stepper see
// the bound buffer without knowing about swapping.
//
// Buffer size: a record holds the kinds its group's optimizer creates (a master copy, then
// Adam's two moments and max_exp_avg_sq only with amsgrad; SGD's momentum buffer only with
// momentum), so the pool's buffers are sized for the largest bucket's *actual* record (AdamW
// fp32: 2 slots, not room for 4). A group whose hyperparameters change so that it needs one
// more kind (momentum set after the first step, amsgrad switched on) moves its record into a
// larger buffer at that store (the pool's buffers grow to it as they are reused).
//
// Between steps (checkpoints; engine::BucketStates is the one caller):
//   bindForRead(b)   as fetch, but a record that cannot be used raises c10::Error naming its file
//                    and bucket, with nothing bound and nothing kept for endStep;
//   unbind(b)        gives the record back unchanged (no write; a record whose last write failed
//                    stays in memory, its only copy): the state tensors become undefined again,
//                    the master an empty tensor;
//   bindForWrite(b)  binds a fresh, zero-filled record without reading the file (its content is
//                    being replaced: a corrupt record does not stand in the way), with no state
//                    kinds: the caller assigns the master's values and the segments' state
//                    tensors, then store(b) writes them as the next generation.
//
// Lifetime: the swap files live in a private directory under Options::nvme_path created at
// construction and removed, with its files, by the destructor (which waits for the writes).
// Not thread-safe: the training thread only.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "optimizers/adapter/zero/bucket_stepper.hpp"
#include "optimizers/adapter/zero/options.hpp"
#include "optimizers/adapter/zero/placement.hpp"

namespace zeroplus::swap {
class SwapStore;
struct SwapFault;
struct SwapStats;
}  // namespace zeroplus::swap

namespace zeroplus::zero::engine {

class OptimizerSwapper {
 public:
  // Creates the private swap directory and writes the masters that are copies into their
  // records. Throws c10::Error naming options.nvme_path when the directory cannot be made.
  // groupHyper[g]: param group g's hyperparameters at initialize (which state kinds it creates).
  OptimizerSwapper(const Options& options, Placement& placement, std::vector<BucketStepper>& steppers,
                   const std::vector<StepHyper>& groupHyper, int rank);
  ~OptimizerSwapper();

  void prefetchAhead();
  void beginStep() { waitForWrites(); }
  // Waits for the writes in flight (their faults are raised by the next endStep).
  void waitForWrites();
  // false: the record could not be used (the fault is kept for endStep); the master is bound to
  // the parameters' current values so that publish leaves them unchanged; do not step.
  bool fetch(size_t b);
  void store(size_t b);
  // Gives back buffers still held (a step that raised half way), without writing.
  void abandon();
  // Checkpoints (file comment); `op` names the caller in errors.
  void bindForRead(size_t b, const char* op);
  void unbind(size_t b);
  void bindForWrite(size_t b, const char* op);
  void endStep();
  // Collects finished writes without waiting (zero_grad).
  void poll();

  std::string directory() const;
  std::string pathOf(size_t b) const;
  uint64_t bytesRead() const;
  uint64_t bytesWritten() const;
  // Bytes of one pooled buffer (a record's 4 KiB header + the largest payload planned so far).
  size_t bufferBytes() const;
  // The store's counters (swap_store.hpp SwapStats): reads ahead and on demand, time blocked on
  // reads and writes, checksum time; a profiler (bench/zero/bench_cpp_offload.cpp) takes differences.
  swap::SwapStats stats() const;

 private:
  enum Kind : uint8_t { kMaster, kExpAvg, kExpAvgSq, kMaxExpAvgSq, kMomentum, kKinds };
  struct Home {
    bool masterCopy = false;
    int64_t shardNumel = 0;
    std::vector<Kind> slots;              // payload order
    std::vector<uint8_t> has;             // [segment]: bitmask of kinds the segment has
    uint64_t generation = 0;
    bool held = false;
    size_t capacity = 0;                  // slots the record is planned for (grows: grow())
  };
  uint64_t slotBytes(const Home& h) const;
  uint64_t payloadBytes(const Home& h) const { return slotBytes(h) * h.slots.size(); }
  uint64_t layoutTag(const Home& h) const;
  at::Tensor slotTensor(size_t b, size_t k) const;
  at::Tensor paramsShardAsFp32(size_t b) const;
  // Points the master (a copy) and the state tensors of the kinds each segment has at the payload.
  void bind(size_t b, void* payload);
  // Bucket b (held) needs `slots` slots, more than it was planned for: its payload moves into a
  // new buffer of that size (the old one is given back unwritten; the file keeps the last record)
  // and the views are bound to it. false: no buffer (the fault is kept for endStep; nothing views
  // the old buffer; the bucket is not held and its record not written).
  bool grow(size_t b, size_t slots);
  // Plans the reads of buckets first, first + 1, ... (the order every reader visits them in).
  void readAhead(size_t first);
  void noteFaults(std::vector<swap::SwapFault> faults);

  Placement& placement_;
  std::vector<BucketStepper>& steppers_;
  int rank_;
  std::unique_ptr<swap::SwapStore> store_;
  std::vector<Home> homes_;
  std::vector<void*> payloads_;  // [bucket]: the bound payload while held
  std::vector<std::string> faults_;
};

}  // namespace zeroplus::zero::engine
