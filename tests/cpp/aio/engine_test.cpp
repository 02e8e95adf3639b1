// Round trips through both engines, with and without O_DIRECT, over sizes that exercise empty
// transfers, sub-block tails, block boundaries and multi-request splits.
#include <thread>

#include "tests/cpp/aio/test_helpers.hpp"

namespace zeroplus::aio {
namespace {

using test::TempDir;

struct Config {
  EngineKind kind;
  DirectMode direct;
};

std::string name(const testing::TestParamInfo<Config>& info) {
  return std::string(info.param.kind == EngineKind::IoUring ? "IoUring" : "ThreadPool") +
         (info.param.direct == DirectMode::On ? "Direct" : "Buffered");
}

class EngineRoundTrip : public testing::TestWithParam<Config> {
 protected:
  void SetUp() override {
    if (GetParam().direct == DirectMode::On) {
      // Probe the temp file system: direct tests skip where O_DIRECT is refused.
      auto f = File::open(dir_.file("probe"), test::writeOptions(DirectMode::Auto));
      if (!f->direct()) GTEST_SKIP() << "O_DIRECT not supported under " << dir_.path();
    }
  }
  EngineOptions options(unsigned qd = 8, unsigned threads = 2, uint64_t block = 64 << 10) {
    EngineOptions o;
    o.kind = GetParam().kind;
    o.queue_depth = qd;
    o.threads = threads;
    o.block_size = block;
    return o;
  }
  // Writes `n` random bytes at `offset`, reads them back, compares; checks the file size.
  void roundTrip(Engine& engine, const std::string& path, size_t n, uint64_t offset,
                 uint64_t seed) {
    AlignedBuffer src(n), dst(n);
    test::fillRandom(src.data(), n, seed);
    auto w = File::open(path, test::writeOptions(GetParam().direct));
    engine.run({OpKind::Write, w, src.data(), offset, n});
    EXPECT_EQ(w->size(), n ? offset + n : 0) << "size " << n << " offset " << offset;
    auto r = File::open(path, test::readOptions(GetParam().direct));
    engine.run({OpKind::Read, r, dst.data(), offset, n});
    ASSERT_EQ(0, std::memcmp(src.data(), dst.data(), n)) << "size " << n << " offset " << offset;
  }
  TempDir dir_;
};

TEST_P(EngineRoundTrip, ManySizesAndOffsets) {
  ZP_CREATE_ENGINE_OR_SKIP(engine, options());
  EXPECT_EQ(engine->kind(), GetParam().kind);
  const size_t sizes[] = {0, 1, 511, 4095, 4096, 4097, (64 << 10) + 1, (1 << 20) + 123,
                          (3 << 20) + 4096};
  const uint64_t offsets[] = {0, 4096, 1 << 20};
  uint64_t seed = 1;
  for (size_t n : sizes) {
    for (uint64_t off : offsets) {
      roundTrip(*engine, dir_.file("f" + std::to_string(seed)), n, off, seed);
      ++seed;
    }
  }
}

TEST_P(EngineRoundTrip, UnalignedOffsetsWhenBuffered) {
  if (GetParam().direct == DirectMode::On) GTEST_SKIP() << "O_DIRECT requires aligned offsets";
  ZP_CREATE_ENGINE_OR_SKIP(engine, options());
  uint64_t seed = 100;
  for (uint64_t off : {1ull, 7ull, 4097ull}) {
    for (size_t n : {1ul, 333ul, 200001ul}) roundTrip(*engine, dir_.file("u"), n, off, seed++);
  }
}

TEST_P(EngineRoundTrip, QueueDepthOneAndBlockLargerThanTransfer) {
  for (auto [qd, block] : {std::pair{1u, 4096ull}, std::pair{64u, 8ull << 20}}) {
    ZP_CREATE_ENGINE_OR_SKIP(engine, options(qd, 1, block));
    roundTrip(*engine, dir_.file("qd"), (2 << 20) + 4096 + 17, 0, qd);
  }
}

TEST_P(EngineRoundTrip, SeveralFilesInFlightAtOnce) {
  ZP_CREATE_ENGINE_OR_SKIP(engine, options(16, 2));
  constexpr int kFiles = 6;
  const size_t n = (1 << 20) + 8192 + 5;
  std::vector<AlignedBuffer> src, dst;
  std::vector<Ticket> tickets;
  for (int i = 0; i < kFiles; ++i) {
    src.emplace_back(n);
    dst.emplace_back(n);
    test::fillRandom(src.back().data(), n, 1000 + i);
    auto f = File::open(dir_.file("m" + std::to_string(i)), test::writeOptions(GetParam().direct));
    tickets.push_back(engine->submit({OpKind::Write, f, src.back().data(), 0, n}));
  }
  for (auto& t : tickets) t.wait();
  tickets.clear();
  for (int i = 0; i < kFiles; ++i) {
    auto f = File::open(dir_.file("m" + std::to_string(i)), test::readOptions(GetParam().direct));
    tickets.push_back(engine->submit({OpKind::Read, f, dst[i].data(), 0, n}));
  }
  for (int i = 0; i < kFiles; ++i) {
    tickets[i].wait();
    EXPECT_TRUE(tickets[i].ready());
    EXPECT_EQ(0, std::memcmp(src[i].data(), dst[i].data(), n)) << "file " << i;
  }
}

TEST_P(EngineRoundTrip, ConcurrentEnginesFromThreads) {
  std::vector<std::thread> threads;
  std::atomic<int> failures{0}, skipped{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::unique_ptr<Engine> engine;
      try {
        engine = Engine::create(options(4, 1));
      } catch (const IoError&) {
        ++skipped;
        return;
      }
      const size_t n = (512 << 10) + t * 4096 + 3;
      AlignedBuffer src(n), dst(n);
      test::fillRandom(src.data(), n, 77 + t);
      const std::string path = dir_.file("c" + std::to_string(t));
      for (int rep = 0; rep < 5; ++rep) {
        engine->run({OpKind::Write, File::open(path, test::writeOptions(GetParam().direct)), src.data(), 0, n});
        engine->run({OpKind::Read, File::open(path, test::readOptions(GetParam().direct)), dst.data(), 0, n});
        if (std::memcmp(src.data(), dst.data(), n) != 0) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  if (skipped) GTEST_SKIP() << "io_uring unavailable";
  EXPECT_EQ(failures.load(), 0);
}

TEST_P(EngineRoundTrip, RegisteredBuffers) {
  ZP_CREATE_ENGINE_OR_SKIP(engine, options(8, 2));
  const size_t n = (4 << 20) + 4096;
  AlignedBuffer src(n), dst(n);
  test::fillRandom(src.data(), n, 5);
  const bool reg = engine->registerBuffer(src.data(), n) && engine->registerBuffer(dst.data(), n);
  if (GetParam().kind == EngineKind::ThreadPool) {
    EXPECT_FALSE(reg);
  }
  auto w = File::open(dir_.file("r"), test::writeOptions(GetParam().direct));
  engine->run({OpKind::Write, w, src.data(), 0, n});
  engine->run({OpKind::Read, w, dst.data(), 0, n});
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), n));
  engine->unregisterBuffer(src.data());
  engine->unregisterBuffer(dst.data());
  // After unregistering, the same memory still works through plain requests.
  std::memset(dst.data(), 0, n);
  engine->run({OpKind::Read, w, dst.data(), 0, n});
  EXPECT_EQ(0, std::memcmp(src.data(), dst.data(), n));
}

INSTANTIATE_TEST_SUITE_P(Engines, EngineRoundTrip,
                         testing::Values(Config{EngineKind::IoUring, DirectMode::On},
                                         Config{EngineKind::IoUring, DirectMode::Off},
                                         Config{EngineKind::ThreadPool, DirectMode::On},
                                         Config{EngineKind::ThreadPool, DirectMode::Off}),
                         name);

TEST(Engine, RejectsZeroKnobs) {
  EngineOptions o;
  o.queue_depth = 0;
  EXPECT_THROW(Engine::create(o), std::invalid_argument);
}

TEST(Engine, AutoPrefersIoUring) {
  auto e = Engine::create(EngineOptions{});
  EXPECT_NE(e->kind(), EngineKind::Auto);
}

}  // namespace
}  // namespace zeroplus::aio
