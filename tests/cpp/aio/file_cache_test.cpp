// FileCache: queued operations on one file share one File (two descriptors at most), however
// many there are; a file replaced under its path gets a fresh open; nothing stays open once the
// operations let go.
#include <dirent.h>
#include <sys/resource.h>

#include "aio/core/file_cache.hpp"
#include "tests/cpp/aio/test_helpers.hpp"

namespace zeroplus::aio {
namespace {

int openDescriptors() {
  int n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  while (dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
  ::closedir(d);
  return n;
}

OpenOptions asyncWrite(DirectMode direct) {
  OpenOptions o;
  o.write = o.create = true;  // as AioHandle opens for async_pwrite: no truncate
  o.direct = direct;
  return o;
}

TEST(FileCache, ManyUsersOfOneFileShareOneFile) {
  test::TempDir dir;
  FileCache cache;
  const int before = openDescriptors();
  std::vector<std::shared_ptr<File>> users;
  for (int i = 0; i < 5000; ++i) users.push_back(cache.open(dir.file("f"), asyncWrite(DirectMode::Auto)));
  for (auto& u : users) EXPECT_EQ(u.get(), users.front().get());
  EXPECT_LE(openDescriptors() - before, 2);  // buffered + O_DIRECT descriptor
  EXPECT_EQ(cache.openCount(), 1u);
  users.clear();
  EXPECT_EQ(openDescriptors(), before);  // closed with the last user
  EXPECT_EQ(cache.openCount(), 0u);
}

TEST(FileCache, ModesAreKeptApart) {
  test::TempDir dir;
  FileCache cache;
  auto w = cache.open(dir.file("m"), asyncWrite(DirectMode::Auto));
  auto wb = cache.open(dir.file("m"), asyncWrite(DirectMode::Off));
  auto r = cache.open(dir.file("m"), test::readOptions(DirectMode::Auto));
  EXPECT_NE(w.get(), wb.get());
  EXPECT_NE(w.get(), r.get());
  EXPECT_FALSE(r->writable());
  EXPECT_FALSE(wb->direct());
  EXPECT_EQ(cache.open(dir.file("m"), test::readOptions(DirectMode::Auto)).get(), r.get());
}

TEST(FileCache, ReplacedPathGetsAFreshOpen) {
  test::TempDir dir;
  FileCache cache;
  const std::string p = dir.file("r");
  auto first = cache.open(p, asyncWrite(DirectMode::Off));
  ASSERT_EQ(std::rename(p.c_str(), dir.file("old").c_str()), 0);
  auto second = cache.open(p, asyncWrite(DirectMode::Off));  // recreated: a new inode
  EXPECT_NE(first.get(), second.get());
  EXPECT_TRUE(std::filesystem::exists(p));
  ::unlink(p.c_str());
  auto third = cache.open(p, asyncWrite(DirectMode::Off));
  EXPECT_NE(second.get(), third.get());
}

// Under a small descriptor limit, thousands of holders of one file still need two descriptors.
TEST(FileCache, ThousandsOfUsersUnderASmallFdLimit) {
  test::TempDir dir;
  const int rc = test::runInChild([&] {
    rlimit lim{};
    ::getrlimit(RLIMIT_NOFILE, &lim);
    lim.rlim_cur = static_cast<rlim_t>(openDescriptors() + 16);
    if (::setrlimit(RLIMIT_NOFILE, &lim) != 0) return 2;
    FileCache cache;
    std::vector<std::shared_ptr<File>> users;
    for (int i = 0; i < 3000; ++i) users.push_back(cache.open(dir.file("lim"), asyncWrite(DirectMode::Auto)));
    return 0;
  });
  EXPECT_EQ(rc, 0);
}

}  // namespace
}  // namespace zeroplus::aio
