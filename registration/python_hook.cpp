// Load-time hook: when libzeroplus.so is loaded into a Python process (torch.ops.load_library or
// import zeroplus), register the "zeroplus" backend with torch.distributed by running the
// embedded backend_hook.py.
//
// Why dlsym and not a link against libpython: the library must stay loadable from a plain
// LibTorch C++ program and from any Python build (static or shared libpython), so it carries no
// Py* undefined symbols. In a process without Python the lookups fail and the hook does nothing.
//
// ctypes calls dlopen with the GIL held, on the loading thread; PyGILState_Ensure is re-entrant,
// so taking it again is safe and also covers a C++ host that embeds Python on another thread.
// Nothing here may throw: an exception escaping a static initializer terminates the process.
#include <dlfcn.h>

#include <string>

#include "registration/backend_hook_source.hpp"

namespace zeroplus::registration {
namespace {

using PyIsInitializedFn = int (*)();
using PyGilEnsureFn = int (*)();  // PyGILState_STATE is an enum (int-sized)
using PyGilReleaseFn = void (*)(int);
using PyRunSimpleStringFn = int (*)(const char*);

template <typename Fn>
Fn lookup(const char* name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_DEFAULT, name));
}

void runBackendHook() noexcept {
  auto isInitialized = lookup<PyIsInitializedFn>("Py_IsInitialized");
  auto gilEnsure = lookup<PyGilEnsureFn>("PyGILState_Ensure");
  auto gilRelease = lookup<PyGilReleaseFn>("PyGILState_Release");
  auto runString = lookup<PyRunSimpleStringFn>("PyRun_SimpleString");
  if (!isInitialized || !gilEnsure || !gilRelease || !runString) return;  // no Python here
  if (!isInitialized()) return;
  const int state = gilEnsure();
  runString(kBackendHookPython);  // the script reports its own failures on stderr
  gilRelease(state);
}

// Runs after the TORCH_LIBRARY registrations of this library only in the sense that it does
// not need them: the hook registers a Python creator that calls torch.ops.zeroplus.* later,
// at init_process_group time, when every static initializer has long finished.
[[maybe_unused]] const bool kHookRan = (runBackendHook(), true);

}  // namespace
}  // namespace zeroplus::registration
