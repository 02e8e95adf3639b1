// Exclusive creation of files and directories in places other users can write to (/dev/shm,
// /tmp, a shared checkpoint or swap directory), so that a name planted in advance (a symbolic
// link to a victim file, a FIFO, a regular file with chosen contents) can neither redirect a
// write nor pre-empt the file zeroplus means to create (issue 29). Torch-free; the one place
// that owns these rules: process_group/core (the /dev/shm host token) and aio/core (atomic_write
// temporaries) use it, and so must every later file zeroplus creates.
//
// Rules every function here follows:
//  * names are resolved relative to a directory descriptor (openat): the directory is looked
//    up once and a rename of a path component later cannot redirect the next call;
//  * new files are created with O_CREAT|O_EXCL|O_NOFOLLOW: an existing name, a symbolic link
//    included, is never opened, truncated or followed; creation fails with EEXIST instead;
//  * temporary names end in 16 random hex digits from the kernel's random source (getrandom),
//    so nobody can plant them in advance (mkstemp-like; creation is retried on EEXIST);
//  * what is opened is checked with fstat on the descriptor (type, and owner where asked), not
//    by a path lookup that could name a different file a moment later;
//  * a directory zeroplus creates is 0700 and verified after opening (owned by this effective
//    uid, a directory, no group/other permission bits).
// Errors are returned as negative errno (liburing style); the callers turn them into their own
// exception type (CommError, IoError) naming the path. Every function is thread-safe and
// returns descriptors with O_CLOEXEC.
#pragma once

#include <sys/types.h>

#include <string>

namespace zeroplus::fs {

// An owned descriptor (closed by the destructor); movable.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd();
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Opens the directory `path` (O_RDONLY|O_DIRECTORY|O_NOFOLLOW). When the last component is a
// symbolic link, it is followed only if the link is owned by this effective uid or by root (a
// link a user made to their own disk), never one planted by another user: -ELOOP then. Earlier
// components are the caller's to trust (as fs.protected_symlinks does, per link owner).
int openDirectory(const std::string& path, UniqueFd* out);

// Opens `path` relative to `dirFd` (AT_FDCWD: the working directory; an absolute path ignores
// it) as a directory without following a symbolic link in its last component (-ENOTDIR then,
// as for anything else that is not a directory); with `requireOwner`, -EPERM unless it is
// owned by this effective uid (a directory zeroplus is about to write into or remove from).
int openDirectoryAt(int dirFd, const std::string& path, bool requireOwner, UniqueFd* out);

// Creates the new directory `name` in `dirFd` exclusively (-EEXIST for any existing name, a
// symbolic link included) with mode 0700, and returns it verified as ensurePrivateDirectory
// does. A umask that narrowed the owner's bits is undone (fchmod 0700 on the descriptor).
int createPrivateDirectory(int dirFd, const std::string& name, UniqueFd* out);

// Creates `name` in `dirFd` as a directory with mode 0700, or opens an existing one; either
// way the result must be a directory owned by this effective uid with no group/other bits:
// -EPERM (another owner), -ENOTDIR (not a directory; a symbolic link is never followed) or
// -EACCES (group/other bits set) otherwise.
int ensurePrivateDirectory(int dirFd, const std::string& name, UniqueFd* out);

// Creates the new regular file `name` in `dirFd`, opened O_RDWR, with `mode` (less the umask).
// `extraFlags` may add O_DIRECT etc. -EEXIST when anything, a symbolic link included, exists
// under that name.
int createExclusive(int dirFd, const std::string& name, mode_t mode, int extraFlags, UniqueFd* out);

// Creates a new regular file named `prefix` + 16 random hex digits in `dirFd` as
// createExclusive does, retrying on a name collision; *name receives the name created.
int createTemporary(int dirFd, const std::string& prefix, mode_t mode, int extraFlags, UniqueFd* out,
                    std::string* name);

// Opens the existing `name` in `dirFd` read-only without following a symbolic link and without
// blocking on a FIFO, and checks that it is a regular file (-EINVAL otherwise) owned by this
// effective uid when `requireOwner` (-EPERM otherwise).
int openRegularForReading(int dirFd, const std::string& name, bool requireOwner, UniqueFd* out);

// 16 lowercase hex digits from the kernel's random source.
std::string randomSuffix();

}  // namespace zeroplus::fs
