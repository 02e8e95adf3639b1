// The C++ ZeRO engine's one collectives seam: every byte the engine moves between ranks goes
// through these calls on the engine's c10d::ProcessGroup (the zeroplus backend, or any other).
//
// The same collectives in the same order as the Python engine (zero/comm.py): a bucket's
// gradients are reduce-scattered (stage 2) or all-reduced (stage 1) with SUM, parameters are
// all-gathered from every rank's shard, the per-step agreement is an all-reduce MAX of one byte
// per parameter, and clipping all-reduces fp32 partial sums. So with the same backend both
// front-ends produce the same bits. (Python's gloo-only per-owner form is not used here: the
// LibTorch front-end runs on the group the program made.)
//
// Every collective runs on tensors of the engine's device (the parameters': CPU or one CUDA
// device), the small ones (agreement flags, clipping sums, checkpoint metadata) too, so a group
// whose backend serves only that device (NCCL for CUDA) is enough. On CUDA a collective is
// ordered after the work queued on the caller's current stream, and wait() orders the current
// stream after the collective (c10d's contract): no host synchronisation beyond what reading a
// result on the host needs.
//
// Asynchronous calls return the c10d::Work; inputs and outputs must stay alive and untouched
// until it is waited on. Errors: whatever the backend raises (c10::DistBackendError from wait()).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace zeroplus::zero::engine {

class Collectives {
 public:
  Collectives(c10::intrusive_ptr<c10d::ProcessGroup> pg, at::Device device);

  int rank() const { return rank_; }
  // The engine's device: every tensor passed here lives on it.
  at::Device device() const { return device_; }
  int worldSize() const { return world_; }
  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const { return pg_; }

  // SUM of every rank's `input` (world * output.numel() elements); this rank keeps its slice.
  c10::intrusive_ptr<c10d::Work> reduceScatter(at::Tensor& output, at::Tensor& input);
  // SUM over ranks, in place.
  c10::intrusive_ptr<c10d::Work> allReduce(at::Tensor& tensor);
  // Every rank's `input` concatenated into `output` in rank order.
  c10::intrusive_ptr<c10d::Work> allGather(at::Tensor& output, at::Tensor& input);
  // What allGather takes as input when `own` is this rank's slice of its output: `own` itself
  // where the group's backend allows the alias (zeroplus: process_group/core/communicator.hpp;
  // NCCL's in-place all-gather), else a copy (the Python engine's comm.gather_input).
  at::Tensor gatherInput(const at::Tensor& own) const { return gatherInPlace_ ? own : own.clone(); }
  // Blocking: rank 0's values everywhere.
  void broadcastFromZero(at::Tensor& tensor);
  // Blocking, in place: element-wise MAX / SUM over ranks.
  void allReduceMax(at::Tensor& tensor);
  void allReduceSum(at::Tensor& tensor);

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  int rank_ = 0;
  int world_ = 1;
  at::Device device_;
  bool gatherInPlace_ = false;
};

}  // namespace zeroplus::zero::engine
