// SIGINT chaining and the watcher thread; see interrupt_watch.hpp.
#include "process_group/adapter/interrupt_watch.hpp"

#include <signal.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <map>
#include <mutex>
#include <thread>

namespace zeroplus::pg {
namespace {

struct sigaction gPrevious {};  // the action we chain to; written before ours is installed
int gEventFd = -1;
pid_t gOwner = 0;  // a forked child shares the eventfd: only the installing process signals it

std::mutex& registryMutex() {
  static std::mutex m;
  return m;
}
std::map<uint64_t, std::function<void()>>& listeners() {
  static std::map<uint64_t, std::function<void()>> l;
  return l;
}

void onSigint(int sig, siginfo_t* info, void* context) {
  const int saved = errno;
  if (gEventFd >= 0 && ::getpid() == gOwner) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t rc = ::write(gEventFd, &one, sizeof(one));
  }
  if (gPrevious.sa_flags & SA_SIGINFO) {
    if (gPrevious.sa_sigaction != nullptr) gPrevious.sa_sigaction(sig, info, context);
  } else if (gPrevious.sa_handler != SIG_DFL && gPrevious.sa_handler != SIG_IGN && gPrevious.sa_handler != nullptr) {
    gPrevious.sa_handler(sig);
  }
  errno = saved;
}

void watch() {
  for (;;) {
    uint64_t n = 0;
    if (::read(gEventFd, &n, sizeof(n)) != sizeof(n)) {
      if (errno == EINTR) continue;
      return;
    }
    std::lock_guard<std::mutex> lock(registryMutex());
    for (auto& entry : listeners()) entry.second();
  }
}

}  // namespace

bool installInterruptChain() {
  static std::mutex installMutex;
  std::lock_guard<std::mutex> lock(installMutex);
  struct sigaction current {};
  if (::sigaction(SIGINT, nullptr, &current) != 0) return false;
  const bool ours = (current.sa_flags & SA_SIGINFO) && current.sa_sigaction == onSigint;
  if (ours) return true;
  if (!(current.sa_flags & SA_SIGINFO) && (current.sa_handler == SIG_DFL || current.sa_handler == SIG_IGN)) {
    return false;
  }
  if (gEventFd < 0 || gOwner != ::getpid()) {  // first install, or first in a forked child
    gEventFd = ::eventfd(0, EFD_CLOEXEC);
    if (gEventFd < 0) return false;
    gOwner = ::getpid();
    std::thread(watch).detach();  // lives as long as the process (the library is never unloaded)
  }
  gPrevious = current;
  struct sigaction mine = current;  // same mask and flags (SA_ONSTACK, no SA_RESTART: as Python)
  mine.sa_flags |= SA_SIGINFO;
  mine.sa_sigaction = onSigint;
  return ::sigaction(SIGINT, &mine, nullptr) == 0;
}

uint64_t addInterruptListener(std::function<void()> listener) {
  static uint64_t next = 0;
  std::lock_guard<std::mutex> lock(registryMutex());
  listeners().emplace(++next, std::move(listener));
  return next;
}

void removeInterruptListener(uint64_t id) {
  std::lock_guard<std::mutex> lock(registryMutex());
  listeners().erase(id);
}

}  // namespace zeroplus::pg
