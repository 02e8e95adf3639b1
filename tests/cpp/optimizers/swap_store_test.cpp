// SwapStore (optimizers/core/swap_store.hpp): records round-trip, corrupt and stale records are
// refused naming the file, a failing write keeps the record in memory and is retried (also after
// a reader released it unchanged), overwrite holds a zero-filled record without reading the file
// (a corrupt one included), a pool without a free buffer waits for the oldest write, planned
// reads start as writes free buffers (no call from the owner needed) and are checked before use,
// and a fetch waiting for a buffer gets the next one a write frees before any planned read.
// The Python engine's uses: a store in the caller's own directory (inPlace), records cached after
// their write (keepWritten) and evicted least recently written first, a payload kept readable
// after its store until released (linger), buffers that grow with reserve() (replaced, never
// added: the pool's bytes stay bufferCount x the largest record), a full disk reported when the
// file is created (preallocation), and a record file replaced by a rename (adopt) or dropped from
// the buffers (forget). The parameter swapper's: a record stored while its shard is still read
// (linger) is held again by a fetch after its write, without a read; a peak window restarts
// (resetPeak). The gradient spill's (no keepWritten): a record released after its write is read
// from its file again (a file damaged meanwhile is refused), and a failed write of an abandoned
// pass is dropped from memory (forget) while the other record of the bucket stays readable.
// Refusals: a store of a record larger than the buffer it is held in (no overflow), forget/adopt/
// overwrite of a record stored with linger, a link or a non-private directory in place; and a
// record file left by a failed adopt is used by the next store (prefetch sees reserve() too).
#include "optimizers/core/swap_store.hpp"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>

#include "aio/core/io_error.hpp"
#include "tests/cpp/temp_dir.hpp"

namespace zeroplus::swap {
namespace {

using zeroplus::test_util::TempDir;

constexpr uint64_t kPayload = 3 * 4096 + 100;  // not a multiple of a block: the buffered tail too

SwapStoreOptions optionsFor(const std::string& dir, size_t count = 4) {
  SwapStoreOptions o;
  o.parent = dir;
  o.bufferBytes = recordBytes(kPayload);
  o.bufferCount = count;
  return o;
}

RecordKey key(uint64_t id, uint64_t gen) { return {id, gen, kPayload, 0x1234}; }

void fill(void* p, uint64_t id, uint64_t gen) {
  auto* b = static_cast<unsigned char*>(p);
  for (uint64_t i = 0; i < kPayload; ++i) b[i] = static_cast<unsigned char>(i * 7 + id * 13 + gen);
}
bool matches(const void* p, uint64_t id, uint64_t gen) {
  auto* b = static_cast<const unsigned char*>(p);
  for (uint64_t i = 0; i < kPayload; ++i) {
    if (b[i] != static_cast<unsigned char>(i * 7 + id * 13 + gen)) return false;
  }
  return true;
}

// Writes generation 1 of record `id` and waits for it.
void writeOne(SwapStore& store, uint64_t id) {
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.fetch(key(id, 0), &p, &f), 0) << f.what;
  fill(p, id, 1);
  store.store(key(id, 1));
}

TEST(SwapStore, RoundTripThroughTheFile) {
  TempDir dir;
  std::string privateDir;
  {
    SwapStore store(optionsFor(dir.path()));
    privateDir = store.directory();
    EXPECT_EQ(std::filesystem::status(privateDir).permissions() & std::filesystem::perms::all,
              std::filesystem::perms::owner_all);
    void* p = nullptr;
    SwapFault f;
    ASSERT_EQ(store.fetch(key(3, 0), &p, &f), 0);
    for (uint64_t i = 0; i < kPayload; ++i) ASSERT_EQ(static_cast<unsigned char*>(p)[i], 0);  // fresh: zeros
    EXPECT_EQ(store.fetch(key(3, 0), &p, &f), -EBUSY);  // already held
    store.release(3);
    writeOne(store, 3);
    EXPECT_TRUE(store.drain().empty());
    EXPECT_TRUE(std::filesystem::exists(store.pathOf(3)));
    EXPECT_EQ(std::filesystem::file_size(store.pathOf(3)), recordBytes(kPayload));
    EXPECT_TRUE(store.prefetch(key(3, 1)));
    ASSERT_EQ(store.fetch(key(3, 1), &p, &f), 0) << f.what;
    EXPECT_TRUE(matches(p, 3, 1));
    EXPECT_EQ(store.stats().reads, 1u);
    fill(p, 3, 2);
    store.store(key(3, 2));
    // Fetched again while its write may be in flight: the buffer is the record, no read.
    ASSERT_EQ(store.fetch(key(3, 2), &p, &f), 0) << f.what;
    EXPECT_TRUE(matches(p, 3, 2));
    EXPECT_EQ(store.stats().reads, 1u);
    store.release(3);
  }
  EXPECT_FALSE(std::filesystem::exists(privateDir));  // files and directory removed
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(SwapStore, CorruptAndStaleRecordsAreRefusedNamingTheFile) {
  TempDir dir;
  SwapStore store(optionsFor(dir.path()));
  writeOne(store, 5);
  ASSERT_TRUE(store.drain().empty());
  void* p = nullptr;
  SwapFault f;
  EXPECT_EQ(store.fetch(key(5, 2), &p, &f), -EBADMSG);  // a write that never happened
  EXPECT_NE(f.what.find("stale"), std::string::npos) << f.what;
  EXPECT_EQ(f.path, store.pathOf(5));
  const int fd = ::open(store.pathOf(5).c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, kHeaderBytes + 777), 1);
  byte ^= 0x10;
  ASSERT_EQ(::pwrite(fd, &byte, 1, kHeaderBytes + 777), 1);
  ::close(fd);
  f = {};
  EXPECT_EQ(store.fetch(key(5, 1), &p, &f), -EBADMSG);
  EXPECT_EQ(f.id, 5u);
  EXPECT_EQ(f.path, store.pathOf(5));
  EXPECT_NE(f.what.find("checksum"), std::string::npos) << f.what;
  EXPECT_EQ(store.fetch(key(9, 1), &p, &f), -ENOENT);  // never written
}

TEST(SwapStore, FailingWriteIsKeptInMemoryAndRetried) {
  TempDir dir;
  SwapStoreOptions o = optionsFor(dir.path());
  o.io.kind = aio::EngineKind::ThreadPool;  // plain pwrite in this process: RLIMIT_FSIZE applies
  SwapStore store(o);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  auto* previous = signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 4096;  // the header fits, the payload does not: EFBIG
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  writeOne(store, 1);
  auto faults = store.drain();
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  signal(SIGXFSZ, previous);
  ASSERT_EQ(faults.size(), 1u);
  EXPECT_EQ(faults[0].id, 1u);
  EXPECT_EQ(faults[0].err, EFBIG);
  EXPECT_EQ(faults[0].path, store.pathOf(1));
  // The record is still in memory: fetched without a read, then written again.
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.fetch(key(1, 1), &p, &f), 0) << f.what;
  EXPECT_TRUE(matches(p, 1, 1));
  EXPECT_EQ(store.stats().reads, 0u);
  store.store(key(1, 2));
  EXPECT_TRUE(store.drain().empty());
  ASSERT_EQ(store.fetch(key(1, 2), &p, &f), 0) << f.what;  // from the file now
  EXPECT_TRUE(matches(p, 1, 1));
  EXPECT_EQ(store.stats().reads, 1u);
  store.release(1);
}

