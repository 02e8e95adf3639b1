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
  // Creates a temporary "<dir>/.<name>.tmp-<16 random hex digits>" next to `path`, exclusively
  // (O_CREAT|O_EXCL|O_NOFOLLOW relative to the directory's descriptor,
  // common/core/exclusive_file.hpp), with the permission bits of an existing `path` (else 0644
  // less the umask). A name planted in advance can neither redirect nor pre-empt it, even in a
  // world-writable sticky directory such as /tmp. Throws IoError: EISDIR/EINVAL when `path`
  // exists and is not a regular file, ELOOP when it is a symbolic link (an atomic write
  // replaces regular files only) or when its directory is a symbolic link another user owns.
  // A process killed before commit() or the destructor leaves the temporary file behind.
  AtomicFile(const std::string& path, DirectMode direct = DirectMode::Auto);
  // Unlinks the temporary file unless commit() succeeded.
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  const std::shared_ptr<File>& file() const noexcept { return file_; }
  const std::string& tempPath() const noexcept { return temp_; }
  const std::string& path() const noexcept { return path_; }
  // fsync(temp), renameat(temp, name) and fsync(dir), all through the directory descriptor
  // opened by the constructor. After a failure the temp file is removed.
  void commit();

 private:
  void removeTemp() noexcept;

  std::string path_;
  std::string dir_;
  std::string name_;
  std::string tempName_;
  std::string temp_;
  int dirFd_ = -1;
  std::shared_ptr<File> file_;
  bool committed_ = false;
};

}  // namespace zeroplus::aio
