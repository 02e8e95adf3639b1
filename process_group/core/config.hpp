// Tuning knobs of the "zeroplus" process group, and the one place that reads ZEROPLUS_*
// environment variables for it (docs/backend.md, "Knobs", lists them all).
//
// Precedence: built-in default < environment variable < backend option
// (zeroplus.BackendOptions, forwarded by registration/library.cpp). Torch-free.
//
// Contract: configFromEnvironment() is called once per group construction on the caller's
// thread; it never caches, so a test may change the environment between groups. A malformed
// value throws std::invalid_argument naming the variable, the value and what was expected.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace zeroplus::pg {

enum class ShmMode : uint8_t {
  kAuto,  // use shared memory when every rank of the group is on this host
  kOn,    // same, but a group that cannot use it fails to initialise
  kOff,   // TCP only
};

// Which transport serves CUDA tensors (process_group/adapter/cuda_transport.hpp).
enum class CudaTransport : uint8_t {
  kAuto,  // NCCL in builds with CUDA, host staging otherwise
  kNccl,  // an inner ProcessGroupNCCL; an error in builds without CUDA
  kHost,  // copy through host memory and use this group's CPU transport
};

// What carries the inter-host phase of a group that spans hosts (docs/multihost.md).
enum class InterHost : uint8_t {
  kAuto,  // Gloo when the Python registration hook provided it, else the flat TCP mesh
  kGloo,  // hierarchical collectives with Gloo between hosts (needs the Python layer)
  kTcp,   // the flat algorithms over zeroplus's own TCP mesh, as on one host
};

struct PgTuning {
  // Largest flat bucket packed for fused/coalesced allreduces (bytes). 0 disables packing:
  // every tensor moves as its own operation.
  size_t bucketBytes = 4u << 20;
  // Async allreduces that sit together in the queue are fused into one bucketed op.
  bool fuse = true;
  ShmMode shm = ShmMode::kAuto;
  // Bytes per pipeline stage of the shared-memory transport (per rank, per slot).
  size_t shmChunkBytes = 1u << 20;
  // How long a shared-memory wait spins before it sleeps on a futex (microseconds). Spinning
  // is what keeps small-op latency low; with 2 cores a long spin starves the peer rank.
  uint32_t spinMicros = 50;
  // Synchronous collectives (async_op=False) run on the caller's thread when nothing is queued,
  // saving two thread hand-offs per op.
  bool inlineSync = true;
  CudaTransport cudaTransport = CudaTransport::kAuto;
  // Network interface whose IPv4 address the set-up listeners (collective and point-to-point
  // meshes) bind and publish. Empty: loopback when every rank shares one network namespace,
  // else the host's address (tcp_mesh.hpp). May differ between ranks (names are per host).
  std::string socketIfname;
  // Where socketIfname came from, for error messages: "ZEROPLUS_SOCKET_IFNAME",
  // "GLOO_SOCKET_IFNAME" (honoured when ZEROPLUS_SOCKET_IFNAME is unset; its first entry, as
  // Gloo's list form "eth0,eth1" names several) or "BackendOptions.socket_ifname".
  std::string socketIfnameSource;
  // ZEROPLUS_INTERHOST: see InterHost. Must agree on every rank (part of the tuning check).
  InterHost interHost = InterHost::kAuto;
  // ZEROPLUS_DEBUG=1: log the group's topology and transport choice once, at creation, to
  // stderr (group rank 0 only). Not part of the cross-rank tuning check.
  bool debug = false;
};

// Defaults overridden by ZEROPLUS_BUCKET_BYTES, ZEROPLUS_FUSE, ZEROPLUS_SHM,
// ZEROPLUS_SHM_CHUNK_BYTES, ZEROPLUS_SPIN_US, ZEROPLUS_INLINE_SYNC, ZEROPLUS_CUDA_TRANSPORT,
// ZEROPLUS_SOCKET_IFNAME (else GLOO_SOCKET_IFNAME), ZEROPLUS_INTERHOST and ZEROPLUS_DEBUG.
PgTuning configFromEnvironment();

// Applies one BackendOptions field ("bucket_bytes", "fuse", "shm", "shm_chunk_bytes",
// "spin_us", "inline_sync", "cuda_transport", "socket_ifname", "interhost", "debug") given as text, with the same parsing and limits as its
// environment variable. Throws std::invalid_argument.
void applyOption(PgTuning& tuning, std::string_view field, std::string_view value);

// Parsers shared with the backend-options path. Sizes accept a plain integer or a K/M/G
// (KiB/MiB/GiB) suffix.
size_t parseBytes(std::string_view name, std::string_view value);
bool parseBool(std::string_view name, std::string_view value);
ShmMode parseShmMode(std::string_view name, std::string_view value);
std::string_view toString(ShmMode mode);
CudaTransport parseCudaTransport(std::string_view name, std::string_view value);
std::string_view toString(CudaTransport transport);
InterHost parseInterHost(std::string_view name, std::string_view value);
std::string_view toString(InterHost interHost);

}  // namespace zeroplus::pg
