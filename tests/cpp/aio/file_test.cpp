// Opening files: O_DIRECT detection, alignment from statx/sysfs, explicit buffered mode.
#include <signal.h>
#include <sys/stat.h>
#include <sys/statfs.h>

#include "tests/cpp/aio/test_helpers.hpp"

namespace zeroplus::aio {
namespace {

bool isPowerOfTwo(uint64_t v) { return v && (v & (v - 1)) == 0; }

TEST(File, DirectAlignmentIsQueriedNotAssumed) {
  test::TempDir dir;
  auto f = File::open(dir.file("x"), test::writeOptions(DirectMode::Auto));
  if (!f->direct()) GTEST_SKIP() << "no O_DIRECT under " << dir.path();
  EXPECT_TRUE(isPowerOfTwo(f->offsetAlign()));
  EXPECT_TRUE(isPowerOfTwo(f->memAlign()));
  EXPECT_GE(f->offsetAlign(), 512u);
  EXPECT_LE(f->offsetAlign(), 65536u);
  uint64_t oa = 0, ma = 0;
  bool ok = false;
  ASSERT_EQ(queryDirectAlignment(f->fd(), &oa, &ma, &ok), 0);
  EXPECT_TRUE(ok);
  EXPECT_EQ(oa, f->offsetAlign());
}

TEST(File, BufferedModeHasNoAlignment) {
  test::TempDir dir;
  auto f = File::open(dir.file("x"), test::writeOptions(DirectMode::Off));
  EXPECT_FALSE(f->direct());
  EXPECT_EQ(f->offsetAlign(), 1u);
  EXPECT_EQ(f->memAlign(), 1u);
  EXPECT_EQ(f->fd(), f->bufferedFd());
  EXPECT_TRUE(f->writable());
}

TEST(File, CreateAndTruncate) {
  test::TempDir dir;
  const std::string p = dir.file("t");
  {
    auto f = File::open(p, test::writeOptions(DirectMode::Off));
    ASSERT_EQ(::pwrite(f->fd(), "hello", 5, 0), 5);
  }
  EXPECT_EQ(File::open(p, test::writeOptions(DirectMode::Off, /*truncate=*/false))->size(), 5u);
  EXPECT_EQ(File::open(p, test::writeOptions(DirectMode::Off, /*truncate=*/true))->size(), 0u);
}

// O_DIRECT refused -> buffered under Auto, an error under On. Needs a file system that refuses
// O_DIRECT; tmpfs did before Linux 6.6.
TEST(File, DirectRefusedFallsBackToBuffered) {
  const std::string shm = "/dev/shm";
  struct statfs sfs {};
  if (::statfs(shm.c_str(), &sfs) != 0) GTEST_SKIP() << "no /dev/shm";
  char tmpl[] = "/dev/shm/zeroplus-aio-XXXXXX";
  if (!::mkdtemp(tmpl)) GTEST_SKIP() << "cannot create under /dev/shm";
  const std::string p = std::string(tmpl) + "/f";
  auto f = File::open(p, test::writeOptions(DirectMode::Auto));
  const bool refused = !f->direct();
  std::string msg;
  if (refused) {
    EXPECT_THROW(File::open(p, test::writeOptions(DirectMode::On)), IoError);
  }
  f.reset();
  std::filesystem::remove_all(tmpl);
  if (!refused) GTEST_SKIP() << "/dev/shm accepts O_DIRECT on this kernel";
}

TEST(IoError, MessageCarriesEverything) {
  IoError e("write", "/x/y", 4096, 100, ENOSPC, "extra");
  const std::string m = e.what();
  for (const char* part : {"write", "/x/y", "4096", "100", "No space left", "extra"}) {
    EXPECT_NE(m.find(part), std::string::npos) << m;
  }
  EXPECT_EQ(checkErrno(5, "op", "p"), 5);
  EXPECT_THROW(checkErrno(-EIO, "op", "p"), IoError);
}

TEST(AlignedBuffer, ExactSizePageAligned) {
  for (size_t n : {0ul, 1ul, 4097ul, (3ul << 20) + 5}) {
    AlignedBuffer b(n);
    EXPECT_EQ(b.size(), n);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b.data()) % kPageSize, 0u);
  }
}