TEST(SwapStore, ReleasedDirtyRecordStaysInMemory) {
  TempDir dir;
  SwapStoreOptions o = optionsFor(dir.path());
  o.io.kind = aio::EngineKind::ThreadPool;  // plain pwrite in this process: RLIMIT_FSIZE applies
  SwapStore store(o);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  auto* previous = signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 4096;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  writeOne(store, 1);
  auto faults = store.drain();
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  signal(SIGXFSZ, previous);
  ASSERT_EQ(faults.size(), 1u);
  // A reader (a checkpoint save) fetches the dirty record and gives it back unchanged: the
  // buffer is still the only copy, so a later fetch finds it without a read.
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.fetch(key(1, 1), &p, &f), 0) << f.what;
  store.release(1);
  ASSERT_EQ(store.fetch(key(1, 1), &p, &f), 0) << f.what;
  EXPECT_TRUE(matches(p, 1, 1));
  EXPECT_EQ(store.stats().reads, 0u);
  store.store(key(1, 2));
  EXPECT_TRUE(store.drain().empty());
}

TEST(SwapStore, OverwriteHoldsAFreshRecordWithoutReading) {
  TempDir dir;
  SwapStore store(optionsFor(dir.path()));
  writeOne(store, 4);
  ASSERT_TRUE(store.drain().empty());
  // Corrupt the file: a fetch refuses it, an overwrite does not read it.
  const int fd = ::open(store.pathOf(4).c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, kHeaderBytes + 9), 1);
  byte ^= 0x01;
  ASSERT_EQ(::pwrite(fd, &byte, 1, kHeaderBytes + 9), 1);
  ::close(fd);
  EXPECT_TRUE(store.prefetch(key(4, 1)));  // a read in flight is waited for and discarded
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.overwrite(4, kPayload, &p, &f), 0) << f.what;
  for (uint64_t i = 0; i < kPayload; ++i) ASSERT_EQ(static_cast<unsigned char*>(p)[i], 0);
  EXPECT_EQ(store.overwrite(4, kPayload, &p, &f), -EBUSY);  // already held
  EXPECT_EQ(store.overwrite(4, kPayload * 2, &p, &f), -EINVAL);
  fill(p, 4, 2);
  store.store(key(4, 2));
  EXPECT_TRUE(store.drain().empty());
  ASSERT_EQ(store.fetch(key(4, 2), &p, &f), 0) << f.what;  // from the file
  EXPECT_TRUE(matches(p, 4, 2));
  store.release(4);
  // A record never written gets a buffer too.
  ASSERT_EQ(store.overwrite(7, kPayload, &p, &f), 0) << f.what;
  store.release(7);
}

