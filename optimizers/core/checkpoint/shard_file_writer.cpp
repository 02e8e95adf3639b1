#include "optimizers/core/checkpoint/shard_file_writer.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "aio/core/io_error.hpp"
#include "common/core/crc32.hpp"
#include "common/core/full_io.hpp"

namespace zeroplus::ckpt {
namespace {

constexpr uint8_t kZeros[ShardFileWriter::kAlign] = {};
// A coalesced group is below kFlushBytes before its last piece, which is below kCoalesceBytes.
constexpr int64_t kGroupCapacity = ShardFileWriter::kFlushBytes + ShardFileWriter::kCoalesceBytes;
// Our buffers in flight at most (coalesced groups, bounce pages) before place() waits for the
// oldest: bounds the memory a shard of many small pieces holds to a few groups.
constexpr size_t kMaxOwned = 8;

// A second descriptor of the same open file for aio::File::adopt, which takes ownership of it;
// the writer keeps its own for fdatasync and the final checks.
int dupFd(int fd) { return ::fcntl(fd, F_DUPFD_CLOEXEC, 0); }

}  // namespace

ShardFileWriter::Buffer ShardFileWriter::Buffer::allocate(int64_t bytes) {
  Buffer b;
  void* p = nullptr;
  if (::posix_memalign(&p, static_cast<size_t>(kAlign), static_cast<size_t>(bytes)) == 0) {
    b.mem.reset(p);
    b.size = bytes;
  }
  return b;
}

void startWriteback(int fd, int64_t offset, int64_t bytes) {
  ::sync_file_range(fd, offset, bytes, SYNC_FILE_RANGE_WRITE);  // a hint: a failure changes nothing
}

ShardFileWriter::~ShardFileWriter() { abandon(); }

int ShardFileWriter::failed(std::string* error) const {
  if (error) *error = error_;
  return rc_;
}

// The first error sticks; the writes already queued are waited for (the caller may free its
// memory once we return) and the temporary file is removed.
int ShardFileWriter::fail(int rc, const std::string& what, std::string* error) {
  if (rc_ == 0) {
    rc_ = rc;
    error_ = what;
  }
  abandon();
  return failed(error);
}

// fail() with errno as the failed call left it (building `what` allocates, which leaves errno
// alone when it succeeds).
int ShardFileWriter::failErrno(std::string what, std::string* error) {
  const int e = errno;
  return fail(-e, std::move(what) + ": " + std::strerror(e), error);
}

void ShardFileWriter::abandon() {
  waitAll(nullptr);
  // The engine goes before any buffer: its destructor drains whatever was submitted and not
  // tracked (a tracking push that failed), so no transfer reads memory freed below.
  file_.reset();
  buffered_.reset();
  engine_.reset();
  owned_.clear();
  group_ = Buffer();
  groupBytes_ = 0;
  fd_ = fs::UniqueFd();
  if (!finished_ && !tmp_.empty()) ::unlinkat(dirFd_, tmp_.c_str(), 0);
  tmp_.clear();
  if (rc_ == 0 && !finished_) {  // a caller's abandon: later calls say so, not "before open()"
    rc_ = -ECANCELED;
    error_ = "shard writer: the shard file " + final_ + " was abandoned";
  }
}

int ShardFileWriter::open(int dirFd, const std::string& dirPath, int rank, const ShardFileOptions& options,
                          std::string* error) {
  if (fd_ || finished_ || rc_ < 0) {
    return fail(-EINVAL, "shard writer: open() on a writer that was already opened", error);
  }
  if (rank < 0) return fail(-EINVAL, "shard writer: rank must be >= 0, got " + std::to_string(rank), error);
  options_ = options;
  dirFd_ = dirFd;
  final_ = shardFileName(rank);
  path_ = dirPath + "/" + final_;
  if (options.blockBytes <= 0 || options.blockBytes > kMaxBlockBytes) {
    return fail(-EINVAL, "shard writer: block_bytes must be in (0, " + std::to_string(kMaxBlockBytes) + "], got " +
                             std::to_string(options.blockBytes), error);
  }
  if (options.segmentBytes <= 0) {
    return fail(-EINVAL, "shard writer: segment_bytes must be > 0, got " + std::to_string(options.segmentBytes),
                error);
  }
  if (options.io == ShardIo::Aio && options.direct == aio::DirectMode::On) {
    return fail(-EINVAL, "shard writer: direct must be Auto or Off (a file system without O_DIRECT still works)",
                error);
  }
  if (const int rc = fs::createTemporary(dirFd, "." + final_ + ".tmp-", 0600, 0, &fd_, &tmp_); rc < 0) {
    tmp_.clear();
    return fail(rc, "cannot create the shard file in " + dirPath + ": " + std::strerror(-rc), error);
  }
  path_ = dirPath + "/" + tmp_;
  if (options.io == ShardIo::Posix) return 0;
  try {
    aio::EngineOptions eo;  // as the Python writer's AioHandle had it: 1 MiB requests, 16 deep, one ring
    eo.block_size = 1 << 20;
    eo.queue_depth = 16;
    eo.threads = 1;
    engine_ = aio::Engine::create(eo);
    const int a = dupFd(fd_.get());
    if (a < 0) return failErrno("cannot duplicate the descriptor of " + path_, error);
    file_ = aio::File::adopt(a, path_, options.direct);
    if (file_->direct()) {
      const int b = dupFd(fd_.get());
      if (b < 0) return failErrno("cannot duplicate the descriptor of " + path_, error);
      buffered_ = aio::File::adopt(b, path_, aio::DirectMode::Off);
    } else {
      buffered_ = file_;
    }
  } catch (const aio::IoError& e) {
    return fail(-e.error(), e.what(), error);
  } catch (const std::exception& e) {
    return fail(-ENOMEM, std::string("shard writer: cannot set up the aio engine for ") + path_ + ": " + e.what(),
                error);
  }
  return 0;
}

void ShardFileWriter::feed(const void* data, int64_t n) {
  // Block CRCs as the bytes go out: a piece may start and end anywhere inside a block.
  const auto* at = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const int64_t take = std::min(n, options_.blockBytes - fill_);
    crc_ = checksum::crc32(crc_, at, static_cast<size_t>(take));
    at += take, n -= take, fill_ += take;
    if (fill_ == options_.blockBytes) {
      crcs_.push_back(crc_);
      crc_ = 0, fill_ = 0;
    }
  }
}

