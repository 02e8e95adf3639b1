// The file side of a zeroplus checkpoint, torch-free: the crash-consistent commit of a checkpoint
// directory, and verified reads of element ranges. The same protocol as the Python package
// (checkpoint/commit.py, shard_io.py, fsutil.py, reader.py; docs/checkpoints.md "Guarantees");
// every file and directory is created and opened through common/core/exclusive_file.hpp
// (exclusive creation, no link followed in a name we open, except the user's own link as the
// checkpoint path or its root).
//
// Save (the caller sequences the ranks; checkpoint_io.cpp does it with collectives):
//   rank 0   prepareSave: ROOT created 0700 (and missing parents); ROOT/NAME must be absent, an
//            empty directory or a zeroplus checkpoint (else -EEXIST: nothing written); a private
//            staging directory ROOT/.NAME.tmp-<random> is created, flock'ed (Python's sweep of
//            stale staging directories leaves a locked one alone) before it gets that name.
//   each     its shard file into staging (shard_file_writer.hpp: a temporary name, the bytes,
//            fdatasync, then the final rankNNNNN.bin, never replacing anything).
//   rank 0   commitSave: manifest.json (temporary, fdatasync, rename), fsync staging, latest's new
//            content fdatasync'ed under a temporary name, then staging renamed to NAME or, when
//            NAME is a complete checkpoint, swapped with it atomically (renameat2
//            RENAME_EXCHANGE; the old one removed), fsync ROOT, latest renamed into place, fsync
//            ROOT. Any failure before the swap removes the staging directory: NAME and latest
//            are untouched. abandonSave removes it on an error elsewhere.
// Load: CheckpointReader resolves PATH (a checkpoint directory, or a root whose `latest` names
// one), reads and parses the manifest (manifest.hpp: the seal and every field), and read()
// returns one value's flat element range, checking the size of each shard file it opens; the
// bytes go through verifiedRead (verified_read.hpp: the CRC-32 of every block touched, on a few
// threads), the same code as the Python reader's.
//
// Errors: negative errno and *error naming the file and what failed (EIO: corrupt, truncated or
// checksum mismatch; ENOENT: missing; EEXIST: a destination we refuse to replace; ENOTSUP:
// newer format; EINVAL: malformed). Not thread-safe per object; distinct objects are independent.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/core/exclusive_file.hpp"
#include "optimizers/core/checkpoint/manifest.hpp"

namespace zeroplus::ckpt {

// PATH as the save's (ROOT, NAME): the absolute path split at its last component, which must be
// a plain directory name (isPlainDirName). -EINVAL otherwise.
int splitSavePath(const std::string& path, std::string* root, std::string* name, std::string* error);

struct Staging {
  std::string root, name, staging;  // ROOT, NAME, the staging directory's name in ROOT
  fs::UniqueFd rootFd, stagingFd;   // stagingFd holds the flock on rank 0
};

// Rank 0 (see the file comment). On success `out` is ready for the shard writers and commitSave.
int prepareSave(const std::string& root, const std::string& name, Staging* out, std::string* error);
// Other ranks: open the staging directory rank 0 made (it must be this user's).
int openStaging(const std::string& root, const std::string& name, const std::string& staging, Staging* out,
                std::string* error);

// Rank 0: the rest of the save (file comment). The staging directory is gone afterwards either way.
int commitSave(Staging& s, const std::string& manifestBytes, std::string* error);
// Rank 0 on an error before commitSave: removes the staging directory.
void abandonSave(Staging& s);

// Whether dirFd/name is a directory holding a manifest.json whose "format" is a zeroplus one.
bool isCheckpoint(int dirFd, const std::string& name);

class CheckpointReader {
 public:
  CheckpointReader() = default;
  // Resolves `path`, reads and parses the manifest. The shard files are opened on first read.
  int open(const std::string& path, std::string* error);

  const Manifest& manifest() const { return manifest_; }
  const std::string& directory() const { return dir_; }
  uint32_t manifestCrc32() const { return manifestCrc_; }  // which manifest this is (ranks compare it)

  // The dtype (name) `tensor`'s value `key` is stored in, or "" if no chunk holds it.
  std::string storedDtype(const std::string& tensor, const std::string& key) const;
  // Elements [lo, hi) of value `key` of `tensor` into dst ((hi - lo) * dtypeBytes bytes, in the
  // stored dtype): every element must be covered by a chunk (else -EIO: the manifest is torn).
  int read(const std::string& tensor, const std::string& key, int64_t lo, int64_t hi, void* dst, std::string* error);

 private:
  int fileFd(int64_t fi, int* fd, std::string* error);

  std::string dir_;
  fs::UniqueFd dirFd_;
  Manifest manifest_;
  uint32_t manifestCrc_ = 0;
  std::map<std::pair<std::string, std::string>, std::vector<const Chunk*>> chunks_;  // sorted by lo
  std::map<int64_t, fs::UniqueFd> fds_;
  // The last block a read covered only in part, verified: the engine reads value by value, and
  // many small tensors share a block (one read and one CRC for all of them, not one each).
  int64_t cachedFile_ = -1, cachedBlock_ = -1;
  std::vector<uint8_t> block_;
};

}  // namespace zeroplus::ckpt
