// Internal: the op descriptor every rank publishes before an op moves data, so that ranks which
// called different collectives, or the same one with a different size, dtype, reduce op or root,
// all fail at that call with a message naming what differs and both ranks' values, instead of
// reducing each other's unrelated bytes (or one rank succeeding and the other blaming a
// "connection reset"). The idea of Gloo's and NCCL's debug-mode collective fingerprints, made
// cheap enough to be always on:
//   TCP: the descriptor is a 32-byte message sent to and received from every peer before the
//        data (one small all-to-all per collective; point-to-point ops carry (tag, bytes) in
//        their own headers instead).
//   shm: the descriptor sits in the rank's control block next to the phase it publishes at
//        the op's first synchronisation, so checking it costs no extra round.
// Every rank compares every peer's descriptor with its own: if any two differ, every rank sees
// a difference with at least one peer, so every rank raises.
//
// Layout: the first 16 bytes read as a WireHeader whose op is the collective, so a rank posted
// in recv() that meets a peer's descriptor reports "collective mismatch" too.
#pragma once

#include <cstdint>
#include <string>

#include "process_group/core/datatype.hpp"
#include "process_group/core/wire.hpp"

namespace zeroplus::pg::detail {

struct OpDescriptor {
  static constexpr uint8_t kNone = 0xff;  // dtype / reduceOp of ops without one
  static constexpr uint8_t kFused = 1;    // flags: a fused batch of queued allreduces
  // flags: this rank's own arguments are inconsistent (alltoallv: what it sends to itself is
  // not what it expects from itself). It still publishes its descriptor, so every peer fails
  // naming the cause (docs/errors.md rule 9); `count` then holds the bytes it sends to itself
  // and `reserved2` those it expects (saturated at 2^32 - 1).
  static constexpr uint8_t kBadArgs = 2;

  uint16_t magic = kWireMagic;
  uint8_t op = 0;  // WireOp
  uint8_t flags = 0;
  uint8_t dtype = kNone;     // DataType
  uint8_t reduceOp = kNone;  // ReduceOp
  uint16_t reserved = 0;
  int32_t root = -1;  // -1: the op has no root
  uint32_t reserved2 = 0;
  uint64_t count = 0;  // elements when dtype is set, else bytes (per rank, as the op defines it)
  uint64_t seq = 0;    // collectives this communicator ran before: reported, never compared
};
static_assert(sizeof(OpDescriptor) == 32, "OpDescriptor is sent and stored as raw bytes");

inline OpDescriptor describe(WireOp op, uint64_t bytes, int root = -1) {
  OpDescriptor d;
  d.op = static_cast<uint8_t>(op);
  d.count = bytes;
  d.root = root;
  return d;
}

inline OpDescriptor describe(WireOp op, uint64_t count, DataType type, ReduceOp reduceOp, int root = -1) {
  OpDescriptor d = describe(op, count, root);
  d.dtype = static_cast<uint8_t>(type);
  d.reduceOp = static_cast<uint8_t>(reduceOp);
  return d;
}

// "" when `theirs` (rank `peer`) agrees with `mine`; otherwise "collective mismatch with rank
// <peer> at collective #<seq>: <what> differs: this rank <x>, rank <peer> <y>[; ...]".
std::string describeMismatch(const OpDescriptor& mine, const OpDescriptor& theirs, int peer);

// The shared-memory control block stores a descriptor as three 64-bit words.
uint64_t packHead(const OpDescriptor& d);
OpDescriptor unpack(uint64_t head, uint64_t count, uint64_t seq);

}  // namespace zeroplus::pg::detail
