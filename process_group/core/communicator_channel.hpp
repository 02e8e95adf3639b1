// CommunicatorChannel: an InterHostChannel over a zeroplus Communicator whose ranks are the
// host indices (one rank per host, same local index). Used by the unit tests of the
// hierarchical algorithms (ranks as threads, no torch); the product's inter-host channel is
// Gloo (adapter/gloo_channel.cpp). Owns the communicator; errors are its CommErrors.
#pragma once

#include <memory>
#include <utility>

#include "process_group/core/inter_host_channel.hpp"

namespace zeroplus::pg {

class CommunicatorChannel final : public InterHostChannel {
 public:
  explicit CommunicatorChannel(std::unique_ptr<Communicator> comm) : comm_(std::move(comm)) {}
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  std::string name() const override { return "tcp"; }
  bool supports(DataType type, ReduceOp op) const override { return reduceSupported(type, op); }
  void allreduce(void* data, size_t count, DataType type, ReduceOp op, Deadline deadline) override {
    comm_->allreduce(data, count, type, op, deadline);
  }
  void allgather(const void* in, size_t bytes, void* out, Deadline deadline) override {
    comm_->allgather(in, bytes, out, deadline);
  }
  void broadcast(void* data, size_t bytes, int root, Deadline deadline) override {
    comm_->broadcast(data, bytes, root, deadline);
  }
  void reduceScatter(const void* in, void* out, size_t count, DataType type, ReduceOp op,
                     Deadline deadline) override {
    comm_->reduceScatter(in, out, count, type, op, deadline);
  }
  void abort() override { comm_->abort(); }

 private:
  std::unique_ptr<Communicator> comm_;
};

}  // namespace zeroplus::pg
