// The same-host shared-memory transport: results of every op it carries against a serial
// reference (world sizes 2-4, chunk sizes that force 1-sync, 2-sync and multi-chunk paths),
// vectored allreduce over scattered spans, agreement, segment naming/permissions/stale
// clean-up, and failure paths (abort, deadline, a forked peer that dies).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <thread>

#include "process_group/core/shm_segment.hpp"
#include "test_group.hpp"

namespace zeroplus::pg {
namespace {

using namespace std::chrono_literals;
using testing::Group;
using testing::in;
using testing::soon;

constexpr size_t kChunk = 128 * 1024;  // > kShmSmallBytes: both chunk paths; modest counts span many chunks

Group& group(int n) {
  static std::map<int, std::unique_ptr<Group>> groups;
  auto& g = groups[n];
  if (!g) g = std::make_unique<Group>(n, 20s, ShmMode::kOn, kChunk);
  return *g;
}

class ShmSizes : public ::testing::TestWithParam<int> {};

TEST_P(ShmSizes, SelectedAndAllreduceMatchesReference) {
  const int n = GetParam();
  Group& g = group(n);
  EXPECT_EQ(g[0].transport(), "shm+tcp");
  for (size_t count : {size_t{0}, size_t{1}, size_t{1023}, kChunk / 4 + 5, size_t{3} * kChunk + 77}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
      std::vector<std::vector<int32_t>> data(static_cast<size_t>(n));
      g.run([&](Communicator& c, int r) {
        auto& v = data[static_cast<size_t>(r)];
        v.resize(count);
        for (size_t i = 0; i < count; ++i) v[i] = static_cast<int32_t>((i * 7 + static_cast<size_t>(r) * 13) % 101);
        c.allreduce(v.data(), count, DataType::kInt32, op, soon());
      });
      for (size_t i = 0; i < count; ++i) {
        int32_t want = op == ReduceOp::kSum ? 0 : INT32_MIN;
        for (int r = 0; r < n; ++r) {
          const auto x = static_cast<int32_t>((i * 7 + static_cast<size_t>(r) * 13) % 101);
          want = op == ReduceOp::kSum ? want + x : std::max(want, x);
        }
        for (int r = 0; r < n; ++r) ASSERT_EQ(data[static_cast<size_t>(r)][i], want) << "n=" << n << " i=" << i;
      }
    }
  }
}

TEST_P(ShmSizes, FloatResultsAreBitwiseIdenticalOnEveryRank) {
  const int n = GetParam();
  for (size_t count : {size_t{1000}, size_t{5} * kChunk / 4 + 3}) {
    std::vector<std::vector<float>> data(static_cast<size_t>(n));
    group(n).run([&](Communicator& c, int r) {
      std::mt19937 gen(static_cast<unsigned>(r) * 31 + 1);
      std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
      auto& v = data[static_cast<size_t>(r)];
      v.resize(count);
      for (auto& x : v) x = dist(gen);
      c.allreduce(v.data(), count, DataType::kFloat32, ReduceOp::kSum, soon());
    });
    for (int r = 1; r < n; ++r) {
      ASSERT_EQ(std::memcmp(data[0].data(), data[static_cast<size_t>(r)].data(), count * 4), 0) << "rank " << r;
    }
  }
}

TEST_P(ShmSizes, AllreducevOverScatteredSpans) {
  const int n = GetParam();
  // 300 spans of varying length (some empty), total crossing several chunk boundaries; rank r
  // splits the same total differently from its peers.
  std::vector<std::vector<std::vector<double>>> bufs(static_cast<size_t>(n));
  group(n).run([&](Communicator& c, int r) {
    auto& mine = bufs[static_cast<size_t>(r)];
    std::vector<Span> spans;
    size_t at = 0;
    for (int i = 0; i < 300; ++i) {
      const size_t len = static_cast<size_t>((i * 37 + (r == 0 ? 0 : 3 * (i % 2 ? 1 : -1))) % 97 + 3);
      mine.emplace_back(len);
      for (size_t k = 0; k < len; ++k) mine.back()[k] = static_cast<double>(at + k);
      at += len;
    }
    for (auto& b : mine) spans.push_back(Span{b.data(), b.size()});
    c.allreducev(spans, DataType::kFloat64, ReduceOp::kSum, soon());
  });
  for (int r = 0; r < n; ++r) {
    size_t at = 0;
    for (const auto& b : bufs[static_cast<size_t>(r)]) {
      for (double x : b) ASSERT_EQ(x, static_cast<double>(at++) * n);
    }
  }
}

TEST_P(ShmSizes, BroadcastAllgatherBarrierAgree) {
  const int n = GetParam();
  const size_t bytes = 2 * kChunk + 11;
  group(n).run([&](Communicator& c, int r) {
    std::vector<uint8_t> b(bytes, static_cast<uint8_t>(r));
    c.broadcast(b.data(), bytes, n - 1, soon());
    for (uint8_t x : b) ASSERT_EQ(x, n - 1);
    std::vector<uint8_t> out(bytes * static_cast<size_t>(n));
    std::vector<uint8_t> mine(bytes, static_cast<uint8_t>(r + 1));
    c.allgather(mine.data(), bytes, out.data(), soon());
    for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(out[i], i / bytes + 1);
    c.barrier(soon());
    EXPECT_EQ(c.agreeMin(static_cast<uint64_t>(10 + r), soon()), 10u);
    EXPECT_EQ(c.agreeMin(static_cast<uint64_t>(50 - r), soon()), static_cast<uint64_t>(51 - n));
    // Ops the transport delegates still work in between.
    std::vector<int64_t> v(5, r);
    c.reduce(v.data(), 5, DataType::kInt64, ReduceOp::kSum, 0, soon());
    if (r == 0) {
      EXPECT_EQ(v[0], n * (n - 1) / 2);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmSizes, ::testing::Values(2, 3, 4));

TEST(ShmSelection, OffAndSingleRankStayOnTcp) {
  Group off(2, 20s, ShmMode::kOff);
  EXPECT_EQ(off[0].transport(), "tcp");
  Group automatic(2, 20s, ShmMode::kAuto);
  EXPECT_EQ(automatic[1].transport(), "shm+tcp");
}

TEST(ShmSegment, CreatedPrivateAndUnlinked) {
  detail::ShmSegment s;
  ASSERT_EQ(s.create(0, 8192), 0);
  const std::string path = "/dev/shm" + s.name();
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(st.st_size, 8192);
  ASSERT_EQ(s.unlink(), 0);
  EXPECT_NE(::stat(path.c_str(), &st), 0);
}

TEST(ShmSegment, StaleSegmentOfDeadProcessIsRemoved) {
  // A pid that surely does not exist: a child that has exited and been reaped.
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  const std::string stale = "/dev/shm" + detail::ShmSegment::makeName(child, 0x1234, 0);
  { std::ofstream(stale) << "x"; }
  const std::string live = "/dev/shm" + detail::ShmSegment::makeName(::getpid(), 0x1234, 0);
  { std::ofstream(live) << "x"; }
  EXPECT_GE(detail::ShmSegment::removeStaleSegments(), 1);
  EXPECT_FALSE(std::filesystem::exists(stale));
  EXPECT_TRUE(std::filesystem::exists(live));  // our own pid lives
  std::filesystem::remove(live);
}

TEST(ShmFailure, AbortWakesBlockedPeerAndDeadlineFires) {
  Group g(2, 20s, ShmMode::kOn, kChunk);
  std::thread aborter([&] {
    std::this_thread::sleep_for(100ms);
    g[1].abort();
  });
  // Rank 0 waits for rank 1, which never joins the barrier: abort makes both fail fast.
  EXPECT_THROW(g[0].barrier(in(20s)), CommError);
  aborter.join();
  EXPECT_THROW(g[1].barrier(in(1s)), CommError);

  Group h(2, 20s, ShmMode::kOn, kChunk);
  const auto t0 = Clock::now();
  try {
    h[0].barrier(in(300ms));
    FAIL() << "expected a timeout";
  } catch (const CommError& e) {
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - t0, 5s);
}

TEST(ShmFailure, DeadPeerProcessIsCommErrorNotHang) {
  const auto dir = std::filesystem::temp_directory_path() / ("zeroplus_shm_fork_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    testing::FileRendezvous rdv(dir);
    CommunicatorOptions o;
    o.rank = 1;
    o.size = 2;
    o.connectTimeout = 10s;
    o.shm = ShmMode::kOn;
    o.shmChunkBytes = kChunk;
    auto c = Communicator::connect(rdv, o);
    c->barrier(in(10s));
    ::kill(::getpid(), SIGKILL);  // die without a word: no abort, no EOF before the kernel's
  }
  testing::FileRendezvous rdv(dir);
  CommunicatorOptions o;
  o.rank = 0;
  o.size = 2;
  o.connectTimeout = 10s;
  o.shm = ShmMode::kOn;
  o.shmChunkBytes = kChunk;
  auto c = Communicator::connect(rdv, o);
  c->barrier(in(10s));
  std::vector<float> v(1000, 1.0f);
  const auto t0 = Clock::now();
  EXPECT_THROW(c->allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, in(30s)), CommError);
  EXPECT_LT(Clock::now() - t0, 10s);
  ::waitpid(child, nullptr, 0);
  std::filesystem::remove_all(dir);
  // Both segments were unlinked at set-up, so the crash left nothing in /dev/shm.
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    EXPECT_EQ(e.path().filename().string().find("zeroplus-" + std::to_string(child) + "-"), std::string::npos);
  }
}

}  // namespace
}  // namespace zeroplus::pg

