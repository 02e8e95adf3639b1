// Lifecycle, the worker thread and the collective() funnel of ZeroPlusBackend. The per-op
// wrappers live in collectives.cpp.
#include "process_group/adapter/backend.hpp"

#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cstdio>
#include <optional>

#include "process_group/adapter/interrupt_watch.hpp"
#include "process_group/adapter/store_rendezvous.hpp"
#include "process_group/core/group_session.hpp"
#include "process_group/core/hierarchical_communicator.hpp"
#include "process_group/core/peer_address.hpp"

namespace zeroplus::pg {
namespace {

c10::DistBackendError backendError(const std::string& message) {
  return c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message);
}

// Puts the thread running an op into the autograd modes its issuer had (Task::inferenceMode).
// The common case (grad on, no inference mode: the worker's own state) sets nothing.
class IssuerModes {
 public:
  IssuerModes(bool inference, bool grad) {
    if (inference) {
      inference_.emplace(true);
    } else if (!grad) {
      grad_.emplace(false);
    }
  }

 private:
  std::optional<c10::InferenceMode> inference_;
  std::optional<c10::AutoGradMode> grad_;
};

}  // namespace

ZeroPlusBackend::ZeroPlusBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                 BackendConfig config)
    : c10d::Backend(rank, size), config_(std::move(config)) {
  TORCH_CHECK(store, "zeroplus: store is null");
  TORCH_CHECK(size >= 1, "zeroplus: group size must be >= 1, got ", size);
  TORCH_CHECK(rank >= 0 && rank < size, "zeroplus: rank ", rank, " out of range for group size ", size);
  TORCH_CHECK(config_.timeout.count() > 0, "zeroplus: timeout must be positive, got ", config_.timeout.count(), " ms");
  // Before any other key: agree a scope no earlier instance of this group can have used (the
  // store may be torchrun's, kept across restarts), and read and write nothing outside it.
  try {
    StoreRendezvous raw(store);
    sessionPrefix_ = scopePrefix(agreeSession(raw, rank, size, Clock::now() + config_.timeout));
  } catch (const CommError& e) {
    throw backendError(std::string("zeroplus init: ") + e.what());
  }
  store_ = c10::make_intrusive<c10d::PrefixStore>(sessionPrefix_, store);
  StoreRendezvous rendezvous(store_);
  CommunicatorOptions options;
  options.rank = rank;
  options.size = size;
  options.connectTimeout = config_.timeout;
  options.shm = config_.tuning.shm;
  options.shmChunkBytes = config_.tuning.shmChunkBytes;
  options.spinMicros = config_.tuning.spinMicros;
  options.socketIfname = config_.tuning.socketIfname;
  if (!config_.tuning.socketIfnameSource.empty()) options.socketIfnameSource = config_.tuning.socketIfnameSource;
  // Fusion and bucketing decide how ops map onto transfers, so every rank must use the same
  // knobs; a mismatch would otherwise show up later as a hang or a size-mismatch error.
  const auto& t = config_.tuning;
  const std::string mine = std::to_string(t.bucketBytes) + "," + std::to_string(t.fuse) + "," +
                           std::to_string(t.shmChunkBytes) + "," + std::string(toString(t.shm)) + "," +
                           std::string(toString(t.interHost));
  store_->set("zeroplus/tuning/" + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  // One deadline for the whole exchange: a rank that never joins is reported once, by rank
  // number, within the group timeout (not size x timeout, and not as the store's bare message).
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    const std::string key = "zeroplus/tuning/" + std::to_string(r);
    const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    std::vector<uint8_t> theirs;
    try {
      theirs = rendezvous.get(key, std::max(config_.timeout - spent, std::chrono::milliseconds(1)));
    } catch (const std::exception& e) {
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      throw backendError("zeroplus init: rank " + std::to_string(rank) + " timed out after " +
                         std::to_string(elapsed).substr(0, std::to_string(elapsed).find('.') + 2) +
                         " s waiting for rank " + std::to_string(r) + " to join the group (" + e.what() + ")");
    }
    TORCH_CHECK(std::string(theirs.begin(), theirs.end()) == mine, "zeroplus init: rank ", rank,
                " has tuning (bucket_bytes,fuse,shm_chunk_bytes,shm,interhost) = (", mine, ") but rank ", r, " has (",
                std::string(theirs.begin(), theirs.end()), "); set the same ZEROPLUS_* variables and options on every rank");
  }
  try {
    topology_ = exchangeTopology(rendezvous, rank, size, Clock::now() + config_.timeout);
    options.hostCount = topology_.hostCount();
    comm_ = Communicator::connect(rendezvous, options);
    p2p_ = PointToPoint::connect(rendezvous, options);
  } catch (const CommError& e) {
    throw backendError(std::string("zeroplus init: ") + e.what());
  }
  options_ = options;
  if (config_.tuning.debug && rank == 0) {
    // Once per group, from its rank 0: enough to see how a job was laid out without 4 x N lines.
    std::fprintf(stderr, "zeroplus: group '%s' of %d ranks: topology %s; transport %s\n", config_.groupName.c_str(),
                 size, topology_.describe().c_str(), comm_->transport().c_str());
    if (topology_.hostCount() > 1 && interHostPlan().empty()) {
      std::fprintf(stderr, "zeroplus: group '%s' inter-host: tcp (flat: %s)\n", config_.groupName.c_str(),
                   config_.tuning.interHost == InterHost::kTcp ? "ZEROPLUS_INTERHOST=tcp"
                                                               : "hosts have different numbers of ranks");
    }
  }
  fusion_ = config_.tuning.fuse && config_.tuning.bucketBytes > 0 && size > 1 && comm_->fusesCheaply();
  worker_ = std::thread([this] { workerLoop(); });
  interruptListener_ = addInterruptListener([this] { onInterrupt(); });
  init();
}

