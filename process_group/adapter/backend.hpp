// ZeroPlusBackend: the c10d::Backend registered as "zeroplus".
//
// Shape (after ProcessGroupGloo): each collective is a short wrapper that validates its
// arguments on the caller's thread (TORCH_CHECK, message "zeroplus <op>: ...") and hands one
// closure to collective(), the funnel that owns sequence numbers, the worker queue, timeouts
// and error conversion. The closure runs on the backend's single worker thread, in issue
// order, against the torch-free Communicator (process_group/core). Point-to-point ops (send,
// recv, recvAnysource) bypass that queue: they go to the PointToPoint engine
// (process_group/core/point_to_point.hpp), which progresses them on its own links and thread, so
// irecv-before-isend patterns and collectives issued meanwhile do not wait on each other.
//
// Fast paths (knobs in PgTuning, docs/backend.md):
// * Inline sync: a synchronous op (opts.asyncOp == false, i.e. async_op=False in Python)
//   issued while nothing is queued or running runs on the caller's thread: no hand-off.
// * Fusion (transports with Communicator::fusesCheaply(), i.e. shared memory): single-tensor
//   allreduces no larger than bucketBytes (not PREMUL_SUM) are "fusible". When the worker
//   takes a fusible op it also takes the compatible ops queued right behind it (same dtype,
//   reduce op and timeout, up to bucketBytes); Communicator::allreduceFused lets the ranks
//   agree on the smallest such count inside the data exchange (a rank never waits for ops
//   another rank has not issued) and moves them as one bucket; the rest go back to the queue
//   front. Whether an op is fusible depends only on its arguments and the group's tuning, not
//   on async_op (DDP's Join mixes sync and async calls of one collective across ranks), so
//   every rank makes the same choice; tuning is checked to be equal on all ranks at creation.
// * allreduce_coalesced packs its tensors into buckets of bucketBytes (Communicator::
//   allreducev: tensors already back to back in one buffer are not copied).
// Issue order per group is kept: fused ops are consecutive in the queue, and complete together.
//
// Rules callers must follow (the c10d contract): every rank of the group issues the same
// collectives in the same order with matching shapes. Input and output tensors must not be
// modified by the caller until the returned Work completes; the Work keeps them alive.
//
// Interrupts: when the backend hook installed the SIGINT chain (interrupt_watch.hpp), Ctrl-C
// aborts the op in flight (running or queued), so a rank blocked in a collective raises
// KeyboardInterrupt at once instead of at the op timeout; the group is then broken as after any
// failure, and its peers fail promptly.
//
// Failure model: an op that times out or loses a peer fails its Work with
// c10::DistBackendError (torch.distributed.DistBackendError in Python) naming op, rank, peer
// and elapsed time. The backend is then broken: later ops fail at once with the first error,
// as with NCCL. shutdown()/abort() (called by destroy_process_group) stop the worker and close
// the connections; a new group can be created afterwards in the same process.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "process_group/adapter/tensor_checks.hpp"
#include "process_group/adapter/work.hpp"
#include "process_group/core/communicator.hpp"
#include "process_group/core/config.hpp"
#include "process_group/core/inter_host_channel.hpp"
#include "process_group/core/point_to_point.hpp"
#include "process_group/core/topology.hpp"

namespace zeroplus::pg {

// Everything needed to build a backend; filled by registration/ from c10d's creator arguments.
struct BackendConfig {
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};  // group default per-op timeout
  std::string groupName;
  std::vector<int64_t> globalRanks;  // empty: identity
  PgTuning tuning;                   // registration fills it from ZEROPLUS_* and BackendOptions
};

