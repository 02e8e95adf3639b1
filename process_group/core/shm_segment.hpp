// Internal: one POSIX shared-memory segment of the same-host transport.
//
// Naming: "/zeroplus-<pid>-<16 hex nonce>-r<rank>", created with O_CREAT|O_EXCL and mode 0600,
// so two groups (or two jobs of one user) never share a segment and other users cannot open
// it. The creator unlinks the name as soon as every peer has mapped it (ShmCommunicator
// set-up), so a finished or crashed run leaves nothing behind; only a crash inside the short
// set-up window can leave a name, and removeStaleSegments() deletes those whose creator pid is
// gone (called before every create).
//
// Ownership: the object owns its mapping (munmap in the destructor) and, until unlink(), the
// name. Not thread-safe; the mapping itself is shared memory that the communicator accesses
// with atomics.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace zeroplus::pg::detail {

class ShmSegment {
 public:
  ShmSegment() = default;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ShmSegment(ShmSegment&& other) noexcept { *this = std::move(other); }
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ~ShmSegment();

  // Creates and maps a new zero-filled segment of `bytes`, its pages reserved up front
  // (posix_fallocate), so a /dev/shm too small for it is -ENOSPC here and never a SIGBUS on
  // first touch. Returns 0 or -errno.
  int create(int rank, size_t bytes);
  // Maps an existing segment created by a peer. Returns 0 or -errno (-EINVAL: size mismatch).
  int open(const std::string& name, size_t bytes);
  // Removes the name (the mapping stays valid). Idempotent; returns 0 or -errno.
  int unlink();

  uint8_t* data() const { return data_; }
  size_t size() const { return bytes_; }
  const std::string& name() const { return name_; }

  // Space left in /dev/shm for this user (statvfs f_bavail), for error messages. 0 or -errno.
  static int freeBytes(uint64_t* bytes);
  // Unlinks /dev/shm/zeroplus-<pid>-* entries of this user whose pid no longer exists.
  // Returns how many were removed.
  static int removeStaleSegments();
  static std::string makeName(int pid, uint64_t nonce, int rank);

 private:
  void reset();

  uint8_t* data_ = nullptr;
  size_t bytes_ = 0;
  std::string name_;
  bool owner_ = false;  // created here and not yet unlinked
};

}  // namespace zeroplus::pg::detail
