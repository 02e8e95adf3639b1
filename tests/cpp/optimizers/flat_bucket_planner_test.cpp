// Flat-bucket planner (ZeRO stage 2/3 layout): bucket cuts, padding, shard slices.
#include "optimizers/core/flat_bucket_planner.hpp"

#include <gtest/gtest.h>

#include <cerrno>
#include <limits>
#include <numeric>

namespace zeroplus::optim {
namespace {

FlatPlan plan(const std::vector<int64_t>& numels, std::vector<int64_t> segments, int world, int64_t cap,
              int64_t align = 1) {
  if (segments.empty()) segments.assign(numels.size(), 0);
  FlatPlan p;
  EXPECT_EQ(planFlatBuckets(numels, segments, world, cap, align, &p), 0);
  return p;
}

TEST(FlatBucketPlanner, CutsAtCapAndKeepsOrder) {
  const FlatPlan p = plan({4, 4, 4, 4, 4}, {}, 2, 8);
  ASSERT_EQ(p.buckets.size(), 3u);
  EXPECT_EQ(p.bucket_of, (std::vector<int>{0, 0, 1, 1, 2}));
  EXPECT_EQ(p.buckets[0].entries[1].offset, 4);
  EXPECT_EQ(p.buckets[2].used, 4);
  EXPECT_EQ(p.buckets[2].numel, 4);
}

TEST(FlatBucketPlanner, OversizedParameterGetsItsOwnBucket) {
  const FlatPlan p = plan({3, 100, 3}, {}, 4, 10);
  ASSERT_EQ(p.buckets.size(), 3u);
  EXPECT_EQ(p.buckets[1].used, 100);
  EXPECT_EQ(p.buckets[1].entries.size(), 1u);
}

TEST(FlatBucketPlanner, SegmentChangeStartsNewBucket) {
  const FlatPlan p = plan({1, 1, 1, 1}, {0, 0, 1, 0}, 1, 100);
  EXPECT_EQ(p.bucket_of, (std::vector<int>{0, 0, 1, 2}));
  EXPECT_EQ(p.buckets[1].segment, 1);
}

class PaddingTest : public ::testing::TestWithParam<int> {};

TEST_P(PaddingTest, EveryShardEqualAndAligned) {
  const int world = GetParam();
  const FlatPlan p = plan({7, 0, 13, 1, 29}, {}, world, 1 << 20, 16);
  ASSERT_EQ(p.buckets.size(), 1u);
  const FlatBucket& b = p.buckets[0];
  EXPECT_EQ(b.used, 50);
  EXPECT_EQ(b.numel % (16 * world), 0);
  EXPECT_LT(b.numel - b.used, 16 * world);
  EXPECT_EQ(b.shard_numel * world, b.numel);
  // Every parameter element is covered exactly once by the shards' slices.
  for (const FlatEntry& e : b.entries) {
    int64_t covered = 0, next_param_offset = 0;
    for (int r = 0; r < world; ++r) {
      const ShardSlice s = sliceInShard(b, e, r);
      if (s.length == 0) continue;
      EXPECT_EQ(s.param_offset, next_param_offset);
      EXPECT_EQ(b.shard_numel * r + s.shard_offset, e.offset + s.param_offset);
      next_param_offset += s.length;
      covered += s.length;
    }
    EXPECT_EQ(covered, e.numel) << "param " << e.param;
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, PaddingTest, ::testing::Values(1, 2, 3, 4));

TEST(FlatBucketPlanner, EmptyInputsGiveOneShardPerRank) {
  const FlatPlan none = plan({}, {}, 3, 8);
  EXPECT_TRUE(none.buckets.empty());
  const FlatPlan zeros = plan({0, 0}, {}, 3, 8);
  ASSERT_EQ(zeros.buckets.size(), 1u);
  EXPECT_EQ(zeros.buckets[0].numel, 3);
  EXPECT_EQ(zeros.buckets[0].shard_numel, 1);
}

TEST(FlatBucketPlanner, SliceOutsideShardIsEmpty) {
  const FlatPlan p = plan({2, 6}, {}, 2, 100);  // numel 8, shards [0,4) and [4,8)
  const FlatBucket& b = p.buckets[0];
  EXPECT_EQ(sliceInShard(b, b.entries[0], 1).length, 0);
  const ShardSlice s = sliceInShard(b, b.entries[1], 0);
  EXPECT_EQ(s.param_offset, 0);
  EXPECT_EQ(s.shard_offset, 2);
  EXPECT_EQ(s.length, 2);
}

TEST(FlatBucketPlanner, RejectsBadArguments) {
  FlatPlan p;
  EXPECT_EQ(planFlatBuckets({1}, {0}, 0, 8, 1, &p), -EINVAL);
  EXPECT_EQ(planFlatBuckets({1}, {0}, 2, 0, 1, &p), -EINVAL);
  EXPECT_EQ(planFlatBuckets({1}, {0}, 2, 8, 0, &p), -EINVAL);
  EXPECT_EQ(planFlatBuckets({-1}, {0}, 2, 8, 1, &p), -EINVAL);
  EXPECT_EQ(planFlatBuckets({1, 2}, {0}, 2, 8, 1, &p), -EINVAL);
  EXPECT_EQ(planFlatBuckets({1}, {0}, 2, 8, 1, nullptr), -EINVAL);
  const int64_t big = std::numeric_limits<int64_t>::max() - 2;
  EXPECT_EQ(planFlatBuckets({big}, {0}, 4, 8, 16, &p), -EINVAL);  // padding would overflow
}

}  // namespace
}  // namespace zeroplus::optim
