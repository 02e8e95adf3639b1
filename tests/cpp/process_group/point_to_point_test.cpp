// PointToPoint (point_to_point.hpp): receives posted before sends, per-(peer, tag) order,
// receives from any source, size mismatch, timeout and abort. Ranks are threads.
#include "process_group/core/point_to_point.hpp"

#include <gtest/gtest.h>

#include <future>
#include <numeric>

#include "tests/cpp/process_group/test_group.hpp"

namespace zeroplus::pg::testing {
namespace {

using namespace std::chrono_literals;

struct P2pGroup {
  std::vector<std::unique_ptr<PointToPoint>> engines;
  explicit P2pGroup(int n) : engines(static_cast<size_t>(n)) {
    InMemoryRendezvous rdv;
    runRanks(n, [&](int r) {
      CommunicatorOptions o;
      o.rank = r;
      o.size = n;
      o.connectTimeout = 20s;
      engines[static_cast<size_t>(r)] = PointToPoint::connect(rdv, o);
    });
  }
  PointToPoint& operator[](int r) { return *engines[static_cast<size_t>(r)]; }
};

// A posted op and the future of its result.
struct Pending {
  std::shared_ptr<std::promise<P2pResult>> promise = std::make_shared<std::promise<P2pResult>>();
  std::future<P2pResult> future = promise->get_future();
  PointToPoint::Completion completion() {
    return [p = promise](const P2pResult& r) { p->set_value(r); };
  }
  P2pResult get() {
    EXPECT_EQ(future.wait_for(30s), std::future_status::ready);
    return future.get();
  }
};

std::string errorText(const P2pResult& r) {
  try {
    if (r.error) std::rethrow_exception(r.error);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

class PointToPointTest : public ::testing::TestWithParam<int> {};

TEST_P(PointToPointTest, EveryRankPostsReceivesBeforeSends) {
  const int n = GetParam();
  P2pGroup g(n);
  const size_t count = 300000;  // larger than the socket buffers: sends must not wait for receives
  runRanks(n, [&](int r) {
    std::vector<std::vector<int32_t>> in(static_cast<size_t>(n), std::vector<int32_t>(count, -1));
    std::vector<int32_t> out(count);
    std::iota(out.begin(), out.end(), r * 1000);
    std::vector<Pending> recvs(static_cast<size_t>(n)), sends(static_cast<size_t>(n));
    for (int p = 0; p < n; ++p) {
      if (p != r) g[r].recv(in[static_cast<size_t>(p)].data(), count * 4, p, 0, soon(), recvs[static_cast<size_t>(p)].completion());
    }
    for (int p = 0; p < n; ++p) {
      if (p != r) g[r].send(out.data(), count * 4, p, 0, soon(), sends[static_cast<size_t>(p)].completion());
    }
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      EXPECT_EQ(errorText(sends[static_cast<size_t>(p)].get()), "");
      const P2pResult got = recvs[static_cast<size_t>(p)].get();
      EXPECT_EQ(errorText(got), "");
      EXPECT_EQ(got.source, p);
      EXPECT_EQ(in[static_cast<size_t>(p)][0], p * 1000);
      EXPECT_EQ(in[static_cast<size_t>(p)][count - 1], p * 1000 + static_cast<int32_t>(count - 1));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, PointToPointTest, ::testing::Values(2, 3, 4));

TEST(PointToPointOrderTest, MessagesMatchInOrderPerPeerAndTag) {
  P2pGroup g(2);
  runRanks(2, [&](int r) {
    if (r == 0) {
      // tag 1 twice, then tag 2: the receiver asks for tag 2 first.
      for (int v : {10, 11}) {
        Pending s;
        g[0].send(&v, 4, 1, 1, soon(), s.completion());
        EXPECT_EQ(errorText(s.get()), "");
      }
      int v = 20;
      Pending s;
      g[0].send(&v, 4, 1, 2, soon(), s.completion());
      EXPECT_EQ(errorText(s.get()), "");
    } else {
      int a = 0, b = 0, c = 0;
      Pending pc, pa, pb;
      g[1].recv(&c, 4, 0, 2, soon(), pc.completion());
      EXPECT_EQ(errorText(pc.get()), "");
      g[1].recv(&a, 4, 0, 1, soon(), pa.completion());
      g[1].recv(&b, 4, 0, 1, soon(), pb.completion());
      EXPECT_EQ(errorText(pa.get()), "");
      EXPECT_EQ(errorText(pb.get()), "");
      EXPECT_EQ(c, 20);
      EXPECT_EQ(a, 10);
      EXPECT_EQ(b, 11);
    }
  });
}

TEST(PointToPointAnySourceTest, ReceivesFromEveryPeerAndNamesIt) {
  P2pGroup g(4);
  runRanks(4, [&](int r) {
    if (r == 0) {
      std::vector<int> sources;
      for (int i = 0; i < 6; ++i) {
        int v = -1;
        Pending p;
        g[0].recv(&v, 4, kAnySource, 7, soon(), p.completion());
        const P2pResult got = p.get();
        EXPECT_EQ(errorText(got), "");
        EXPECT_EQ(v, got.source * 100);
        sources.push_back(got.source);
      }
      std::sort(sources.begin(), sources.end());
      EXPECT_EQ(sources, (std::vector<int>{1, 1, 2, 2, 3, 3}));
    } else {
      int v = r * 100;
      for (int i = 0; i < 2; ++i) {
        Pending s;
        g[r].send(&v, 4, 0, 7, soon(), s.completion());
        EXPECT_EQ(errorText(s.get()), "");
      }
    }
  });
}

TEST(PointToPointFailureTest, SizeMismatchNamesBothSizesAndBreaksTheEngine) {
  P2pGroup g(2);
  std::vector<uint8_t> buf(16);
  Pending s, rcv;
  g[0].send(buf.data(), 8, 1, 5, soon(), s.completion());
  g[1].recv(buf.data(), 16, 0, 5, soon(), rcv.completion());
  const std::string what = errorText(rcv.get());
  EXPECT_NE(what.find("posted a receive of 16 bytes with tag 5 but peer 0 sent 8 bytes"), std::string::npos) << what;
  EXPECT_FALSE(g[1].usable());
  Pending later;
  g[1].recv(buf.data(), 8, 0, 5, soon(), later.completion());
  EXPECT_NE(errorText(later.get()).find("unusable"), std::string::npos);
}

TEST(PointToPointFailureTest, RecvFromSilentPeerTimesOutAndThePeerLearns) {
  P2pGroup g(2);
  std::vector<uint8_t> buf(4);
  Pending rcv, peer;
  g[1].recv(buf.data(), 4, 0, 9, in(60s), peer.completion());  // rank 1 waits too
  g[0].recv(buf.data(), 4, 1, 0, in(300ms), rcv.completion());
  const std::string what = errorText(rcv.get());
  EXPECT_NE(what.find("zeroplus recv: rank 0 timed out after 0.3 s waiting for peer 1"), std::string::npos) << what;
  // Rank 0's failure aborted its links: rank 1 fails now, not after its own 60 s.
  const std::string peerWhat = errorText(peer.get());
  EXPECT_NE(peerWhat.find("lost peer 0"), std::string::npos) << peerWhat;
}

TEST(PointToPointFailureTest, GracefulCloseFailsOnlyOpsThatInvolveThePeer) {
  P2pGroup g(3);
  std::vector<uint8_t> buf(4);
  g.engines[2].reset();  // rank 2 leaves; 0 and 1 go on
  int v = 3, got = 0;
  Pending s, r;
  g[0].send(&v, 4, 1, 0, soon(), s.completion());
  g[1].recv(&got, 4, 0, 0, soon(), r.completion());
  EXPECT_EQ(errorText(s.get()), "");
  EXPECT_EQ(errorText(r.get()), "");
  EXPECT_EQ(got, 3);
  Pending fromGone;
  g[0].recv(buf.data(), 4, 2, 0, soon(), fromGone.completion());
  EXPECT_NE(errorText(fromGone.get()).find("lost peer 2"), std::string::npos);
}

TEST(PointToPointFailureTest, CloseFailsPendingOps) {
  P2pGroup g(2);
  std::vector<uint8_t> buf(4);
  Pending rcv;
  g[0].recv(buf.data(), 4, 1, 0, soon(), rcv.completion());
  g[0].close();
  EXPECT_NE(errorText(rcv.get()).find("shut down"), std::string::npos);
}

}  // namespace
}  // namespace zeroplus::pg::testing
