// TORCH_LIBRARY(zeroplus): the operator namespace every zeroplus registration file extends with
// TORCH_LIBRARY_FRAGMENT. This file owns the process-group glue: build_info() and attach().
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>
#include <torch/version.h>

#include "process_group/adapter/backend.hpp"

namespace zeroplus::registration {
namespace {

std::string buildInfo() {
  return "zeroplus " ZEROPLUS_VERSION "; torch " ZEROPLUS_BUILD_TORCH_VERSION;
}

// Builds a ZeroPlusBackend for the group described by `pg` (store, rank, size) and sets it on
// `pg` for CPU. Called by the Python creator in backend_hook.py with a scratch group.
void attach(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, int64_t timeoutMs, std::string groupName,
            std::vector<int64_t> globalRanks) {
  TORCH_CHECK(pg, "zeroplus attach: pg is None");
  TORCH_CHECK(timeoutMs > 0, "zeroplus attach: timeout_ms must be positive, got ", timeoutMs);
  pg::BackendConfig config;
  config.timeout = std::chrono::milliseconds(timeoutMs);
  config.groupName = std::move(groupName);
  config.globalRanks = std::move(globalRanks);
  auto backend = c10::make_intrusive<pg::ZeroPlusBackend>(pg->getStore(), pg->getRank(), pg->getSize(),
                                                          std::move(config));
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
}

}  // namespace
}  // namespace zeroplus::registration

TORCH_LIBRARY(zeroplus, m) {
  m.def("build_info() -> str", &zeroplus::registration::buildInfo);
  m.def(
      "attach(__torch__.torch.classes.c10d.ProcessGroup pg, int timeout_ms, str group_name, int[] global_ranks) -> ()",
      &zeroplus::registration::attach);
}
