// HierarchicalCommunicator with ranks as threads: the intra-host communicator is a real one
// (shared memory when the machine allows, else TCP), the inter-host channel a
// CommunicatorChannel over TCP, or a channel that fails. Hosts are interleaved (rank r on host
// r % H) so the permutations between group ranks and (host, local index) are exercised.
#include "process_group/core/hierarchical_communicator.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "process_group/core/communicator_channel.hpp"
#include "process_group/core/prefix_rendezvous.hpp"
#include "tests/cpp/process_group/test_group.hpp"

namespace zeroplus::pg {
namespace {

using testing::InMemoryRendezvous;
using testing::runRanks;
using testing::soon;

// Every call fails, as a Gloo phase with a lost peer host would.
class FailingChannel final : public InterHostChannel {
 public:
  FailingChannel(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "fake"; }
  bool supports(DataType, ReduceOp) const override { return true; }
  void allreduce(void*, size_t, DataType, ReduceOp, Deadline) override { fail(); }
  void allgather(const void*, size_t, void*, Deadline) override { fail(); }
  void broadcast(void*, size_t, int, Deadline) override { fail(); }
  void reduceScatter(const void*, void*, size_t, DataType, ReduceOp, Deadline) override { fail(); }
  void abort() override {}

 private:
  [[noreturn]] static void fail() { throw std::runtime_error("link down"); }
  int rank_, size_;
};

struct Shape {
  int hosts;
  int local;
};

// Builds the n = hosts * local hierarchical communicators of one group.
// flatBytes 0: every size takes the hierarchical path.
std::vector<std::unique_ptr<Communicator>> makeGroup(Shape shape, bool failing = false, size_t flatBytes = 0) {
  const int n = shape.hosts * shape.local;
  std::vector<std::string> ids, names;
  for (int r = 0; r < n; ++r) {
    ids.push_back("host" + std::to_string(r % shape.hosts));
    names.push_back("h" + std::to_string(r % shape.hosts));
  }
  std::vector<std::unique_ptr<Communicator>> comms(static_cast<size_t>(n));
  InMemoryRendezvous rdv;
  runRanks(n, [&](int r) {
    Topology topo = topologyFromIdentities(r, ids, names);
    CommunicatorOptions o;
    o.rank = r;
    o.size = n;
    o.connectTimeout = std::chrono::seconds(20);
    o.hostCount = shape.hosts;
    auto flat = Communicator::connect(rdv, o);
    o.shm = ShmMode::kAuto;
    auto local = HierarchicalCommunicator::connectLocal(rdv, topo, o);
    std::unique_ptr<InterHostChannel> inter;
    if (failing) {
      inter = std::make_unique<FailingChannel>(topo.host(), shape.hosts);
    } else {
      PrefixRendezvous channelRdv(rdv, "inter/" + std::to_string(local->rank()) + "/");
      CommunicatorOptions c;
      c.rank = topo.host();
      c.size = shape.hosts;
      c.connectTimeout = std::chrono::seconds(20);
      inter = std::make_unique<CommunicatorChannel>(Communicator::connect(channelRdv, c));
    }
    comms[static_cast<size_t>(r)] =
        std::make_unique<HierarchicalCommunicator>(topo, std::move(flat), std::move(local), std::move(inter), flatBytes);
  });
  return comms;
}

float value(int rank, size_t i) { return static_cast<float>(rank * 1000 + static_cast<int>(i % 997)); }

class Hierarchical : public ::testing::TestWithParam<Shape> {};

class HierarchicalSizes : public ::testing::TestWithParam<std::tuple<Shape, size_t>> {};

TEST_P(HierarchicalSizes, CollectivesMatchTheirDefinition) {
  const Shape shape = std::get<0>(GetParam());
  const int n = shape.hosts * shape.local;
  auto comms = makeGroup(shape, false, std::get<1>(GetParam()));
  EXPECT_NE(comms[0]->transport().find("between " + std::to_string(shape.hosts) + " hosts"), std::string::npos);
  // 0, 1, odd small, past kHierFlatBytes and not divisible by the local size.
  for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{kHierFlatBytes / 4 + 5}}) {
    runRanks(n, [&](int r) {
      Communicator& c = *comms[static_cast<size_t>(r)];
      std::vector<float> a(count);
      for (size_t i = 0; i < count; ++i) a[i] = value(r, i);
      c.allreduce(a.data(), count, DataType::kFloat32, ReduceOp::kSum, soon());
      for (size_t i = 0; i < count; ++i) {
        float want = 0;
        for (int q = 0; q < n; ++q) want += value(q, i);
        ASSERT_EQ(a[i], want) << "allreduce count " << count << " rank " << r << " i " << i;
      }
      for (int root = 0; root < n; ++root) {
        std::vector<float> b(count);
        for (size_t i = 0; i < count; ++i) b[i] = value(r, i);
        c.broadcast(b.data(), count * 4, root, soon());
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(b[i], value(root, i)) << "broadcast root " << root;
      }
      std::vector<float> in(count), out(count * static_cast<size_t>(n));
      for (size_t i = 0; i < count; ++i) in[i] = value(r, i);
      c.allgather(in.data(), count * 4, out.data(), soon());
      for (int q = 0; q < n; ++q) {
        for (size_t i = 0; i < count; ++i) ASSERT_EQ(out[static_cast<size_t>(q) * count + i], value(q, i));
      }
      std::vector<float> rsIn(count * static_cast<size_t>(n)), rsOut(count);
      for (size_t i = 0; i < rsIn.size(); ++i) rsIn[i] = value(r, i);
      c.reduceScatter(rsIn.data(), rsOut.data(), count, DataType::kFloat32, ReduceOp::kSum, soon());
      for (size_t i = 0; i < count; ++i) {
        float want = 0;
        for (int q = 0; q < n; ++q) want += value(q, static_cast<size_t>(r) * count + i);
        ASSERT_EQ(rsOut[i], want) << "reduce_scatter count " << count << " rank " << r;
      }
    });
  }
}

