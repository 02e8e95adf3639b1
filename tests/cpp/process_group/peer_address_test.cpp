// The rendezvous address entry of the TCP set-up (peer_address.hpp): round trips, and every
// malformed entry is refused with false instead of an exception or a truncated port.
#include "process_group/core/peer_address.hpp"

#include <gtest/gtest.h>

#include <string>

namespace zeroplus::pg::detail {
namespace {

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

TEST(PeerAddress, RoundTrips) {
  PeerAddress a;
  a.host = "node-1";
  a.addr = "10.0.0.7";
  a.port = 65535;
  a.any = true;
  a.nonce = UINT64_MAX;
  PeerAddress b;
  ASSERT_TRUE(decodePeerAddress(encodePeerAddress(a), &b));
  EXPECT_EQ(b.host, a.host);
  EXPECT_EQ(b.addr, a.addr);
  EXPECT_EQ(b.port, a.port);
  EXPECT_EQ(b.any, a.any);
  EXPECT_EQ(b.nonce, a.nonce);
}

TEST(PeerAddress, FieldsInAnyOrderUnknownKeysIgnored) {
  PeerAddress b;
  ASSERT_TRUE(decodePeerAddress(bytes("nonce=7;x=y;port=80;addr=h;junk"), &b));
  EXPECT_EQ(b.addr, "h");
  EXPECT_EQ(b.port, 80);
  EXPECT_EQ(b.nonce, 7u);
  EXPECT_FALSE(b.any);
  EXPECT_EQ(b.host, "");
}

TEST(PeerAddress, MalformedEntriesAreRefusedNotThrown) {
  // Each of these threw std::invalid_argument / std::out_of_range from std::stoul (reported as a
  // rendezvous *timeout*), or was accepted with a wrong value (port 65537 -> 1, "-1" wrapped).
  for (const char* s : {"", "addr=h;port=x;nonce=1", "addr=h;port=;nonce=1", "addr=h;port=65536;nonce=1",
                        "addr=h;port=65537;nonce=1", "addr=h;port=-1;nonce=1", "addr=h;port= 80;nonce=1",
                        "addr=h;port=80x;nonce=1", "addr=h;port=0;nonce=1", "addr=h;port=80;nonce=18446744073709551616",
                        "addr=h;port=80;nonce=99999999999999999999999", "addr=h;port=80;nonce=0x10",
                        "addr=h;port=80;nonce=1;any=2", "port=80;nonce=1", "addr=h;nonce=1", "addr=h;port=80"}) {
    PeerAddress b;
    bool ok = true;
    EXPECT_NO_THROW(ok = decodePeerAddress(bytes(s), &b)) << s;
    EXPECT_FALSE(ok) << s;
  }
}

}  // namespace
}  // namespace zeroplus::pg::detail