void ShardFileWriter::zeros(int64_t n) {  // n < kAlign: a hole in the file, zeros when read
  feed(kZeros, n);
  offset_ += n;
}

int ShardFileWriter::alignEnd() {
  zeros((kAlign - offset_ % kAlign) % kAlign);
  return 0;
}

// One write of the caller's memory (or ours, when the caller keeps it in owned_). O_DIRECT needs
// the offset and the address aligned to the file's direct-I/O alignment; every write we issue is
// 4 KiB-aligned, so only a device wanting more sends one through the page cache.
int ShardFileWriter::write(const void* data, int64_t bytes, int64_t offset) {
  if (options_.io == ShardIo::Posix) {
    const int rc = fs::pwriteFull(fd_.get(), data, bytes, offset);
    return rc < 0 ? fail(rc, "cannot write " + path_ + " at offset " + std::to_string(offset) + " (" +
                                 std::to_string(bytes) + " bytes): " + std::strerror(-rc), nullptr)
                  : 0;
  }
  const auto addr = reinterpret_cast<uintptr_t>(data);
  const bool aligned = static_cast<uint64_t>(offset) % file_->offsetAlign() == 0 && addr % file_->memAlign() == 0;
  const auto& f = aligned ? file_ : buffered_;
  try {
    tickets_.push_back(engine_->submit({aio::OpKind::Write, f, const_cast<void*>(data), static_cast<uint64_t>(offset),
                                        static_cast<uint64_t>(bytes)}));
  } catch (const aio::IoError& e) {
    return fail(-e.error(), e.what(), nullptr);
  }
  return 0;
}