namespace zeroplus::pg {
namespace {

TEST(ShmFailure, MismatchedCollectivesAreDetected) {
  Group g(2, std::chrono::seconds(20), ShmMode::kOn, kChunk);
  std::vector<std::string> errors(2);
  g.run([&](Communicator& c, int r) {
    std::vector<float> v(r == 0 ? 100 : 200, 1.0f);
    try {
      c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, testing::in(std::chrono::seconds(10)));
    } catch (const CommError& e) {
      errors[static_cast<size_t>(r)] = e.what();
    }
  });
  for (const auto& e : errors) EXPECT_NE(e.find("size differs"), std::string::npos) << e;  // more in mismatch_test
}

}  // namespace
}  // namespace zeroplus::pg

namespace zeroplus::pg {
namespace {

TEST(ShmFused, RanksAgreeOnTheShortestCandidateList) {
  // Rank r offers 3 + 2r candidates (it has that many ops queued); everyone must reduce the
  // first 3 only, and leave the rest untouched. Candidate sizes straddle the chunk size.
  for (int n : {2, 3}) {
    const std::vector<size_t> sizes = {5, kChunk / 4 + 9, 100, 7, 3};
    std::vector<std::vector<std::vector<float>>> bufs(static_cast<size_t>(n));
    std::vector<size_t> agreed(static_cast<size_t>(n));
    group(n).run([&](Communicator& c, int r) {
      auto& mine = bufs[static_cast<size_t>(r)];
      std::vector<Span> cands;
      for (size_t i = 0; i < std::min<size_t>(sizes.size(), 3 + 2 * static_cast<size_t>(r)); ++i) {
        mine.emplace_back(sizes[i], static_cast<float>(r + 1));
      }
      for (auto& b : mine) cands.push_back(Span{b.data(), b.size()});
      agreed[static_cast<size_t>(r)] = c.allreduceFused(cands, DataType::kFloat32, ReduceOp::kSum, testing::soon());
      // A plain op right after must still line up (phase and slot counters in step).
      std::vector<float> v(10, 1.0f);
      c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, testing::soon());
      EXPECT_EQ(v[9], static_cast<float>(n));
    });
    const float sum = static_cast<float>(n * (n + 1) / 2);
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(agreed[static_cast<size_t>(r)], 3u);
      const auto& mine = bufs[static_cast<size_t>(r)];
      for (size_t i = 0; i < mine.size(); ++i) {
        for (float x : mine[i]) ASSERT_EQ(x, i < 3 ? sum : static_cast<float>(r + 1)) << "rank " << r << " op " << i;
      }
    }
  }
}

}  // namespace
}  // namespace zeroplus::pg
