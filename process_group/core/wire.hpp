// Internal: the on-the-wire message header.
//
// Each peer pair shares one TCP connection, i.e. one ordered byte stream per direction. The
// c10d rule (all ranks issue the same collectives in the same order) keeps the streams in step,
// so no per-message routing is needed. The header exists for safety, not routing: the first
// transfer of an operation on each link carries (op, tag, bytes), and the receiver checks them
// against what it expects, turning "ranks called different collectives" or "ranks passed
// different sizes" into a CommError instead of silent corruption or a hang. Pipelined segments
// after the first carry no header, so the check costs one 16-byte write per link and op
// (merged with the payload by sendmsg).
#pragma once

#include <cstdint>
#include <string_view>

namespace zeroplus::pg::detail {

enum class WireOp : uint8_t {
  kConnect, kBroadcast, kAllreduce, kReduce, kAllgather, kAllgatherv, kGather, kScatter,
  kReduceScatter, kAlltoallv, kSend, kRecv, kBarrier, kAgree,
};

inline std::string_view opName(WireOp op) {
  switch (op) {
    case WireOp::kConnect: return "connect";
    case WireOp::kBroadcast: return "broadcast";
    case WireOp::kAllreduce: return "allreduce";
    case WireOp::kReduce: return "reduce";
    case WireOp::kAllgather: return "allgather";
    case WireOp::kAllgatherv: return "allgatherv";
    case WireOp::kGather: return "gather";
    case WireOp::kScatter: return "scatter";
    case WireOp::kReduceScatter: return "reduce_scatter";
    case WireOp::kAlltoallv: return "alltoallv";
    case WireOp::kSend: return "send";
    case WireOp::kRecv: return "recv";
    case WireOp::kBarrier: return "barrier";
    case WireOp::kAgree: return "fusion agreement";
  }
  return "unknown";
}

inline constexpr uint16_t kWireMagic = 0x5A50;  // "ZP"

struct WireHeader {
  uint16_t magic = kWireMagic;
  uint8_t op = 0;  // WireOp; a recv() matches a peer's send(), so both use kSend
  uint8_t reserved = 0;
  uint32_t tag = 0;     // p2p tag, barrier round; 0 for collectives
  uint64_t bytes = 0;   // payload size of the whole operation on this link
};
static_assert(sizeof(WireHeader) == 16, "WireHeader is sent as raw bytes");

inline WireHeader makeHeader(WireOp op, uint64_t bytes, uint32_t tag = 0) {
  WireHeader h;
  h.op = static_cast<uint8_t>(op);
  h.tag = tag;
  h.bytes = bytes;
  return h;
}

}  // namespace zeroplus::pg::detail
