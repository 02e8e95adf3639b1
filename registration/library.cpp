// TORCH_LIBRARY(zeroplus): the operator namespace every zeroplus registration file extends with
// TORCH_LIBRARY_FRAGMENT. This file owns the process-group glue: build_info(), attach() and
// watch_interrupts().
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>
#include <torch/version.h>

#include "process_group/adapter/backend.hpp"
#include "process_group/adapter/device_router.hpp"
#include "process_group/adapter/interrupt_watch.hpp"

namespace zeroplus::registration {
namespace {

std::string buildInfo() {
  return "zeroplus " ZEROPLUS_VERSION "; torch " ZEROPLUS_BUILD_TORCH_VERSION;
}

// Builds a ZeroPlusBackend for the group described by `pg` (store, rank, size) and sets it on
// `pg` for CPU. Called by the Python creator in backend_hook.py with a scratch group.
// `options` are "field=value" pairs of zeroplus.BackendOptions; they override ZEROPLUS_*.
void attach(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int64_t timeoutMs, std::string groupName,
            std::vector<int64_t> globalRanks, std::vector<std::string> options) {
  TORCH_CHECK(pg, "zeroplus attach: pg is None");
  TORCH_CHECK(timeoutMs > 0, "zeroplus attach: timeout_ms must be positive, got ", timeoutMs);
  pg::BackendConfig config;
  config.timeout = std::chrono::milliseconds(timeoutMs);
  config.groupName = std::move(groupName);
  config.globalRanks = std::move(globalRanks);
  try {
    config.tuning = pg::configFromEnvironment();
    for (const auto& option : options) {
      const auto eq = option.find('=');
      TORCH_CHECK(eq != std::string::npos, "zeroplus attach: option '", option, "' is not field=value");
      pg::applyOption(config.tuning, option.substr(0, eq), option.substr(eq + 1));
    }
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  auto cpu = c10::make_intrusive<pg::ZeroPlusBackend>(pg->getStore(), pg->getRank(), pg->getSize(),
                                                      std::move(config));
  // c10d registers this one object for both "cpu" and "cuda"; the router picks the transport.
  auto router = c10::make_intrusive<pg::DeviceRouter>(pg->getStore(), cpu);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, router);
}

}  // namespace
}  // namespace zeroplus::registration

TORCH_LIBRARY(zeroplus, m) {
  m.def("build_info() -> str", &zeroplus::registration::buildInfo);
  m.def(
      "attach(__torch__.torch.classes.c10d.ProcessGroup pg, int timeout_ms, str group_name, int[] global_ranks, "
      "str[] options) -> ()",
      &zeroplus::registration::attach);
  // Called by backend_hook.py while Python's default SIGINT handler is set (interrupt_watch.hpp).
  m.def("watch_interrupts() -> bool", [] { return zeroplus::pg::installInterruptChain(); });
}
