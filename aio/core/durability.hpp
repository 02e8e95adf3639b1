// Durability helpers for checkpoints (torch-free). All throw IoError on failure.
//
// O_DIRECT does not make data durable: the device cache and the extent metadata (for example
// the unwritten->written conversion of preallocated extents) still need fdatasync/fsync. A
// crash-consistent file is written as: AtomicFile (temp name in the target directory) ->
// preallocate -> write -> commit() = fsync file, rename over the target, fsync the directory.
//
// Threading: free functions are thread-safe. AtomicFile is used by one thread at a time; its
// File may be handed to an Engine, but every transfer must be waited for before commit().
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "aio/core/file.hpp"

namespace zeroplus::aio {

// Reserves [offset, offset+length) so later writes cannot fail with ENOSPC half-way and do not
// allocate on the write path. File systems without fallocate get a size extension (ftruncate),
// logged once.
void preallocate(const File& file, uint64_t offset, uint64_t length);
void syncData(const File& file);  // fdatasync
void syncAll(const File& file);   // fsync
// fsync of a directory, making a rename or a newly created name in it durable.
void syncDirectory(const std::string& dir);

class AtomicFile {
 public:
  // Creates "<dir>/.<name>.tmp-<pid>-<n>" next to `path`, opened for writing (truncated), with
  // the permission bits of an existing `path`. Throws IoError (EINVAL, EISDIR) when `path`
  // exists and is not a regular file. A process killed before commit() or the destructor
  // leaves the temporary file behind (its name says which pid made it).
  AtomicFile(const std::string& path, DirectMode direct = DirectMode::Auto);
  // Unlinks the temporary file unless commit() succeeded.
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  const std::shared_ptr<File>& file() const noexcept { return file_; }
  const std::string& tempPath() const noexcept { return temp_; }
  const std::string& path() const noexcept { return path_; }
  // fsync(temp), rename(temp, path), fsync(dir). After a failure the temp file is removed.
  void commit();

 private:
  std::string path_;
  std::string temp_;
  std::shared_ptr<File> file_;
  bool committed_ = false;
};

}  // namespace zeroplus::aio