TEST(AlignedBuffer, SizesThatCannotBeRoundedUpFailCleanly) {
  // Rounding SIZE_MAX up to a page used to wrap around to a zero-byte allocation that was
  // returned as if it had the requested size.
  bool locked = true;
  EXPECT_EQ(allocateAligned(SIZE_MAX, kPageSize, false, &locked), nullptr);
  EXPECT_EQ(allocateAligned(SIZE_MAX - 100, kPageSize, false, &locked), nullptr);
  EXPECT_THROW(AlignedBuffer(SIZE_MAX - 1), std::bad_alloc);
}

// FIFOs and other special files are refused at open, without blocking. Run in a child with
// an alarm: before the check, opening a FIFO that has no writer blocked forever.
TEST(File, FifoIsRefusedWithoutBlocking) {
  test::TempDir dir;
  const std::string fifo = dir.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const int rc = test::runInChild([&] {
    ::alarm(10);
    for (const OpenOptions& o : {test::readOptions(DirectMode::Auto), test::readOptions(DirectMode::Off),
                                 test::writeOptions(DirectMode::Auto, /*truncate=*/false)}) {
      try {
        File::open(fifo, o);
        return 1;  // accepted: a write would vanish into the pipe, a read would block
      } catch (const IoError& e) {
        if (e.error() != EINVAL || e.path() != fifo) return 2;
        if (std::string(e.what()).find("FIFO") == std::string::npos) return 3;
      }
    }
    return 0;
  });
  EXPECT_EQ(rc, 0) << "1: accepted, 2: wrong errno/path, 3: message, -14: blocked (SIGALRM)";
}

TEST(File, CharacterDeviceAndDirectoryAreRefused) {
  try {
    File::open("/dev/null", test::writeOptions(DirectMode::Off, /*truncate=*/false));
    ADD_FAILURE() << "/dev/null accepted: writes would report success and discard the data";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error(), EINVAL);
    EXPECT_NE(std::string(e.what()).find("character device"), std::string::npos) << e.what();
  }
  test::TempDir dir;
  try {
    File::open(dir.path(), test::readOptions(DirectMode::Auto));
    ADD_FAILURE() << "a directory was accepted for reading";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error(), EISDIR);
  }
}

// Block devices stay allowed (raw NVMe). Their st_size is 0, so size() must ask the device.
// A loop device stands in; skipped where one cannot be attached (not root, no loop driver).
TEST(File, BlockDeviceSizeComesFromTheDevice) {
  test::TempDir dir;
  const std::string backing = dir.file("backing");
  { auto f = File::open(backing, test::writeOptions(DirectMode::Off)); ASSERT_EQ(::ftruncate(f->fd(), 3 << 20), 0); }
  FILE* p = ::popen(("losetup -f --show " + backing + " 2>/dev/null").c_str(), "r");
  char dev[256] = {0};
  bool attached = false;
  if (p) {
    attached = std::fgets(dev, sizeof dev, p) != nullptr;
    attached = ::pclose(p) == 0 && attached;
  }
  if (!attached) GTEST_SKIP() << "cannot attach a loop device";
  std::string device(dev);
  device.erase(device.find_last_not_of("\n") + 1);
  try {
    auto f = File::open(device, test::readOptions(DirectMode::Auto));
    EXPECT_EQ(f->size(), 3u << 20);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
  }
  std::system(("losetup -d " + device).c_str());
}

TEST(File, RefusedOpenDoesNotTruncate) {
  // A refused special file must not be touched; for a regular file truncate still works.
  test::TempDir dir;
  const std::string p = dir.file("r");
  { auto f = File::open(p, test::writeOptions(DirectMode::Off)); ::pwrite(f->fd(), "abc", 3, 0); }
  auto f = File::open(p, test::writeOptions(DirectMode::Auto, /*truncate=*/true));
  EXPECT_EQ(f->size(), 0u);
}

}  // namespace
}  // namespace zeroplus::aio