TEST_P(Hierarchical, AChannelFailureFailsEveryRankPromptlyNamingTheOpAndPeers) {
  const Shape shape = GetParam();
  const int n = shape.hosts * shape.local;
  auto comms = makeGroup(shape, /*failing=*/true);
  std::vector<std::string> errors(static_cast<size_t>(n));
  const auto start = Clock::now();
  runRanks(n, [&](int r) {
    std::vector<float> a(1 << 20, 1.0f);  // striped: every local rank crosses hosts
    try {
      comms[static_cast<size_t>(r)]->allreduce(a.data(), a.size(), DataType::kFloat32, ReduceOp::kSum, soon());
    } catch (const CommError& e) {
      errors[static_cast<size_t>(r)] = e.what();
    }
  });
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0);
  int namedTheLink = 0;
  for (int r = 0; r < n; ++r) {
    const std::string& e = errors[static_cast<size_t>(r)];
    EXPECT_EQ(e.rfind("zeroplus allreduce: rank " + std::to_string(r) + " ", 0), 0u) << e;
    if (e.find("inter-host phase over fake with rank ") != std::string::npos) {
      EXPECT_NE(e.find("link down"), std::string::npos) << e;
      ++namedTheLink;
    } else {
      // A rank still in the first intra-host phase when a local peer failed on the link and
      // aborted (slow runs: sanitizers) never reaches the link; it names that peer instead, or,
      // when the peer it waits on was itself told by another local rank, the first culprit and
      // the rank that relayed it ("lost peer P ... (rank Q lost it first and aborted)").
      EXPECT_NE(e.find("intra-host phase (local allreduce on host "), std::string::npos) << e;
      EXPECT_TRUE(e.find("failed or aborted") != std::string::npos ||
                  e.find("lost it first and aborted") != std::string::npos) << e;
    }
    EXPECT_FALSE(comms[static_cast<size_t>(r)]->usable());
  }
  EXPECT_GE(namedTheLink, 1);  // the failure itself is always named
  // Later ops fail at once with the first error.
  float x = 1;
  EXPECT_THROW(comms[0]->allreduce(&x, 1, DataType::kFloat32, ReduceOp::kSum, soon()), CommError);
}

// flat threshold 0 (every size hierarchical) and the default (small ones flat).
INSTANTIATE_TEST_SUITE_P(Shapes, HierarchicalSizes,
                         ::testing::Combine(::testing::Values(Shape{2, 1}, Shape{2, 2}, Shape{3, 1}, Shape{2, 3}),
                                            ::testing::Values(size_t{0}, kHierFlatBytes)),
                         [](const auto& info) {
                           const Shape s = std::get<0>(info.param);
                           return std::to_string(s.hosts) + "hosts_x" + std::to_string(s.local) +
                                  (std::get<1>(info.param) ? "_small_flat" : "_all_hierarchical");
                         });

INSTANTIATE_TEST_SUITE_P(Shapes, Hierarchical,
                         ::testing::Values(Shape{2, 1}, Shape{2, 2}, Shape{3, 1}, Shape{2, 3}),
                         [](const auto& info) {
                           return std::to_string(info.param.hosts) + "hosts_x" + std::to_string(info.param.local);
                         });

TEST(HierarchicalLocalSize, EqualHostsOnly) {
  EXPECT_EQ(HierarchicalCommunicator::localSize(topologyFromIdentities(0, {"a", "b", "a", "b"}, {})), 2);
  EXPECT_EQ(HierarchicalCommunicator::localSize(topologyFromIdentities(0, {"a", "b", "a"}, {})), 0);
}

}  // namespace
}  // namespace zeroplus::pg
