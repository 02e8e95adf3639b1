// Host topology: numbering, leaders and the rendezvous exchange (topology.hpp).
#include "process_group/core/topology.hpp"

#include <gtest/gtest.h>

#include <thread>

#include "process_group/core/host_identity.hpp"
#include "memory_rendezvous.hpp"

namespace zeroplus::pg {
namespace {

TEST(Topology, HostsAreNumberedByTheirLowestRank) {
  // Ranks 0 and 3 share a host, 1 and 2 another, 4 is alone.
  const Topology t = topologyFromIdentities(2, {"x", "y", "y", "x", "z"}, {"a", "b", "b", "a", "c"});
  EXPECT_EQ(t.hostCount(), 3);
  EXPECT_EQ(t.hostOf, (std::vector<int>{0, 1, 1, 0, 2}));
  EXPECT_EQ(t.host(), 1);
  EXPECT_EQ(t.ranksOn(0), (std::vector<int>{0, 3}));
  EXPECT_EQ(t.leaders(), (std::vector<int>{0, 1, 4}));
  EXPECT_EQ(t.describe(), "3 hosts: host 0 'a' ranks 0,3; host 1 'b' ranks 1,2; host 2 'c' ranks 4");
}

TEST(Topology, IdentityIsStableAndNotTheHostName) {
  const std::string id = detail::hostIdentity();
  EXPECT_EQ(id, detail::hostIdentity());  // the /dev/shm token is created once, then read
  EXPECT_EQ(id.find(detail::hostLabel() + "/"), std::string::npos);
}

TEST(Topology, ExchangeAgreesOnOneHostAndNamesAMissingRank) {
  testing::InMemoryRendezvous rendezvous;
  std::vector<Topology> got(3);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 3; ++r) {
    ranks.emplace_back([&, r] { got[static_cast<size_t>(r)] = exchangeTopology(rendezvous, r, 3, Clock::now() + std::chrono::seconds(10)); });
  }
  for (auto& t : ranks) t.join();
  for (const Topology& t : got) {
    EXPECT_EQ(t.hostCount(), 1);
    EXPECT_EQ(t.hostOf, (std::vector<int>{0, 0, 0}));
  }
  testing::InMemoryRendezvous lonely;
  try {
    exchangeTopology(lonely, 0, 2, Clock::now() + std::chrono::milliseconds(200));
    ADD_FAILURE() << "exchange with a missing rank returned";
  } catch (const CommError& e) {
    EXPECT_EQ(e.peer(), 1);
    EXPECT_NE(std::string(e.what()).find("waiting for rank 1 to publish its host identity"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace zeroplus::pg