// `bytes` at pageAt + skew (pageAt aligned, skew the address's place in its page): the first
// partial page through an aligned bounce page holding `skew` zeros, the rest from the caller's
// memory, which is then page-aligned at a page-aligned offset.
int ShardFileWriter::writeSkewed(const void* data, int64_t bytes, int64_t pageAt, int64_t skew) {
  if (skew == 0) return write(data, bytes, pageAt);
  const int64_t head = std::min(kAlign - skew, bytes);
  InFlight page;
  page.mem = Buffer::allocate(kAlign);
  if (!page.mem.mem) return fail(-ENOMEM, "cannot allocate a bounce page for " + path_, nullptr);
  uint8_t* p = page.mem.data();
  std::memset(p, 0, static_cast<size_t>(skew));
  std::memcpy(p + skew, data, static_cast<size_t>(head));
  owned_.push_back(std::move(page));  // tracked before the write is submitted
  if (const int rc = write(p, skew + head, pageAt); rc < 0) return rc;
  owned_.back().ticket = tickets_.back();
  tickets_.pop_back();
  return head < bytes ? write(static_cast<const uint8_t*>(data) + head, bytes - head, pageAt + kAlign) : 0;
}

// Sends the coalesced group. With Aio its buffer stays in owned_ until the write is done.
int ShardFileWriter::flush() {
  if (groupBytes_ == 0) return 0;
  const int64_t n = groupBytes_;
  groupBytes_ = 0;
  if (options_.io == ShardIo::Posix) return write(group_.data(), n, groupAt_);  // written: the buffer is free again
  owned_.push_back({std::move(group_), {}});  // tracked before the write is submitted
  if (const int rc = write(owned_.back().mem.data(), n, groupAt_); rc < 0) return rc;
  owned_.back().ticket = tickets_.back();
  tickets_.pop_back();
  return 0;
}

// Waits for every queued write, all of them even after a failure (the memory is free afterwards);
// the first failure is the result (*what: its message).
int ShardFileWriter::waitAll(std::string* what) {
  int rc = 0;
  auto wait = [&](const aio::Ticket& t) {
    try {
      t.wait();
    } catch (const aio::IoError& e) {
      if (rc == 0) {
        rc = -e.error();
        if (what) *what = e.what();
      }
    }
  };
  for (const auto& t : tickets_) wait(t);
  tickets_.clear();
  for (auto& o : owned_) wait(o.ticket);
  // A group buffer is kept for the next group (the others go: groups are rare after a drain).
  for (auto& o : owned_) {
    if (!group_.mem && o.mem.size >= kGroupCapacity) group_ = std::move(o.mem);
  }
  owned_.clear();
  return rc;
}

// A buffer for the next coalesced group: one of ours whose write is done (the oldest first, and
// waited for while kMaxOwned are in flight: bounded memory for a shard of many small pieces),
// else a new one.
int ShardFileWriter::takeGroupBuffer(std::string* error) {
  while (!owned_.empty() && (owned_.size() >= kMaxOwned || owned_.front().ticket.ready())) {
    InFlight o = std::move(owned_.front());
    owned_.pop_front();
    try {
      o.ticket.wait();
    } catch (const aio::IoError& e) {
      return fail(-e.error(), e.what(), error);
    }
    if (!group_.mem && o.mem.size >= kGroupCapacity) group_ = std::move(o.mem);
  }
  if (!group_.mem) group_ = Buffer::allocate(kGroupCapacity);
  if (!group_.mem) return fail(-ENOMEM, "cannot allocate a coalescing buffer for " + path_, error);
  return 0;
}

int ShardFileWriter::place(const void* data, int64_t bytes, int64_t* offset, std::string* error) {
  if (rc_ < 0) return failed(error);
  if (!fd_) return fail(-EINVAL, "shard writer: place() before open()", error);
  if (bytes < 0 || (bytes > 0 && data == nullptr)) {
    return fail(-EINVAL, "shard writer: a piece needs bytes >= 0 and memory, got " + std::to_string(bytes) +
                             " bytes", error);
  }
  if (bytes == 0) {  // no alignment either: a pad at the end would be a hole past the end of the file
    *offset = offset_;
    return 0;
  }
  const auto* src = static_cast<const uint8_t*>(data);
  if (bytes < kCoalesceBytes) {
    if (groupBytes_ == 0) {
      alignEnd();
      groupAt_ = offset_;
      if (takeGroupBuffer(error) < 0) return rc_;
    }
    *offset = offset_;
    std::memcpy(group_.data() + groupBytes_, src, static_cast<size_t>(bytes));
    groupBytes_ += bytes;
    feed(src, bytes);
    offset_ += bytes;
    if (groupBytes_ >= kFlushBytes && flush() < 0) return failed(error);
    return 0;
  }
  if (flush() < 0) return failed(error);
  alignEnd();
  const int64_t skew =
      options_.io == ShardIo::Aio ? static_cast<int64_t>(reinterpret_cast<uintptr_t>(data) % kAlign) : 0;
  zeros(skew);  // the padding before the piece: zeros in the file and in the checksums
  *offset = offset_;
  const int64_t at = offset_;
  const bool pageCache = options_.io == ShardIo::Posix || options_.direct == aio::DirectMode::Off;
  if (!pageCache) {  // queued first: the engine writes while we checksum
    if (writeSkewed(src, bytes, at - skew, skew) < 0) return failed(error);
    feed(src, bytes);
  } else {  // segment by segment, each one's write-back started once it is in the cache
    for (int64_t a = 0; a < bytes; a += options_.segmentBytes) {
      const int64_t part = std::min(options_.segmentBytes, bytes - a);
      const int rc = a == 0 ? writeSkewed(src, part, at - skew, skew) : write(src + a, part, at + a);
      if (rc < 0) return failed(error);
      feed(src + a, part);
      std::string what;
      if (const int w = waitAll(&what); w < 0) return fail(w, what, error);
      const int64_t pad = a == 0 ? skew : 0;
      if (options_.writeback != nullptr) options_.writeback(fd_.get(), at + a - pad, part + pad);
    }
  }
  offset_ += bytes;
  return 0;
}

