// Ctrl-C in a blocked collective (docs/backend.md, "Interrupts").
//
// Why: a rank blocked in a collective waits inside C++ with the GIL released, and Python runs its
// SIGINT handler (KeyboardInterrupt) only once the main thread is back in the interpreter, so
// without help Ctrl-C takes effect at the op timeout (30 minutes by default). The library must
// not link libpython (tests/python/test_registration.py), so it cannot call PyErr_CheckSignals;
// instead it chains a SIGINT handler in front of whatever handler is installed (Python's C-level
// trampoline):
//   * installInterruptChain() saves the current SIGINT action and installs one that writes an
//     eventfd (async-signal-safe) and then calls the saved handler, so Python still records the
//     signal and raises KeyboardInterrupt as soon as control returns to it.
//   * a watcher thread, started by the first install, wakes on the eventfd and runs every
//     listener; ZeroPlusBackend aborts its group, which fails a blocked call within
//     milliseconds and tells the peers through the transport's abort (also when nothing was in
//     flight here: the peers may be waiting for an op this rank will not issue).
// The backend hook calls it only while Python's default KeyboardInterrupt handler is set: a
// program with its own SIGINT handler (graceful shutdown) keeps its ops. signal.signal() later
// replaces the chain, and with it this behaviour. In a forked child the handler only forwards.
//
// Threading: all functions are thread-safe. Listeners run on the watcher thread, under the
// registry lock: removeInterruptListener() returns only after a running listener finished.
#pragma once

#include <cstdint>
#include <functional>

namespace zeroplus::pg {

// Returns true when the chain is installed (now or before), false when SIGINT is ignored or
// has its default action (then Ctrl-C kills the process anyway) or sigaction failed.
bool installInterruptChain();

uint64_t addInterruptListener(std::function<void()> listener);
void removeInterruptListener(uint64_t id);

}  // namespace zeroplus::pg
