// CommStats: per-group communication accounting, calls and bytes per collective type.
//
// What is counted (docs/comm_stats.md has the table): every op a zeroplus group accepts is one
// call of its type, counted on the rank that issued it, and adds its *message size* S in bytes:
// the size nccl-tests prints and DeepSpeed's comms logger logs (the "algbw bytes"), which is the
// same on every rank of a symmetric collective:
//   all_reduce, reduce, broadcast           S = the tensor's bytes
//   all_gather*, gather                     S = the whole gathered result (n x one rank's input)
//   reduce_scatter*, scatter                S = the whole input (n x one rank's output)
//   all_to_all*                             S = this rank's whole send buffer
//   *_coalesced                             S = the sum over the coalesced tensors
//   send / recv                             S = the tensor sent / received
//   barrier                                 S = 0 (a call, no payload)
// busFactor() turns S into the bytes each rank moves over its links with a bandwidth-optimal
// algorithm (nccl-tests' busbw factor): 2(n-1)/n for all_reduce, (n-1)/n for all_gather,
// reduce_scatter, all_to_all, gather and scatter, 1 for broadcast, reduce, send and recv.
//
// Threading: record() is lock-free (two relaxed fetch_adds) and may run on any thread at once;
// it is on the hot path of every op, so it never allocates, locks or orders memory. snapshot()
// and reset() may run concurrently with record(): each counter is read or cleared atomically,
// but a snapshot (or a reset) taken while ops are being issued may see an op's call without its
// bytes, or the other way round. Take them between steps. Torch-free.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace zeroplus::pg {

// The collective types, named after the torch.distributed function that issues them (the
// c10d::Backend method in the comment where the names differ).
enum class CommOp : uint8_t {
  kAllReduce,                     // allreduce
  kAllReduceCoalesced,            // allreduce_coalesced (also _coalescing_manager's all_reduce)
  kReduce,
  kBroadcast,
  kAllGather,                     // allgather (list of outputs)
  kAllGatherIntoTensor,           // _allgather_base
  kAllGatherCoalesced,            // allgather_coalesced
  kAllGatherIntoTensorCoalesced,  // allgather_into_tensor_coalesced
  kGather,
  kScatter,
  kReduceScatter,                 // reduce_scatter (list of inputs)
  kReduceScatterTensor,           // _reduce_scatter_base
  kReduceScatterTensorCoalesced,  // reduce_scatter_tensor_coalesced
  kAllToAll,                      // alltoall (lists)
  kAllToAllSingle,                // alltoall_base
  kSend,
  kRecv,                          // recv and recvAnysource
  kBarrier,
};
inline constexpr size_t kCommOpCount = static_cast<size_t>(CommOp::kBarrier) + 1;

// "all_reduce", "all_gather_into_tensor", ...: the torch.distributed name (unique, stable: the
// Python API's keys).
const char* commOpName(CommOp op);
// The nccl-tests busbw factor of `op` at group size n >= 1 (see above); 0 for barrier.
double busFactor(CommOp op, int groupSize);

struct OpCount {
  uint64_t calls = 0;
  uint64_t bytes = 0;
};

struct CommStatsSnapshot {
  std::array<OpCount, kCommOpCount> ops{};
  const OpCount& operator[](CommOp op) const { return ops[static_cast<size_t>(op)]; }
  OpCount total() const;
};

class CommStats {
 public:
  void record(CommOp op, uint64_t bytes) noexcept {
    Counter& c = counters_[static_cast<size_t>(op)];
    c.calls.fetch_add(1, std::memory_order_relaxed);
    c.bytes.fetch_add(bytes, std::memory_order_relaxed);
  }
  CommStatsSnapshot snapshot() const noexcept;
  void reset() noexcept;

 private:
  struct Counter {
    std::atomic<uint64_t> calls{0};
    std::atomic<uint64_t> bytes{0};
  };
  std::array<Counter, kCommOpCount> counters_{};
};

}  // namespace zeroplus::pg
