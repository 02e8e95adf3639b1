// Description: common/core/sha256 against the FIPS 180-2 (appendix B) test vectors, the empty
// string, a million 'a's fed in uneven pieces, and every padding boundary against a split feed.
#include <gtest/gtest.h>

#include <string>

#include "common/core/sha256.hpp"

namespace {

using zeroplus::checksum::Sha256;
using zeroplus::checksum::sha256Hex;

std::string hex(const std::array<uint8_t, 32>& d) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (uint8_t b : d) out += std::string{kHex[b >> 4], kHex[b & 15]};
  return out;
}

TEST(Sha256, Fips180Vectors) {
  EXPECT_EQ(sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256Hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256Hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(Sha256, MillionAInUnevenPieces) {
  const std::string chunk(997, 'a');
  Sha256 s;
  size_t left = 1000000;
  while (left) {
    const size_t n = left < chunk.size() ? left : chunk.size();
    s.update(chunk.data(), n);
    left -= n;
  }
  EXPECT_EQ(hex(s.finish()), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, SplitFeedEqualsOneFeedAtEveryLength) {
  std::string data;
  for (int i = 0; i < 200; ++i) data += static_cast<char>(i * 7 + 3);
  for (size_t n = 0; n <= data.size(); ++n) {
    for (size_t cut : {size_t{0}, n / 2, n}) {
      Sha256 s;
      s.update(data.data(), cut);
      s.update(data.data() + cut, n - cut);
      ASSERT_EQ(hex(s.finish()), sha256Hex(std::string_view(data.data(), n))) << "length " << n << " cut " << cut;
    }
  }
  EXPECT_NE(sha256Hex("abd"), sha256Hex("abc"));
}

}  // namespace
