// TORCH_LIBRARY(zeroplus): the operator namespace every zeroplus registration file extends with
// TORCH_LIBRARY_FRAGMENT. This file owns the build stamp and the process-group glue:
// build_info(), backend_config(), attach(), topology(), interhost_plan(), attach_interhost(),
// comm_stats(), reset_comm_stats() and watch_interrupts().
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>
#include <torch/version.h>

#include "process_group/adapter/backend.hpp"
#include "process_group/adapter/device_router.hpp"
#include "process_group/adapter/gloo_channel.hpp"
#include "process_group/adapter/interrupt_watch.hpp"

#ifdef ZEROPLUS_WITH_CUDA
#define ZEROPLUS_STAMP_CUDA 1
#else
#define ZEROPLUS_STAMP_CUDA 0
#endif

#define ZEROPLUS_STR_(x) #x
#define ZEROPLUS_STR(x) ZEROPLUS_STR_(x)

// The build stamp: one NUL-terminated line in .rodata that Python reads from the file *before*
// dlopen (plugin/python/zeroplus/_library.py, zeroplus.report), so a library built for another
// torch is refused with both versions named instead of an undefined-symbol error or a crash
// inside a static initializer. Keep the "ZEROPLUS_BUILD_STAMP " prefix and the key=value format.
extern "C" __attribute__((used, visibility("default"))) const char zeroplus_build_stamp[] =
    "ZEROPLUS_BUILD_STAMP zeroplus=" ZEROPLUS_VERSION " torch=" ZEROPLUS_BUILD_TORCH_VERSION
    " cxx11_abi=" ZEROPLUS_STR(_GLIBCXX_USE_CXX11_ABI) " cuda=" ZEROPLUS_STR(ZEROPLUS_STAMP_CUDA);

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
  auto router = c10::make_intrusive<pg::DeviceRouter>(cpu->sessionStore(), cpu);
  pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, router);
}