TEST(SwapStore, PoolExhaustionWaitsForTheOldestWrite) {
  TempDir dir;
  SwapStore store(optionsFor(dir.path(), /*count=*/2));
  writeOne(store, 0);
  writeOne(store, 1);
  EXPECT_EQ(store.stats().buffers, 2u);
  // Both buffers are writing (or done, if the pump thread was quick): a fetch waits for the
  // oldest write (record 0) and takes its buffer; the pool does not grow.
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.fetch(key(2, 0), &p, &f), 0) << f.what;
  EXPECT_EQ(store.stats().buffers, 2u);
  fill(p, 2, 1);
  store.store(key(2, 1));
  EXPECT_TRUE(store.drain().empty());
  for (uint64_t id = 0; id < 3; ++id) {
    ASSERT_EQ(store.fetch(key(id, 1), &p, &f), 0) << f.what;
    EXPECT_TRUE(matches(p, id, 1));
    store.release(id);
  }
  EXPECT_EQ(store.stats().buffers, 2u);
}

TEST(SwapStore, PlannedReadStartsWhenAWriteFreesABufferWithoutTheOwner) {
  TempDir dir;
  SwapStore store(optionsFor(dir.path(), /*count=*/1));
  writeOne(store, 0);
  ASSERT_TRUE(store.drain().empty());
  // The pool's one buffer goes to record 1, whose write then keeps it: the plan cannot start yet.
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.fetch(key(1, 0), &p, &f), 0) << f.what;
  fill(p, 1, 1);
  store.store(key(1, 1));
  store.planReads({key(0, 1)});
  // No further call into the store: the end of the write starts the planned read.
  for (int i = 0; i < 10000 && store.stats().readsAhead == 0; ++i) ::usleep(1000);
  EXPECT_EQ(store.stats().readsAhead, 1u);
  ASSERT_EQ(store.fetch(key(0, 1), &p, &f), 0) << f.what;
  EXPECT_TRUE(matches(p, 0, 1));
  EXPECT_EQ(store.stats().readsOnDemand, 0u);
  EXPECT_EQ(store.stats().buffers, 1u);
  store.release(0);
  EXPECT_TRUE(store.drain().empty());
}

TEST(SwapStore, AFetchWaitingForABufferGetsTheOneAWriteFreesBeforeAPlannedRead) {
  // One buffer. The owner stores record 0 (its write holds the buffer), the plan wants record 2,
  // and the owner fetches record 1 meanwhile: the buffer the write frees goes to record 1. Before,
  // the store's thread started the planned read of record 2 first, and the fetch then evicted it
  // and read record 1 on demand (record 2 read twice: the stage-2 offload slowdown).
  TempDir dir;
  constexpr uint64_t kBig = 16ull << 20;  // a write of milliseconds: the fetch waits for it
  SwapStoreOptions o;
  o.parent = dir.path();
  o.bufferBytes = recordBytes(kBig);
  o.bufferCount = 1;
  SwapStore store(o);
  auto big = [](uint64_t id, uint64_t gen) { return RecordKey{id, gen, kBig, 0x99}; };
  void* p = nullptr;
  SwapFault f;
  for (uint64_t id = 0; id < 3; ++id) {
    ASSERT_EQ(store.fetch(big(id, 0), &p, &f), 0) << f.what;
    std::memset(p, static_cast<int>(id + 1), kBig);
    store.store(big(id, 1));
  }
  ASSERT_TRUE(store.drain().empty());
  ASSERT_EQ(store.fetch(big(0, 1), &p, &f), 0) << f.what;
  store.planReads({big(2, 1)});  // cannot start: the one buffer is held
  store.store(big(0, 2));
  const SwapStats before = store.stats();
  ASSERT_EQ(store.fetch(big(1, 1), &p, &f), 0) << f.what;
  EXPECT_EQ(static_cast<const unsigned char*>(p)[kBig - 1], 2);
  const SwapStats after = store.stats();
  EXPECT_EQ(after.evictions - before.evictions, 0u);
  EXPECT_EQ(after.readsAhead - before.readsAhead, 0u);
  EXPECT_EQ(after.readsOnDemand - before.readsOnDemand, 1u);
  store.release(1);
  ASSERT_EQ(store.fetch(big(2, 1), &p, &f), 0) << f.what;  // the plan's record, read in its turn
  EXPECT_EQ(static_cast<const unsigned char*>(p)[0], 3);
  store.release(2);
  EXPECT_TRUE(store.drain().empty());
}

