// Lifecycle, the worker thread and the collective() funnel of ZeroPlusBackend. The per-op
// wrappers live in collectives.cpp.
#include "process_group/adapter/backend.hpp"

#include <c10/util/Exception.h>

#include "process_group/adapter/store_rendezvous.hpp"

namespace zeroplus::pg {
namespace {

c10::DistBackendError backendError(const std::string& message) {
  return c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message);
}

}  // namespace

ZeroPlusBackend::ZeroPlusBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                 BackendConfig config)
    : c10d::Backend(rank, size), config_(std::move(config)) {
  TORCH_CHECK(size >= 1, "zeroplus: group size must be >= 1, got ", size);
  TORCH_CHECK(rank >= 0 && rank < size, "zeroplus: rank ", rank, " out of range for group size ", size);
  TORCH_CHECK(config_.timeout.count() > 0, "zeroplus: timeout must be positive, got ", config_.timeout.count(), " ms");
  StoreRendezvous rendezvous(store);
  CommunicatorOptions options;
  options.rank = rank;
  options.size = size;
  options.connectTimeout = config_.timeout;
  try {
    comm_ = Communicator::connect(rendezvous, options);
  } catch (const CommError& e) {
    throw backendError(std::string("zeroplus init: ") + e.what());
  }
  worker_ = std::thread([this] { workerLoop(); });
  init();
}

ZeroPlusBackend::~ZeroPlusBackend() {
  stopWorker();
}

void ZeroPlusBackend::setTimeout(std::chrono::milliseconds timeout) {
  TORCH_CHECK(timeout.count() > 0, "zeroplus set_timeout: timeout must be positive, got ", timeout.count(), " ms");
  std::lock_guard<std::mutex> lock(mutex_);
  config_.timeout = timeout;
}

void ZeroPlusBackend::shutdown() {
  stopWorker();
}

void ZeroPlusBackend::abort() {
  // Wake a blocked transfer first so the worker can observe stopping_.
  if (comm_) comm_->abort();
  stopWorker();
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
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::collective(c10d::OpType opType, const char* opName,
                                                           std::vector<at::Tensor> outputs,
                                                           std::chrono::milliseconds opTimeout, Body body) {
  const uint64_t seq = ++sequenceNumber_;
  auto work = c10::make_intrusive<ZeroPlusWork>(rank_, opType, opName, seq, std::move(outputs));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (opTimeout.count() <= 0) opTimeout = config_.timeout;  // kUnsetTimeout: group default
    if (!brokenReason_.empty()) {
      work->markFailed(std::make_exception_ptr(backendError(std::string("zeroplus ") + opName +
                                                            ": process group is unusable after an earlier failure: " +
                                                            brokenReason_)));
      return work;
    }
    TORCH_CHECK(!stopping_, "zeroplus ", opName, ": process group has been shut down");
    queue_.push_back(Task{work, std::move(body), opTimeout, opName});
    if (coalescing_) coalescedWorks_.push_back(work);
  }
  queueCv_.notify_one();
  return work;
}

void ZeroPlusBackend::workerLoop() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      queueCv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    runTask(task);
  }
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
    task.body(deadline);
    task.work->markSucceeded();
  } catch (const CommError& e) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      brokenReason_ = e.what();
    }
    task.work->markFailed(std::make_exception_ptr(backendError(e.what())));
  } catch (const c10::Error&) {
    task.work->markFailed(std::current_exception());
  } catch (const std::exception& e) {
    task.work->markFailed(
        std::make_exception_ptr(backendError(std::string("zeroplus ") + task.opName + ": " + e.what())));
  }
}

}  // namespace zeroplus::pg
