// Per-instance scope agreement (group_session.hpp): every rank of one instance gets the same
// fresh scope, whatever an earlier instance left in the rendezvous and whoever arrives first.
#include "process_group/core/group_session.hpp"

#include <gtest/gtest.h>

#include <thread>

#include "memory_rendezvous.hpp"

namespace zeroplus::pg {
namespace {

using namespace std::chrono_literals;

// Runs agreeSession on `size` threads; rank r starts after delays[r].
std::vector<std::string> agree(Rendezvous& rendezvous, int size, std::vector<std::chrono::milliseconds> delays = {}) {
  delays.resize(static_cast<size_t>(size), 0ms);
  std::vector<std::string> scopes(static_cast<size_t>(size));
  std::vector<std::thread> ranks;
  for (int r = 0; r < size; ++r) {
    ranks.emplace_back([&, r] {
      std::this_thread::sleep_for(delays[static_cast<size_t>(r)]);
      scopes[static_cast<size_t>(r)] = agreeSession(rendezvous, r, size, Clock::now() + 10s);
    });
  }
  for (auto& t : ranks) t.join();
  return scopes;
}

class GroupSession : public ::testing::TestWithParam<int> {};

TEST_P(GroupSession, EveryRankGetsTheSameFreshScope) {
  testing::InMemoryRendezvous rendezvous;
  const auto scopes = agree(rendezvous, GetParam());
  for (const auto& s : scopes) {
    EXPECT_TRUE(detail::isToken(s)) << s;
    EXPECT_EQ(s, scopes[0]);
  }
}

TEST_P(GroupSession, ARestartedInstanceNeverReusesTheEarlierScope) {
  // The same rendezvous across "attempts", as torchrun's agent store: each attempt's ranks
  // arrive in a different order (rank 0 last, first, in the middle), so the new rank 0 sees
  // the old attempt's join nonces, and new ranks > 0 see the old welcomes and joined keys.
  const int size = GetParam();
  testing::InMemoryRendezvous rendezvous;
  std::vector<std::string> seen;
  for (int attempt = 0; attempt < 4; ++attempt) {
    std::vector<std::chrono::milliseconds> delays(static_cast<size_t>(size), 0ms);
    if (attempt == 1) delays[0] = 50ms;  // every other rank joins before rank 0 exists
    if (attempt == 2) {
      for (int r = 1; r < size; ++r) delays[static_cast<size_t>(r)] = 50ms;  // rank 0 first
    }
    if (attempt == 3 && size > 2) delays[1] = 80ms;
    const auto scopes = agree(rendezvous, size, delays);
    for (const auto& s : scopes) EXPECT_EQ(s, scopes[0]) << "attempt " << attempt;
    for (const auto& old : seen) EXPECT_NE(scopes[0], old) << "attempt " << attempt;
    seen.push_back(scopes[0]);
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, GroupSession, ::testing::Values(1, 2, 3, 4));

TEST(GroupSessionFaults, AnInstanceWhoseRankDiedBeforeJoiningDoesNotConfuseTheNext) {
  // Attempt 0: rank 1 published its nonce and died before rank 0 came; a stranger wrote a
  // non-token under rank 2's join key. Attempt 1's rank 0 arrives first and sees both; its
  // ranks still agree on its own scope.
  testing::InMemoryRendezvous rendezvous;
  rendezvous.set("zeroplus/session/join/1", std::vector<uint8_t>(32, '7'));
  rendezvous.set("zeroplus/session/join/2", {'.', '.', '/', 'x'});
  const auto scopes = agree(rendezvous, 3, {0ms, 60ms, 90ms});
  EXPECT_EQ(scopes[0], scopes[1]);
  EXPECT_EQ(scopes[0], scopes[2]);
  // rank 0 welcomed the dead rank's nonce too (it cannot tell), harmlessly
  EXPECT_TRUE(rendezvous.check("zeroplus/session/welcome/1/" + std::string(32, '7')));
  EXPECT_FALSE(rendezvous.check("zeroplus/session/welcome/2/../x"));
}

TEST(GroupSessionFaults, AMissingRankIsNamedOnBothSides) {
  testing::InMemoryRendezvous lonelyLeader;
  try {
    agreeSession(lonelyLeader, 0, 3, Clock::now() + 200ms);
    ADD_FAILURE() << "rank 0 agreed without its peers";
  } catch (const CommError& e) {
    EXPECT_EQ(e.peer(), -1);
    EXPECT_NE(std::string(e.what()).find("waiting for ranks 1, 2 to join the group"), std::string::npos) << e.what();
  }
  testing::InMemoryRendezvous lonelyFollower;
  try {
    agreeSession(lonelyFollower, 1, 2, Clock::now() + 200ms);
    ADD_FAILURE() << "rank 1 agreed without rank 0";
  } catch (const CommError& e) {
    EXPECT_EQ(e.peer(), 0);
    EXPECT_NE(std::string(e.what()).find("waiting for rank 0 to admit it to the group"), std::string::npos)
        << e.what();
  }
}

TEST(GroupSessionFaults, TokensAreUnpredictableHex) {
  const std::string a = detail::freshToken();
  const std::string b = detail::freshToken();
  EXPECT_TRUE(detail::isToken(a));
  EXPECT_NE(a, b);
  EXPECT_FALSE(detail::isToken(a.substr(1)));
  EXPECT_FALSE(detail::isToken(std::string(31, 'a') + "G"));
}

}  // namespace
}  // namespace zeroplus::pg
