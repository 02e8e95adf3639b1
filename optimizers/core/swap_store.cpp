#include "optimizers/core/swap_store.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <utility>

#include "aio/core/io_error.hpp"

namespace zeroplus::swap {
namespace {

uint64_t nowNs() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

}  // namespace

SwapStore::SwapStore(const SwapStoreOptions& options) : options_(options) {
  if (options_.bufferBytes < kHeaderBytes || options_.bufferCount == 0) {
    throw aio::IoError("swap store", options_.parent, 0, options_.bufferBytes, EINVAL,
                       "bufferBytes must hold a header and bufferCount must be >= 1");
  }
  aio::checkErrno(fs::openDirectory(options_.parent, &parentFd_), "swap store: open directory", options_.parent);
  if (faccessat(parentFd_.get(), ".", W_OK | X_OK, AT_EACCESS) != 0) {
    throw aio::IoError("swap store: directory not writable", options_.parent, 0, 0, errno);
  }
  int rc = -EEXIST;
  for (int attempt = 0; attempt < 8 && rc == -EEXIST; ++attempt) {
    dirName_ = options_.prefix + fs::randomSuffix();
    rc = fs::createPrivateDirectory(parentFd_.get(), dirName_, &dirFd_);
  }
  aio::checkErrno(rc, "swap store: create private directory", options_.parent + "/" + dirName_);
  dirPath_ = options_.parent + "/" + dirName_;
  // Liveness, as nvme_store.py: the lock is held while this store lives and dropped by the
  // kernel however the process ends, so a later sweep can tell a live directory from a crashed one.
  (void)flock(dirFd_.get(), LOCK_EX | LOCK_NB);
  try {
    engine_ = aio::Engine::create(options_.io);
  } catch (...) {
    unlinkat(parentFd_.get(), dirName_.c_str(), AT_REMOVEDIR);
    throw;
  }
}

SwapStore::~SwapStore() {
  for (auto& slot : slots_) {
    if (slot->state == State::kReading || slot->state == State::kWriting) {
      try {
        slot->ticket.wait();
      } catch (...) {  // nothing to report to: the files are removed next
      }
    }
  }
  engine_.reset();
  files_.clear();
  char name[32];
  // Every id that ever got a file is in files_ until here; remove by name (the directory is
  // ours and private, so the names are the files we created).
  for (uint64_t id : createdIds_) {
    std::snprintf(name, sizeof(name), "%05llu.swp", static_cast<unsigned long long>(id));
    unlinkat(dirFd_.get(), (options_.stem + name).c_str(), 0);
  }
  unlinkat(parentFd_.get(), dirName_.c_str(), AT_REMOVEDIR);
}

std::string SwapStore::pathOf(uint64_t id) const {
  char name[32];
  std::snprintf(name, sizeof(name), "%05llu.swp", static_cast<unsigned long long>(id));
  return dirPath_ + "/" + options_.stem + name;
}

void SwapStore::noteFault(uint64_t id, int err, std::string what) {
  faults_.push_back({id, pathOf(id), err, std::move(what)});
}

std::shared_ptr<aio::File> SwapStore::fileFor(uint64_t id, int* err) {
  auto it = files_.find(id);
  if (it != files_.end()) return it->second;
  const std::string path = pathOf(id);
  fs::UniqueFd fd;
  const std::string name = path.substr(dirPath_.size() + 1);
  const int rc = fs::createExclusive(dirFd_.get(), name, 0600, 0, &fd);
  if (rc < 0) {
    *err = -rc;
    return nullptr;
  }
  createdIds_.push_back(id);
  try {
    auto file = aio::File::adopt(fd.release(), path, options_.direct);
    files_[id] = file;
    return file;
  } catch (const aio::IoError& e) {
    *err = e.error();
    return nullptr;
  }
}

void SwapStore::noteInFlight() {
  size_t n = 0;
  for (const auto& slot : slots_) n += slot->state == State::kReading || slot->state == State::kWriting;
  stats_.maxInFlight = std::max(stats_.maxInFlight, n);
}

void SwapStore::finishWrite(size_t s) {
  Slot& slot = *slots_[s];
  try {
    const uint64_t t0 = nowNs();
    slot.ticket.wait();
    stats_.writeWaitNs += nowNs() - t0;
    stats_.bytesWritten += slot.length;
    slot.state = State::kFree;
    slotOf_.erase(slot.id);
  } catch (const aio::IoError& e) {
    slot.state = State::kDirty;  // the record stays in memory; its next store writes it again
    noteFault(slot.id, e.error(), std::string("write failed: ") + e.what());
  }
  slot.ticket = {};
}

int SwapStore::acquire(bool mayGrow, bool mayWait) {
  for (;;) {
    for (size_t s = 0; s < slots_.size(); ++s) {
      if (slots_[s]->state == State::kFree) return static_cast<int>(s);
    }
    size_t inPool = 0;  // dirty buffers are kept beyond the pool's count
    for (const auto& slot : slots_) inPool += slot->state != State::kDirty;
    int oldest = -1;
    for (size_t s = 0; s < slots_.size(); ++s) {
      if (slots_[s]->state == State::kWriting && (oldest < 0 || slots_[s]->seq < slots_[oldest]->seq)) {
        oldest = static_cast<int>(s);
      }
    }
    if (inPool >= options_.bufferCount && oldest >= 0 && (mayWait || slots_[oldest]->ticket.ready())) {
      // Pool exhausted: wait for the oldest write in flight, whose buffer is then free (or
      // dirty, when the write failed: look again).
      ++stats_.waitsForWrite;
      finishWrite(static_cast<size_t>(oldest));
      continue;
    }
    if (inPool >= options_.bufferCount && !mayGrow) return -EBUSY;  // every buffer held or being read
    auto slot = std::make_unique<Slot>();
    try {
      slot->mem = aio::AlignedBuffer(options_.bufferBytes);
    } catch (const std::bad_alloc&) {
      return -ENOMEM;
    }
    slots_.push_back(std::move(slot));
    stats_.buffers = slots_.size();
    return static_cast<int>(slots_.size() - 1);
  }
}

bool SwapStore::prefetch(const RecordKey& key) {
  if (key.generation == 0 || slotOf_.count(key.id) != 0) return false;
  if (recordBytes(key.payloadBytes) > options_.bufferBytes) return false;
  auto it = files_.find(key.id);
  if (it == files_.end()) return false;  // fetch reports the missing file
  const int s = acquire(/*mayGrow=*/false, /*mayWait=*/false);
  if (s < 0) {
    ++stats_.prefetchesRefused;
    return false;
  }
  Slot& slot = *slots_[s];
  slot.id = key.id;
  slot.length = recordBytes(key.payloadBytes);
  try {
    slot.ticket = engine_->submit({aio::OpKind::Read, it->second, slot.mem.data(), 0, slot.length});
  } catch (const aio::IoError&) {
    return false;  // fetch reads again and reports
  }
  slot.state = State::kReading;
  slotOf_[key.id] = static_cast<size_t>(s);
  ++stats_.readsAhead;
  noteInFlight();
  return true;
}

int SwapStore::fetch(const RecordKey& key, void** payload, SwapFault* fault) {
  auto fail = [&](int err, std::string what) {
    *fault = {key.id, pathOf(key.id), err, std::move(what)};
    return -err;
  };
  const uint64_t length = recordBytes(key.payloadBytes);
  if (length > options_.bufferBytes) {
    return fail(EINVAL, "record of " + std::to_string(length) + " bytes exceeds the pool's buffers of " +
                            std::to_string(options_.bufferBytes));
  }
  auto found = slotOf_.find(key.id);
  if (found == slotOf_.end()) {
    const int s = acquire(/*mayGrow=*/true, /*mayWait=*/true);
    if (s < 0) return fail(-s, "no buffer for the record");
    Slot& slot = *slots_[s];
    slot.id = key.id;
    slot.dirty = false;
    if (key.generation == 0) {  // never written: fresh, zero-filled
      std::memset(slot.mem.data(), 0, length);
      slot.state = State::kHeld;
      slotOf_[key.id] = static_cast<size_t>(s);
      *payload = static_cast<char*>(slot.mem.data()) + kHeaderBytes;
      return 0;
    }
    auto it = files_.find(key.id);
    if (it == files_.end()) return fail(ENOENT, "record file missing");
    slot.length = length;
    try {
      slot.ticket = engine_->submit({aio::OpKind::Read, it->second, slot.mem.data(), 0, length});
    } catch (const aio::IoError& e) {
      return fail(e.error(), std::string("read failed: ") + e.what());
    }
    slot.state = State::kReading;
    found = slotOf_.emplace(key.id, static_cast<size_t>(s)).first;
    ++stats_.readsOnDemand;
    noteInFlight();
  } else if (slots_[found->second]->state == State::kWriting || slots_[found->second]->state == State::kDirty) {
    ++stats_.fetchesInBuffer;
  }
  const size_t s = found->second;
  Slot& slot = *slots_[s];
  switch (slot.state) {
    case State::kHeld:
      return fail(EBUSY, "record is already held");
    case State::kWriting:
      finishWrite(s);  // its buffer still holds the record: no read
      slot.dirty = slot.state == State::kDirty;
      slot.state = State::kHeld;  // written or dirty (a failed write): either way the record is here
      slotOf_[key.id] = s;
      break;
    case State::kDirty:
      slot.dirty = true;
      slot.state = State::kHeld;
      break;
    case State::kReading: {
      const uint64_t t0 = nowNs();
      try {
        slot.ticket.wait();
        stats_.readWaitNs += nowNs() - t0;
      } catch (const aio::IoError& e) {
        stats_.readWaitNs += nowNs() - t0;
        slot.ticket = {};
        slot.state = State::kFree;
        slotOf_.erase(found);
        return fail(e.error(), std::string("read failed: ") + e.what());
      }
      slot.ticket = {};
      ++stats_.reads;
      stats_.bytesRead += length;
      std::string why;
      const uint64_t t1 = nowNs();
      const int bad = checkRecord(slot.mem.data(), key, &why);
      stats_.checksumNs += nowNs() - t1;
      if (bad != 0) {
        slot.state = State::kFree;
        slotOf_.erase(found);
        return fail(EBADMSG, "corrupt record refused: " + why);
      }
      slot.dirty = false;
      slot.state = State::kHeld;
      break;
    }
    case State::kFree:
      break;
  }
  *payload = static_cast<char*>(slot.mem.data()) + kHeaderBytes;
  return 0;
}

void SwapStore::store(const RecordKey& key) {
  auto found = slotOf_.find(key.id);
  if (found == slotOf_.end() || slots_[found->second]->state != State::kHeld) {
    noteFault(key.id, EINVAL, "store of a record that is not held");
    return;
  }
  Slot& slot = *slots_[found->second];
  slot.dirty = false;
  const uint64_t t0 = nowNs();
  sealRecord(slot.mem.data(), key);
  stats_.checksumNs += nowNs() - t0;
  slot.length = recordBytes(key.payloadBytes);
  int err = 0;
  auto file = fileFor(key.id, &err);
  if (!file) {
    slot.state = State::kDirty;
    noteFault(key.id, err, std::string("create failed: ") + std::strerror(err));
    return;
  }
  try {
    slot.ticket = engine_->submit({aio::OpKind::Write, file, slot.mem.data(), 0, slot.length});
  } catch (const aio::IoError& e) {
    slot.state = State::kDirty;
    noteFault(key.id, e.error(), std::string("write failed: ") + e.what());
    return;
  }
  slot.state = State::kWriting;
  slot.seq = ++seq_;
  ++stats_.writes;
  noteInFlight();
}

void SwapStore::release(uint64_t id) {
  auto found = slotOf_.find(id);
  if (found == slotOf_.end() || slots_[found->second]->state != State::kHeld) return;
  Slot& slot = *slots_[found->second];
  if (slot.dirty) {  // the file is stale: this buffer is the record until its next store
    slot.state = State::kDirty;
    return;
  }
  slot.state = State::kFree;
  slotOf_.erase(found);
}

int SwapStore::overwrite(uint64_t id, uint64_t payloadBytes, void** payload, SwapFault* fault) {
  auto fail = [&](int err, std::string what) {
    *fault = {id, pathOf(id), err, std::move(what)};
    return -err;
  };
  const uint64_t length = recordBytes(payloadBytes);
  if (length > options_.bufferBytes) {
    return fail(EINVAL, "record of " + std::to_string(length) + " bytes exceeds the pool's buffers of " +
                            std::to_string(options_.bufferBytes));
  }
  size_t s = 0;
  auto found = slotOf_.find(id);
  if (found != slotOf_.end()) {
    s = found->second;
    Slot& slot = *slots_[s];
    if (slot.state == State::kHeld) return fail(EBUSY, "record is already held");
    if (slot.state == State::kReading || slot.state == State::kWriting) {
      // The buffer is reused: the transfer must end first. Its outcome does not matter (a read's
      // bytes are discarded, a write's record is superseded by the one the caller stores next).
      try {
        slot.ticket.wait();
        if (slot.state == State::kWriting) stats_.bytesWritten += slot.length;
      } catch (const aio::IoError&) {
      }
      slot.ticket = {};
    }
  } else {
    const int a = acquire(/*mayGrow=*/true, /*mayWait=*/true);
    if (a < 0) return fail(-a, "no buffer for the record");
    s = static_cast<size_t>(a);
    slotOf_[id] = s;
  }
  Slot& slot = *slots_[s];
  slot.id = id;
  slot.dirty = false;
  slot.state = State::kHeld;
  std::memset(slot.mem.data(), 0, length);
  *payload = static_cast<char*>(slot.mem.data()) + kHeaderBytes;
  return 0;
}

std::vector<SwapFault> SwapStore::poll() {
  for (size_t s = 0; s < slots_.size(); ++s) {
    if (slots_[s]->state == State::kWriting && slots_[s]->ticket.ready()) finishWrite(s);
  }
  return std::exchange(faults_, {});
}

std::vector<SwapFault> SwapStore::drain() {
  for (size_t s = 0; s < slots_.size(); ++s) {
    if (slots_[s]->state == State::kWriting) finishWrite(s);
  }
  return std::exchange(faults_, {});
}

}  // namespace zeroplus::swap