std::vector<int64_t> ZeroPlusBackend::interHostPlan() const {
  if (topology_.hostCount() < 2 || config_.tuning.interHost == InterHost::kTcp) return {};
  const int localSize = HierarchicalCommunicator::localSize(topology_);
  if (localSize == 0) return {};
  const auto here = topology_.ranksOn(topology_.host());
  const auto local = std::find(here.begin(), here.end(), topology_.rank) - here.begin();
  return {topology_.host(), topology_.hostCount(), static_cast<int64_t>(local)};
}

std::string ZeroPlusBackend::publishedAddress() const {
  // The address the mesh published (tcp_mesh.hpp), read back on demand: only a group that
  // will create its inter-host channel asks, while every peer still serves the store.
  StoreRendezvous rendezvous(store_);
  detail::PeerAddress self;
  const auto entry = rendezvous.get("zeroplus/addr/" + std::to_string(rank_), std::chrono::seconds(10));
  return detail::decodePeerAddress(entry, &self) ? self.addr : std::string();
}

void ZeroPlusBackend::attachInterHost(std::unique_ptr<InterHostChannel> channel) {
  TORCH_CHECK(!interHostPlan().empty(), "zeroplus attach_interhost: group '", config_.groupName,
              "' does not use an inter-host channel (one host, ZEROPLUS_INTERHOST=tcp or unequal ranks per host)");
  TORCH_CHECK(channel->size() == topology_.hostCount() && channel->rank() == topology_.host(),
              "zeroplus attach_interhost: channel has rank ", channel->rank(), " of ", channel->size(),
              ", expected host ", topology_.host(), " of ", topology_.hostCount());
  std::unique_ptr<Communicator> local;
  try {
    StoreRendezvous rendezvous(store_);
    local = HierarchicalCommunicator::connectLocal(rendezvous, topology_, options_);
  } catch (const CommError& e) {
    throw backendError(std::string("zeroplus init (intra-host communicator): ") + e.what());
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(queue_.empty() && !busy_ && sequenceNumber_.load() == 0 && !interHostAttached_,
                "zeroplus attach_interhost: only once per group, before its first op");
    interHostAttached_ = true;
    comm_ = std::make_unique<HierarchicalCommunicator>(topology_, std::move(comm_), std::move(local),
                                                       std::move(channel));
  }
  if (config_.tuning.debug && rank_ == 0) {
    std::fprintf(stderr, "zeroplus: group '%s' inter-host: gloo (hierarchical: %s)\n", config_.groupName.c_str(),
                 comm_->transport().c_str());
  }
}

void ZeroPlusBackend::noteNoInterHostChannel() const {
  if (config_.tuning.debug && rank_ == 0 && !interHostPlan().empty()) {
    std::fprintf(stderr, "zeroplus: group '%s' inter-host: tcp (flat: no Python layer to create the Gloo groups)\n",
                 config_.groupName.c_str());
  }
}

ZeroPlusBackend::~ZeroPlusBackend() {
  removeInterruptListener(interruptListener_);  // waits for a running onInterrupt()
  stopWorker();
}

