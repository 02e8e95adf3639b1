#include "aio/core/file_cache.hpp"

#include <sys/stat.h>

namespace zeroplus::aio {
namespace {

// True when `path` still resolves to the inode `file` has open.
bool sameInode(const std::string& path, const File& file) {
  struct stat by_path {}, by_fd {};
  if (::stat(path.c_str(), &by_path) != 0 || ::fstat(file.bufferedFd(), &by_fd) != 0) return false;
  return by_path.st_dev == by_fd.st_dev && by_path.st_ino == by_fd.st_ino;
}

}  // namespace

std::shared_ptr<File> FileCache::open(const std::string& path, const OpenOptions& options) {
  if (options.truncate) return File::open(path, options);
  const Key key{path, options.write, options.create, static_cast<int>(options.direct)};
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(key);
    if (it != files_.end()) {
      if (auto f = it->second.lock(); f && sameInode(path, *f)) return f;
    }
  }
  // Opened outside the lock: open() may block (NFS, a slow device) and must not stall the
  // other submitting threads. Two racing opens of one key both succeed; the later one wins
  // the slot and the earlier File lives on with its transfers.
  std::shared_ptr<File> f = File::open(path, options);
  std::lock_guard<std::mutex> lock(mu_);
  files_[key] = f;
  // Amortised cleanup, so a handle that touches many distinct files does not grow forever.
  if (++opens_since_prune_ >= 64 && opens_since_prune_ >= files_.size()) prune();
  return f;
}

size_t FileCache::openCount() {
  std::lock_guard<std::mutex> lock(mu_);
  prune();
  return files_.size();
}

void FileCache::prune() {
  for (auto it = files_.begin(); it != files_.end();) {
    it = it->second.expired() ? files_.erase(it) : std::next(it);
  }
  opens_since_prune_ = 0;
}

}  // namespace zeroplus::aio