int ShardFileWriter::drain(std::string* error) {
  if (rc_ < 0) return failed(error);
  if (!fd_) return fail(-EINVAL, "shard writer: drain() before open()", error);
  if (flush() < 0) return failed(error);
  std::string what;
  if (const int rc = waitAll(&what); rc < 0) return fail(rc, what, error);
  return 0;
}

int ShardFileWriter::finish(FileRecord* record, std::string* error) {
  if (drain(error) < 0) return rc_;
  if (::fdatasync(fd_.get()) != 0) return failErrno("cannot fdatasync " + path_, error);
  // The name must still be the inode we wrote, of the size we placed: a file swapped under the
  // writer (impossible in a private staging directory, but cheap to rule out) is never published.
  struct stat mine{}, here{};
  if (::fstat(fd_.get(), &mine) != 0) return failErrno("cannot stat " + path_, error);
  if (::fstatat(dirFd_, tmp_.c_str(), &here, AT_SYMLINK_NOFOLLOW) != 0) {
    return failErrno("cannot stat " + path_, error);
  }
  if (here.st_ino != mine.st_ino || here.st_dev != mine.st_dev || mine.st_size != offset_) {
    return fail(-EIO, "shard file " + path_ + " changed under the writer (size " + std::to_string(mine.st_size) +
                          ", expected " + std::to_string(offset_) + ")", error);
  }
  file_.reset();
  buffered_.reset();
  engine_.reset();
  fd_ = fs::UniqueFd();
  // Never replaces: link fails with EEXIST when the name exists (a planted one included).
  if (::linkat(dirFd_, tmp_.c_str(), dirFd_, final_.c_str(), 0) != 0) {
    return failErrno("cannot publish " + path_ + " as " + final_, error);
  }
  if (::unlinkat(dirFd_, tmp_.c_str(), 0) != 0) {
    return failErrno("cannot remove " + path_ + " after publishing it as " + final_, error);
  }
  tmp_.clear();
  finished_ = true;
  if (fill_ > 0) crcs_.push_back(crc_);
  crc_ = 0, fill_ = 0;
  record->name = final_;
  record->bytes = offset_;
  record->blockCrc32 = std::move(crcs_);
  rc_ = -EALREADY;  // finished: any later call is a caller's error
  error_ = "shard file " + final_ + " was already finished";
  return 0;
}

int writeShard(int dirFd, const std::string& dirPath, int rank, const std::vector<ShardPiece>& pieces,
               const ShardFileOptions& options, FileRecord* record, std::vector<int64_t>* offsets,
               std::string* error) {
  ShardFileWriter w;
  offsets->clear();
  int rc = w.open(dirFd, dirPath, rank, options, error);
  for (size_t k = 0; rc == 0 && k < pieces.size(); ++k) {
    int64_t at = 0;
    rc = w.place(pieces[k].data, pieces[k].bytes, &at, error);
    offsets->push_back(at);
  }
  return rc == 0 ? w.finish(record, error) : rc;
}

}  // namespace zeroplus::ckpt
