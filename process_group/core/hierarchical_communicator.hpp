// HierarchicalCommunicator: the collectives of a group that spans hosts, as an intra-host phase
// over the host's own communicator (shared memory among its ranks), an inter-host phase over an
// InterHostChannel (Gloo in the product) and an intra-host phase back.
//
// Shape. Every host has the same number L of ranks (the caller checks; otherwise the group
// stays flat). Local rank i of every host joins inter-host channel i (rank = host index,
// size = host count H), so the inter-host traffic is striped over L channels at once:
//   allreduce      local allreduce (shm); local rank i allreduces chunk i (ceil(count/L)
//                  elements) across hosts; local allgather of the chunks.
//   reduceScatter  the input is permuted so local rank i's part is the blocks of local index i
//                  on every host; local allreduce of that; inter-host reduce-scatter of part i.
//   allgather      inter-host allgather of each rank's block; local allgather of those;
//                  permuted into group-rank order.
//   broadcast      local broadcast on the root's host; chunk i crosses hosts on channel i
//                  from the root's host; local allgather of the chunks elsewhere.
// Ops whose whole payload is at most `flatBytes` (kHierFlatBytes by default) run on the flat
// mesh instead: up to there the flat algorithms measured faster on 2 hosts x 2 ranks (4 KiB
// allreduce 0.22-0.33 ms flat vs 1.0-1.5 ms through shm + Gloo + shm; 1 MiB 3.3-3.6 ms vs 4.0-6.4;
// from 4 MiB on the hierarchical path is as fast or faster; docs/multihost.md).
// Every rank ends with identical bits: the local phases give identical results on a host (the
// shm transport reduces in one order) and the inter-host phase is an allreduce/broadcast whose
// result is identical on its members.
// Everything else (reduce, gather, scatter, allgatherv, alltoallv, send/recv, barrier, and
// reductions the channel does not support) runs on `flat`, the group-wide TCP communicator.
//
// Errors: as Communicator. A failure of any phase makes the communicator unusable and aborts
// all three parts, so the local peers and the flat mesh's peers fail at once; an exception of
// the channel becomes CommError naming the op, this rank and the peer ranks of its channel.
// Threading: as Communicator (one caller at a time; abort() from anywhere).
#pragma once

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "process_group/core/communicator.hpp"
#include "process_group/core/inter_host_channel.hpp"
#include "process_group/core/topology.hpp"

namespace zeroplus::pg {

inline constexpr size_t kHierFlatBytes = 1u << 20;

class HierarchicalCommunicator final : public Communicator {
 public:
  // Connects the intra-host communicator among this rank's host's ranks through `rendezvous`
  // (keys under "zeroplus/local/<host>/"), with `options` for shm and timeouts. Blocks like
  // Communicator::connect. Precondition: localSize(topology) > 0.
  static std::unique_ptr<Communicator> connectLocal(Rendezvous& rendezvous, const Topology& topology,
                                                    CommunicatorOptions options);
  // The common number of ranks per host, or 0 when hosts differ.
  static int localSize(const Topology& topology);

  // flat: the group-wide communicator; local: connectLocal's; inter: this rank's stripe.
  HierarchicalCommunicator(Topology topology, std::unique_ptr<Communicator> flat, std::unique_ptr<Communicator> local,
                           std::unique_ptr<InterHostChannel> inter, size_t flatBytes = kHierFlatBytes);

  int rank() const override { return topology_.rank; }
  int size() const override { return static_cast<int>(topology_.hostOf.size()); }
  void abort() override;
  bool usable() const override { return !broken_ && flat_->usable() && local_->usable(); }
  // e.g. "shm+tcp within hosts, gloo between 2 hosts".
  std::string transport() const override;

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
  // The funnel: refuses a broken communicator, runs `body`, and on any failure marks it broken,
  // aborts all parts and rethrows as CommError(op).
  template <typename Body>
  void run(const char* op, Body&& body);
  // One call on the intra-host communicator; its CommError is re-issued under `op`, naming
  // group ranks instead of local indices.
  template <typename Call>
  void within(const char* op, Call&& call);
  // One call on the channel; its exception becomes CommError naming the channel's peers.
  template <typename Call>
  void cross(const char* op, Call&& call);
  // Local allgather of one `chunk`-byte block per local rank into out (L*chunk bytes), where
  // this rank's block already sits at out + localIndex*chunk.
  void localAllgatherInPlace(const char* op, uint8_t* out, size_t chunk, Deadline deadline);
  int rankOf(int host, int local) const { return hostRanks_[static_cast<size_t>(host)][static_cast<size_t>(local)]; }
  uint8_t* scratch(std::vector<uint8_t>& buf, size_t bytes);

  Topology topology_;
  int host_;
  int localIndex_;
  int hosts_;
  int localSize_;
  size_t flatBytes_;
  std::vector<std::vector<int>> hostRanks_;  // [host][local index] -> group rank
  std::unique_ptr<Communicator> flat_;
  std::unique_ptr<Communicator> local_;
  std::unique_ptr<InterHostChannel> inter_;
  bool broken_ = false;
  bool crossFailed_ = false;  // the channel threw (it is unusable from then on)
  std::string brokenWhat_;
  Clock::time_point start_{};
  std::vector<uint8_t> scratchA_, scratchB_;  // grow only
};

}  // namespace zeroplus::pg