void ZeroPlusBackend::onInterrupt() {
  // Abort even when this rank has nothing in flight: its peers may be blocked in a collective
  // this rank will now never issue (Ctrl-C landed between two ops, and the process lives on in
  // a notebook, a cleanup handler or a debugger); only the abort tells them before the op
  // timeout. Whether an op happened to be in flight at that microsecond must not decide it.
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    interrupted_ = true;
  }
  comm_->abort();
  if (p2p_) p2p_->abort();
}

std::string ZeroPlusBackend::failureText(const CommError& e) const {
  return interrupted_ ? std::string(e.what()) + " (interrupted by SIGINT)" : std::string(e.what());
}

void ZeroPlusBackend::setTimeout(std::chrono::milliseconds timeout) {
  TORCH_CHECK(timeout.count() > 0, "zeroplus set_timeout: timeout must be positive, got ", timeout.count(), " ms");
  std::lock_guard<std::mutex> lock(mutex_);
  config_.timeout = timeout;
}

void ZeroPlusBackend::shutdown() {
  // destroy_process_group must not sit out an op's timeout: an op still running or queued (say,
  // one a peer never joined) is aborted and fails its Work; an idle group closes gracefully.
  // A Work completes (and its waiter returns) before the worker clears busy_: a rank that
  // waited on its last op and destroys the group at once must not abort, or peers still
  // finishing that op would take the abort alert for a failure. So "in flight" means an
  // incomplete Work, not busy_. And a Work's future completes before the Work itself (the
  // worker runs the future's callbacks in between): a rank that waited on the future, as DDP's
  // reducer does, is just as done with the op.
  bool inFlight = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    inFlight = !queue_.empty();
    for (const auto& w : running_) inFlight = inFlight || !(w->isCompleted() || w->getFuture()->completed());
  }
  // Point-to-point ops still pending count as in flight too (a recv nobody will satisfy).
  inFlight = inFlight || (p2p_ && p2p_->pending() > 0);
  if (inFlight) abortTransports();
  stopWorker();
}

void ZeroPlusBackend::abort() {
  // Wake a blocked transfer first so the worker can observe stopping_.
  abortTransports();
  stopWorker();
}

void ZeroPlusBackend::abortTransports() {
  if (comm_) comm_->abort();
  if (p2p_) p2p_->abort();
}

void ZeroPlusBackend::markBroken(const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (brokenReason_.empty()) brokenReason_ = what;
  }
  // Both transports: peers blocked on this rank in either fail at once instead of at their
  // deadline, and the group stays unusable as after any failure.
  abortTransports();
}

