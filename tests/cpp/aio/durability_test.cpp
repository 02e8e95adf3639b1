// Preallocation, syncs and the temp + rename + directory fsync commit.
#include <sys/stat.h>

#include <fstream>

#include "aio/core/durability.hpp"
#include "tests/cpp/aio/test_helpers.hpp"

namespace zeroplus::aio {
namespace {

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

TEST(Durability, PreallocateReservesBlocks) {
  test::TempDir dir;
  auto f = File::open(dir.file("p"), test::writeOptions(DirectMode::Auto));
  preallocate(*f, 0, 8 << 20);
  EXPECT_EQ(f->size(), 8u << 20);
  struct stat st {};
  ASSERT_EQ(::stat(f->path().c_str(), &st), 0);
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, 8u << 20);
  syncData(*f);
  syncAll(*f);
}

TEST(Durability, AtomicFileCommitReplacesTarget) {
  test::TempDir dir;
  const std::string target = dir.file("ckpt.bin");
  { std::ofstream(target) << "old"; }
  ZP_CREATE_ENGINE_OR_SKIP(engine, EngineOptions{});
  const size_t n = (1 << 20) + 3;
  AlignedBuffer buf(n);
  test::fillRandom(buf.data(), n, 3);
  {
    AtomicFile af(target);
    preallocate(*af.file(), 0, n);
    engine->run({OpKind::Write, af.file(), buf.data(), 0, n});
    EXPECT_EQ(slurp(target), "old");  // not visible before commit
    af.commit();
    EXPECT_FALSE(std::filesystem::exists(af.tempPath()));
  }
  const std::string got = slurp(target);
  ASSERT_EQ(got.size(), n);
  EXPECT_EQ(0, std::memcmp(got.data(), buf.data(), n));
}

TEST(Durability, AbandonedAtomicFileLeavesNoTrace) {
  test::TempDir dir;
  const std::string target = dir.file("ckpt.bin");
  { std::ofstream(target) << "old"; }
  std::string temp;
  {
    AtomicFile af(target);
    temp = af.tempPath();
    ASSERT_EQ(::pwrite(af.file()->bufferedFd(), "new", 3, 0), 3);
    EXPECT_TRUE(std::filesystem::exists(temp));
  }  // no commit: e.g. an exception while writing
  EXPECT_FALSE(std::filesystem::exists(temp));
  EXPECT_EQ(slurp(target), "old");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 1);
}

TEST(Durability, AtomicFileKeepsTheTargetsPermissions) {
  test::TempDir dir;
  const std::string target = dir.file("secret");
  { std::ofstream(target) << "old"; }
  ASSERT_EQ(::chmod(target.c_str(), 0600), 0);
  {
    AtomicFile af(target);
    ASSERT_EQ(::pwrite(af.file()->bufferedFd(), "new", 3, 0), 3);
    af.commit();
  }
  struct stat st {};
  ASSERT_EQ(::stat(target.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);  // was 0644: rewriting made it world-readable
  EXPECT_EQ(slurp(target), "new");
}

TEST(Durability, AtomicFileRefusesToReplaceSpecialFiles) {
  test::TempDir dir;
  const std::string fifo = dir.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& target : {fifo, dir.path()}) {
    try {
      AtomicFile af(target);
      af.commit();
      ADD_FAILURE() << "replaced " << target;
    } catch (const IoError& e) {
      EXPECT_EQ(e.path(), target);
    }
  }
  struct stat st {};
  ASSERT_EQ(::stat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));  // still the FIFO, not a regular file renamed over it
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()), {}), 1);
}

TEST(Durability, ErrorsNameThePath) {
  try {
    syncDirectory("/nonexistent/zeroplus");
    FAIL();
  } catch (const IoError& e) {
    EXPECT_EQ(e.error(), ENOENT);
    EXPECT_EQ(e.path(), "/nonexistent/zeroplus");
  }
  EXPECT_THROW(AtomicFile("/nonexistent/zeroplus/x"), IoError);
}

}  // namespace
}  // namespace zeroplus::aio
