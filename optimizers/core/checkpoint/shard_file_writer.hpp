// zeroplus::ckpt::ShardFileWriter: how one rank's shard file's bytes go out (torch-free). The one
// implementation behind both front-ends: Python's checkpoint/shard_io.py drives it through
// torch.classes.zeroplus.ShardFileWriter (registration/files_registration.cpp), the LibTorch
// engine's checkpoint_io.cpp directly. docs/checkpoints.md "Shard files" describes the layout.
//
// Streaming: open() creates a temporary file exclusively in the staging directory; place() puts
// one piece and returns its file offset; drain() waits for every queued write; finish() makes the
// file durable under its final name rankNNNNN.bin and returns its size and block CRC-32s.
//
// Layout (what a reader relies on is only the chunk offsets; the rest is for speed):
//   * a piece of fewer than kCoalesceBytes bytes is copied into a coalescing buffer; a group of
//     them starts at a 4 KiB-aligned offset and goes out as one aligned write once it reaches
//     kFlushBytes (or before a large piece, drain(), finish());
//   * a large piece starts on the page after the previous bytes, at the offset within that page
//     equal to its address modulo 4 KiB when io is Aio ("skew"; 0 for Posix): its first partial
//     page goes out through an aligned bounce page holding the skew's zeros, the rest straight
//     from the caller's memory at an aligned offset: zero-copy O_DIRECT;
//   * the gaps are holes, zero when read, and counted as zeros by the block CRCs;
//   * a piece of 0 bytes takes no space and no alignment: its offset is the current end.
// I/O: Aio + DirectMode::Off (page cache): a large piece goes out in segmentBytes segments, each
// one's write-back started (sync_file_range) once it is in the cache, so the disk writes segment
// k while the cache takes k + 1 instead of all of it waiting for the final fdatasync.
// Aio + DirectMode::Auto: O_DIRECT where the file system takes it (a write it cannot take aligned
// goes through the page cache); the CRC of a piece is computed while the engine writes it.
// Posix: pwrite on the writer's descriptor, segmented write-back as for the page cache.
// Block CRCs are computed in file order as the bytes are placed, padding included.
//
// Durability (finish): fdatasync through the writer's descriptor; the temporary name must still
// be the inode created, of the size placed (else EIO); then link to the final name (never
// replacing: EEXIST) and unlink the temporary. The directory is not fsynced (the commit does it
// once for all ranks, commit.py / checkpoint_files.hpp).
//
// Lifetime of the caller's memory: a piece's bytes must stay valid and unchanged until the next
// drain() or finish() returns (Aio queues writes from them; a small piece is copied at once but
// the contract is the same for every piece). The staging directory's descriptor must stay open
// for the writer's lifetime (it is not owned).
// Errors: negative errno and *error naming the file and what failed; after one, every later call
// returns it again. Any error, and destruction before finish() succeeded, remove the temporary
// file: nothing is left under either name. Not thread-safe; blocking: place() may wait for I/O
// (segments, a full coalescing pool), drain() and finish() do.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "aio/core/engine.hpp"
#include "aio/core/file.hpp"
#include "common/core/exclusive_file.hpp"
#include "optimizers/core/checkpoint/manifest.hpp"

namespace zeroplus::ckpt {

enum class ShardIo { Aio, Posix };

// Starts write-back of [offset, offset + bytes) of fd without waiting; a hint (failures ignored).
using StartWriteback = void (*)(int fd, int64_t offset, int64_t bytes);
// sync_file_range(SYNC_FILE_RANGE_WRITE): the default StartWriteback.
void startWriteback(int fd, int64_t offset, int64_t bytes);

struct ShardFileOptions {
  ShardIo io = ShardIo::Aio;
  aio::DirectMode direct = aio::DirectMode::Off;  // Aio only: Off (page cache) or Auto (O_DIRECT)
  int64_t blockBytes = kBlockBytes;               // CRC block, (0, kMaxBlockBytes]
  int64_t segmentBytes = int64_t{32} << 20;       // page-cache write-back granularity, > 0
  StartWriteback writeback = &startWriteback;     // a test observes write-back through it

  ShardFileOptions& setIo(ShardIo v) { io = v; return *this; }
  ShardFileOptions& setDirect(aio::DirectMode v) { direct = v; return *this; }
  ShardFileOptions& setBlockBytes(int64_t v) { blockBytes = v; return *this; }
  ShardFileOptions& setSegmentBytes(int64_t v) { segmentBytes = v; return *this; }
  ShardFileOptions& setWriteback(StartWriteback v) { writeback = v; return *this; }
};

class ShardFileWriter {
 public:
  static constexpr int64_t kAlign = 4096;              // every group and large piece starts on a page
  static constexpr int64_t kCoalesceBytes = 1 << 20;   // smaller pieces are coalesced
  static constexpr int64_t kFlushBytes = 8 << 20;      // a coalesced group goes out at this size

