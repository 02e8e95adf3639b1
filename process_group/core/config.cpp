// ZEROPLUS_* environment parsing for the process group (see config.hpp). Every environment
// variable the process-group code reads is read here.
#include "process_group/core/config.hpp"

#include <cstdlib>
#include <stdexcept>

namespace zeroplus::pg {
namespace {

[[noreturn]] void bad(std::string_view name, std::string_view value, std::string_view expected) {
  throw std::invalid_argument("zeroplus: " + std::string(name) + "='" + std::string(value) + "' is invalid, expected " +
                              std::string(expected));
}

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

}  // namespace

size_t parseBytes(std::string_view name, std::string_view value) {
  // Every size must stay below 1 TiB after the suffix is applied. Both the digits and the
  // multiplication are checked: "17179869184G" would otherwise shift to 2^64 = 0, and
  // "17179869185G" wrap around to 1 GiB.
  constexpr unsigned long long kLimit = 1ull << 40;
  size_t i = 0;
  unsigned long long n = 0;
  while (i < value.size() && value[i] >= '0' && value[i] <= '9') {
    n = n * 10 + static_cast<unsigned>(value[i] - '0');
    if (n >= kLimit) bad(name, value, "a size below 1 TiB");
    ++i;
  }
  if (i == 0) bad(name, value, "a byte count such as 4194304, 4096K or 4M");
  std::string_view suffix = value.substr(i);
  unsigned shift = 0;
  if (suffix == "" || suffix == "B") shift = 0;
  else if (suffix == "K" || suffix == "KiB" || suffix == "k") shift = 10;
  else if (suffix == "M" || suffix == "MiB") shift = 20;
  else if (suffix == "G" || suffix == "GiB") shift = 30;
  else bad(name, value, "a byte count with an optional K, M or G suffix");
  if (n >= (kLimit >> shift)) bad(name, value, "a size below 1 TiB");
  return static_cast<size_t>(n << shift);
}

bool parseBool(std::string_view name, std::string_view value) {
  if (value == "1" || value == "on" || value == "true" || value == "yes") return true;
  if (value == "0" || value == "off" || value == "false" || value == "no") return false;
  bad(name, value, "one of 1/0, on/off, true/false");
}

ShmMode parseShmMode(std::string_view name, std::string_view value) {
  if (value == "auto") return ShmMode::kAuto;
  if (value == "on" || value == "1") return ShmMode::kOn;
  if (value == "off" || value == "0") return ShmMode::kOff;
  bad(name, value, "auto, on or off");
}

std::string_view toString(ShmMode mode) {
  switch (mode) {
    case ShmMode::kAuto: return "auto";
    case ShmMode::kOn: return "on";
    case ShmMode::kOff: return "off";
  }
  return "?";
}

CudaTransport parseCudaTransport(std::string_view name, std::string_view value) {
  if (value == "auto") return CudaTransport::kAuto;
  if (value == "nccl") return CudaTransport::kNccl;
  if (value == "host") return CudaTransport::kHost;
  bad(name, value, "auto, nccl or host");
}

std::string_view toString(CudaTransport transport) {
  switch (transport) {
    case CudaTransport::kAuto: return "auto";
    case CudaTransport::kNccl: return "nccl";
    case CudaTransport::kHost: return "host";
  }
  return "?";
}

InterHost parseInterHost(std::string_view name, std::string_view value) {
  if (value == "auto") return InterHost::kAuto;
  if (value == "gloo") return InterHost::kGloo;
  if (value == "tcp") return InterHost::kTcp;
  bad(name, value, "auto, gloo or tcp");
}

std::string_view toString(InterHost interHost) {
  switch (interHost) {
    case InterHost::kAuto: return "auto";
    case InterHost::kGloo: return "gloo";
    case InterHost::kTcp: return "tcp";
  }
  return "?";
}

namespace {

// Every knob once: its BackendOptions field name and its environment variable.
struct Knob {
  const char* field;
  const char* env;
};
constexpr Knob kKnobs[] = {
    {"bucket_bytes", "ZEROPLUS_BUCKET_BYTES"},       {"fuse", "ZEROPLUS_FUSE"},
    {"shm", "ZEROPLUS_SHM"},                         {"shm_chunk_bytes", "ZEROPLUS_SHM_CHUNK_BYTES"},
    {"spin_us", "ZEROPLUS_SPIN_US"},                 {"inline_sync", "ZEROPLUS_INLINE_SYNC"},
    {"cuda_transport", "ZEROPLUS_CUDA_TRANSPORT"},   {"socket_ifname", "ZEROPLUS_SOCKET_IFNAME"},
    {"interhost", "ZEROPLUS_INTERHOST"},             {"debug", "ZEROPLUS_DEBUG"},
};

void apply(PgTuning& t, std::string_view field, std::string_view value, std::string_view shownAs) {
  if (field == "bucket_bytes") {
    t.bucketBytes = parseBytes(shownAs, value);
  } else if (field == "fuse") {
    t.fuse = parseBool(shownAs, value);
  } else if (field == "shm") {
    t.shm = parseShmMode(shownAs, value);
  } else if (field == "shm_chunk_bytes") {
    t.shmChunkBytes = parseBytes(shownAs, value);
    if (t.shmChunkBytes < 4096 || t.shmChunkBytes > (256u << 20)) bad(shownAs, value, "4K to 256M");
  } else if (field == "spin_us") {
    const size_t us = parseBytes(shownAs, value);
    if (us > 1000000) bad(shownAs, value, "0 to 1000000 microseconds");
    t.spinMicros = static_cast<uint32_t>(us);
  } else if (field == "inline_sync") {
    t.inlineSync = parseBool(shownAs, value);
  } else if (field == "cuda_transport") {
    t.cudaTransport = parseCudaTransport(shownAs, value);
  } else if (field == "socket_ifname") {
    // Linux interface names: 1 to 15 bytes (IFNAMSIZ - 1), no '/', ':' or whitespace.
    const bool ok = !value.empty() && value.size() < 16 &&
                    value.find_first_of("/: \t\n") == std::string_view::npos;
    if (!ok) bad(shownAs, value, "a network interface name such as eth0 (1 to 15 characters)");
    t.socketIfname = std::string(value);
    t.socketIfnameSource = std::string(shownAs);
  } else if (field == "interhost") {
    t.interHost = parseInterHost(shownAs, value);
  } else if (field == "debug") {
    t.debug = parseBool(shownAs, value);
  } else {
    throw std::invalid_argument("zeroplus: unknown backend option '" + std::string(field) +
                                "'; known: bucket_bytes, fuse, shm, shm_chunk_bytes, spin_us, inline_sync, "
                                "cuda_transport, socket_ifname, interhost, debug");
  }
}

}  // namespace

PgTuning configFromEnvironment() {
  PgTuning t;
  for (const Knob& k : kKnobs) {
    if (const char* v = env(k.env)) apply(t, k.field, v, k.env);
  }
  // Users moving from backend="gloo" already set GLOO_SOCKET_IFNAME; honour it (its first
  // entry: Gloo accepts a comma-separated list) unless ZEROPLUS_SOCKET_IFNAME says otherwise.
  if (t.socketIfname.empty()) {
    if (const char* v = env("GLOO_SOCKET_IFNAME")) {
      const std::string_view all(v);
      apply(t, "socket_ifname", all.substr(0, all.find(',')), "GLOO_SOCKET_IFNAME");
    }
  }
  return t;
}

void applyOption(PgTuning& tuning, std::string_view field, std::string_view value) {
  apply(tuning, field, value, "BackendOptions." + std::string(field));
}

}  // namespace zeroplus::pg
