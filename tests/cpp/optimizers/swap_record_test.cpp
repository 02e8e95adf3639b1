// swap_record.hpp: the record format the optimizer swappers of both engines write (the Python
// engine's through SwapStore since issue 39). The cases of the Python record's test
// (tests/python/test_offload_nvme.py::test_record_refuses_torn_stale_flipped_and_misplaced_data):
// a sealed record is accepted; a stale generation, another record's id, a flipped payload bit,
// two 4 KiB blocks in each other's place, a torn (zeroed) block, a bad magic, a flipped header
// bit, another payload size and another layout are each refused, saying which check failed.
#include "optimizers/core/swap_record.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace zeroplus::swap {
namespace {

constexpr uint64_t kPayload = 6000 * 4 + 64;  // a few 4 KiB blocks and a tail
const RecordKey kKey{5, 7, kPayload, 0xC0FFEE};

std::vector<unsigned char> sealed() {
  std::vector<unsigned char> rec(recordBytes(kPayload));
  std::mt19937 gen(42);
  for (uint64_t i = 0; i < kPayload; ++i) rec[kHeaderBytes + i] = static_cast<unsigned char>(gen());
  sealRecord(rec.data(), kKey);
  return rec;
}

void expectRefused(const std::function<void(std::vector<unsigned char>&)>& mutate, const RecordKey& key,
                   const std::string& match) {
  std::vector<unsigned char> rec = sealed();
  mutate(rec);
  std::string why;
  EXPECT_EQ(checkRecord(rec.data(), key, &why), -EBADMSG) << match;
  EXPECT_NE(why.find(match), std::string::npos) << "expected '" << match << "' in: " << why;
}

TEST(SwapRecord, SealedRecordIsAccepted) {
  std::vector<unsigned char> rec = sealed();
  std::string why;
  EXPECT_EQ(checkRecord(rec.data(), kKey, &why), 0) << why;
}

TEST(SwapRecord, StaleMisplacedFlippedTornAndForeignRecordsAreRefused) {
  auto none = [](std::vector<unsigned char>&) {};
  expectRefused(none, {5, 8, kPayload, kKey.layoutTag}, "generation 7, expected 8");  // a write that never happened
  expectRefused(none, {4, 7, kPayload, kKey.layoutTag}, "id 5, expected 4");          // another record's file
  expectRefused([](auto& b) { b[kHeaderBytes + 5000] ^= 1; }, kKey, "payload checksum");
  expectRefused(  // the same bytes, two blocks in each other's place
      [](auto& b) {
        std::swap_ranges(b.begin() + kHeaderBytes, b.begin() + kHeaderBytes + 4096, b.begin() + kHeaderBytes + 4096);
      },
      kKey, "payload checksum");
  expectRefused([](auto& b) { std::fill(b.begin() + kHeaderBytes + 8192, b.begin() + kHeaderBytes + 12288, 0); },
                kKey, "payload checksum");  // torn
  expectRefused([](auto& b) { std::fill(b.begin(), b.begin() + 8, 0); }, kKey, "magic");
  expectRefused([](auto& b) { b[40] ^= 1; }, kKey, "header checksum");
  expectRefused(none, {5, 7, kPayload, kKey.layoutTag + 1}, "layout");
  expectRefused(none, {5, 7, kPayload - 64, kKey.layoutTag}, "payload of");
}

}  // namespace
}  // namespace zeroplus::swap
