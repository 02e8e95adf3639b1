// GlooChannel: the InterHostChannel (core/inter_host_channel.hpp) over torch's own
// ProcessGroupGloo, driven through the public c10d::Backend interface only (no Gloo headers).
//
// The Python registration hook (registration/backend_hook.py) creates the Gloo group, one per
// local index, over a prefixed view of the group's store, with the interface the flat mesh
// chose; registration/library.cpp's attach_interhost() hands its backend here.
//
// Contract: buffers are wrapped with torch::from_blob as CPU tensors (no copy) that live until
// the Work completes; each call waits for its Work in slices of at most 100 ms, so abort()
// (any thread) and the caller's deadline end the wait even when Gloo's own timeout is longer.
// A Work that fails rethrows Gloo's error (c10::Error, a std::exception). Not thread-safe
// otherwise: one caller at a time, as Communicator.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>

#include "process_group/core/inter_host_channel.hpp"

namespace zeroplus::pg {

class GlooChannel final : public InterHostChannel {
 public:
  GlooChannel(c10::intrusive_ptr<c10d::Backend> backend, int hostIndex, int hostCount);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "gloo"; }
  bool supports(DataType type, ReduceOp op) const override;
  void allreduce(void* data, size_t count, DataType type, ReduceOp op, Deadline deadline) override;
  void allgather(const void* in, size_t bytes, void* out, Deadline deadline) override;
  void broadcast(void* data, size_t bytes, int root, Deadline deadline) override;
  void reduceScatter(const void* in, void* out, size_t count, DataType type, ReduceOp op,
                     Deadline deadline) override;
  void abort() override { aborted_.store(true, std::memory_order_release); }

 private:
  void wait(const c10::intrusive_ptr<c10d::Work>& work, Deadline deadline) const;

  c10::intrusive_ptr<c10d::Backend> backend_;
  int rank_;
  int size_;
  std::atomic<bool> aborted_{false};
};

}  // namespace zeroplus::pg
