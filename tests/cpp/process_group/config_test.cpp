// ZEROPLUS_* value parsing (process_group/core/config.cpp): sizes with K/M/G suffixes must be
// range-checked after the suffix is applied, never wrap around.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <stdexcept>
#include <string>

#include "process_group/core/config.hpp"

namespace zeroplus::pg {
namespace {

std::string errorOf(const char* value) {
  try {
    parseBytes("ZEROPLUS_BUCKET_BYTES", value);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

TEST(ConfigParseBytes, Suffixes) {
  EXPECT_EQ(parseBytes("X", "0"), 0u);
  EXPECT_EQ(parseBytes("X", "4096"), 4096u);
  EXPECT_EQ(parseBytes("X", "4K"), 4096u);
  EXPECT_EQ(parseBytes("X", "4k"), 4096u);
  EXPECT_EQ(parseBytes("X", "3MiB"), 3u << 20);
  EXPECT_EQ(parseBytes("X", "1023G"), 1023ull << 30);
  EXPECT_EQ(parseBytes("X", "1099511627775"), (1ull << 40) - 1);
}

TEST(ConfigParseBytes, OverflowingSuffixesAreRefusedNamingVariableAndValue) {
  // 17179869185 << 30 wrapped to 1 GiB, 17179869184 << 30 to 0, and 1024G passed "below 1 TiB".
  for (const char* v : {"17179869185G", "17179869184G", "1024G", "1048576M", "1073741824K", "1099511627776",
                        "99999999999999999999999999G"}) {
    const std::string m = errorOf(v);
    EXPECT_NE(m.find("ZEROPLUS_BUCKET_BYTES"), std::string::npos) << v << ": " << m;
    EXPECT_NE(m.find(v), std::string::npos) << m;
    EXPECT_NE(m.find("below 1 TiB"), std::string::npos) << m;
  }
  EXPECT_NE(errorOf("12X").find("suffix"), std::string::npos);
  EXPECT_NE(errorOf("").find("byte count"), std::string::npos);
}

TEST(ConfigEnvironment, SpinMicrosCannotWrapToZero) {
  ::setenv("ZEROPLUS_SPIN_US", "17179869184G", 1);
  try {
    const PgTuning t = configFromEnvironment();
    ADD_FAILURE() << "accepted as spin_us=" << t.spinMicros;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("ZEROPLUS_SPIN_US='17179869184G'"), std::string::npos) << e.what();
  }
  ::setenv("ZEROPLUS_SPIN_US", "1G", 1);
  EXPECT_THROW(configFromEnvironment(), std::invalid_argument);  // over 1000000 us
  ::setenv("ZEROPLUS_SPIN_US", "20", 1);
  EXPECT_EQ(zeroplus::pg::configFromEnvironment().spinMicros, 20u);
  ::unsetenv("ZEROPLUS_SPIN_US");
}

}  // namespace
}  // namespace zeroplus::pg

TEST(ConfigEnvironment, GlooSocketIfnameIsHonouredUnlessZeroplusNamesOne) {
  ::unsetenv("ZEROPLUS_SOCKET_IFNAME");
  ::setenv("GLOO_SOCKET_IFNAME", "eth1,eth2", 1);  // Gloo's list form: the first entry counts
  zeroplus::pg::PgTuning t = zeroplus::pg::configFromEnvironment();
  EXPECT_EQ(t.socketIfname, "eth1");
  EXPECT_EQ(t.socketIfnameSource, "GLOO_SOCKET_IFNAME");
  ::setenv("ZEROPLUS_SOCKET_IFNAME", "eth3", 1);
  t = zeroplus::pg::configFromEnvironment();
  EXPECT_EQ(t.socketIfname, "eth3");
  EXPECT_EQ(t.socketIfnameSource, "ZEROPLUS_SOCKET_IFNAME");
  ::unsetenv("ZEROPLUS_SOCKET_IFNAME");
  ::setenv("GLOO_SOCKET_IFNAME", "a/b", 1);
  try {
    zeroplus::pg::configFromEnvironment();
    ADD_FAILURE() << "a malformed GLOO_SOCKET_IFNAME was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("GLOO_SOCKET_IFNAME='a/b' is invalid"), std::string::npos) << e.what();
  }
  ::unsetenv("GLOO_SOCKET_IFNAME");
  EXPECT_EQ(zeroplus::pg::configFromEnvironment().socketIfname, "");
}

TEST(ConfigEnvironment, InterHostTakesAutoGlooOrTcpAndNamesTheVariableOtherwise) {
  using zeroplus::pg::InterHost;
  ::unsetenv("ZEROPLUS_INTERHOST");
  EXPECT_EQ(zeroplus::pg::configFromEnvironment().interHost, InterHost::kAuto);
  ::setenv("ZEROPLUS_INTERHOST", "tcp", 1);
  EXPECT_EQ(zeroplus::pg::configFromEnvironment().interHost, InterHost::kTcp);
  ::setenv("ZEROPLUS_INTERHOST", "gloo", 1);
  EXPECT_EQ(zeroplus::pg::configFromEnvironment().interHost, InterHost::kGloo);
  ::setenv("ZEROPLUS_INTERHOST", "nccl", 1);
  try {
    zeroplus::pg::configFromEnvironment();
    ADD_FAILURE() << "ZEROPLUS_INTERHOST=nccl was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "zeroplus: ZEROPLUS_INTERHOST='nccl' is invalid, expected auto, gloo or tcp");
  }
  ::unsetenv("ZEROPLUS_INTERHOST");
  zeroplus::pg::PgTuning t;
  zeroplus::pg::applyOption(t, "interhost", "tcp");
  EXPECT_EQ(t.interHost, InterHost::kTcp);
  EXPECT_THROW(zeroplus::pg::applyOption(t, "interhost", "x"), std::invalid_argument);
}
