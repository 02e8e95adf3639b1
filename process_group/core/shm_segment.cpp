// POSIX shared-memory segments; see shm_segment.hpp for naming and lifetime rules.
#include "process_group/core/shm_segment.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>

namespace zeroplus::pg::detail {
namespace {

constexpr const char* kPrefix = "zeroplus-";

uint8_t* mapFd(int fd, size_t bytes, int* err) {
  // MAP_POPULATE pre-faults the pages so the first collective does not pay for them.
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    *err = -errno;
    return nullptr;
  }
  return static_cast<uint8_t*>(p);
}

}  // namespace

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    reset();
    data_ = other.data_;
    bytes_ = other.bytes_;
    name_ = std::move(other.name_);
    owner_ = other.owner_;
    other.data_ = nullptr;
    other.bytes_ = 0;
    other.owner_ = false;
  }
  return *this;
}

ShmSegment::~ShmSegment() { reset(); }

void ShmSegment::reset() {
  if (owner_) unlink();
  if (data_ != nullptr) ::munmap(data_, bytes_);
  data_ = nullptr;
  bytes_ = 0;
}

std::string ShmSegment::makeName(int pid, uint64_t nonce, int rank) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "/%s%d-%016llx-r%d", kPrefix, pid, static_cast<unsigned long long>(nonce), rank);
  return buf;
}

int ShmSegment::create(int rank, size_t bytes) {
  reset();
  std::random_device rd;
  const uint64_t nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  std::string name = makeName(static_cast<int>(::getpid()), nonce, rank);
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return -errno;
  int err = 0;
  // The umask can only clear bits of 0600, but be explicit: nobody else may read gradients.
  if (::fchmod(fd, 0600) != 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) err = -errno;
  // ftruncate only sets the size: on a small tmpfs the missing pages surface as SIGBUS at first
  // touch, in this rank or a peer. posix_fallocate reserves them now, so a full /dev/shm is
  // -ENOSPC here (it returns the error number instead of setting errno).
  if (err == 0 && bytes > 0) {
    if (const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); rc != 0) err = -rc;
  }
  uint8_t* p = err == 0 ? mapFd(fd, bytes, &err) : nullptr;
  ::close(fd);
  if (p == nullptr) {
    ::shm_unlink(name.c_str());
    return err;
  }
  data_ = p;
  bytes_ = bytes;
  name_ = std::move(name);
  owner_ = true;
  return 0;
}

int ShmSegment::open(const std::string& name, size_t bytes) {
  reset();
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return -errno;
  struct stat st {};
  int err = 0;
  if (::fstat(fd, &st) != 0) {
    err = -errno;
  } else if (!S_ISREG(st.st_mode) || st.st_uid != ::geteuid()) {
    // Peers' segments are this user's 0600 files; anything else under that name was planted.
    err = -EPERM;
  } else if (static_cast<size_t>(st.st_size) != bytes) {
    err = -EINVAL;
  }
  uint8_t* p = err == 0 ? mapFd(fd, bytes, &err) : nullptr;
  ::close(fd);
  if (p == nullptr) return err;
  data_ = p;
  bytes_ = bytes;
  name_ = name;
  owner_ = false;
  return 0;
}

int ShmSegment::unlink() {
  if (!owner_) return 0;
  owner_ = false;
  return ::shm_unlink(name_.c_str()) == 0 ? 0 : -errno;
}

int ShmSegment::freeBytes(uint64_t* bytes) {
  struct statvfs st {};
  if (::statvfs("/dev/shm", &st) != 0) return -errno;
  *bytes = static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
  return 0;
}

int ShmSegment::removeStaleSegments() {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  const uid_t me = ::geteuid();
  while (dirent* e = ::readdir(dir)) {
    const char* n = e->d_name;
    if (std::strncmp(n, kPrefix, std::strlen(kPrefix)) != 0) continue;
    char* end = nullptr;
    const long pid = std::strtol(n + std::strlen(kPrefix), &end, 10);
    if (end == nullptr || *end != '-' || pid <= 0) continue;
    struct stat st {};
    if (::fstatat(::dirfd(dir), n, &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_uid != me) continue;
    // kill(pid, 0) fails with ESRCH only when no such process exists; EPERM means it lives.
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    if (::shm_unlink((std::string("/") + n).c_str()) == 0) ++removed;
  }
  ::closedir(dir);
  return removed;
}

}  // namespace zeroplus::pg::detail
