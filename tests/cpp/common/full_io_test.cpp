// fs::pwriteFull / fs::preadFull (common/core/full_io.hpp): whole ranges, the end of a file told
// apart from a failed read, errors as negative errno.
#include "common/core/full_io.hpp"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

namespace zeroplus::fs {
namespace {

TEST(FullIo, WritesAndReadsWholeRangesAndTellsTheEndOfTheFile) {
  char tmpl[] = "/tmp/zeroplus_full_io_XXXXXX";
  const int fd = ::mkstemp(tmpl);
  ASSERT_GE(fd, 0);
  ::unlink(tmpl);
  std::vector<uint8_t> data(3 << 20);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7 + (i >> 9));
  ASSERT_EQ(pwriteFull(fd, data.data(), static_cast<int64_t>(data.size()), 4096), 0);

  std::vector<uint8_t> back(data.size());
  int64_t done = -1;
  bool ended = true;
  ASSERT_EQ(preadFull(fd, back.data(), static_cast<int64_t>(back.size()), 4096, &done, &ended), 0);
  EXPECT_EQ(back, data);
  EXPECT_EQ(done, static_cast<int64_t>(data.size()));
  EXPECT_FALSE(ended);

  // Past the end: -EIO, the bytes that were there, and "ended".
  std::vector<uint8_t> tail(100);
  EXPECT_EQ(preadFull(fd, tail.data(), 100, 4096 + static_cast<int64_t>(data.size()) - 40, &done, &ended), -EIO);
  EXPECT_EQ(done, 40);
  EXPECT_TRUE(ended);
  EXPECT_EQ(std::vector<uint8_t>(tail.begin(), tail.begin() + 40), std::vector<uint8_t>(data.end() - 40, data.end()));
  ::close(fd);

  // A failed call: -errno, not "ended".
  EXPECT_EQ(preadFull(fd, tail.data(), 10, 0, &done, &ended), -EBADF);
  EXPECT_FALSE(ended);
  EXPECT_EQ(pwriteFull(fd, tail.data(), 10, 0), -EBADF);
}

}  // namespace
}  // namespace zeroplus::fs
