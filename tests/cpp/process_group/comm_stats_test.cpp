// CommStats (comm_stats.hpp): per-op counting, totals, reset, names and bus factors, and that
// concurrent record() calls lose nothing.
#include "process_group/core/comm_stats.hpp"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <thread>
#include <vector>

namespace zeroplus::pg {
namespace {

TEST(CommStats, CountsCallsAndBytesPerOp) {
  CommStats stats;
  stats.record(CommOp::kAllReduce, 4096);
  stats.record(CommOp::kAllReduce, 8);
  stats.record(CommOp::kSend, 100);
  stats.record(CommOp::kBarrier, 0);
  const CommStatsSnapshot s = stats.snapshot();
  EXPECT_EQ(s[CommOp::kAllReduce].calls, 2u);
  EXPECT_EQ(s[CommOp::kAllReduce].bytes, 4104u);
  EXPECT_EQ(s[CommOp::kSend].calls, 1u);
  EXPECT_EQ(s[CommOp::kSend].bytes, 100u);
  EXPECT_EQ(s[CommOp::kBarrier].calls, 1u);
  EXPECT_EQ(s[CommOp::kBarrier].bytes, 0u);
  EXPECT_EQ(s[CommOp::kRecv].calls, 0u);
  EXPECT_EQ(s.total().calls, 4u);
  EXPECT_EQ(s.total().bytes, 4204u);
}

TEST(CommStats, ResetClearsEveryCounter) {
  CommStats stats;
  for (size_t i = 0; i < kCommOpCount; ++i) stats.record(static_cast<CommOp>(i), i + 1);
  EXPECT_EQ(stats.snapshot().total().calls, kCommOpCount);
  stats.reset();
  const CommStatsSnapshot s = stats.snapshot();
  EXPECT_EQ(s.total().calls, 0u);
  EXPECT_EQ(s.total().bytes, 0u);
  stats.record(CommOp::kBroadcast, 7);  // still counts after a reset
  EXPECT_EQ(stats.snapshot()[CommOp::kBroadcast].bytes, 7u);
}

TEST(CommStats, ConcurrentRecordsAreAllCounted) {
  CommStats stats;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&stats, t] {
      const CommOp op = t % 2 ? CommOp::kAllReduce : CommOp::kAllGatherIntoTensor;
      for (int i = 0; i < kPerThread; ++i) stats.record(op, 3);
    });
  }
  for (auto& th : threads) th.join();
  const CommStatsSnapshot s = stats.snapshot();
  EXPECT_EQ(s[CommOp::kAllReduce].calls, 2u * kPerThread);
  EXPECT_EQ(s[CommOp::kAllGatherIntoTensor].calls, 2u * kPerThread);
  EXPECT_EQ(s.total().bytes, 3u * kThreads * kPerThread);
}

TEST(CommStats, NamesAreUniqueTorchNames) {
  std::set<std::string> names;
  for (size_t i = 0; i < kCommOpCount; ++i) names.insert(commOpName(static_cast<CommOp>(i)));
  EXPECT_EQ(names.size(), kCommOpCount);
  EXPECT_EQ(std::string(commOpName(CommOp::kAllGatherIntoTensor)), "all_gather_into_tensor");
  EXPECT_EQ(std::string(commOpName(CommOp::kReduceScatterTensor)), "reduce_scatter_tensor");
  EXPECT_EQ(names.count("unknown"), 0u);
}

TEST(CommStats, BusFactorsFollowNcclTests) {
  EXPECT_DOUBLE_EQ(busFactor(CommOp::kAllReduce, 4), 1.5);
  EXPECT_DOUBLE_EQ(busFactor(CommOp::kAllReduceCoalesced, 2), 1.0);
  EXPECT_DOUBLE_EQ(busFactor(CommOp::kAllGatherIntoTensor, 4), 0.75);
  EXPECT_DOUBLE_EQ(busFactor(CommOp::kReduceScatterTensor, 2), 0.5);
  EXPECT_DOUBLE_EQ(busFactor(CommOp::kAllToAllSingle, 4), 0.75);
  EXPECT_DOUBLE_EQ(busFactor(CommOp::kBroadcast, 4), 1.0);
  EXPECT_DOUBLE_EQ(busFactor(CommOp::kSend, 2), 1.0);
  EXPECT_DOUBLE_EQ(busFactor(CommOp::kBarrier, 4), 0.0);
  EXPECT_DOUBLE_EQ(busFactor(CommOp::kAllReduce, 1), 0.0);  // nothing leaves a lone rank
}

}  // namespace
}  // namespace zeroplus::pg