// The backend knobs as ZEROPLUS_* sets them in this process, for zeroplus.report ("field=value";
// a malformed variable raises ValueError naming it, exactly as group creation would).
std::vector<std::string> backendConfig() {
  pg::PgTuning t;
  try {
    t = pg::configFromEnvironment();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  return {"bucket_bytes=" + std::to_string(t.bucketBytes),
          std::string("fuse=") + (t.fuse ? "1" : "0"),
          "shm=" + std::string(pg::toString(t.shm)),
          "shm_chunk_bytes=" + std::to_string(t.shmChunkBytes),
          "spin_us=" + std::to_string(t.spinMicros),
          std::string("inline_sync=") + (t.inlineSync ? "1" : "0"),
          "cuda_transport=" + std::string(pg::toString(t.cudaTransport)),
          "socket_ifname=" + t.socketIfname,
          "interhost=" + std::string(pg::toString(t.interHost)),
          std::string("debug=") + (t.debug ? "1" : "0")};
}

// The group's host topology for zeroplus.topology(): the host index of every group rank and
// the host names by index. `pg` must be a zeroplus group (the Python wrapper checks the backend
// name first; this check catches a direct call).
// The zeroplus backend of `pg`, or a ValueError naming `op`.
pg::DeviceRouter& zeroplusRouter(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  TORCH_CHECK_VALUE(pg, "zeroplus ", op, ": group is None");
  c10::intrusive_ptr<c10d::Backend> backend;
  try {
    backend = pg->getBackend(c10::DeviceType::CPU);
  } catch (const c10::Error&) {
  }
  auto* router = dynamic_cast<pg::DeviceRouter*>(backend.get());
  TORCH_CHECK_VALUE(router != nullptr, "zeroplus ", op, ": group is not a zeroplus group (its CPU backend is '",
                    backend ? backend->getBackendName() : std::string("none"), "')");
  return *router;
}

pg::ZeroPlusBackend& zeroplusBackend(const char* op, const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  return const_cast<pg::ZeroPlusBackend&>(zeroplusRouter(op, pg).cpuBackend());
}

// zeroplus.comm_stats(group): the op names (core/comm_stats.hpp, in CommOp order), the calls
// and bytes of each on this rank, and each op's busbw factor at the group's size.
std::tuple<std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>, std::vector<double>> commStats(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  pg::DeviceRouter& router = zeroplusRouter("comm_stats", pg);
  const pg::CommStatsSnapshot s = router.commStats().snapshot();
  std::vector<std::string> names;
  std::vector<int64_t> calls, bytes;
  std::vector<double> factors;
  for (size_t i = 0; i < pg::kCommOpCount; ++i) {
    const auto op = static_cast<pg::CommOp>(i);
    names.emplace_back(pg::commOpName(op));
    calls.push_back(static_cast<int64_t>(s.ops[i].calls));
    bytes.push_back(static_cast<int64_t>(s.ops[i].bytes));
    factors.push_back(pg::busFactor(op, router.getSize()));
  }
  return {names, calls, bytes, factors};
}

void resetCommStats(const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  zeroplusRouter("reset_comm_stats", pg).commStats().reset();
}

// The group's host topology and transport line: the host index of every group rank, the host
// names by index, and what carries the collectives (ZeroPlusBackend::transport()).
std::tuple<std::vector<int64_t>, std::vector<std::string>, std::string> topology(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  const pg::ZeroPlusBackend& backend = zeroplusBackend("topology", pg);
  const pg::Topology& t = backend.topology();
  return {std::vector<int64_t>(t.hostOf.begin(), t.hostOf.end()), t.hostNames, backend.transport()};
}

// What backend_hook.py needs to create the inter-host Gloo group right after attach():
// ({host index, host count, local index} or [] when the group wants none, the interface to
// bind or "", else the address the mesh published, the group instance's store prefix: the Gloo
// groups' keys go under it, so a restarted job never reads the previous attempt's).
std::tuple<std::vector<int64_t>, std::string, std::string, std::string> interhostPlan(
    const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
  const pg::ZeroPlusBackend& backend = zeroplusBackend("interhost_plan", pg);
  auto plan = backend.interHostPlan();
  if (plan.empty()) return {plan, "", "", backend.sessionPrefix()};
  const std::string& ifname = backend.socketIfname();
  return {plan, ifname, ifname.empty() ? backend.publishedAddress() : std::string(), backend.sessionPrefix()};
}

// Hands the Gloo group `interhost` (rank = host index) to the zeroplus group `pg` as its
// inter-host channel (gloo_channel.hpp); collective over the ranks of `pg`.
void attachInterhost(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                     const c10::intrusive_ptr<c10d::ProcessGroup>& interhost) {
  pg::ZeroPlusBackend& backend = zeroplusBackend("attach_interhost", pg);
  TORCH_CHECK_VALUE(interhost, "zeroplus attach_interhost: interhost_pg is None");
  auto gloo = interhost->getBackend(c10::DeviceType::CPU);
  backend.attachInterHost(std::make_unique<pg::GlooChannel>(gloo, interhost->getRank(), interhost->getSize()));
}

}  // namespace
}  // namespace zeroplus::registration

TORCH_LIBRARY(zeroplus, m) {
  m.def("build_info() -> str", &zeroplus::registration::buildInfo);
  m.def("backend_config() -> str[]", &zeroplus::registration::backendConfig);
  m.def(
      "attach(__torch__.torch.classes.c10d.ProcessGroup pg, int timeout_ms, str group_name, int[] global_ranks, "
      "str[] options) -> ()",
      &zeroplus::registration::attach);
  m.def("topology(__torch__.torch.classes.c10d.ProcessGroup pg) -> (int[], str[], str)",
        &zeroplus::registration::topology);
  m.def("interhost_plan(__torch__.torch.classes.c10d.ProcessGroup pg) -> (int[], str, str, str)",
        &zeroplus::registration::interhostPlan);
  m.def(
      "attach_interhost(__torch__.torch.classes.c10d.ProcessGroup pg, "
      "__torch__.torch.classes.c10d.ProcessGroup interhost_pg) -> ()",
      &zeroplus::registration::attachInterhost);
  m.def("comm_stats(__torch__.torch.classes.c10d.ProcessGroup pg) -> (str[], int[], int[], float[])",
        &zeroplus::registration::commStats);
  m.def("reset_comm_stats(__torch__.torch.classes.c10d.ProcessGroup pg) -> ()",
        &zeroplus::registration::resetCommStats);
  // Called by backend_hook.py while Python's default SIGINT handler is set (interrupt_watch.hpp).
  m.def("watch_interrupts() -> bool", [] { return zeroplus::pg::installInterruptChain(); });
}
