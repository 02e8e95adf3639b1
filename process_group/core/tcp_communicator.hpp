// Internal: the Communicator implementation over the TCP mesh.
//
// Algorithm choice (n = world size, S = bytes per rank; kSmallBytes = 64 KiB):
//   allreduce      S <= kSmall: every rank sends its buffer to every peer (1 hop) and reduces
//                  all n inputs in rank order 0..n-1, so all ranks compute identical bits.
//                  Else: pipelined ring reduce-scatter + ring allgather (each chunk is reduced
//                  once, by one order, then copied: identical bits again).
//   reduce         small: direct to root, rank-order reduction; large: ring reduce-scatter
//                  (inputs untouched, partial sums in scratch) + gather of the chunks to root.
//   reduceScatter  small: direct exchange of blocks + rank-order reduction; large: ring.
//   broadcast      small or n == 2: root sends to each peer; large: pipelined chain from root.
//   allgather(v)   small total: direct exchange; large: pipelined ring, zero-copy receives.
//   gather/scatter direct to/from root, all peers concurrently.
//   alltoallv      every pair exchanges concurrently in one poll loop.
//   barrier        the op-descriptor all-to-all every collective starts with (op_descriptor.hpp).
//   send/recv      header (tag, bytes) + payload on the pair's stream; a recv that meets a
//                  message with another tag stashes it for a later recv with that tag.
// Every path stays correct for count 0 and sizes not divisible by n (balanced blocks).
//
// Scratch buffers (scratch_, slots_, steps_) persist across calls and only grow: a steady
// training loop allocates nothing after its first iteration.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <deque>
#include <vector>

#include "process_group/core/communicator.hpp"
#include "process_group/core/exchange.hpp"
#include "process_group/core/op_descriptor.hpp"
#include "process_group/core/ring.hpp"
#include "process_group/core/tcp_mesh.hpp"

namespace zeroplus::pg::detail {

inline constexpr size_t kSmallBytes = 64 * 1024;

class TcpCommunicator final : public Communicator {
 public:
  explicit TcpCommunicator(std::unique_ptr<TcpMesh> mesh);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void abort() override { mesh_->abort(); }
  void abortBecause(int culprit) override { mesh_->abort(culprit); }
  bool usable() const override { return !broken_; }

  void broadcast(void* data, size_t bytes, int root, Deadline deadline) override;
  void allreduce(void* data, size_t count, DataType type, ReduceOp op, Deadline deadline) override;
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

 private:
  // The funnel: refuses to run on a broken/aborted communicator, begins the exchange, runs
  // `body`, and on CommError marks the communicator broken and shuts the links down so peers
  // fail fast instead of waiting for their own deadline.
  // Collectives first exchange `desc` with every peer (op_descriptor.hpp) and fail on any
  // difference before a data byte moves; send/recv skip that (their headers carry tag and size).
  template <typename Body>
  void run(OpDescriptor desc, Deadline deadline, Body&& body);
  void checkDescriptors(OpDescriptor desc);
  // Argument errors are the caller's bug, detected before any byte moves: they throw
  // CommError without breaking the communicator.
  void require(WireOp op, bool ok, const std::string& what) const;
  void checkRoot(WireOp op, int root) const;
  void checkReduce(WireOp op, DataType type, ReduceOp op2) const;

  uint8_t* scratch(size_t bytes);
  // dst = inputs[0] op inputs[1] op ... in rank order; inputs[rank_] is this rank's buffer,
  // acc is a scratch area of the same size (may be null for n == 2). dst may alias one input.
  void reduceRankOrder(void* dst, const std::vector<const uint8_t*>& inputs, uint8_t* acc, size_t count,
                       DataType type, ReduceOp op) const;
  // Ring reduce-scatter over blocks (byte offsets/lengths into `in`): this rank's block ends up
  // in ownOut; partial results of other blocks go to work + offset. `in` is not modified.
  void ringReduceScatter(const uint8_t* in, const std::vector<size_t>& off, const std::vector<size_t>& len,
                         uint8_t* ownOut, uint8_t* work, const WireHeader& header, DataType type, ReduceOp op);
  void allgatherImpl(WireOp op, const void* in, void* out, const std::vector<size_t>& counts,
                     const std::vector<size_t>& displs, Deadline deadline);
  void balancedBlocks(size_t count, size_t elementSize);  // fills off_/len_ in bytes

  int rank_;
  int size_;
  std::unique_ptr<TcpMesh> mesh_;
  Exchange exchange_;
  bool broken_ = false;
  std::string brokenWhat_;
  std::vector<uint8_t> scratch_;
  std::vector<uint8_t> slots_;
  std::vector<RingStep> steps_;
  std::vector<size_t> off_, len_;
  std::vector<const uint8_t*> inputs_;
  std::vector<OpDescriptor> peerDescs_;
  uint64_t seq_ = 0;  // collectives run (descriptor seq)
  std::map<std::pair<int, uint32_t>, std::deque<std::vector<uint8_t>>> stash_;
};

template <typename Body>
void TcpCommunicator::run(OpDescriptor desc, Deadline deadline, Body&& body) {
  const auto op = static_cast<WireOp>(desc.op);
  if (broken_) {
    throw CommError(std::string(opName(op)), rank_, -1, 0.0,
                    "cannot run: the communicator is unusable after an earlier error (" + brokenWhat_ + ")");
  }
  try {
    exchange_.begin(op, deadline);
    if (op != WireOp::kSend && op != WireOp::kRecv) checkDescriptors(desc);
    body();
  } catch (const std::exception& e) {
    // The pair streams may now be out of step (a transfer stopped half-way), so nothing may
    // run on them again: c10d marks the backend broken, and peers are told through EOF.
    broken_ = true;
    brokenWhat_ = e.what();
    const auto* lost = dynamic_cast<const CommError*>(&e);
    mesh_->abort(lost ? lost->peer() : -1);
    throw;
  }
}

}  // namespace zeroplus::pg::detail
