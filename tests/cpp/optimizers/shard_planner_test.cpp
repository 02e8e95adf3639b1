// Shard planner: partitions checked against hand-computed results of torch's sorted-greedy
// ZeroRedundancyOptimizer._partition_parameters, bucket layouts and broadcast schedules.
#include "optimizers/core/shard_planner.hpp"

#include <gtest/gtest.h>

#include <cerrno>

namespace zeroplus::optim {
namespace {

using Groups = std::vector<std::vector<int64_t>>;

PartitionPlan plan(const Groups& g, int world) {
  PartitionPlan p;
  EXPECT_EQ(planPartition(g, world, &p), 0);
  return p;
}

TEST(ShardPlanner, LinearWeightToRank0BiasToRank1) {
  // nn.Linear(1, 1) on 2 ranks (test_step_with_closure): equal sizes keep registration order.
  const PartitionPlan p = plan({{1, 1}}, 2);
  EXPECT_EQ(p.owner[0], (std::vector<int>{0, 1}));
}

class ShardingTest : public ::testing::TestWithParam<int> {};

TEST_P(ShardingTest, SizesNineSevenFiveThreeGiveEqualShards) {
  // test_sharding: sizes [9, 7, 5, 3] repeated world_size times -> every rank owns 24.
  const int world = GetParam();
  std::vector<int64_t> sizes;
  for (int r = 0; r < world; ++r) sizes.insert(sizes.end(), {9, 7, 5, 3});
  const PartitionPlan p = plan({sizes}, world);
  for (int r = 0; r < world; ++r) EXPECT_EQ(p.rank_numel[r], 24) << r;
}

INSTANTIATE_TEST_SUITE_P(Worlds, ShardingTest, ::testing::Values(1, 2, 3, 4));

TEST(ShardPlanner, SortedGreedyByHand) {
  // sizes [3, 10, 4, 4, 1] on 2 ranks. Sorted (stable): 10(i1), 4(i2), 4(i3), 3(i0), 1(i4).
  // 10 -> r0 [10,0]; 4 -> r1 [10,4]; 4 -> r1 [10,8]; 3 -> r1 [10,11]; 1 -> r0 [11,11].
  const PartitionPlan p = plan({{3, 10, 4, 4, 1}}, 2);
  EXPECT_EQ(p.owner[0], (std::vector<int>{1, 0, 1, 1, 0}));
  ASSERT_EQ(p.params[0][0].size(), 2u);
  EXPECT_EQ(p.params[0][0][0].index, 1);
  EXPECT_EQ(p.params[0][0][1].index, 4);
  ASSERT_EQ(p.params[1][0].size(), 3u);
  EXPECT_EQ(p.params[1][0][0].index, 2);  // partition order is the sorted order
  EXPECT_EQ(p.params[1][0][1].index, 3);
  EXPECT_EQ(p.params[1][0][2].index, 0);
  EXPECT_EQ(p.rank_numel, (std::vector<int64_t>{11, 11}));
}

TEST(ShardPlanner, RunningSizesCarryAcrossGroups) {
  // group 0 {10} -> r0; group 1 {3, 3}: both to r1 because r0 already holds 10.
  const PartitionPlan p = plan({{10}, {3, 3}}, 2);
  EXPECT_EQ(p.owner[0], (std::vector<int>{0}));
  EXPECT_EQ(p.owner[1], (std::vector<int>{1, 1}));
  EXPECT_TRUE(p.params[0][1].empty());  // rank 0 still has an (empty) entry for group 1
  EXPECT_EQ(p.params[1][0].size(), 0u);
}

TEST(ShardPlanner, TiesGoToLowestRankAndZeroSizedParams) {
  const PartitionPlan p = plan({{0, 0, 0, 5}}, 3);
  // 5 -> r0; zeros: all ranks tie except r0 -> r1 (sizes 5,0,0) -> r1 again (size unchanged) ...
  EXPECT_EQ(p.owner[0], (std::vector<int>{1, 1, 1, 0}));
}

TEST(ShardPlanner, AddParamGroupKeepsEarlierOwners) {
  // Re-planning with an extra group must not move older parameters (deterministic greedy).
  const PartitionPlan a = plan({{9, 7, 5, 3}}, 3);
  const PartitionPlan b = plan({{9, 7, 5, 3}, {6, 2}}, 3);
  EXPECT_EQ(a.owner[0], b.owner[0]);
  EXPECT_EQ(b.owner[1].size(), 2u);
}

TEST(ShardPlanner, EmptyAndErrors) {
  PartitionPlan p;
  EXPECT_EQ(planPartition({}, 2, &p), 0);
  EXPECT_EQ(p.rank_numel, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(planPartition({{1}}, 0, &p), -EINVAL);
  EXPECT_EQ(planPartition({{-1}}, 1, &p), -EINVAL);
  EXPECT_EQ(planPartition({{1}}, 1, nullptr), -EINVAL);
}

TEST(ShardPlanner, BucketsFollowPartitionOrderSkipFrozenAndPadDummies) {
  // sizes [3, 10, 4, 4, 1] on 3 ranks: 10 -> r0, 4 -> r1, 4 -> r2, 3 -> r1 (4<4? no: r1,r2 tie at 4
  // after... ) computed: [10,0,0] -> 4:r1 [10,4,0] -> 4:r2 [10,4,4] -> 3:r1 [10,7,4] -> 1:r2.
  const PartitionPlan p = plan({{3, 10, 4, 4, 1}}, 3);
  EXPECT_EQ(p.owner[0], (std::vector<int>{1, 0, 1, 2, 2}));
  std::vector<std::vector<ParamPlacement>> place(1);
  for (int64_t n : {3, 10, 4, 4, 1}) place[0].push_back(ParamPlacement{n, 0, true});
  place[0][3].trainable = false;  // rank 2 keeps only the 1-element param
  place[0][1].trainable = false;  // rank 0 has nothing trainable -> dummy bucket
  std::vector<Bucket> buckets;
  ASSERT_EQ(planBuckets(p, place, 1, &buckets), 0);
  ASSERT_EQ(buckets.size(), 3u);
  EXPECT_TRUE(buckets[0].dummy);
  EXPECT_EQ(buckets[0].numel, 1);
  EXPECT_EQ(buckets[1].numel, 7);
  ASSERT_EQ(buckets[1].entries.size(), 2u);
  EXPECT_EQ(buckets[1].entries[0].param, (ParamRef{0, 2}));
  EXPECT_EQ(buckets[1].entries[1].offset, 4);
  EXPECT_EQ(buckets[2].numel, 1);
  EXPECT_FALSE(buckets[2].dummy);

  ASSERT_EQ(planBuckets(p, place, 16, &buckets), 0);  // aligned layout (not torch's default)
  EXPECT_EQ(buckets[1].entries[1].offset, 16);
  EXPECT_EQ(buckets[1].numel, 19);

  const auto ops = broadcastSchedule(p, &buckets);
  ASSERT_EQ(ops.size(), 3u);
  EXPECT_EQ(ops[2].src_rank, 2);
  EXPECT_EQ(ops[2].bucket, 2);
}

TEST(ShardPlanner, DevicesInFirstAppearanceOrder) {
  const PartitionPlan p = plan({{4, 3}}, 2);  // 4 -> r0, 3 -> r1
  std::vector<std::vector<ParamPlacement>> place{{{4, 7, true}, {3, 2, true}}};
  std::vector<Bucket> buckets;
  ASSERT_EQ(planBuckets(p, place, 1, &buckets), 0);
  ASSERT_EQ(buckets.size(), 4u);  // device 7 (rank 0's) first, then device 2
  EXPECT_EQ(buckets[0].device, 7);
  EXPECT_FALSE(buckets[0].dummy);
  EXPECT_TRUE(buckets[1].dummy);  // rank 1 has nothing on device 7
  EXPECT_EQ(buckets[2].device, 2);
  EXPECT_TRUE(buckets[2].dummy);
  EXPECT_EQ(buckets[3].numel, 3);
  EXPECT_EQ(planBuckets(p, {}, 1, &buckets), -EINVAL);
}

TEST(ShardPlanner, PerParameterScheduleIsRankMajorIncludingFrozen) {
  const PartitionPlan p = plan({{5, 1}, {2}}, 2);  // 5 -> r0; 1 -> r1; group 1: 2 -> r1
  const auto ops = broadcastSchedule(p, nullptr);
  ASSERT_EQ(ops.size(), 3u);
  EXPECT_EQ(ops[0].src_rank, 0);
  EXPECT_EQ(ops[1].src_rank, 1);
  EXPECT_EQ(ops[1].param, (ParamRef{0, 1}));
  EXPECT_EQ(ops[2].param, (ParamRef{1, 0}));
}

TEST(ShardPlanner, SyncChunksKeepFrozenSplitAtCapAndSkipEmptyRanks) {
  const PartitionPlan p = plan({{6, 5, 4, 3}, {2}}, 3);
  // 3 ranks: 6 -> r0, 5 -> r1, 4 -> r2, 3 -> r2 (4 < 5 < 6), group 1: 2 -> r1 (5 < 6, 7).
  std::vector<std::vector<ParamPlacement>> place{{{6, 0, true}, {5, 0, false}, {4, 0, true}, {3, 0, true}},
                                                 {{2, 0, true}}};
  std::vector<Bucket> chunks;
  ASSERT_EQ(planSyncChunks(p, place, 100, &chunks), 0);
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ(chunks[1].rank, 1);
  EXPECT_EQ(chunks[1].numel, 7);  // frozen 5 is included, then group 1's 2
  EXPECT_EQ(chunks[1].entries[1].param, (ParamRef{1, 0}));
  EXPECT_EQ(chunks[1].entries[1].offset, 5);
  EXPECT_EQ(chunks[2].numel, 7);

  ASSERT_EQ(planSyncChunks(p, place, 5, &chunks), 0);  // rank 2: 4 | 3; rank 1: 5 | 2; rank 0: 6
  ASSERT_EQ(chunks.size(), 5u);
  for (const Bucket& c : chunks) {
    EXPECT_EQ(c.entries.size(), 1u);
    EXPECT_EQ(c.entries[0].offset, 0);
  }
  EXPECT_EQ(chunks[0].numel, 6);  // larger than the cap: a chunk of its own
  const auto ops = broadcastSchedule(p, &chunks);
  ASSERT_EQ(ops.size(), 5u);
  EXPECT_EQ(ops[4].src_rank, 2);

  const PartitionPlan q = plan({{1}}, 4);  // ranks 1..3 own nothing: no chunk for them
  std::vector<std::vector<ParamPlacement>> one{{{1, 0, true}}};
  ASSERT_EQ(planSyncChunks(q, one, 8, &chunks), 0);
  ASSERT_EQ(chunks.size(), 1u);
  EXPECT_EQ(planSyncChunks(q, one, 0, &chunks), -EINVAL);
  EXPECT_EQ(planSyncChunks(q, {}, 8, &chunks), -EINVAL);
}

}  // namespace
}  // namespace zeroplus::optim