TEST(SwapStore, CorruptRecordReadAheadIsRefusedAtFetchNamingTheFile) {
  TempDir dir;
  SwapStore store(optionsFor(dir.path()));
  writeOne(store, 2);
  writeOne(store, 3);
  ASSERT_TRUE(store.drain().empty());
  const int fd = ::open(store.pathOf(3).c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  unsigned char byte = 0;
  ASSERT_EQ(::pread(fd, &byte, 1, kHeaderBytes + 3), 1);
  byte ^= 0x80;
  ASSERT_EQ(::pwrite(fd, &byte, 1, kHeaderBytes + 3), 1);
  ::close(fd);
  // Read and checked on the store's thread; the verdict waits for the fetch.
  store.planReads({key(2, 1), key(3, 1)});
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.fetch(key(2, 1), &p, &f), 0) << f.what;
  EXPECT_TRUE(matches(p, 2, 1));
  store.release(2);
  EXPECT_EQ(store.fetch(key(3, 1), &p, &f), -EBADMSG);
  EXPECT_EQ(f.path, store.pathOf(3));
  EXPECT_NE(f.what.find("checksum"), std::string::npos) << f.what;
  EXPECT_EQ(store.stats().readsAhead, 2u);
  EXPECT_EQ(store.stats().readsOnDemand, 0u);
}

TEST(SwapStore, ReadAheadOfAnOlderGenerationIsReadAgain) {
  TempDir dir;
  SwapStore store(optionsFor(dir.path()));
  writeOne(store, 6);
  ASSERT_TRUE(store.drain().empty());
  store.planReads({key(6, 1)});
  // The owner rewrites the record before fetching the planned generation: the buffered read
  // of generation 1 is not taken for generation 2.
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.overwrite(6, kPayload, &p, &f), 0) << f.what;
  fill(p, 6, 2);
  store.store(key(6, 2));
  ASSERT_TRUE(store.drain().empty());
  ASSERT_EQ(store.fetch(key(6, 2), &p, &f), 0) << f.what;
  EXPECT_TRUE(matches(p, 6, 2));
  store.release(6);
}

TEST(SwapStore, InPlaceUsesTheCallersDirectoryAndLeavesIt) {
  TempDir dir;
  {
    SwapStoreOptions o = optionsFor(dir.path());
    o.inPlace = true;
    o.stem = "optimizer-b";
    SwapStore store(o);
    EXPECT_EQ(store.directory(), dir.path());
    EXPECT_EQ(store.pathOf(3), dir.path() + "/optimizer-b00003.swp");
    writeOne(store, 3);
    ASSERT_TRUE(store.drain().empty());
    EXPECT_EQ(std::filesystem::status(store.pathOf(3)).permissions() & std::filesystem::perms::all,
              std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  }
  EXPECT_TRUE(std::filesystem::exists(dir.path()));  // the caller's: only the files go
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(SwapStore, WrittenRecordsStayCachedAndTheLeastRecentlyWrittenGoesFirst) {
  TempDir dir;
  SwapStoreOptions o = optionsFor(dir.path(), /*count=*/2);
  o.keepWritten = true;
  SwapStore store(o);
  writeOne(store, 0);
  writeOne(store, 1);
  ASSERT_TRUE(store.drain().empty());
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.fetch(key(1, 1), &p, &f), 0) << f.what;  // cached: no read
  EXPECT_TRUE(matches(p, 1, 1));
  EXPECT_EQ(store.stats().cacheHits, 1u);
  EXPECT_EQ(store.stats().reads, 0u);
  store.release(1);
  // A third record takes the buffer of record 0 (written before record 1).
  writeOne(store, 2);
  ASSERT_TRUE(store.drain().empty());
  EXPECT_EQ(store.stats().buffers, 2u);
  ASSERT_EQ(store.fetch(key(2, 1), &p, &f), 0) << f.what;
  store.release(2);
  EXPECT_EQ(store.stats().cacheHits, 2u);
  ASSERT_EQ(store.fetch(key(0, 1), &p, &f), 0) << f.what;  // evicted: read from its file
  EXPECT_TRUE(matches(p, 0, 1));
  EXPECT_EQ(store.stats().reads, 1u);
  store.release(0);
  // A cached copy of another generation is not taken for the one asked (a stale file is refused).
  EXPECT_EQ(store.fetch(key(2, 2), &p, &f), -EBADMSG);
  EXPECT_NE(f.what.find("generation"), std::string::npos) << f.what;
}

TEST(SwapStore, CachedRecordsInThePlanAreNotEvictedByItsReads) {
  TempDir dir;
  SwapStoreOptions o = optionsFor(dir.path(), /*count=*/2);
  o.keepWritten = true;
  SwapStore store(o);
  for (uint64_t id = 0; id < 3; ++id) writeOne(store, id);  // cached now: records 1 and 2
  ASSERT_TRUE(store.drain().empty());
  store.planReads({key(2, 1), key(0, 1), key(1, 1)});  // record 2 first: cached, kept for its fetch
  for (int i = 0; i < 10000 && store.stats().readsAhead == 0; ++i) ::usleep(1000);
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.fetch(key(2, 1), &p, &f), 0) << f.what;
  EXPECT_TRUE(matches(p, 2, 1));
  EXPECT_EQ(store.stats().cacheHits, 1u);
  store.release(2);
  ASSERT_EQ(store.fetch(key(0, 1), &p, &f), 0) << f.what;
  EXPECT_TRUE(matches(p, 0, 1));
  store.release(0);
  EXPECT_EQ(store.stats().readsOnDemand, 0u);  // record 2 was kept, record 0 read ahead in record 1's buffer
  EXPECT_EQ(store.stats().evictions, 0u);
}

