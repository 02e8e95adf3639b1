#include "process_group/core/comm_stats.hpp"

namespace zeroplus::pg {

const char* commOpName(CommOp op) {
  switch (op) {
    case CommOp::kAllReduce: return "all_reduce";
    case CommOp::kAllReduceCoalesced: return "all_reduce_coalesced";
    case CommOp::kReduce: return "reduce";
    case CommOp::kBroadcast: return "broadcast";
    case CommOp::kAllGather: return "all_gather";
    case CommOp::kAllGatherIntoTensor: return "all_gather_into_tensor";
    case CommOp::kAllGatherCoalesced: return "all_gather_coalesced";
    case CommOp::kAllGatherIntoTensorCoalesced: return "all_gather_into_tensor_coalesced";
    case CommOp::kGather: return "gather";
    case CommOp::kScatter: return "scatter";
    case CommOp::kReduceScatter: return "reduce_scatter";
    case CommOp::kReduceScatterTensor: return "reduce_scatter_tensor";
    case CommOp::kReduceScatterTensorCoalesced: return "reduce_scatter_tensor_coalesced";
    case CommOp::kAllToAll: return "all_to_all";
    case CommOp::kAllToAllSingle: return "all_to_all_single";
    case CommOp::kSend: return "send";
    case CommOp::kRecv: return "recv";
    case CommOp::kBarrier: return "barrier";
  }
  return "unknown";
}

double busFactor(CommOp op, int groupSize) {
  const double n = groupSize < 1 ? 1.0 : static_cast<double>(groupSize);
  switch (op) {
    case CommOp::kAllReduce:
    case CommOp::kAllReduceCoalesced:
      return 2.0 * (n - 1.0) / n;  // reduce-scatter then all-gather of the whole buffer
    case CommOp::kAllGather:
    case CommOp::kAllGatherIntoTensor:
    case CommOp::kAllGatherCoalesced:
    case CommOp::kAllGatherIntoTensorCoalesced:
    case CommOp::kGather:
    case CommOp::kScatter:
    case CommOp::kReduceScatter:
    case CommOp::kReduceScatterTensor:
    case CommOp::kReduceScatterTensorCoalesced:
    case CommOp::kAllToAll:
    case CommOp::kAllToAllSingle:
      return (n - 1.0) / n;  // every rank moves all but its own 1/n of S
    case CommOp::kReduce:
    case CommOp::kBroadcast:
    case CommOp::kSend:
    case CommOp::kRecv:
      return 1.0;
    case CommOp::kBarrier:
      return 0.0;
  }
  return 0.0;
}

OpCount CommStatsSnapshot::total() const {
  OpCount sum;
  for (const OpCount& c : ops) {
    sum.calls += c.calls;
    sum.bytes += c.bytes;
  }
  return sum;
}

CommStatsSnapshot CommStats::snapshot() const noexcept {
  CommStatsSnapshot s;
  for (size_t i = 0; i < kCommOpCount; ++i) {
    s.ops[i].calls = counters_[i].calls.load(std::memory_order_relaxed);
    s.ops[i].bytes = counters_[i].bytes.load(std::memory_order_relaxed);
  }
  return s;
}

void CommStats::reset() noexcept {
  for (Counter& c : counters_) {
    c.calls.store(0, std::memory_order_relaxed);
    c.bytes.store(0, std::memory_order_relaxed);
  }
}

}  // namespace zeroplus::pg
