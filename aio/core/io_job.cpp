#include "aio/core/io_job.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <string>

namespace zeroplus::aio::detail {
namespace {

constexpr int kMaxRetries = 1000;  // EAGAIN/EINTR resubmissions before giving up

const char* opName(OpKind op) { return op == OpKind::Read ? "read" : "write"; }

}  // namespace

int64_t fullPio(OpKind op, int fd, char* buf, uint64_t length, uint64_t offset) {
  while (length > 0) {
    ssize_t n = op == OpKind::Read ? ::pread(fd, buf, length, static_cast<off_t>(offset))
                                   : ::pwrite(fd, buf, length, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return -errno;
    }
    if (n == 0) return op == OpKind::Read ? -ENODATA : -EIO;
    buf += n;
    offset += static_cast<uint64_t>(n);
    length -= static_cast<uint64_t>(n);
  }
  return 0;
}

Job::Job(const Transfer& t, uint64_t block_size, std::function<void()> onDone)
    : op_(t.op),
      file_(t.file),
      buf_(static_cast<char*>(t.buf)),
      offset_(t.offset),
      length_(t.length),
      onDone_(std::move(onDone)) {
  const uint64_t align = file_->offsetAlign();
  bulk_ = length_ / align * align;
  // Requests must stay aligned, so the block size is rounded down to the file's alignment.
  // Capped at 1 GiB: an io_uring request length is 32 bits (4 GiB would become 0) and Linux
  // moves at most 0x7ffff000 bytes per read/write call anyway.
  const uint64_t block = std::min<uint64_t>(block_size, kMaxRequestBytes);
  chunk_ = std::max<uint64_t>(align, block / align * align);
  n_requests_ = (bulk_ + chunk_ - 1) / chunk_;
  if (n_requests_ == 0) finish();  // empty or tail-only: done right here, synchronously
}

bool Job::applyResult(Request& r, int64_t res) {
  if (res == -EAGAIN || res == -EINTR) {
    if (++r.retries <= kMaxRetries) return false;
  }
  if (res == -EINVAL && r.direct) {
    // The request was checked aligned before submission, so this EINVAL is the kernel refusing
    // the direct transfer as it would have issued it: a write that RLIMIT_FSIZE (or a file-size
    // limit of the file system) cuts to an unaligned length. Buffered I/O gives the transfer's
    // real outcome: the bytes up to the limit, then EFBIG, as a buffered write reports it.
    int64_t rc = fullPio(op_, file_->bufferedFd(), r.buf, r.length, r.offset);
    if (rc < 0) fail(static_cast<int>(-rc), r.offset, r.length, "direct transfer refused, buffered retry");
    return true;
  }
  if (res < 0) {
    fail(static_cast<int>(-res), r.offset, r.length);
    return true;
  }
  if (res == 0) {
    if (op_ == OpKind::Read) {
      fail(ENODATA, r.offset, r.length, "unexpected end of file (read past end?)");
    } else {
      fail(EIO, r.offset, r.length, "write made no progress");
    }
    return true;
  }
  const auto n = static_cast<uint64_t>(res);
  r.buf += n;
  r.offset += n;
  r.length -= n;
  if (r.length == 0) return true;
  // Short transfer. O_DIRECT needs the remainder aligned; if it is not, finish it buffered.
  const uint64_t a = file_->offsetAlign();
  if (r.direct && (r.offset % a != 0 || r.length % a != 0)) {
    int64_t rc = fullPio(op_, file_->bufferedFd(), r.buf, r.length, r.offset);
    if (rc < 0) fail(static_cast<int>(-rc), r.offset, r.length, "short transfer remainder");
    return true;
  }
  return false;
}

void Job::fail(int err, uint64_t offset, uint64_t length, const char* detail) {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_) return;
  std::string d = detail;
  if (!d.empty()) d += "; ";
  d += "transfer [" + std::to_string(offset_) + ", +" + std::to_string(length_) + ")";
  error_.emplace(opName(op_), file_->path(), offset, length, err, std::move(d));
  failed_.store(true, std::memory_order_release);
}

void Job::requestsDone(uint64_t n) {
  if (done_.fetch_add(n, std::memory_order_acq_rel) + n == n_requests_) finish();
}

void Job::finish() {
  // The tail runs only after every bulk request completed: when the tail and the last aligned
  // block share a page, a concurrent buffered write could otherwise write back stale data.
  if (!failed() && bulk_ < length_) {
    int64_t rc = fullPio(op_, file_->bufferedFd(), buf_ + bulk_, length_ - bulk_, offset_ + bulk_);
    if (rc < 0) fail(static_cast<int>(-rc), offset_ + bulk_, length_ - bulk_, "unaligned tail");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    complete_ = true;
    cv_.notify_all();
  }
  if (onDone_) onDone_();  // after ready(): the woken party sees the transfer ended
}

bool Job::ready() const {
  std::lock_guard<std::mutex> lock(mu_);
  return complete_;
}

void Job::wait() const {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return complete_; });
  if (error_) throw *error_;
}

void JobQueue::push(std::shared_ptr<Job> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_all();
}

bool JobQueue::take(Request* out, bool block) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    while (!jobs_.empty()) {
      Job& j = *jobs_.front();
      if (j.failed()) {
        // Do not issue the rest of a failed transfer; account for it as finished.
        std::shared_ptr<Job> dead = std::move(jobs_.front());
        jobs_.pop_front();
        const uint64_t skipped = dead->n_requests_ - dead->next_;
        dead->next_ = dead->n_requests_;
        if (skipped) dead->requestsDone(skipped);
        continue;
      }
      const uint64_t i = j.next_++;
      const uint64_t start = i * j.chunk_;
      out->job = jobs_.front();
      out->buf = j.buf_ + start;
      out->offset = j.offset_ + start;
      out->length = std::min(j.chunk_, j.bulk_ - start);
      out->fd = j.file_->fd();
      out->direct = j.file_->direct();
      out->retries = 0;
      if (j.next_ == j.n_requests_) jobs_.pop_front();
      return true;
    }
    if (!block || stopped_) return false;
    cv_.wait(lock, [&] { return stopped_ || !jobs_.empty(); });
  }
}

void JobQueue::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
  }
  cv_.notify_all();
}

}  // namespace zeroplus::aio::detail
