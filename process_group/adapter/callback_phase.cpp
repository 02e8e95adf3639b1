// Callback phases: collectives issued from a Work future's callbacks.
//
// Why: c10d runs a future's callbacks on the thread that completes it, here the group's worker
// (or the caller of an inline sync op, or a relief thread, below). A callback that issues a
// collective on the same group and waits for it (torch's hook_with_zero_step_interleaved
// broadcasts and then waits from a `Future.then` callback) would wait for the very thread that
// is running it: a self-deadlock. Running the callbacks on some other thread instead would let
// their collectives race with those the user's threads issue, so two ranks could queue them in
// different orders (a hang on TCP, mixed-up data on shared memory).
//
// How: a thread completes Works inside a phase (withCallbackPhase). A collective submitted from
// that thread while its phase is open, i.e. from one of the callbacks, goes to the phase's own
// queue instead of the group's, and a relief thread runs that queue in order while the callbacks
// go on (and may wait, on the Work or on its future). The phase ends once the callbacks have
// returned and the relief thread has drained the queue; only then does the group move on (busy_
// stays held). So ops issued by callbacks run right after the op whose completion ran those
// callbacks, on every rank alike, whatever the timing.
//
// Threading: one thread moves data at a time. A phase's owner is inside callbacks, not in the
// communicator, while its relief thread runs ops; a relief thread's own completions open a
// nested phase with its own relief thread. Fusible allreduces issued from callbacks run as
// batches of one (every rank does the same). A relief thread exists only while its phase has
// ops to run, so callbacks that issue nothing (DDP's) cost one thread-local lookup.
#include <c10/util/Exception.h>

#include "process_group/adapter/backend.hpp"

namespace zeroplus::pg {

struct ZeroPlusBackend::CallbackPhase {
  ZeroPlusBackend* owner = nullptr;
  CallbackPhase* outer = nullptr;  // the phase this thread was in before (nested completions)
  std::mutex mutex;
  std::condition_variable idle;
  std::deque<Task> tasks;  // issued by the callbacks, not started yet
  bool reliefActive = false;
  std::thread relief;
};

ZeroPlusBackend::CallbackPhase*& ZeroPlusBackend::threadPhase() {
  thread_local CallbackPhase* phase = nullptr;
  return phase;
}

void ZeroPlusBackend::withCallbackPhase(const std::function<void()>& body) {
  CallbackPhase phase;
  phase.owner = this;
  CallbackPhase*& current = threadPhase();
  phase.outer = current;
  current = &phase;
  // Closes the phase on every exit: once this thread's callbacks have returned nothing new can
  // join it, so waiting for the relief thread to drain the queue ends it.
  struct Close {
    CallbackPhase& phase;
    CallbackPhase*& current;
    ~Close() {
      current = phase.outer;
      std::unique_lock<std::mutex> lock(phase.mutex);
      phase.idle.wait(lock, [this] { return !phase.reliefActive; });
      lock.unlock();
      if (phase.relief.joinable()) phase.relief.join();
    }
  } close{phase, current};
  body();
}

bool ZeroPlusBackend::submitToCallbackPhase(Task& task) {
  CallbackPhase* phase = threadPhase();
  while (phase != nullptr && phase->owner != this) phase = phase->outer;  // another group's phase
  if (phase == nullptr) return false;
  std::string broken;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (task.timeout.count() <= 0) task.timeout = config_.timeout;  // kUnsetTimeout: group default
    TORCH_CHECK(!stopping_, "zeroplus ", task.opName, ": process group has been shut down");
    broken = brokenReason_;
    if (broken.empty() && coalescing_) coalescedWorks_.push_back(task.work);
  }
  if (!broken.empty()) {  // outside mutex_: failing runs the Work's callbacks, which may submit
    failTask(task, std::make_exception_ptr(c10::DistBackendError(
                       c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                       std::string("zeroplus ") + task.opName +
                           ": process group is unusable after an earlier failure: " + broken)));
    return true;
  }
  std::lock_guard<std::mutex> lock(phase->mutex);
  phase->tasks.push_back(std::move(task));
  if (!phase->reliefActive) {
    if (phase->relief.joinable()) phase->relief.join();  // an earlier one that found the queue empty
    phase->reliefActive = true;
    phase->relief = std::thread([this, phase] { runPhase(*phase); });
  }
  return true;
}

void ZeroPlusBackend::runPhase(CallbackPhase& phase) {
  for (;;) {
    Task task;
    {
      std::lock_guard<std::mutex> lock(phase.mutex);
      if (phase.tasks.empty()) {
        phase.reliefActive = false;
        phase.idle.notify_all();
        return;  // touches nothing of `phase` after the unlock: its owner may destroy it
      }
      task = std::move(phase.tasks.front());
      phase.tasks.pop_front();
    }
    withCallbackPhase([&] { runSingle(task); });
  }
}

}  // namespace zeroplus::pg
