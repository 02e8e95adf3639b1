// Verified reads of a checkpoint shard file: "these byte ranges of this file into these
// destinations, after checking the CRC-32 of every block they touch". The one implementation
// behind the Python reader (zeroplus.checkpoint.reader, through the zeroplus::verified_read op)
// and the C++ engine's CheckpointReader (checkpoint_files.hpp). Torch-free.
//
// The plan (docs/checkpoints.md "Format": a shard file is cut into blocks of blockBytes, the
// last one possibly short, each with its CRC-32 in the manifest):
//  * the blocks wholly inside a piece are read straight into its destination and checked there,
//    in tasks of about taskBytes (whole blocks, at least one): no second copy;
//  * a block some piece covers only in part is read once into a buffer of its own, checked, then
//    copied to every piece that shares it (many small tensors share a block: one read, one CRC);
//  * the tasks run in file order (the disk sees mostly sequential reads) on `threads` threads:
//    the caller's and threads - 1 started for the call (pread and the CRC of different blocks
//    overlap; no interpreter lock is held here).
// Validation before change: a destination byte may be written before its block is checked (the
// whole-block case), so on an error the destinations hold unspecified bytes; the caller must not
// publish them. Nothing is written outside [dst, dst + hi - lo) of any piece.
//
// Blocking and threading: returns only after every task has ended (no thread still writes into
// a destination); safe to call from several threads at once on different destinations (pread
// does not move the descriptor's offset). The descriptor and destinations are the caller's and
// must outlive the call; pieces must not overlap one another's destinations.
//
// Errors: 0, or a negative errno with *failure filled. The message has the Python reader's
// wording and leaves the file's path to the caller (OSError's filename, or "path: message"):
//   -EIO, corrupt:  "checkpoint: checksum mismatch in bytes [a, b) (corrupt file)" (block [a, b))
//   -EIO:           "checkpoint: file is truncated: wanted N bytes at offset O, it ends at E"
//   -errno:         "checkpoint: cannot read bytes [a, b): <strerror>" (pread failed)
//   -EINVAL:        a bad argument (a piece outside the file, too few CRCs, threads < 1), named.
// Of several failing tasks the first in file order is reported; tasks not yet started when one
// fails are skipped (they lie after it in file order, so the report is the same).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zeroplus::ckpt {

// The file being read: an open descriptor, its size (the caller has checked it against the
// manifest: fstat) and its block CRCs, ceil(bytes / blockBytes) of them.
struct VerifiedFile {
  int fd = -1;
  int64_t bytes = 0;
  int64_t blockBytes = 0;
  const uint32_t* blockCrc32 = nullptr;
  int64_t blocks = 0;  // entries at blockCrc32
};

// File bytes [lo, hi) -> dst[0, hi - lo). lo == hi is allowed and reads nothing.
struct ReadPiece {
  int64_t lo = 0, hi = 0;
  uint8_t* dst = nullptr;
};

struct VerifiedReadOptions {
  // Two ranks reading and checksumming 300 MB each with the page cache dropped, 4 threads each:
  // 8-16 MiB tasks 0.15-0.31 s, 64 MiB 0.33-0.67 s (several tasks' reads in flight while others
  // are checked keep the disk busier; docs/checkpoints.md, Benchmark).
  static constexpr int64_t kTaskBytes = int64_t{8} << 20;
  // Not capped by the core count: a cold read's threads mostly wait for the disk, and more reads
  // in flight keep it busier. Two ranks reading and checking 300 MB each on 2 cores, page cache
  // dropped, 8 launches each interleaved: 2 threads 0.52 s, 4 threads 0.39 s, 8 threads 0.44 s
  // (warm: 0.30, 0.25, 0.25 s). The Python reader used min(4, cores) before.
  static constexpr int kThreads = 4;
  int threads = kThreads;
  int64_t taskBytes = kTaskBytes;

  VerifiedReadOptions& setThreads(int n) {
    threads = n;
    return *this;
  }
  VerifiedReadOptions& setTaskBytes(int64_t n) {
    taskBytes = n;
    return *this;
  }
};

struct ReadFailure {
  int code = 0;          // negative errno, 0 when nothing failed
  bool corrupt = false;  // a checksum mismatch (CheckpointCorruptError in Python)
  bool badArgument = false;  // the call's arguments were refused (-EINVAL); nothing was read
  std::string message;   // the wording above, without the file's path
};

int verifiedRead(const VerifiedFile& file, const std::vector<ReadPiece>& pieces, const VerifiedReadOptions& options,
                 ReadFailure* failure);

}  // namespace zeroplus::ckpt