  ShardFileWriter() = default;
  ~ShardFileWriter();  // waits for queued writes, removes the temporary file unless finished
  ShardFileWriter(const ShardFileWriter&) = delete;
  ShardFileWriter& operator=(const ShardFileWriter&) = delete;

  // dirFd: the staging directory (kept open by the caller); dirPath names it in messages.
  // -EINVAL for bad options, else what creating the file or the aio engine returned.
  int open(int dirFd, const std::string& dirPath, int rank, const ShardFileOptions& options, std::string* error);
  // Places `bytes` bytes at `data` (see Layout); *offset gets where they start in the file.
  int place(const void* data, int64_t bytes, int64_t* offset, std::string* error);
  // Whether a piece of `bytes` placed now is still read from the caller's memory after place()
  // returned (until drain() or finish()): only a large piece written O_DIRECT-capable through
  // aio. Small pieces are copied into the writer's groups, page-cache and pwrite writes of a large
  // piece are waited for segment by segment: the caller may let go of them at once (a save of a
  // CUDA model copies each piece to the host: holding every copy would hold the whole shard).
  bool readsAfterPlace(int64_t bytes) const {
    return options_.io == ShardIo::Aio && options_.direct != aio::DirectMode::Off && bytes >= kCoalesceBytes;
  }
  // Every write queued so far is done (a coalesced group is sent first): placed memory may be
  // reused, and a reader of the temporary file sees the bytes.
  int drain(std::string* error);
  // drain(), durability and the final name (file comment). *record: name, bytes, block CRCs.
  int finish(FileRecord* record, std::string* error);
  // Waits for queued writes and removes the temporary file (as the destructor); idempotent.
  void abandon();

  const std::string& path() const { return path_; }  // the temporary file, for messages

 private:
  // Page-aligned memory of ours (a coalesced group, a bounce page): no zero fill, no mlock
  // (aio::AlignedBuffer does both, which a 9 MiB group buffer written once does not need).
  struct Buffer {
    struct Free {
      void operator()(void* p) const { std::free(p); }
    };
    std::unique_ptr<void, Free> mem;
    int64_t size = 0;
    static Buffer allocate(int64_t bytes);  // empty (null) when out of memory
    uint8_t* data() const { return static_cast<uint8_t*>(mem.get()); }
  };
  struct InFlight {  // a buffer the engine writes from, kept until its write is done
    Buffer mem;
    aio::Ticket ticket;
  };

  int fail(int rc, const std::string& what, std::string* error);
  int failErrno(std::string what, std::string* error);
  int failed(std::string* error) const;
  int write(const void* data, int64_t bytes, int64_t offset);
  int writeSkewed(const void* data, int64_t bytes, int64_t pageAt, int64_t skew);
  int flush();
  int waitAll(std::string* what);
  int takeGroupBuffer(std::string* error);
  void zeros(int64_t n);  // padding: the offset and the CRCs advance
  void feed(const void* data, int64_t n);
  int alignEnd();

  ShardFileOptions options_;
  int dirFd_ = -1;
  std::string tmp_, final_, path_;
  fs::UniqueFd fd_;
  std::unique_ptr<aio::Engine> engine_;
  std::shared_ptr<aio::File> file_, buffered_;  // buffered_: writes O_DIRECT cannot take
  std::vector<aio::Ticket> tickets_;             // writes from the caller's memory
  std::deque<InFlight> owned_;                   // writes from our buffers (bounce pages, groups)
  Buffer group_;                                 // the coalescing buffer being filled
  int64_t groupAt_ = 0, groupBytes_ = 0;
  int64_t offset_ = 0;
  uint32_t crc_ = 0;
  int64_t fill_ = 0;
  std::vector<uint32_t> crcs_;
  int rc_ = 0;
  std::string error_;
  bool finished_ = false;
};

// One piece of a shard held in memory: `bytes` bytes at `data`.
struct ShardPiece {
  const void* data;
  int64_t bytes;
};
// open, place every piece, finish: *offsets gets each piece's offset.
int writeShard(int dirFd, const std::string& dirPath, int rank, const std::vector<ShardPiece>& pieces,
               const ShardFileOptions& options, FileRecord* record, std::vector<int64_t>* offsets,
               std::string* error);

}  // namespace zeroplus::ckpt