void ZeroPlusBackend::stopWorker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ && !worker_.joinable()) return;
    stopping_ = true;
  }
  queueCv_.notify_all();
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
  // Works still queued were never started: fail them rather than leaving waiters hanging.
  std::deque<Task> orphans;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    orphans.swap(queue_);
  }
  for (auto& task : orphans) {
    task.work->markFailed(std::make_exception_ptr(
        backendError(std::string("zeroplus ") + task.opName + ": process group was shut down before the op ran")));
  }
  // Stops the progress thread; point-to-point ops still pending fail ("shut down").
  if (p2p_) p2p_->close();
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::collective(c10d::OpType opType, const char* opName,
                                                           std::vector<at::Tensor> outputs,
                                                           std::chrono::milliseconds opTimeout, Body body,
                                                           bool asyncOp) {
  const uint64_t seq = ++sequenceNumber_;
  Task task;
  task.work = c10::make_intrusive<ZeroPlusWork>(rank_, opType, opName, seq, std::move(outputs));
  task.body = std::move(body);
  task.timeout = opTimeout;
  task.opName = opName;
  task.inferenceMode = c10::InferenceMode::is_enabled();
  task.gradMode = c10::GradMode::is_enabled();
  return submit(std::move(task), asyncOp);
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::collectiveNested(c10d::OpType opType, const char* opName,
                                                                 std::vector<std::vector<at::Tensor>> outputLists,
                                                                 std::chrono::milliseconds opTimeout, Body body) {
  std::vector<at::Tensor> flat;
  for (const auto& list : outputLists) flat.insert(flat.end(), list.begin(), list.end());
  const uint64_t seq = ++sequenceNumber_;
  Task task;
  task.work = c10::make_intrusive<ZeroPlusWork>(rank_, opType, opName, seq, std::move(flat));
  task.work->setNestedOutputs(std::move(outputLists));
  task.body = std::move(body);
  task.timeout = opTimeout;
  task.opName = opName;
  task.inferenceMode = c10::InferenceMode::is_enabled();
  task.gradMode = c10::GradMode::is_enabled();
  return submit(std::move(task), /*asyncOp=*/true);
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::fusibleAllreduce(const at::Tensor& tensor, DataType type,
                                                                 const Reduction& reduction,
                                                                 std::chrono::milliseconds opTimeout, bool asyncOp) {
  const uint64_t seq = ++sequenceNumber_;
  Task task;
  task.work = c10::make_intrusive<ZeroPlusWork>(rank_, c10d::OpType::ALLREDUCE, "allreduce", seq,
                                                std::vector<at::Tensor>{tensor});
  task.timeout = opTimeout;
  task.opName = "allreduce";
  task.fusible = true;
  task.tensor = tensor;
  task.type = type;
  task.reduction = reduction;
  task.inferenceMode = c10::InferenceMode::is_enabled();
  task.gradMode = c10::GradMode::is_enabled();
  return submit(std::move(task), asyncOp);
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::submit(Task task, bool asyncOp) {
  c10::intrusive_ptr<c10d::Work> work = task.work;
  // Issued from a future callback of this group (callback_phase.cpp): runs before the queue.
  if (submitToCallbackPhase(task)) return work;
  if (!asyncOp && config_.tuning.inlineSync) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (queue_.empty() && !busy_ && !coalescing_ && !stopping_ && brokenReason_.empty()) {
      // Inline sync: nothing is ahead of this op, so running it here keeps issue order and
      // saves the hand-off to the worker and back. busy_ keeps the worker off meanwhile. A
      // fusible op runs as a batch of one (its peers may fuse more; they agree on one).
      busy_ = true;
      running_.assign(1, task.work);
      if (task.timeout.count() <= 0) task.timeout = config_.timeout;
      lock.unlock();
      withCallbackPhase([&] { runSingle(task); });
      lock.lock();
      busy_ = false;
      running_.clear();
      const bool more = !queue_.empty();
      lock.unlock();
      if (more) queueCv_.notify_one();
      return work;
    }
  }
  enqueue(std::move(task));
  return work;
}

void ZeroPlusBackend::enqueue(Task task) {
  std::string broken;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (task.timeout.count() <= 0) task.timeout = config_.timeout;  // kUnsetTimeout: group default
    broken = brokenReason_;
    if (broken.empty()) {
      TORCH_CHECK(!stopping_, "zeroplus ", task.opName, ": process group has been shut down");
      if (coalescing_) coalescedWorks_.push_back(task.work);
      queue_.push_back(std::move(task));
    }
  }
  if (!broken.empty()) {  // outside mutex_: failing runs the Work's callbacks, which may submit
    task.work->markFailed(std::make_exception_ptr(backendError(
        std::string("zeroplus ") + task.opName + ": process group is unusable after an earlier failure: " + broken)));
    return;
  }
  queueCv_.notify_one();
}

void ZeroPlusBackend::workerLoop() {
  std::vector<Task> batch;
  for (;;) {
    batch.clear();
    {
      std::unique_lock<std::mutex> lock(mutex_);
      queueCv_.wait(lock, [this] { return stopping_ || (!queue_.empty() && !busy_); });
      if (stopping_) return;
      busy_ = true;
      batch.push_back(std::move(queue_.front()));
      queue_.pop_front();
      // Take the compatible fusible ops queued right behind the first one (see "Fusion").
      const Task& head = batch.front();
      size_t bytes = head.fusible ? head.tensor.nbytes() : 0;
      while (head.fusible && !queue_.empty()) {
        const Task& next = queue_.front();
        if (!next.fusible || next.type != head.type || next.reduction.op != head.reduction.op ||
            next.reduction.average != head.reduction.average || next.timeout != head.timeout ||
            next.inferenceMode != head.inferenceMode || next.gradMode != head.gradMode ||
            bytes + next.tensor.nbytes() > config_.tuning.bucketBytes) {
          break;
        }
        bytes += next.tensor.nbytes();
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      running_.clear();
      for (const Task& t : batch) running_.push_back(t.work);
    }
    withCallbackPhase([&] {
      if (batch.front().fusible) {
        runFused(batch);  // may push unagreed ops back to the queue front
      } else {
        runTask(batch.front());
      }
    });
    {
      std::lock_guard<std::mutex> lock(mutex_);
      busy_ = false;
      running_.clear();
    }
  }
}

void ZeroPlusBackend::runSingle(Task& task) {
  if (task.fusible) {
    std::vector<Task> batch;
    batch.push_back(std::move(task));
    runFused(batch);
  } else {
    runTask(task);
  }
}

void ZeroPlusBackend::failTask(Task& task, std::exception_ptr error) {
  task.work->markFailed(std::move(error));
}

void ZeroPlusBackend::runTask(Task& task) {
  std::string broken;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    broken = brokenReason_;
  }
  if (!broken.empty()) {
    task.work->markFailed(std::make_exception_ptr(backendError(
        std::string("zeroplus ") + task.opName + ": process group is unusable after an earlier failure: " + broken)));
    return;
  }
  // The deadline starts when the op starts moving data, not when it was queued (as NCCL).
  const Deadline deadline = Clock::now() + task.timeout;
  try {
    IssuerModes modes(task.inferenceMode, task.gradMode);
    task.body(deadline);
    task.work->markSucceeded();
  } catch (const CommError& e) {
    const std::string what = failureText(e);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      brokenReason_ = what;
    }
    // A transport failure also stops point-to-point, so peers waiting on this rank there fail
    // at once (the collective links were aborted by the communicator).
    if (!comm_->usable() && p2p_) p2p_->abort();
    task.work->markFailed(std::make_exception_ptr(backendError(what)));
  } catch (const c10::Error&) {
    task.work->markFailed(std::current_exception());
  } catch (const std::exception& e) {
    task.work->markFailed(
        std::make_exception_ptr(backendError(std::string("zeroplus ") + task.opName + ": " + e.what())));
  }
}

