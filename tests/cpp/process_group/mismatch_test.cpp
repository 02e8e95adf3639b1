// Ranks that call mismatched collectives (size, dtype, reduce op, root, collective, a fused
// batch of queued allreduces) must ALL fail at that call with a CommError naming what differs
// and both ranks' values: never a silent partial reduction, never one rank succeeding, never a
// bare "connection reset". Run over both transports (TCP only, and shared memory + TCP).
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "test_group.hpp"

namespace zeroplus::pg {
namespace {

using namespace std::chrono_literals;
using testing::Group;

constexpr size_t kChunk = 128 * 1024;

class Mismatch : public ::testing::TestWithParam<ShmMode> {
 protected:
  // Runs fn(comm, rank) on 2 fresh ranks; returns each rank's CommError text ("" if none).
  std::vector<std::string> failures(const std::function<void(Communicator&, int)>& fn) {
    Group g(2, 20s, GetParam(), kChunk);
    if (GetParam() == ShmMode::kOn) EXPECT_EQ(g[0].transport(), "shm+tcp");
    std::vector<std::string> what(2);
    g.run([&](Communicator& c, int r) {
      try {
        fn(c, r);
      } catch (const CommError& e) {
        what[static_cast<size_t>(r)] = e.what();
      }
    });
    return what;
  }
  // Every rank failed, and its message contains each of `parts`.
  static void expectAllNamed(const std::vector<std::string>& what, const std::vector<std::string>& parts) {
    for (size_t r = 0; r < what.size(); ++r) {
      ASSERT_FALSE(what[r].empty()) << "rank " << r << " did not fail";
      EXPECT_NE(what[r].find("collective mismatch"), std::string::npos) << what[r];
      for (const auto& p : parts) EXPECT_NE(what[r].find(p), std::string::npos) << "rank " << r << ": " << what[r];
    }
  }
};

Deadline deadline() { return testing::in(20s); }

void allreduceOf(Communicator& c, size_t n, DataType type = DataType::kFloat32, ReduceOp op = ReduceOp::kSum) {
  std::vector<uint8_t> buf(n * elementSize(type), 1);
  c.allreduce(buf.data(), n, type, op, deadline());
}

void fusedOf(Communicator& c, const std::vector<size_t>& counts) {
  std::vector<std::vector<float>> bufs;
  std::vector<Span> spans;
  for (size_t n : counts) bufs.emplace_back(n, 1.0f);
  for (auto& b : bufs) spans.push_back(Span{b.data(), b.size()});
  c.allreduceFused(spans, DataType::kFloat32, ReduceOp::kSum, deadline());
}

TEST_P(Mismatch, AllreduceSizeSmall) {
  expectAllNamed(failures([](Communicator& c, int r) { allreduceOf(c, r == 0 ? 1000 : 2000); }),
                 {"size differs", "1000 elements", "2000 elements"});
}

TEST_P(Mismatch, AllreduceSizeLarge) {
  expectAllNamed(failures([](Communicator& c, int r) { allreduceOf(c, r == 0 ? 1u << 20 : 1u << 19); }),
                 {"size differs", "1048576 elements", "524288 elements"});
}

TEST_P(Mismatch, AllreduceDtype) {
  expectAllNamed(failures([](Communicator& c, int r) {
                   allreduceOf(c, 64, r == 0 ? DataType::kFloat32 : DataType::kFloat64);
                 }),
                 {"dtype differs", "float32", "float64"});
}

TEST_P(Mismatch, AllreduceReduceOp) {
  expectAllNamed(failures([](Communicator& c, int r) {
                   allreduceOf(c, 64, DataType::kFloat32, r == 0 ? ReduceOp::kSum : ReduceOp::kMax);
                 }),
                 {"reduce op differs", "sum", "max"});
}

TEST_P(Mismatch, FusedSingleCandidateSize) {
  // The case: defaults, one host, 1000 vs 2000 floats through the fused path.
  expectAllNamed(failures([](Communicator& c, int r) { fusedOf(c, {r == 0 ? 1000u : 2000u}); }),
                 {"1000 elements", "2000 elements"});
}

TEST_P(Mismatch, FusedSingleCandidateSizeLarge) {
  expectAllNamed(failures([](Communicator& c, int r) { fusedOf(c, {r == 0 ? 1u << 20 : 1u << 19}); }),
                 {"1048576 elements", "524288 elements"});
}

TEST_P(Mismatch, FusedLaterCandidateSize) {
  // Shared memory compares each candidate; TCP (agreeMin + one allreducev) compares the total.
  const bool shm = GetParam() == ShmMode::kOn;
  expectAllNamed(failures([](Communicator& c, int r) { fusedOf(c, {10, r == 0 ? 20u : 30u, 5}); }),
                 {shm ? "20 elements" : "35 elements", shm ? "30 elements" : "45 elements"});
}

TEST_P(Mismatch, BroadcastSizeAndRoot) {
  expectAllNamed(failures([](Communicator& c, int r) {
                   std::vector<uint8_t> buf(128);
                   c.broadcast(buf.data(), r == 0 ? 64 : 128, 0, deadline());
                 }),
                 {"size differs", "64 bytes", "128 bytes"});
  const auto what = failures([](Communicator& c, int r) {
    std::vector<uint8_t> buf(128);
    c.broadcast(buf.data(), buf.size(), r, deadline());
  });
  expectAllNamed(what, {"root differs"});
  EXPECT_NE(what[0].find("this rank 0, rank 1 1"), std::string::npos) << what[0];
  EXPECT_NE(what[1].find("this rank 1, rank 0 0"), std::string::npos) << what[1];
}

TEST_P(Mismatch, EmptyOpAgainstNonEmpty) {
  // A 0-byte op moves nothing but must still be compared, or the other rank waits it out.
  expectAllNamed(failures([](Communicator& c, int r) {
                   std::vector<uint8_t> buf(100);
                   c.broadcast(buf.data(), r == 0 ? 0 : 100, 0, deadline());
                 }),
                 {"0 bytes", "100 bytes"});
  expectAllNamed(failures([](Communicator& c, int r) { allreduceOf(c, r == 0 ? 0 : 10); }),
                 {"0 elements", "10 elements"});
}

TEST_P(Mismatch, DifferentCollectives) {
  expectAllNamed(failures([](Communicator& c, int r) {
                   std::vector<float> buf(32, 1.0f);
                   if (r == 0) {
                     c.allreduce(buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum, deadline());
                   } else {
                     c.broadcast(buf.data(), buf.size() * 4, 0, deadline());
                   }
                 }),
                 {"collective differs", "allreduce", "broadcast"});
  expectAllNamed(failures([](Communicator& c, int r) {
                   std::vector<float> buf(32, 1.0f);
                   if (r == 0) {
                     c.barrier(deadline());
                   } else {
                     c.allgather(buf.data(), 8, buf.data(), deadline());
                   }
                 }),
                 {"collective differs", "barrier", "allgather"});
}

TEST_P(Mismatch, MatchingOpsStillWorkAfterEmptyOps) {
  // The extra synchronisation of empty ops keeps every counter in step.
  Group g(2, 20s, GetParam(), kChunk);
  g.run([](Communicator& c, int) {
    std::vector<float> v(1000, 1.0f);
    for (int i = 0; i < 3; ++i) {
      c.broadcast(v.data(), 0, 0, deadline());
      c.allreduce(v.data(), 0, DataType::kFloat32, ReduceOp::kSum, deadline());
      c.allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, deadline());
    }
    EXPECT_EQ(v[999], 8.0f);
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, Mismatch, ::testing::Values(ShmMode::kOff, ShmMode::kOn),
                         [](const auto& info) { return info.param == ShmMode::kOff ? "Tcp" : "Shm"; });

}  // namespace
}  // namespace zeroplus::pg