TEST(SwapStore, ALingeringPayloadIsNotReusedUntilReleased) {
  TempDir dir;
  SwapStore store(optionsFor(dir.path(), /*count=*/1));
  writeOne(store, 0);
  ASSERT_TRUE(store.drain().empty());
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.fetch(key(1, 0), &p, &f), 0) << f.what;
  fill(p, 1, 1);
  store.store(key(1, 1), /*linger=*/true);
  store.planReads({key(0, 1)});
  ASSERT_TRUE(store.drain().empty());
  ::usleep(20000);  // the pump had every chance to read record 0 into the one buffer
  EXPECT_EQ(store.stats().readsAhead, 0u);
  EXPECT_TRUE(matches(p, 1, 1));  // still the owner's to read
  store.release(1);               // the end of the linger: the plan goes on
  for (int i = 0; i < 10000 && store.stats().readsAhead == 0; ++i) ::usleep(1000);
  EXPECT_EQ(store.stats().readsAhead, 1u);
  ASSERT_EQ(store.fetch(key(0, 1), &p, &f), 0) << f.what;
  EXPECT_TRUE(matches(p, 0, 1));
  store.release(0);
  EXPECT_EQ(store.stats().buffers, 1u);
}

TEST(SwapStore, ReserveGrowsBuffersByReplacingThem) {
  TempDir dir;
  SwapStore store(optionsFor(dir.path(), /*count=*/2));
  writeOne(store, 0);
  writeOne(store, 1);
  ASSERT_TRUE(store.drain().empty());
  const uint64_t small = recordBytes(kPayload);
  EXPECT_EQ(store.stats().bufferBytes, 2 * small);
  constexpr uint64_t kLarger = 3 * kPayload;
  void* p = nullptr;
  SwapFault f;
  EXPECT_EQ(store.overwrite(0, kLarger, &p, &f), -EINVAL);  // not reserved
  store.reserve(recordBytes(kLarger));
  ASSERT_EQ(store.overwrite(0, kLarger, &p, &f), 0) << f.what;
  auto* bytes = static_cast<unsigned char*>(p);
  for (uint64_t i = 0; i < kLarger; ++i) bytes[i] = static_cast<unsigned char>(i * 3);
  store.store({0, 2, kLarger, 0x77});
  ASSERT_TRUE(store.drain().empty());
  EXPECT_GE(std::filesystem::file_size(store.pathOf(0)), recordBytes(kLarger));  // the reservation grew
  ASSERT_EQ(store.fetch({0, 2, kLarger, 0x77}, &p, &f), 0) << f.what;
  bytes = static_cast<unsigned char*>(p);
  bool same = true;
  for (uint64_t i = 0; i < kLarger; ++i) same = same && bytes[i] == static_cast<unsigned char>(i * 3);
  EXPECT_TRUE(same);
  store.release(0);
  ASSERT_EQ(store.fetch(key(1, 1), &p, &f), 0) << f.what;  // the small record in a grown buffer
  EXPECT_TRUE(matches(p, 1, 1));
  store.release(1);
  const SwapStats st = store.stats();
  EXPECT_EQ(st.buffers, 2u);
  EXPECT_LE(st.peakBufferBytes, 2 * recordBytes(kLarger));
  EXPECT_LE(st.bufferBytes, 2 * recordBytes(kLarger));
}

TEST(SwapStore, AFullDiskShowsWhenTheFileIsCreatedAndTheRecordIsKept) {
  TempDir dir;
  SwapStoreOptions o = optionsFor(dir.path());
  o.inPlace = true;
  SwapStore store(o);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  auto* previous = signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 4096;  // the preallocation of the whole record fails: EFBIG
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  writeOne(store, 2);
  auto faults = store.drain();
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  signal(SIGXFSZ, previous);
  ASSERT_EQ(faults.size(), 1u);
  EXPECT_EQ(faults[0].err, EFBIG);
  EXPECT_EQ(faults[0].what.rfind("create failed", 0), 0u) << faults[0].what;
  EXPECT_FALSE(std::filesystem::exists(store.pathOf(2)));  // no half-reserved file is left
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.fetch(key(2, 1), &p, &f), 0) << f.what;  // dirty: in memory
  EXPECT_TRUE(matches(p, 2, 1));
  store.store(key(2, 2));
  EXPECT_TRUE(store.drain().empty());
  EXPECT_TRUE(std::filesystem::exists(store.pathOf(2)));
}