class ZeroPlusBackend final : public c10d::Backend {
 public:
  // Connects to every peer of the group (blocking, bounded by config.timeout).
  ZeroPlusBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, BackendConfig config);
  ~ZeroPlusBackend() override;

  const std::string getBackendName() const override { return "zeroplus"; }
  // The group's default per-op timeout (changed by setTimeout).
  std::chrono::milliseconds timeout() {
    std::lock_guard<std::mutex> lock(mutex_);
    return config_.timeout;
  }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return sequenceNumber_.load(); }
  void shutdown() override;
  void abort() override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts = c10d::BroadcastOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts = c10d::AllreduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts = c10d::BarrierOptions()) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts = c10d::AllreduceCoalescedOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts = c10d::ReduceOptions()) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  // Several tensors of any dtypes and shapes per rank (deprecated in c10d, kept by Gloo).
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts = c10d::AllgatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts = c10d::GatherOptions()) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts = c10d::ScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts = c10d::ReduceScatterOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outputSplitSizes,
                                               std::vector<int64_t>& inputSplitSizes,
                                               const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts = c10d::AllToAllOptions()) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  // recv from whichever rank's message with `tag` arrives first; the Work's sourceRank() names it.
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // "tcp", "shm+tcp", or for a hierarchical group "shm+tcp within hosts, gloo between 2 hosts"
  // (tests and benchmarks report it).
  std::string transport() const { return comm_->transport(); }
  // Multi-host groups (docs/multihost.md): {host index, host count, local index} when this
  // group wants an inter-host channel from the Python hook (it spans hosts with equal ranks per
  // host and ZEROPLUS_INTERHOST is not tcp), else empty. The same answer on every rank.
  std::vector<int64_t> interHostPlan() const;
  // The interface (ZEROPLUS_SOCKET_IFNAME / GLOO_SOCKET_IFNAME) or, without one, the address
  // this rank's mesh published: where the Gloo device of the inter-host channel binds.
  const std::string& socketIfname() const { return config_.tuning.socketIfname; }
  std::string publishedAddress() const;
  // The group's store seen through this instance's scope (core/group_session.hpp), and that
  // scope's key prefix: everything the group and its transports write (the inner NCCL group,
  // the inter-host Gloo groups) goes through it, so nothing of an earlier instance of the
  // group on the same store (torchrun restarts) is read back.
  const c10::intrusive_ptr<c10d::Store>& sessionStore() const { return store_; }
  const std::string& sessionPrefix() const { return sessionPrefix_; }
  // Switches the group to hierarchical collectives over `channel` (its rank = host index):
  // connects the intra-host communicator (collective; every rank of a group with a non-empty
  // plan calls it once, right after construction, before any op) and logs the choice once at
  // ZEROPLUS_DEBUG=1. Throws DistBackendError naming the step on failure.
  void attachInterHost(std::unique_ptr<InterHostChannel> channel);
  // A group built without the Python hook (makeProcessGroup in a LibTorch program) gets no
  // inter-host channel and stays flat; this logs that choice once at ZEROPLUS_DEBUG=1.
  void noteNoInterHostChannel() const;
  const PgTuning& tuning() const { return config_.tuning; }
  // Which group ranks share a host (topology.hpp); fixed at construction.
  const Topology& topology() const { return topology_; }

 private:
  using Body = std::function<void(Deadline)>;
  struct Task {
    c10::intrusive_ptr<ZeroPlusWork> work;
    Body body;
    std::chrono::milliseconds timeout{};
    const char* opName = "";
    // The issuing thread's autograd modes: the op's tensor writes (copies into outputs, AVG
    // divisions) run under them on whatever thread runs the op, so outputs created under
    // torch.inference_mode() can be written outside the caller's thread.
    bool inferenceMode = false;
    bool gradMode = true;
    // Fusible allreduce (body is empty): the tensor and how to reduce it.
    bool fusible = false;
    at::Tensor tensor;
    DataType type = DataType::kFloat32;
    Reduction reduction;
  };

  // The funnel: assigns the sequence number, queues `body` for the worker (or runs it on the
  // caller's thread, see "Inline sync") and returns its Work.
  c10::intrusive_ptr<c10d::Work> collective(c10d::OpType opType, const char* opName, std::vector<at::Tensor> outputs,
                                            std::chrono::milliseconds opTimeout, Body body, bool asyncOp = true);
  // collective() for ops with several output lists per process (Work future: List[List[Tensor]]).
  c10::intrusive_ptr<c10d::Work> collectiveNested(c10d::OpType opType, const char* opName,
                                                  std::vector<std::vector<at::Tensor>> outputLists,
                                                  std::chrono::milliseconds opTimeout, Body body);
  // Queues a fusible allreduce (see "Fusion").
  c10::intrusive_ptr<c10d::Work> fusibleAllreduce(const at::Tensor& tensor, DataType type, const Reduction& reduction,
                                                  std::chrono::milliseconds opTimeout, bool asyncOp);
  // Runs `task` inline (see "Inline sync") or queues it.
  c10::intrusive_ptr<c10d::Work> submit(Task task, bool asyncOp);
  // Moves `tensors` as buckets of at most tuning.bucketBytes through allreducev. Worker thread.
  void bucketedAllreduce(const std::vector<at::Tensor>& tensors, DataType type, const Reduction& reduction,
                         Deadline deadline);
  // Several tensors per process or strided ones: combined locally into one contiguous buffer,
  // allreduced, copied back into every tensor. Worker thread.
  void stagedAllreduce(const std::vector<at::Tensor>& tensors, DataType type, const Reduction& reduction,
                       Deadline deadline);
  // Sparse COO SUM (as Gloo): every rank's coalesced indices and values are gathered and summed;
  // the result replaces every input tensor. Worker thread.
  void sparseAllreduce(const std::vector<at::Tensor>& tensors, Deadline deadline);
  void enqueue(Task task);
  // Completion of `task`'s Work (markSucceeded/markFailed) runs its future's callbacks on the
  // calling thread. Runs `body` (which completes Works) as a callback phase: collectives the
  // callbacks issue on this group run, in their issue order, on a relief thread while the
  // callbacks may wait for them, and before anything else queued (callback_phase.cpp).
  struct CallbackPhase;
  void withCallbackPhase(const std::function<void()>& body);
  bool submitToCallbackPhase(Task& task);  // queues into this thread's phase; false if none
  void runPhase(CallbackPhase& phase);      // relief thread body
  static CallbackPhase*& threadPhase();     // innermost phase of the calling thread, or nullptr
  void workerLoop();
  void runTask(Task& task);
  // One op on its own: a fusible one runs as a batch of one (its peers may fuse more; they agree on one).
  void runSingle(Task& task);
  void runFused(std::vector<Task>& batch);
  void failTask(Task& task, std::exception_ptr error);
  // send/recv/recvAnysource: posts the op to the point-to-point engine (PointToPoint), which
  // runs it beside the collectives' queue, never behind it. `peer` is kAnySource for
  // recvAnysource. Completes the Work from the engine's thread (or at once).
  c10::intrusive_ptr<c10d::Work> pointToPoint(c10d::OpType opType, const char* opName, const at::Tensor& tensor,
                                              int peer, int tag);
  // Records the group as unusable after a transport failure and aborts both transports (peers
  // blocked on this rank fail at once).
  void markBroken(const std::string& what);
  void abortTransports();
  // The listener of interrupt_watch.hpp: aborts the group (the op in flight, if any, and the
  // peers' ops waiting for this rank). Watcher thread.
  void onInterrupt();
  // e.what(), saying so when the failure is the abort of onInterrupt().
  std::string failureText(const CommError& e) const;
  void stopWorker();

  BackendConfig config_;
  std::string sessionPrefix_;               // "zeroplus/<scope>"
  c10::intrusive_ptr<c10d::Store> store_;  // scoped; kept for attachInterHost's intra-host set-up
  CommunicatorOptions options_;            // as the flat communicator was connected
  Topology topology_;
  std::unique_ptr<Communicator> comm_;
  // Point-to-point ops: own links and progress thread; created with comm_, closed by stopWorker.
  std::unique_ptr<PointToPoint> p2p_;
  std::atomic<uint64_t> sequenceNumber_{0};

  std::mutex mutex_;
  std::condition_variable queueCv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  bool fusion_ = false;       // fusible allreduces exist in this group (set once at construction)
  bool busy_ = false;         // an op is running (worker or inline caller); guarded by mutex_
  // The Works of the op(s) busy_ refers to; guarded by mutex_. A Work completes (and wakes its
  // waiter) before busy_ is cleared, so shutdown() asks these whether data is still moving.
  std::vector<c10::intrusive_ptr<c10d::Work>> running_;
  std::string brokenReason_;  // non-empty after a transport failure; guarded by mutex_
  bool interHostAttached_ = false;  // attachInterHost ran; guarded by mutex_
  bool coalescing_ = false;   // inside startCoalescing()/endCoalescing(); guarded by mutex_
  std::vector<c10::intrusive_ptr<ZeroPlusWork>> coalescedWorks_;  // guarded by mutex_
  std::vector<c10::intrusive_ptr<ZeroPlusWork>> coalescedP2p_;    // point-to-point ops of the window; mutex_
  std::thread worker_;
  uint64_t interruptListener_ = 0;
  std::atomic<bool> interrupted_{false};
};

}  // namespace zeroplus::pg
