// Description: verifiedRead (optimizers/core/checkpoint/verified_read.hpp), the checkpoint
// reads of both front-ends: whole-block and partial-block pieces, several pieces sharing a block,
// a short last block, empty ranges; a flipped byte in each kind of block refused with the exact
// message (and the first in file order when several are); a file shorter than its record;
// bad arguments; every case on 1 to 16 threads with tasks of one block and of several; no
// destination written outside its range (guard bytes around each).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "common/core/crc32.hpp"
#include "optimizers/core/checkpoint/verified_read.hpp"

namespace {

using namespace zeroplus::ckpt;

constexpr int64_t kBlock = 64;
constexpr int64_t kSize = 10 * kBlock + 13;  // ten whole blocks and a short one
constexpr uint8_t kGuard = 0xA5;
constexpr int64_t kPad = 16;

// A temporary shard file of kSize patterned bytes, its block CRCs and an open descriptor.
class Shard {
 public:
  Shard() {
    char tmpl[] = "/tmp/zeroplus_verified_read_XXXXXX";
    fd_ = ::mkstemp(tmpl);
    path_ = tmpl;
    bytes_.resize(kSize);
    for (int64_t i = 0; i < kSize; ++i) bytes_[i] = static_cast<uint8_t>((i * 131 + 7) ^ (i >> 8));
    write(bytes_);
  }
  ~Shard() {
    ::close(fd_);
    ::unlink(path_.c_str());
  }
  void write(const std::vector<uint8_t>& b) {
    ASSERT_EQ(::ftruncate(fd_, 0), 0);
    ASSERT_EQ(::pwrite(fd_, b.data(), b.size(), 0), static_cast<ssize_t>(b.size()));
    crcs_.clear();
    for (int64_t a = 0; a < static_cast<int64_t>(b.size()); a += kBlock) {
      crcs_.push_back(zeroplus::checksum::crc32(0, b.data() + a, std::min<int64_t>(kBlock, b.size() - a)));
    }
  }
  // Changes byte `at` on disk, leaving the recorded CRCs as they were.
  void flip(int64_t at) {
    const uint8_t v = bytes_[at] ^ 0x40;
    ASSERT_EQ(::pwrite(fd_, &v, 1, at), 1);
  }
  VerifiedFile file() const { return VerifiedFile{fd_, kSize, kBlock, crcs_.data(), static_cast<int64_t>(crcs_.size())}; }
  const std::vector<uint8_t>& bytes() const { return bytes_; }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  std::string path_;
  std::vector<uint8_t> bytes_;
  std::vector<uint32_t> crcs_;
};

// Destinations with guard bytes on both sides; check() compares the inside with the file's
// bytes and that no guard byte changed.
struct Dests {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  std::vector<std::vector<uint8_t>> bufs;
  std::vector<ReadPiece> pieces;
  explicit Dests(std::vector<std::pair<int64_t, int64_t>> r) : ranges(std::move(r)) {
    for (const auto& [lo, hi] : ranges) bufs.emplace_back(static_cast<size_t>(hi - lo + 2 * kPad), kGuard);
    for (size_t i = 0; i < ranges.size(); ++i) pieces.push_back({ranges[i].first, ranges[i].second, bufs[i].data() + kPad});
  }
  void expectGuards() const {
    for (size_t i = 0; i < bufs.size(); ++i) {
      const int64_t n = ranges[i].second - ranges[i].first;
      for (int64_t k = 0; k < kPad; ++k) {
        ASSERT_EQ(bufs[i][k], kGuard) << "piece " << i << " written before its destination";
        ASSERT_EQ(bufs[i][kPad + n + k], kGuard) << "piece " << i << " written past its destination";
      }
    }
  }
  void expectBytes(const std::vector<uint8_t>& file) const {
    for (size_t i = 0; i < bufs.size(); ++i) {
      for (int64_t a = ranges[i].first; a < ranges[i].second; ++a) {
        ASSERT_EQ(bufs[i][kPad + a - ranges[i].first], file[a]) << "piece " << i << " byte " << a;
      }
    }
    expectGuards();
  }
};

// Whole blocks ([64, 320): a run), a range with partial ends ([30, 200)), small pieces sharing
// blocks 1 and 8, the short last block whole and in part, an empty range, one byte at the end.
std::vector<std::pair<int64_t, int64_t>> mixedRanges() {
  return {{64, 320}, {30, 200}, {70, 75}, {75, 90}, {90, 128}, {520, 530}, {530, 560}, {640, kSize},
          {650, 651}, {300, 300}, {kSize - 1, kSize}, {0, kSize}};
}

class VerifiedRead : public ::testing::TestWithParam<std::tuple<int, int64_t>> {
 protected:
  VerifiedReadOptions options() const {
    return VerifiedReadOptions{}.setThreads(std::get<0>(GetParam())).setTaskBytes(std::get<1>(GetParam()));
  }
};

TEST_P(VerifiedRead, PiecesGetTheirBytesAndNothingElse) {
  Shard s;
  Dests d(mixedRanges());
  ReadFailure why;
  ASSERT_EQ(verifiedRead(s.file(), d.pieces, options(), &why), 0) << why.message;
  EXPECT_EQ(why.code, 0);
  d.expectBytes(s.bytes());
}

TEST_P(VerifiedRead, AFlippedByteInEachKindOfBlockIsRefusedNamingTheBlock) {
  // (byte flipped, its block): inside a whole-block run, in a block only pieces share in part,
  // in the short last block.
  for (const auto& [at, lo, hi] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {100, 64, 128}, {525, 512, 576}, {kSize - 2, 640, kSize}, {0, 0, 64}}) {
    Shard s;
    s.flip(at);
    Dests d(mixedRanges());
    ReadFailure why;
    EXPECT_EQ(verifiedRead(s.file(), d.pieces, options(), &why), -EIO) << at;
    EXPECT_TRUE(why.corrupt);
    EXPECT_EQ(why.message, "checkpoint: checksum mismatch in bytes [" + std::to_string(lo) + ", " + std::to_string(hi) +
                               ") (corrupt file)");
    d.expectGuards();
  }
}