TEST(SwapStore, AdoptOpensTheFileRenamedOverTheRecordAndForgetDropsTheCopy) {
  TempDir dir;
  SwapStoreOptions o = optionsFor(dir.path());
  o.inPlace = true;
  o.keepWritten = true;
  SwapStore store(o);
  writeOne(store, 4);
  ASSERT_TRUE(store.drain().empty());
  // The caller writes generation 5 of record 4 to a side file and renames it over the record.
  aio::AlignedBuffer side(recordBytes(kPayload));
  fill(static_cast<char*>(side.data()) + kHeaderBytes, 4, 5);
  sealRecord(side.data(), key(4, 5));
  const std::string sidePath = dir.path() + "/side.new";
  const int fd = ::open(sidePath.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, side.data(), recordBytes(kPayload), 0), static_cast<ssize_t>(recordBytes(kPayload)));
  ::close(fd);
  ASSERT_EQ(::rename(sidePath.c_str(), store.pathOf(4).c_str()), 0);
  SwapFault f;
  ASSERT_EQ(store.adopt(4, &f), 0) << f.what;
  void* p = nullptr;
  EXPECT_EQ(store.fetch(key(4, 1), &p, &f), -EBADMSG);  // the cached generation 1 is gone
  EXPECT_NE(f.what.find("generation"), std::string::npos) << f.what;
  ASSERT_EQ(store.fetch(key(4, 5), &p, &f), 0) << f.what;  // read through the new file
  EXPECT_TRUE(matches(p, 4, 5));
  EXPECT_EQ(store.adopt(4, &f), -EBUSY);  // held
  store.release(4);
  // forget: the next fetch reads the file again.
  const uint64_t reads = store.stats().reads;
  store.forget(4);
  ASSERT_EQ(store.fetch(key(4, 5), &p, &f), 0) << f.what;
  EXPECT_EQ(store.stats().reads, reads + 1);
  store.release(4);
  // A file that is not there: adopt says so naming it, the next store creates it.
  ASSERT_EQ(::unlink(store.pathOf(4).c_str()), 0);
  EXPECT_EQ(store.adopt(4, &f), -ENOENT);
  EXPECT_EQ(f.path, store.pathOf(4));
}

TEST(SwapStore, ALingeringRecordIsHeldAgainByAFetchWithoutARead) {
  TempDir dir;
  auto o = optionsFor(dir.path(), /*count=*/2);
  o.keepWritten = true;
  SwapStore store(o);
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.fetch(key(0, 0), &p, &f), 0) << f.what;
  fill(p, 0, 1);
  store.store(key(0, 1), /*linger=*/true);  // the pinned shard still reads it
  void* again = nullptr;
  ASSERT_EQ(store.fetch(key(0, 1), &again, &f), 0) << f.what;  // the step changes it in place: held again
  EXPECT_EQ(again, p);
  EXPECT_TRUE(matches(again, 0, 1));
  EXPECT_EQ(store.stats().reads, 0u);
  fill(again, 0, 2);
  store.store(key(0, 2));
  ASSERT_TRUE(store.drain().empty());
  store.release(0);  // the end of the linger (a no-op now: it was fetched again)
  ASSERT_EQ(store.fetch(key(0, 2), &p, &f), 0) << f.what;
  EXPECT_TRUE(matches(p, 0, 2));
  EXPECT_EQ(store.stats().reads, 0u);
  EXPECT_EQ(store.stats().cacheHits, 1u);
  store.release(0);
}

TEST(SwapStore, ResetPeakStartsANewWindowAtTheBytesAllocatedNow) {
  TempDir dir;
  SwapStore store(optionsFor(dir.path(), /*count=*/4));
  void* p = nullptr;
  SwapFault f;
  for (uint64_t id = 0; id < 3; ++id) ASSERT_EQ(store.overwrite(id, kPayload, &p, &f), 0) << f.what;
  for (uint64_t id = 0; id < 3; ++id) store.release(id);
  const SwapStats before = store.stats();
  EXPECT_EQ(before.peakBufferBytes, before.bufferBytes);
  EXPECT_EQ(before.buffers, 3u);
  store.resetPeak();
  EXPECT_EQ(store.stats().peakBufferBytes, before.bufferBytes);  // buffers stay allocated
  ASSERT_EQ(store.overwrite(7, kPayload, &p, &f), 0) << f.what;  // a free one: no new bytes
  store.release(7);
  EXPECT_EQ(store.stats().peakBufferBytes, before.bufferBytes);
}

