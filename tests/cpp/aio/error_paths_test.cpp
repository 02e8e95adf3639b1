// Failures become IoError with op/path/offset/length/errno, and leave the file system as
// expected. Rlimit, setuid and seccomp cases run in a forked child.
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>

#include <cstddef>

#include "aio/core/io_job.hpp"
#include "tests/cpp/aio/test_helpers.hpp"

namespace zeroplus::aio {
namespace {

using test::TempDir;

class ErrorPaths : public testing::TestWithParam<EngineKind> {
 protected:
  EngineOptions options() {
    EngineOptions o;
    o.kind = GetParam();
    o.block_size = 64 << 10;
    o.queue_depth = 4;
    return o;
  }
  TempDir dir_;
};

TEST_P(ErrorPaths, MissingFile) {
  const std::string path = dir_.file("missing");
  try {
    File::open(path, test::readOptions(DirectMode::Auto));
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_EQ(e.error(), ENOENT);
    EXPECT_EQ(e.path(), path);
    EXPECT_NE(std::string(e.what()).find("No such file"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST_P(ErrorPaths, ReadPastEnd) {
  ZP_CREATE_ENGINE_OR_SKIP(engine, options());
  for (DirectMode d : {DirectMode::Auto, DirectMode::Off}) {
    const std::string path = dir_.file("short");
    AlignedBuffer buf(1 << 20);
    auto w = File::open(path, test::writeOptions(d));
    engine->run({OpKind::Write, w, buf.data(), 0, 10000});  // unaligned file size
    auto r = File::open(path, test::readOptions(d));
    // Starts inside the file, runs past its end.
    try {
      engine->run({OpKind::Read, r, buf.data(), 0, 300000});
      FAIL() << "expected IoError";
    } catch (const IoError& e) {
      EXPECT_EQ(e.error(), ENODATA) << e.what();
      EXPECT_EQ(e.op(), "read");
      EXPECT_EQ(e.path(), path);
    }
    // Starts beyond the end.
    EXPECT_THROW(engine->run({OpKind::Read, r, buf.data(), 1 << 20, 4096}), IoError);
    EXPECT_EQ(r->size(), 10000u);
  }
}

TEST_P(ErrorPaths, WriteBeyondFileSizeLimitIsEFBIG) {
  const std::string path = dir_.file("big");
  const EngineOptions opts = options();
  const int rc = test::runInChild([&] {
    ::signal(SIGXFSZ, SIG_IGN);  // otherwise the kernel kills the process instead of EFBIG
    rlimit lim{1 << 20, 1 << 20};
    if (::setrlimit(RLIMIT_FSIZE, &lim) != 0) return 2;
    std::unique_ptr<Engine> engine;
    try {
      engine = Engine::create(opts);
    } catch (const IoError&) {
      return 77;  // no io_uring: skip
    }
    AlignedBuffer buf(2 << 20);
    auto f = File::open(path, test::writeOptions(DirectMode::Auto));
    try {
      engine->run({OpKind::Write, f, buf.data(), 0, 2 << 20});
    } catch (const IoError& e) {
      std::fprintf(stderr, "child got: %s\n", e.what());
      return e.error() == EFBIG && e.op() == "write" ? 0 : 3;
    }
    return 4;
  });
  if (rc == 77) GTEST_SKIP() << "io_uring unavailable";
  ASSERT_EQ(rc, 0);
  // Everything below the limit was written, nothing beyond it.
  EXPECT_EQ(std::filesystem::file_size(path), 1u << 20);
}

TEST_P(ErrorPaths, PermissionDenied) {
  const std::string path = dir_.file("secret");
  {
    auto f = File::open(path, test::writeOptions(DirectMode::Off));
  }
  ::chmod(path.c_str(), 0000);
  ::chmod(dir_.path().c_str(), 0755);
  const int rc = test::runInChild([&] {
    // root bypasses permission bits: drop to nobody in the child.
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) return 77;
    if (::geteuid() == 0) return 77;
    try {
      File::open(path, test::readOptions(DirectMode::Auto));
    } catch (const IoError& e) {
      return e.error() == EACCES && e.path() == path ? 0 : 3;
    }
    return 4;
  });
  if (rc == 77) GTEST_SKIP() << "cannot drop privileges";
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(std::filesystem::file_size(path), 0u);  // untouched
}

TEST_P(ErrorPaths, DirectAlignmentValidatedUpFront) {
  ZP_CREATE_ENGINE_OR_SKIP(engine, options());
  auto f = File::open(dir_.file("a"), test::writeOptions(DirectMode::Auto));
  if (!f->direct()) GTEST_SKIP() << "no O_DIRECT here";
  AlignedBuffer buf(1 << 16);
  try {
    engine->submit({OpKind::Write, f, buf.data(), 100, 4096});
    FAIL();
  } catch (const IoError& e) {
    EXPECT_EQ(e.error(), EINVAL);
    EXPECT_EQ(e.offset(), 100u);
    EXPECT_EQ(e.length(), 4096u);
  }
  EXPECT_THROW(engine->submit({OpKind::Write, f, static_cast<char*>(buf.data()) + 1, 0, 4096}), IoError);
  EXPECT_EQ(f->size(), 0u);  // nothing was issued
}

TEST_P(ErrorPaths, WriteToReadOnlyFile) {
  ZP_CREATE_ENGINE_OR_SKIP(engine, options());
  { File::open(dir_.file("ro"), test::writeOptions(DirectMode::Off)); }
  auto f = File::open(dir_.file("ro"), test::readOptions(DirectMode::Off));
  AlignedBuffer buf(4096);
  try {
    engine->run({OpKind::Write, f, buf.data(), 0, 4096});
    FAIL();
  } catch (const IoError& e) {
    EXPECT_EQ(e.error(), EBADF);
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, ErrorPaths,
                         testing::Values(EngineKind::IoUring, EngineKind::ThreadPool),
                         [](const auto& info) { return std::string(toString(info.param)) == "io_uring" ? "IoUring" : "ThreadPool"; });

// seccomp filter that makes io_uring_setup fail with EPERM, like Docker's default profile.
int denyIoUringSetup() {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return -1;
  return ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog);
}

// A range ending past the largest off_t would reach the kernel as a negative offset (or wrap
// in offset + length): refused at submit, before anything is queued.
TEST_P(ErrorPaths, RangePastLargestFileOffsetIsRefusedAtSubmit) {
  ZP_CREATE_ENGINE_OR_SKIP(engine, options());
  auto f = File::open(dir_.file("o"), test::writeOptions(DirectMode::Off));
  AlignedBuffer buf(8192);
  const uint64_t max = static_cast<uint64_t>(INT64_MAX);
  for (auto [offset, length] : {std::pair<uint64_t, uint64_t>{max - 100, 4096}, {max + 1, 1},
                                {~0ull - 10, 8192}}) {
    for (OpKind op : {OpKind::Read, OpKind::Write}) {
      try {
        engine->submit({op, f, buf.data(), offset, length}).wait();
        ADD_FAILURE() << "accepted offset " << offset << " length " << length;
      } catch (const IoError& e) {
        EXPECT_EQ(e.error(), EOVERFLOW) << e.what();
        EXPECT_EQ(e.offset(), offset);
        EXPECT_EQ(e.length(), length);
      }
    }
  }
  EXPECT_EQ(f->size(), 0u);
}

// io_uring request lengths are 32-bit: a block_size of 4 GiB or more used to be truncated
// (exactly 4 GiB became a 0-byte request, "write made no progress"). Requests are capped.
TEST(Job, RequestsAreAtMostOneGiBWhateverTheBlockSize) {
  test::TempDir dir;
  auto f = File::open(dir.file("j"), test::writeOptions(DirectMode::Off));
  for (uint64_t block : {1ull << 30, 4ull << 30, (4ull << 30) + 4096, ~0ull}) {
    // Never run: constructing a Job only plans its requests (the buffer is not touched).
    detail::Job job({OpKind::Write, f, reinterpret_cast<void*>(4096), 0, 8ull << 30}, block);
    EXPECT_EQ(job.requestCount(), 8u) << "block_size " << block;
  }
}

TEST(Fallback, IoUringBlockedBySeccompFallsBackToThreadPool) {
  TempDir dir;
  const std::string path = dir.file("seccomp");
  const int rc = test::runInChild([&] {
    if (denyIoUringSetup() != 0) return 77;
    try {
      EngineOptions o;
      o.kind = EngineKind::IoUring;
      Engine::create(o);
      return 3;  // explicit io_uring must not silently fall back
    } catch (const IoError& e) {
      if (e.error() != EPERM) return 4;
    }
    auto engine = Engine::create(EngineOptions{});  // Auto
    if (engine->kind() != EngineKind::ThreadPool) return 5;
    const size_t n = (1 << 20) + 17;
    AlignedBuffer src(n), dst(n);
    test::fillRandom(src.data(), n, 9);
    auto f = File::open(path, test::writeOptions(DirectMode::Auto));
    engine->run({OpKind::Write, f, src.data(), 0, n});
    engine->run({OpKind::Read, f, dst.data(), 0, n});
    return std::memcmp(src.data(), dst.data(), n) == 0 ? 0 : 6;
  });
  if (rc == 77) GTEST_SKIP() << "seccomp unavailable";
  EXPECT_EQ(rc, 0);
}

}  // namespace
}  // namespace zeroplus::aio