TEST_P(VerifiedRead, OfSeveralBadBlocksTheFirstInFileOrderIsReported) {
  Shard s;
  for (int64_t at : {600, 330, 200}) s.flip(at);  // blocks 9, 5, 3
  Dests d({{0, kSize}});
  ReadFailure why;
  EXPECT_EQ(verifiedRead(s.file(), d.pieces, options(), &why), -EIO);
  EXPECT_EQ(why.message, "checkpoint: checksum mismatch in bytes [192, 256) (corrupt file)");
}

TEST_P(VerifiedRead, AFileShorterThanItsRecordIsTruncatedNotCorrupt) {
  Shard s;
  ASSERT_EQ(::ftruncate(s.fd(), 600), 0);  // in block 9 [576, 640): ends 24 bytes in
  Dests d({{0, kSize}});
  ReadFailure why;
  EXPECT_EQ(verifiedRead(s.file(), d.pieces, options(), &why), -EIO);
  EXPECT_FALSE(why.corrupt || why.badArgument);
  EXPECT_EQ(why.message, "checkpoint: file is truncated: wanted 64 bytes at offset 576, it ends at 600");
  d.expectGuards();
}

TEST_P(VerifiedRead, EmptyRangesAndAnEmptyFileReadNothing) {
  Shard s;
  Dests d({{10, 10}, {kSize, kSize}});
  ReadFailure why;
  EXPECT_EQ(verifiedRead(s.file(), d.pieces, options(), &why), 0) << why.message;
  d.expectGuards();
  EXPECT_EQ(verifiedRead(s.file(), {}, options(), &why), 0);
  s.write({});
  const VerifiedFile empty{s.fd(), 0, kBlock, nullptr, 0};
  EXPECT_EQ(verifiedRead(empty, {{0, 0, nullptr}}, options(), &why), 0) << why.message;
}

INSTANTIATE_TEST_SUITE_P(ThreadsAndTaskSizes, VerifiedRead,
                         ::testing::Combine(::testing::Values(1, 2, 4, 16), ::testing::Values(kBlock, 3 * kBlock,
                                                                                              int64_t{8} << 20)));

TEST(VerifiedReadMany, ManyPiecesOnManyThreads) {
  Shard s;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t a = 0; a < kSize; a += 7) ranges.emplace_back(a, std::min<int64_t>(a + 7, kSize));  // 7-byte pieces
  Dests d(ranges);
  ReadFailure why;
  ASSERT_EQ(verifiedRead(s.file(), d.pieces, VerifiedReadOptions{}.setThreads(64).setTaskBytes(1), &why), 0)
      << why.message;
  d.expectBytes(s.bytes());
}

TEST(VerifiedReadArguments, AreRefusedWithEinvalNamingThem) {
  Shard s;
  std::vector<uint8_t> buf(kSize);
  ReadFailure why;
  auto refused = [&](const VerifiedFile& f, std::vector<ReadPiece> pieces, VerifiedReadOptions o, const char* what) {
    EXPECT_EQ(verifiedRead(f, pieces, o, &why), -EINVAL) << what;
    EXPECT_TRUE(why.badArgument) << what;
    EXPECT_NE(why.message.find(what), std::string::npos) << why.message;
  };
  VerifiedFile f = s.file();
  refused(f, {{0, kSize + 1, buf.data()}}, {}, "outside the file");
  refused(f, {{5, 4, buf.data()}}, {}, "outside the file");
  refused(f, {{0, 1, nullptr}}, {}, "no destination");
  refused(f, {}, VerifiedReadOptions{}.setThreads(0), "threads");
  refused(f, {}, VerifiedReadOptions{}.setTaskBytes(0), "task bytes");
  f.blocks -= 1;
  refused(f, {}, {}, "needs 11 block CRCs, got 10");
  f = s.file();
  f.blockBytes = 0;
  refused(f, {}, {}, "block bytes");
  f = s.file();
  f.fd = -1;
  refused(f, {}, {}, "fd");
}

}  // namespace
