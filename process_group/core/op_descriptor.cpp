// Op descriptors: comparison and the wording of mismatches; see op_descriptor.hpp.
#include "process_group/core/op_descriptor.hpp"

namespace zeroplus::pg::detail {
namespace {

std::string opText(const OpDescriptor& d) {
  std::string s(opName(static_cast<WireOp>(d.op)));
  if (d.flags & OpDescriptor::kFused) s += " (fused queued allreduces)";
  return s;
}

std::string countText(const OpDescriptor& d) {
  return std::to_string(d.count) + (d.dtype == OpDescriptor::kNone ? " bytes" : " elements");
}

std::string dtypeText(uint8_t t) {
  return t == OpDescriptor::kNone ? "none" : std::string(toString(static_cast<DataType>(t)));
}

std::string reduceText(uint8_t op) {
  return op == OpDescriptor::kNone ? "none" : std::string(toString(static_cast<ReduceOp>(op)));
}

}  // namespace

std::string describeMismatch(const OpDescriptor& mine, const OpDescriptor& theirs, int peer) {
  const std::string them = "rank " + std::to_string(peer);
  std::string what;
  auto add = [&](const std::string& field, const std::string& a, const std::string& b) {
    what += (what.empty() ? "" : "; ") + field + " differs: this rank " + a + ", " + them + " " + b;
  };
  if (theirs.magic != kWireMagic) {
    what = "received a corrupt op descriptor from " + them;
  } else if (theirs.op == mine.op && (theirs.flags & OpDescriptor::kBadArgs)) {
    return "cannot run it: " + them + " called " + opText(theirs) +
           " with inconsistent arguments of its own: it sends " + std::to_string(theirs.count) +
           " bytes to itself but expects " + std::to_string(theirs.reserved2) +
           " (its input and output split sizes for itself differ)";
  } else if (mine.op != theirs.op) {
    // Sizes of different collectives are not comparable; name the collectives only.
    add("collective", "runs " + opText(mine), "runs " + opText(theirs));
  } else {
    // A fused and a plain allreduce meet when sizes differ around bucket_bytes: say both.
    if (mine.flags != theirs.flags) add("collective", "runs " + opText(mine), "runs " + opText(theirs));
    if (mine.count != theirs.count) add("size", "passes " + countText(mine), "passes " + countText(theirs));
    if (mine.dtype != theirs.dtype) add("dtype", dtypeText(mine.dtype), dtypeText(theirs.dtype));
    if (mine.reduceOp != theirs.reduceOp) add("reduce op", reduceText(mine.reduceOp), reduceText(theirs.reduceOp));
    if (mine.root != theirs.root) add("root", std::to_string(mine.root), std::to_string(theirs.root));
  }
  if (what.empty()) return "";
  std::string where = "collective #" + std::to_string(mine.seq);
  if (theirs.seq != mine.seq) where += " (#" + std::to_string(theirs.seq) + " on " + them + ")";
  return "collective mismatch with " + them + " at " + where + " of this group: " + what +
         " (every rank must call the same collectives in the same order with the same sizes, dtypes, ops and roots)";
}

uint64_t packHead(const OpDescriptor& d) {
  return static_cast<uint64_t>(d.op) | static_cast<uint64_t>(d.flags) << 8 | static_cast<uint64_t>(d.dtype) << 16 |
         static_cast<uint64_t>(d.reduceOp) << 24 | static_cast<uint64_t>(static_cast<uint32_t>(d.root)) << 32;
}

OpDescriptor unpack(uint64_t head, uint64_t count, uint64_t seq) {
  OpDescriptor d;
  d.op = static_cast<uint8_t>(head);
  d.flags = static_cast<uint8_t>(head >> 8);
  d.dtype = static_cast<uint8_t>(head >> 16);
  d.reduceOp = static_cast<uint8_t>(head >> 24);
  d.root = static_cast<int32_t>(static_cast<uint32_t>(head >> 32));
  d.count = count;
  d.seq = seq;
  return d;
}

}  // namespace zeroplus::pg::detail
