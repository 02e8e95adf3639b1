// FileCache: shares one open File per (path, access mode, O_DIRECT mode) among the operations
// of one AioHandle, so that N queued operations on one file hold one File (its buffered and
// O_DIRECT descriptors), not N. Without it, 5000 queued small writes to one file hold 10000
// descriptors and fail with EMFILE under the usual `ulimit -n 1024`.
//
// Lifetime: the cache holds Files weakly. A File stays open while any transfer (or caller)
// holds its shared_ptr and closes when the last one lets go; for AioHandle that is when wait()
// releases the completed operations. Nothing is kept open between batches.
//
// Identity: a hit is used only while the path still names the same inode (stat before reuse):
// a file that was renamed over, or deleted and recreated, gets a fresh open, exactly as without
// the cache. Thread-safe; open() may block in the kernel's open() like File::open.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "aio/core/file.hpp"

namespace zeroplus::aio {

class FileCache {
 public:
  // Same contract and errors as File::open (IoError). The truncate option is not cached:
  // opening with truncate always opens (and truncates) anew.
  std::shared_ptr<File> open(const std::string& path, const OpenOptions& options);

  // Number of entries whose File is still open (for tests and diagnostics).
  size_t openCount();

 private:
  using Key = std::tuple<std::string, bool, bool, int>;  // path, write, create, direct mode
  void prune();  // drops expired entries; caller holds mu_

  std::mutex mu_;
  std::map<Key, std::weak_ptr<File>> files_;
  size_t opens_since_prune_ = 0;
};

}  // namespace zeroplus::aio