TEST(SwapStore, WithoutKeepWrittenARecordIsReadFromItsFileAndADamagedOneIsRefused) {
  TempDir dir;
  SwapStore store(optionsFor(dir.path(), /*count=*/2));
  writeOne(store, 4);
  ASSERT_TRUE(store.drain().empty());
  {  // damaged between its write and its read (a flipped payload bit)
    const int fd = ::open(store.pathOf(4).c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    unsigned char byte = 0;
    ASSERT_EQ(::pread(fd, &byte, 1, kHeaderBytes + 8), 1);
    byte ^= 1;
    ASSERT_EQ(::pwrite(fd, &byte, 1, kHeaderBytes + 8), 1);
    ::close(fd);
  }
  void* p = nullptr;
  SwapFault f;
  EXPECT_EQ(store.fetch(key(4, 1), &p, &f), -EBADMSG);  // not cached: the file is read, and refused
  EXPECT_EQ(f.path, store.pathOf(4));
  EXPECT_NE(f.what.find("payload checksum"), std::string::npos) << f.what;
  EXPECT_EQ(store.stats().reads, 1u);
  EXPECT_EQ(store.stats().cacheHits, 0u);
}

TEST(SwapStore, AFailedWriteOfAnAbandonedPassIsForgottenAndTheOtherRecordStaysReadable) {
  TempDir dir;
  SwapStore store(optionsFor(dir.path(), /*count=*/2));
  writeOne(store, 0);  // the committed gradient of bucket 0: record 0
  ASSERT_TRUE(store.drain().empty());
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.overwrite(1, kPayload, &p, &f), 0) << f.what;  // the pass's pending one: record 1
  fill(p, 1, 2);
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto* oldHandler = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  store.store({1, 2, kPayload, 0x1234});
  const auto faults = store.drain();
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &old), 0);
  ::signal(SIGXFSZ, oldHandler);
  ASSERT_EQ(faults.size(), 1u);
  EXPECT_EQ(faults[0].id, 1u);
  store.forget(1);  // the pass is abandoned: its record is not kept in memory
  EXPECT_LT(store.fetch({1, 2, kPayload, 0x1234}, &p, &f), 0) << f.what;  // not served from memory
  ASSERT_EQ(store.fetch(key(0, 1), &p, &f), 0) << f.what;  // the previous gradient is intact
  EXPECT_TRUE(matches(p, 0, 1));
  store.release(0);
  EXPECT_TRUE(store.poll().empty());
}

// A record that grew (reserve()) while held in a buffer allocated before: sealing it would write
// past the buffer's end. store() refuses it naming the file and leaves it held; the owner moves
// it into a buffer of the new size (release, overwrite) and stores it there.
TEST(SwapStore, StoreRefusesARecordLargerThanItsHeldBuffer) {
  TempDir dir;
  SwapStore store(optionsFor(dir.path()));
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.fetch(key(1, 0), &p, &f), 0) << f.what;
  const size_t capacity = store.heldCapacity(1);
  EXPECT_GE(capacity, kPayload);
  EXPECT_EQ(store.heldCapacity(2), 0u);  // not held
  const uint64_t grown = kPayload + 8 * 4096;
  store.reserve(recordBytes(grown));
  EXPECT_EQ(store.heldCapacity(1), capacity);  // a buffer in use keeps its size
  store.store({1, 1, grown, 0x1234});
  const auto faults = store.drain();
  ASSERT_EQ(faults.size(), 1u);
  EXPECT_EQ(faults[0].id, 1u);
  EXPECT_EQ(faults[0].err, EINVAL);
  EXPECT_EQ(faults[0].path, store.pathOf(1));
  EXPECT_NE(faults[0].what.find("store refused"), std::string::npos) << faults[0].what;
  EXPECT_EQ(store.heldCapacity(1), capacity);  // still held, nothing written
  EXPECT_FALSE(std::filesystem::exists(store.pathOf(1)));
  store.release(1);
  ASSERT_EQ(store.overwrite(1, grown, &p, &f), 0) << f.what;
  EXPECT_GE(store.heldCapacity(1), grown);
  std::memset(p, 0x5a, grown);
  store.store({1, 1, grown, 0x1234});
  EXPECT_TRUE(store.drain().empty());
  EXPECT_EQ(std::filesystem::file_size(store.pathOf(1)), recordBytes(grown));
}

// prefetch() compares with the buffer size reserve() raised, not the constructed one.
TEST(SwapStore, PrefetchReadsARecordLargerThanTheConstructedBuffers) {
  TempDir dir;
  SwapStore store(optionsFor(dir.path()));
  const uint64_t grown = kPayload + 4096;
  store.reserve(recordBytes(grown));
  const RecordKey k{2, 1, grown, 7};
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.overwrite(2, grown, &p, &f), 0) << f.what;
  std::memset(p, 0x5a, grown);
  store.store(k);
  ASSERT_TRUE(store.drain().empty());
  EXPECT_TRUE(store.prefetch(k));
  ASSERT_EQ(store.fetch(k, &p, &f), 0) << f.what;
  EXPECT_EQ(static_cast<unsigned char*>(p)[grown - 1], 0x5a);
  EXPECT_EQ(store.stats().readsAhead, 1u);
  EXPECT_EQ(store.stats().readsOnDemand, 0u);
  store.release(2);
}