void ZeroPlusBackend::runFused(std::vector<Task>& batch) {
  std::string broken;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    broken = brokenReason_;
  }
  if (!broken.empty()) {
    for (auto& t : batch) runTask(t);  // each fails with the stored reason
    return;
  }
  const Deadline deadline = Clock::now() + batch.front().timeout;
  const Reduction& reduction = batch.front().reduction;
  try {
    IssuerModes modes(batch.front().inferenceMode, batch.front().gradMode);
    std::vector<Span> candidates;
    candidates.reserve(batch.size());
    for (const auto& t : batch) candidates.push_back(Span{t.tensor.data_ptr(), static_cast<size_t>(t.tensor.numel())});
    const size_t agreed = comm_->allreduceFused(candidates, batch.front().type, reduction.op, deadline);
    if (agreed < batch.size()) {
      // Ops some rank has not issued yet go back, in order, to the queue front.
      std::lock_guard<std::mutex> lock(mutex_);
      for (size_t i = batch.size(); i-- > agreed;) queue_.push_front(std::move(batch[i]));
      batch.resize(agreed);
    }
    if (reduction.average) {
      for (size_t i = 0; i < batch.size(); ++i) {
        if (!divideInPlace(candidates[i].data, candidates[i].count, batch[i].type, size_)) {
          applyAverage(reduction, batch[i].tensor, size_);
        }
      }
    }
  } catch (const CommError& e) {
    const std::string what = failureText(e);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      brokenReason_ = what;
    }
    if (!comm_->usable() && p2p_) p2p_->abort();
    for (auto& t : batch) t.work->markFailed(std::make_exception_ptr(backendError(what)));
    return;
  } catch (const std::exception& e) {
    for (auto& t : batch) {
      t.work->markFailed(std::make_exception_ptr(backendError(std::string("zeroplus allreduce: ") + e.what())));
    }
    return;
  }
  for (auto& t : batch) t.work->markSucceeded();
}

void ZeroPlusBackend::bucketedAllreduce(const std::vector<at::Tensor>& tensors, DataType type,
                                        const Reduction& reduction, Deadline deadline) {
  const size_t cap = std::max<size_t>(config_.tuning.bucketBytes, 1);
  std::vector<Span> spans;
  size_t i = 0;
  do {
    // One bucket: tensors up to `cap` bytes (a larger tensor forms a bucket of its own).
    spans.clear();
    size_t bytes = 0;
    const size_t first = i;
    while (i < tensors.size() && (spans.empty() || bytes + tensors[i].nbytes() <= cap)) {
      at::Tensor t = tensors[i];
      applyPremultiply(reduction, t);
      spans.push_back(Span{t.data_ptr(), static_cast<size_t>(t.numel())});
      bytes += t.nbytes();
      ++i;
    }
    comm_->allreducev(spans, type, reduction.op, deadline);
    if (reduction.average) {
      for (size_t k = first; k < i; ++k) {
        if (!divideInPlace(spans[k - first].data, spans[k - first].count, type, size_)) {
          at::Tensor t = tensors[k];
          applyAverage(reduction, t, size_);
        }
      }
    }
  } while (i < tensors.size());
}

}  // namespace zeroplus::pg
