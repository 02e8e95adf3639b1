// ckpt::ShardFileWriter (optimizers/core/checkpoint/shard_file_writer.hpp): the layout (coalesced
// groups on pages, large pieces at their address's place in a page for aio, zero gaps, empty
// pieces), block CRCs against a recomputation from the file, each I/O mode, the segmented
// write-back, drain(), and error paths that leave no file behind.
#include "optimizers/core/checkpoint/shard_file_writer.hpp"

#include <gtest/gtest.h>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "aio/core/aligned_buffer.hpp"
#include "common/core/crc32.hpp"

namespace zeroplus::ckpt {
namespace {

struct TempDir {
  TempDir() {
    char tmpl[] = "/tmp/zeroplus_shard_writer_XXXXXX";
    path = ::mkdtemp(tmpl);
    fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  }
  ~TempDir() {
    ::close(fd);
    std::system(("rm -rf '" + path + "'").c_str());
  }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    DIR* d = ::opendir(path.c_str());
    while (const dirent* e = ::readdir(d)) {
      if (e->d_name[0] != '.' || (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0)) {
        out.emplace_back(e->d_name);
      }
    }
    ::closedir(d);
    return out;
  }
  std::string read(const std::string& name) const {
    std::ifstream f(path + "/" + name, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  std::string path;
  int fd = -1;
};

// Page-aligned memory with a fill pattern that differs from byte to byte and from call to call.
struct Memory {
  explicit Memory(size_t n, uint8_t seed) : buf(n, static_cast<size_t>(ShardFileWriter::kAlign), false) {
    auto* p = static_cast<uint8_t*>(buf.data());
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(i * 131 + seed + (i >> 12));
  }
  uint8_t* at(size_t k) { return static_cast<uint8_t*>(buf.data()) + k; }
  aio::AlignedBuffer buf;
};

struct Mode {
  const char* name;
  ShardIo io;
  aio::DirectMode direct;
};
const Mode kModes[] = {{"aio_page_cache", ShardIo::Aio, aio::DirectMode::Off},
                       {"aio_direct", ShardIo::Aio, aio::DirectMode::Auto},
                       {"posix", ShardIo::Posix, aio::DirectMode::Off}};

class ShardFileWriterModes : public ::testing::TestWithParam<Mode> {};

std::vector<std::pair<int64_t, int64_t>> gStarted;  // write-back ranges the hook saw
void recordWriteback(int fd, int64_t offset, int64_t bytes) {
  gStarted.emplace_back(offset, bytes);
  startWriteback(fd, offset, bytes);
}

TEST_P(ShardFileWriterModes, LayoutChecksumsAndWriteback) {
  const Mode mode = GetParam();
  const bool aio = mode.io == ShardIo::Aio;
  const bool pageCache = !aio || mode.direct == aio::DirectMode::Off;
  const int64_t big = (int64_t{1} << 20) + 12, segment = (256 << 10) + 12, block = 1 << 16;
  Memory mem(12 << 20, 7);
  // (address, bytes): large pieces at every kind of address, small ones between them, an empty
  // one, and a run of small ones that crosses kFlushBytes (a group sent mid-run).
  std::vector<std::pair<const uint8_t*, int64_t>> pieces;
  size_t at = 0;
  for (const size_t skew : {size_t{0}, size_t{4}, size_t{64}, size_t{4092}, size_t{4000}}) {
    pieces.emplace_back(mem.at(at + skew), big);
    pieces.emplace_back(mem.at(at + skew + big), 5 + skew % 7);
    at += 2 << 20;
  }
  pieces.emplace_back(mem.at(3), 0);
  for (int k = 0; k < 12; ++k) pieces.emplace_back(mem.at(100 + k), (1 << 20) - 1 - k);
  pieces.emplace_back(mem.at(5), 0);

  TempDir dir;
  gStarted.clear();
  ShardFileWriter w;
  std::string err;
  const auto opts = ShardFileOptions()
                        .setIo(mode.io)
                        .setDirect(mode.direct)
                        .setBlockBytes(block)
                        .setSegmentBytes(segment)
                        .setWriteback(&recordWriteback);
  ASSERT_EQ(w.open(dir.fd, dir.path, 3, opts, &err), 0) << err;
  std::vector<int64_t> offsets;
  for (const auto& [p, n] : pieces) {
    int64_t off = -1;
    ASSERT_EQ(w.place(p, n, &off, &err), 0) << err;
    offsets.push_back(off);
  }
  FileRecord rec;
  ASSERT_EQ(w.finish(&rec, &err), 0) << err;
  EXPECT_EQ(rec.name, shardFileName(3));
  EXPECT_EQ(dir.entries(), std::vector<std::string>{rec.name});  // no temporary left
  const std::string data = dir.read(rec.name);
  ASSERT_EQ(static_cast<int64_t>(data.size()), rec.bytes);

  std::vector<char> covered(data.size(), 0);
  int64_t end = 0, groupBytes = 0;
  bool inGroup = false;
  for (size_t k = 0; k < pieces.size(); ++k) {
    const auto [p, n] = pieces[k];
    const int64_t off = offsets[k];
    if (n == 0) {
      EXPECT_EQ(off, end) << "an empty piece takes no space and no alignment";
      continue;
    }
    EXPECT_EQ(std::memcmp(data.data() + off, p, static_cast<size_t>(n)), 0) << "piece " << k;
    if (n >= ShardFileWriter::kCoalesceBytes) {
      const int64_t skew = aio ? static_cast<int64_t>(reinterpret_cast<uintptr_t>(p) % 4096) : 0;
      EXPECT_EQ(off % 4096, skew) << "piece " << k;
      EXPECT_LT(off - end, 4096 + skew);
      inGroup = false;
    } else {
      if (!inGroup) {
        EXPECT_EQ(off % 4096, 0) << "a coalesced group starts on a page, piece " << k;
      } else {
        EXPECT_EQ(off, end) << "coalesced pieces are back to back, piece " << k;
      }
      groupBytes = inGroup ? groupBytes + n : n;
      inGroup = groupBytes < ShardFileWriter::kFlushBytes;  // else sent: the next one starts a group
    }
    std::fill(covered.begin() + off, covered.begin() + off + n, 1);
    end = off + n;
  }
  for (size_t i = 0; i < data.size(); ++i) {
    if (!covered[i]) {
      ASSERT_EQ(data[i], 0) << "gap byte " << i;
    }
  }
  std::vector<uint32_t> crcs;
  for (size_t i = 0; i < data.size(); i += block) {
    crcs.push_back(checksum::crc32Portable(0, data.data() + i, std::min<size_t>(block, data.size() - i)));
  }
  EXPECT_EQ(rec.blockCrc32, crcs);

  if (!pageCache) {
    EXPECT_TRUE(gStarted.empty()) << "O_DIRECT: nothing in the page cache to write back";
    return;
  }
  // Every segment of every large piece exactly once, from its padding to its end, back to back.
  size_t used = 0;
  for (size_t k = 0; k < pieces.size(); ++k) {
    if (pieces[k].second < ShardFileWriter::kCoalesceBytes) continue;
    const int64_t start = offsets[k] - offsets[k] % 4096, stop = offsets[k] + pieces[k].second;
    int64_t next = start;
    while (used < gStarted.size() && gStarted[used].first < stop) {
      EXPECT_EQ(gStarted[used].first, next);
      next = gStarted[used].first + gStarted[used].second;
      ++used;
    }
    EXPECT_EQ(next, stop) << "piece " << k;
  }
  EXPECT_EQ(used, gStarted.size());
}

INSTANTIATE_TEST_SUITE_P(Io, ShardFileWriterModes, ::testing::ValuesIn(kModes),
                         [](const auto& info) { return std::string(info.param.name); });

// After drain() the bytes are in the file: the memory may change (an offloaded bucket's buffer is
// reused for the next one) without changing what was written.
TEST_P(ShardFileWriterModes, DrainLetsTheCallerReuseItsMemory) {
  const Mode mode = GetParam();
  TempDir dir;
  ShardFileWriter w;
  std::string err;
  ASSERT_EQ(w.open(dir.fd, dir.path, 0, ShardFileOptions().setIo(mode.io).setDirect(mode.direct), &err), 0) << err;
  Memory mem(3 << 20, 1);
  const std::string first(reinterpret_cast<const char*>(mem.at(0)), 3 << 20);
  int64_t a = 0, b = 0, c = 0;
  ASSERT_EQ(w.place(mem.at(0), 2 << 20, &a, &err), 0) << err;
  ASSERT_EQ(w.place(mem.at(2 << 20), 1 << 20, &b, &err), 0) << err;  // large: 1 MiB exactly
  ASSERT_EQ(w.drain(&err), 0) << err;
  const auto names = dir.entries();
  ASSERT_EQ(names.size(), 1u);
  const std::string seen = dir.read(names[0]);
  ASSERT_GE(seen.size(), static_cast<size_t>(b + (1 << 20)));
  EXPECT_EQ(seen.substr(a, 2 << 20), first.substr(0, 2 << 20));
  std::memset(mem.at(0), 0xAB, 3 << 20);  // reused
  ASSERT_EQ(w.place(mem.at(0), 100, &c, &err), 0) << err;
  FileRecord rec;
  ASSERT_EQ(w.finish(&rec, &err), 0) << err;
  const std::string data = dir.read(rec.name);
  EXPECT_EQ(data.substr(a, 2 << 20), first.substr(0, 2 << 20));
  EXPECT_EQ(data.substr(b, 1 << 20), first.substr(2 << 20, 1 << 20));
  EXPECT_EQ(data.substr(c, 100), std::string(100, '\xAB'));
}

// Many coalesced groups (each ended by a large piece): their buffers are recycled once written,
// and every byte lands where place() said.
TEST_P(ShardFileWriterModes, ManyGroupsRecycleTheirBuffers) {
  const Mode mode = GetParam();
  TempDir dir;
  ShardFileWriter w;
  std::string err;
  ASSERT_EQ(w.open(dir.fd, dir.path, 0, ShardFileOptions().setIo(mode.io).setDirect(mode.direct), &err), 0) << err;
  Memory mem(2 << 20, 9);
  struct Placed {
    size_t src;
    int64_t at, bytes;
  };
  std::vector<Placed> placed;
  for (int k = 0; k < 20; ++k) {
    int64_t small = 0, large = 0;
    ASSERT_EQ(w.place(mem.at(k), 100, &small, &err), 0) << err;
    ASSERT_EQ(w.place(mem.at(4096 + k), 1 << 20, &large, &err), 0) << err;
    placed.push_back({static_cast<size_t>(k), small, 100});
    placed.push_back({static_cast<size_t>(4096 + k), large, 1 << 20});
  }
  FileRecord rec;
  ASSERT_EQ(w.finish(&rec, &err), 0) << err;
  const std::string data = dir.read(rec.name);
  ASSERT_EQ(static_cast<int64_t>(data.size()), rec.bytes);
  for (const Placed& p : placed) {
    EXPECT_EQ(std::memcmp(data.data() + p.at, mem.at(p.src), static_cast<size_t>(p.bytes)), 0) << p.at;
  }
}

// A write that fails (the file size limit: EFBIG, SIGXFSZ ignored) fails the writer with the
// errno and the file's name, every later call returns it again, and no file is left.
TEST_P(ShardFileWriterModes, FailedWriteLeavesNoFile) {
  const Mode mode = GetParam();
  TempDir dir;
  ShardFileWriter w;
  std::string err;
  ASSERT_EQ(w.open(dir.fd, dir.path, 1, ShardFileOptions().setIo(mode.io).setDirect(mode.direct), &err), 0) << err;
  Memory mem(4 << 20, 2);
  struct rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto oldHandler = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 1 << 20;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  int64_t off = 0;
  int rc = w.place(mem.at(0), 4 << 20, &off, &err);
  FileRecord rec;
  if (rc == 0) rc = w.finish(&rec, &err);
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, oldHandler);
  EXPECT_EQ(rc, -EFBIG) << err;
  EXPECT_NE(err.find(dir.path + "/." + shardFileName(1) + ".tmp-"), std::string::npos) << err;
  std::string again;
  EXPECT_EQ(w.drain(&again), rc);
  EXPECT_EQ(again, err);
  EXPECT_TRUE(dir.entries().empty());
}

// The final name is never replaced: a file planted under it stays, ours is removed.
TEST(ShardFileWriter, FinishRefusesAnExistingName) {
  TempDir dir;
  { std::ofstream(dir.path + "/" + shardFileName(2)) << "theirs"; }
  ShardFileWriter w;
  std::string err;
  ASSERT_EQ(w.open(dir.fd, dir.path, 2, ShardFileOptions(), &err), 0) << err;
  const char bytes[] = "ours";
  int64_t off = 0;
  ASSERT_EQ(w.place(bytes, 4, &off, &err), 0) << err;
  FileRecord rec;
  EXPECT_EQ(w.finish(&rec, &err), -EEXIST);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{shardFileName(2)});
  EXPECT_EQ(dir.read(shardFileName(2)), "theirs");
}

TEST(ShardFileWriter, UnfinishedWriterRemovesItsFile) {
  TempDir dir;
  {
    ShardFileWriter w;
    std::string err;
    ASSERT_EQ(w.open(dir.fd, dir.path, 0, ShardFileOptions(), &err), 0) << err;
    Memory mem(2 << 20, 3);
    int64_t off = 0;
    ASSERT_EQ(w.place(mem.at(1), (2 << 20) - 1, &off, &err), 0) << err;
    EXPECT_EQ(dir.entries().size(), 1u);
  }  // queued writes waited for, temporary removed
  EXPECT_TRUE(dir.entries().empty());
}

TEST(ShardFileWriter, AbandonedWriterRemovesItsFileAndRefusesLaterCalls) {
  // abandon() (the Python driver's, when a bucket's context or a piece raised) waits for the
  // queued writes and removes the temporary file; a later call reports the abandon, not a
  // misleading "before open()".
  TempDir dir;
  ShardFileWriter w;
  std::string err;
  ASSERT_EQ(w.open(dir.fd, dir.path, 0, ShardFileOptions().setDirect(aio::DirectMode::Auto), &err), 0) << err;
  Memory mem(3 << 20, 5);
  int64_t off = 0;
  ASSERT_EQ(w.place(mem.at(7), (2 << 20) + 5, &off, &err), 0) << err;
  ASSERT_EQ(w.place(mem.at(11), 100, &off, &err), 0) << err;
  w.abandon();
  EXPECT_TRUE(dir.entries().empty());
  EXPECT_EQ(w.place(mem.at(0), 10, &off, &err), -ECANCELED);
  EXPECT_NE(err.find("abandoned"), std::string::npos) << err;
  FileRecord rec;
  EXPECT_EQ(w.finish(&rec, &err), -ECANCELED);
  EXPECT_TRUE(dir.entries().empty());
}

TEST(ShardFileWriter, BadArgumentsCreateNothing) {
  TempDir dir;
  std::string err;
  {
    ShardFileWriter w;
    EXPECT_EQ(w.open(dir.fd, dir.path, 0, ShardFileOptions().setBlockBytes(0), &err), -EINVAL);
    EXPECT_NE(err.find("block_bytes"), std::string::npos) << err;
  }
  {
    ShardFileWriter w;
    EXPECT_EQ(w.open(dir.fd, dir.path, -1, ShardFileOptions(), &err), -EINVAL);
  }
  {
    ShardFileWriter w;
    ASSERT_EQ(w.open(dir.fd, dir.path, 0, ShardFileOptions(), &err), 0) << err;
    int64_t off = 0;
    EXPECT_EQ(w.place(nullptr, 8, &off, &err), -EINVAL);
  }
  EXPECT_TRUE(dir.entries().empty());
}

}  // namespace
}  // namespace zeroplus::ckpt