// adopt() fails after dropping its descriptor of the old file (here: a directory was renamed
// over the record). A regular file put there later is the record's: the next store uses it
// instead of failing with EEXIST for ever. A link by the record's name is never followed.
TEST(SwapStore, StoreUsesTheFileAFailedAdoptLeft) {
  TempDir dir;
  SwapStore store(optionsFor(dir.path()));
  writeOne(store, 1);
  ASSERT_TRUE(store.drain().empty());
  const std::string path = store.pathOf(1);
  ASSERT_EQ(::unlink(path.c_str()), 0);
  ASSERT_EQ(::mkdir(path.c_str(), 0700), 0);
  SwapFault f;
  EXPECT_EQ(store.adopt(1, &f), -EISDIR);
  EXPECT_EQ(f.path, path);
  ASSERT_EQ(::rmdir(path.c_str()), 0);
  {
    const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, "junk", 4), 4);
    ::close(fd);
  }
  void* p = nullptr;
  ASSERT_EQ(store.overwrite(1, kPayload, &p, &f), 0) << f.what;
  fill(p, 1, 2);
  store.store(key(1, 2));
  const auto faults = store.drain();
  EXPECT_TRUE(faults.empty()) << faults[0].what;
  ASSERT_EQ(store.fetch(key(1, 2), &p, &f), 0) << f.what;  // read back from that file
  EXPECT_TRUE(matches(p, 1, 2));
  store.release(1);

  const std::string target = dir.path() + "/target";
  {
    const int fd = ::open(target.c_str(), O_CREAT | O_EXCL | O_WRONLY, 0600);
    ASSERT_GE(fd, 0);
    ::close(fd);
  }
  ASSERT_EQ(::symlink(target.c_str(), store.pathOf(2).c_str()), 0);
  writeOne(store, 2);
  const auto linked = store.drain();
  ASSERT_EQ(linked.size(), 1u);
  EXPECT_EQ(linked[0].err, ELOOP) << linked[0].what;
  EXPECT_EQ(std::filesystem::file_size(target), 0u);
  ASSERT_EQ(::unlink(store.pathOf(2).c_str()), 0);
}

// A record stored with linger is still the owner's view until release(): forget, adopt and
// overwrite refuse it (-EBUSY) and its buffer goes to no other record.
TEST(SwapStore, ALingeringRecordIsNeitherDroppedNorOverwritten) {
  TempDir dir;
  SwapStore store(optionsFor(dir.path(), /*count=*/1));
  void* p = nullptr;
  SwapFault f;
  ASSERT_EQ(store.fetch(key(1, 0), &p, &f), 0) << f.what;
  fill(p, 1, 1);
  store.store(key(1, 1), /*linger=*/true);
  ASSERT_TRUE(store.drain().empty());
  EXPECT_EQ(store.forget(1), -EBUSY);
  EXPECT_EQ(store.adopt(1, &f), -EBUSY);
  EXPECT_EQ(f.err, EBUSY);
  void* q = nullptr;
  EXPECT_EQ(store.overwrite(1, kPayload, &q, &f), -EBUSY);
  ASSERT_EQ(store.fetch(key(2, 0), &q, &f), 0) << f.what;  // the pool of one grows instead
  EXPECT_NE(q, p);
  store.release(2);
  EXPECT_TRUE(matches(p, 1, 1));
  store.release(1);  // the linger ends
  EXPECT_EQ(store.forget(1), 0);
  EXPECT_EQ(store.adopt(1, &f), 0) << f.what;
}

// inPlace: the caller's directory must be its own and private (not a link to one).
TEST(SwapStore, InPlaceRefusesADirectoryThatIsNotPrivate) {
  TempDir dir;
  SwapStoreOptions o = optionsFor(dir.path());
  o.inPlace = true;
  ASSERT_EQ(::chmod(dir.path().c_str(), 0750), 0);
  try {
    SwapStore store(o);
    ADD_FAILURE() << "a directory with group permissions was accepted";
  } catch (const aio::IoError& e) {
    EXPECT_EQ(e.error(), EPERM);
    EXPECT_EQ(e.path(), dir.path());
  }
  ASSERT_EQ(::chmod(dir.path().c_str(), 0700), 0);
  if (geteuid() == 0) {  // another owner: only root can make one
    ASSERT_EQ(::chown(dir.path().c_str(), 65534, 65534), 0);
    try {
      SwapStore store(o);
      ADD_FAILURE() << "another user's directory was accepted";
    } catch (const aio::IoError& e) {
      EXPECT_EQ(e.error(), EPERM);
    }
    ASSERT_EQ(::chown(dir.path().c_str(), 0, 0), 0);
  }
  TempDir other;
  o.parent = other.path() + "/link";
  ASSERT_EQ(::symlink(dir.path().c_str(), o.parent.c_str()), 0);
  EXPECT_THROW(SwapStore{o}, aio::IoError);
  o.parent = dir.path();
  EXPECT_NO_THROW(SwapStore{o});  // 0700, ours: as the Python SwapDirectory makes it
}

TEST(SwapStore, BadParentIsRefused) {
  SwapStoreOptions o = optionsFor("/nonexistent-zeroplus-dir");
  EXPECT_THROW(SwapStore{o}, aio::IoError);
  TempDir dir;
  std::filesystem::permissions(dir.path(), std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
  if (geteuid() != 0) {
    EXPECT_THROW(SwapStore{optionsFor(dir.path())}, aio::IoError);
  }
  std::filesystem::permissions(dir.path(), std::filesystem::perms::owner_all);
}

}  // namespace
}  // namespace zeroplus::swap
