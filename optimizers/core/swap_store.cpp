#include "optimizers/core/swap_store.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
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

bool sameKey(const RecordKey& a, const RecordKey& b) {
  return a.id == b.id && a.generation == b.generation && a.payloadBytes == b.payloadBytes &&
         a.layoutTag == b.layoutTag;
}

uint64_t nowNs() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

}  // namespace

SwapStore::SwapStore(const SwapStoreOptions& options) : options_(options), bufferBytes_(options.bufferBytes) {
  if (options_.bufferBytes < kHeaderBytes || options_.bufferCount == 0) {
    throw aio::IoError("swap store", options_.parent, 0, options_.bufferBytes, EINVAL,
                       "bufferBytes must hold a header and bufferCount must be >= 1");
  }
  aio::checkErrno(fs::openDirectory(options_.parent, &parentFd_), "swap store: open directory", options_.parent);
  if (faccessat(parentFd_.get(), ".", W_OK | X_OK, AT_EACCESS) != 0) {
    throw aio::IoError("swap store: directory not writable", options_.parent, 0, 0, errno);
  }
  if (options_.inPlace) {  // the caller's private directory (its owner sweeps and locks it)
    dirPath_ = options_.parent;
    // Reopened without following a link (openDirectory follows one the user owns) and checked as
    // the store's own directory would be: record files hold optimizer state, and a directory
    // another user owns or can enter lets them read it or plant files under our names.
    dirFd_ = fs::UniqueFd(::open(options_.parent.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (dirFd_.get() < 0) throw aio::IoError("swap store: open directory", options_.parent, 0, 0, errno);
    struct stat st {};
    if (fstat(dirFd_.get(), &st) != 0) throw aio::IoError("swap store: stat directory", options_.parent, 0, 0, errno);
    if (st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
      char mode[8];
      std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
      throw aio::IoError("swap store: directory not private", options_.parent, 0, 0, EPERM,
                         "owned by uid " + std::to_string(st.st_uid) + " with mode " + mode + ", expected uid " +
                             std::to_string(geteuid()) + " and no group/other permissions");
    }
  } else {
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
  }
  try {
    engine_ = aio::Engine::create(options_.io);
    pump_ = std::thread([this] { pump(); });
  } catch (...) {
    engine_.reset();
    if (!options_.inPlace) unlinkat(parentFd_.get(), dirName_.c_str(), AT_REMOVEDIR);
    throw;
  }
}

SwapStore::~SwapStore() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    wakePump();
  }
  if (pump_.joinable()) pump_.join();  // it returns once no transfer is in flight
  engine_.reset();
  files_.clear();
  for (auto& slot : slots_) deallocate(&slot->mem);
  char name[32];
  // Every id that ever got a file is in files_ until here; remove by name (the directory is
  // ours and private, so the names are the files we created).
  for (uint64_t id : createdIds_) {
    std::snprintf(name, sizeof(name), "%05llu.swp", static_cast<unsigned long long>(id));
    unlinkat(dirFd_.get(), (options_.stem + name).c_str(), 0);
  }
  if (!options_.inPlace) unlinkat(parentFd_.get(), dirName_.c_str(), AT_REMOVEDIR);
}

std::string SwapStore::pathOf(uint64_t id) const {
  char name[32];
  std::snprintf(name, sizeof(name), "%05llu.swp", static_cast<unsigned long long>(id));
  return dirPath_ + "/" + options_.stem + name;
}

void SwapStore::noteFault(uint64_t id, int err, std::string what) {
  faults_.push_back({id, pathOf(id), err, std::move(what)});
}

namespace {

// Opens the existing record file `name` in dirFd (O_NOFOLLOW: a link is refused): a regular
// file of this effective uid (nobody else's file becomes a record). 0 or a positive errno.
int openExisting(int dirFd, const std::string& name, fs::UniqueFd* out, struct stat* st) {
  fs::UniqueFd fd(::openat(dirFd, name.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC));
  if (fd.get() < 0) return errno;
  if (fstat(fd.get(), st) != 0) return errno;
  if (!S_ISREG(st->st_mode)) return EINVAL;
  if (st->st_uid != geteuid()) return EPERM;
  *out = std::move(fd);
  return 0;
}

// Preallocates `bytes` of fd (a full disk shows here, not in a later write); a file system
// without fallocate gets its size set instead. 0 or a positive errno.
int reserveBytes(int fd, uint64_t bytes) {
  const int rc = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (rc == 0) return 0;
  if (rc != EOPNOTSUPP && rc != EINVAL) return rc;
  struct stat st {};
  if (fstat(fd, &st) != 0) return errno;
  if (static_cast<uint64_t>(st.st_size) < bytes && ftruncate(fd, static_cast<off_t>(bytes)) != 0) return errno;
  return 0;
}

}  // namespace

std::shared_ptr<aio::File> SwapStore::fileFor(uint64_t id, uint64_t bytes, int* err, std::string* what) {
  auto it = files_.find(id);
  if (it != files_.end()) {
    uint64_t& reserved = reserved_[id];
    if (bytes > reserved) {  // the record grew
      const int rc = reserveBytes(it->second->fd(), bytes);
      if (rc != 0) {
        *err = rc;
        *what = "create failed: cannot reserve " + std::to_string(bytes) + " bytes: " + std::strerror(rc);
        return nullptr;
      }
      reserved = bytes;
    }
    return it->second;
  }
  const std::string path = pathOf(id);
  fs::UniqueFd fd;
  const std::string name = path.substr(dirPath_.size() + 1);
  int rc = fs::createExclusive(dirFd_.get(), name, 0600, 0, &fd);
  const bool created = rc == 0;
  if (rc == -EEXIST) {
    // A file by the record's name that the store has no descriptor for: the caller renamed it
    // there and its adopt() failed (files_ had already dropped the old one). It is the record's
    // file now; refusing it would make every later store of the record fail with EEXIST.
    struct stat st {};
    rc = -openExisting(dirFd_.get(), name, &fd, &st);
  }
  if (rc < 0) {
    *err = -rc;
    *what = std::string("create failed: ") + std::strerror(-rc);
    return nullptr;
  }
  if (const int r = reserveBytes(fd.get(), bytes); r != 0) {
    if (created) unlinkat(dirFd_.get(), name.c_str(), 0);  // created again at the next store
    *err = r;
    *what = "create failed: cannot reserve " + std::to_string(bytes) + " bytes: " + std::strerror(r);
    return nullptr;
  }
  if (std::find(createdIds_.begin(), createdIds_.end(), id) == createdIds_.end()) createdIds_.push_back(id);
  try {
    auto file = aio::File::adopt(fd.release(), path, options_.direct);
    files_[id] = file;
    reserved_[id] = bytes;
    return file;
  } catch (const aio::IoError& e) {
    *err = e.error();
    *what = std::string("create failed: ") + e.what();
    return nullptr;
  }
}

SwapStats SwapStore::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

void SwapStore::resetPeak() {
  std::lock_guard<std::mutex> lk(mu_);
  stats_.peakBufferBytes = stats_.bufferBytes;
}

void SwapStore::noteInFlight() {
  size_t n = 0;
  for (const auto& slot : slots_) n += inFlight(slot->state);
  stats_.maxInFlight = std::max(stats_.maxInFlight, n);
}

void SwapStore::wakePump() { waker_->wake(); }

aio::Ticket SwapStore::submit(aio::OpKind op, std::shared_ptr<aio::File> file, Slot& slot) {
  // The callback shares the waker: safe should it run after the store is gone.
  return engine_->submit({op, std::move(file), slot.mem.data(), 0, slot.length}, [w = waker_] { w->wake(); });
}

// -- buffers --

int SwapStore::allocate(aio::AlignedBuffer* mem, size_t bytes) {
  try {
    *mem = aio::AlignedBuffer(bytes);
  } catch (const std::bad_alloc&) {
    return -ENOMEM;
  }
  if (options_.onAllocate) options_.onAllocate(mem->data(), mem->size());
  stats_.bufferBytes += mem->size();
  stats_.peakBufferBytes = std::max(stats_.peakBufferBytes, stats_.bufferBytes);
  return 0;
}

void SwapStore::deallocate(aio::AlignedBuffer* mem) {
  if (mem->data() == nullptr) return;
  if (options_.onFree) options_.onFree(mem->data(), mem->size());
  stats_.bufferBytes -= mem->size();
  *mem = aio::AlignedBuffer();
}

int SwapStore::fit(size_t s, size_t bytes) {
  aio::AlignedBuffer& mem = slots_[s]->mem;
  if (mem.size() >= bytes) return 0;
  deallocate(&mem);  // first: the pool never holds both (peakBufferBytes)
  return allocate(&mem, bytes);
}

int SwapStore::newSlot() {
  auto slot = std::make_unique<Slot>();
  if (const int rc = allocate(&slot->mem, bufferBytes_); rc < 0) return rc;
  slots_.push_back(std::move(slot));
  stats_.buffers = slots_.size();
  return static_cast<int>(slots_.size() - 1);
}

int SwapStore::freeSlot() {
  int found = -1;
  for (size_t s = 0; s < slots_.size() && found < 0; ++s) {
    if (slots_[s]->state == State::kFree) found = static_cast<int>(s);
  }
  if (found < 0) {
    size_t inPool = 0;  // dirty buffers are kept beyond the pool's count
    for (const auto& slot : slots_) inPool += slot->state != State::kDirty;
    if (inPool < options_.bufferCount) return newSlot();
    // The least recently written cached record gives its buffer up (it is in its file).
    for (size_t s = 0; s < slots_.size(); ++s) {
      const Slot& slot = *slots_[s];
      if (slot.state == State::kCached && !slot.linger && (found < 0 || slot.seq < slots_[found]->seq)) {
        found = static_cast<int>(s);
      }
    }
    if (found < 0) return -EBUSY;
    slotOf_.erase(slots_[found]->key.id);
    slots_[found]->state = State::kFree;
  }
  if (const int rc = fit(static_cast<size_t>(found), bufferBytes_); rc < 0) return rc;
  return found;
}

int SwapStore::acquireForOwner(Lock& lk, uint64_t keepId) {
  struct NeedsBuffer {  // set while this call may wait; cleared on every return
    bool& flag;
    ~NeedsBuffer() { flag = false; }
  } needs{ownerNeedsBuffer_};
  for (;;) {
    const int s = freeSlot();
    if (s != -EBUSY) return s;
    ownerNeedsBuffer_ = true;
    bool writing = false, reading = false;
    int evict = -1;
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& slot = *slots_[i];
      if (slot.state == State::kSeal || slot.state == State::kSealing || slot.state == State::kWriting) {
        writing = writing || !slot.keep;
      }
      if ((slot.state == State::kReading || slot.state == State::kChecking) && slot.ahead) reading = true;
      // The record read ahead last is the one needed last: drop it first.
      if (slot.state == State::kReady && slot.ahead && !slot.linger && slot.key.id != keepId &&
          (evict < 0 || slot.seq > slots_[evict]->seq)) {
        evict = static_cast<int>(i);
      }
    }
    if (writing) {  // pool exhausted: the oldest write frees a buffer (or leaves it dirty: look again)
      ++stats_.waitsForWrite;
      const uint64_t t0 = nowNs();
      ownerCv_.wait(lk);
      stats_.writeWaitNs += nowNs() - t0;
      continue;
    }
    if (evict >= 0) {
      Slot& slot = *slots_[evict];
      slotOf_.erase(slot.key.id);
      slot.state = State::kFree;
      ++stats_.evictions;
      if (const int rc = fit(static_cast<size_t>(evict), bufferBytes_); rc < 0) return rc;
      return evict;
    }
    if (reading) {  // a read ahead becomes evictable when it ends
      ownerCv_.wait(lk);
      continue;
    }
    return newSlot();  // every buffer held or dirty: grow past the pool
  }
}

int SwapStore::startRead(size_t s, const RecordKey& key, bool ahead, std::string* why) {
  Slot& slot = *slots_[s];
  slot.key = key;
  slot.length = recordBytes(key.payloadBytes);
  slot.dirty = slot.keep = slot.linger = slot.fromWrite = false;
  slot.ahead = ahead;
  slot.err = 0;
  slot.why.clear();
  try {
    slot.ticket = submit(aio::OpKind::Read, files_.at(key.id), slot);
  } catch (const aio::IoError& e) {
    if (why != nullptr) *why = std::string("read failed: ") + e.what();
    return -e.error();
  }
  slot.state = State::kReading;
  slot.seq = ++seq_;
  slotOf_[key.id] = s;
  ++(ahead ? stats_.readsAhead : stats_.readsOnDemand);
  noteInFlight();
  wakePump();
  return 0;
}

void SwapStore::startPlannedReads() {
  if (ownerNeedsBuffer_) return;  // the next free buffer is the owner's (acquireForOwner)
  for (auto it = plan_.begin(); it != plan_.end();) {
    const RecordKey key = *it;
    auto found = slotOf_.find(key.id);
    if (found != slotOf_.end()) {
      const State st = slots_[found->second]->state;
      // Being written: read after its write, in its turn (the file is not final yet).
      if (st == State::kSeal || st == State::kSealing || st == State::kWriting) {
        ++it;
        continue;
      }
      Slot& slot = *slots_[found->second];
      if (st == State::kCached && sameKey(slot.key, key)) {  // wanted again: protect it as a read ahead
        slot.state = State::kReady;
        slot.ahead = true;
        slot.err = 0;
        slot.seq = ++seq_;
      } else if (st == State::kCached && !slot.linger) {  // another generation: read it anew
        slotOf_.erase(found);
        slot.state = State::kFree;
        continue;
      }
      it = plan_.erase(it);  // in a buffer already
      continue;
    }
    if (key.generation == 0 || recordBytes(key.payloadBytes) > bufferBytes_ || files_.count(key.id) == 0) {
      it = plan_.erase(it);  // fetch makes it, or reports it
      continue;
    }
    const int s = freeSlot();
    if (s < 0) return;  // none free: the next write that ends frees one
    (void)startRead(static_cast<size_t>(s), key, /*ahead=*/true, nullptr);  // a refused read: fetch reports it
    it = plan_.erase(it);
  }
}

// -- the pump thread --

void SwapStore::completeWrite(size_t s) {
  Slot& slot = *slots_[s];
  try {
    slot.ticket.wait();  // ready: does not block
    stats_.bytesWritten += slot.length;
    if (slot.keep) {  // the owner wants this record: it stays, sealed, as if read
      slot.state = State::kReady;
      slot.err = 0;
      slot.ahead = false;
      slot.fromWrite = false;
    } else if (options_.keepWritten || slot.linger) {  // cached: the buffer equals the file
      slot.state = State::kCached;
      slot.fromWrite = true;
      slot.ahead = false;
    } else {
      slot.state = State::kFree;
      slotOf_.erase(slot.key.id);
    }
  } catch (const aio::IoError& e) {
    slot.state = State::kDirty;  // the record stays in memory; its next store writes it again
    noteFault(slot.key.id, e.error(), std::string("write failed: ") + e.what());
  }
  slot.keep = false;
  slot.ticket = {};
  slot.file.reset();
}

void SwapStore::pump() {
  Lock lk(mu_);
  for (;;) {
    bool moved = false;
    // 1. Transfers that ended. A read is checked here (its CRC-32, unlocked: the slot is the
    // pump's while kChecking, and the owner waits for kReady).
    for (size_t s = 0; s < slots_.size(); ++s) {
      Slot& slot = *slots_[s];
      if (!inFlight(slot.state) || !slot.ticket.ready()) continue;
      moved = true;
      if (slot.state == State::kWriting) {
        completeWrite(s);
        continue;
      }
      slot.state = State::kChecking;
      const aio::Ticket ticket = slot.ticket;
      const RecordKey key = slot.key;
      void* mem = slot.mem.data();
      int err = 0;
      std::string why;
      uint64_t ns = 0;
      lk.unlock();
      try {
        ticket.wait();
        const uint64_t t0 = nowNs();
        if (checkRecord(mem, key, &why) != 0) {
          err = EBADMSG;
          why = "corrupt record refused: " + why;
        }
        ns = nowNs() - t0;
      } catch (const aio::IoError& e) {
        err = e.error();
        why = std::string("read failed: ") + e.what();
      }
      lk.lock();
      Slot& done = *slots_[s];
      done.ticket = {};
      done.err = err;
      done.why = std::move(why);
      done.state = State::kReady;
      stats_.checksumNs += ns;
      if (err == 0 || err == EBADMSG) {
        ++stats_.reads;
        stats_.bytesRead += done.length;
      }
    }
    // 2. One stored record: seal it (CRC-32, unlocked: the slot is the pump's while kSealing) and
    // start its write. The oldest first.
    int seal = -1;
    for (size_t s = 0; s < slots_.size() && !stop_; ++s) {
      if (slots_[s]->state == State::kSeal && (seal < 0 || slots_[s]->seq < slots_[seal]->seq)) seal = static_cast<int>(s);
    }
    if (seal >= 0) {
      moved = true;
      Slot& slot = *slots_[seal];
      slot.state = State::kSealing;
      void* mem = slot.mem.data();
      const RecordKey key = slot.key;
      lk.unlock();
      const uint64_t t0 = nowNs();
      sealRecord(mem, key);
      const uint64_t ns = nowNs() - t0;
      lk.lock();
      stats_.checksumNs += ns;
      Slot& sealed = *slots_[seal];
      try {
        sealed.ticket = submit(aio::OpKind::Write, sealed.file, sealed);
        sealed.state = State::kWriting;
        sealed.seq = ++seq_;
        ++stats_.writes;
        noteInFlight();
      } catch (const aio::IoError& e) {
        sealed.state = State::kDirty;
        sealed.keep = false;
        sealed.file.reset();
        noteFault(key.id, e.error(), std::string("write failed: ") + e.what());
      }
    }
    // 3. Planned reads into the buffers that are free now.
    if (!stop_) startPlannedReads();
    if (moved) {
      ownerCv_.notify_all();
      continue;
    }
    // 4. Sleep until a transfer ends (aio's onDone) or the owner hands over work. A wake between
    // the checks above and the wait is not lost: the flag stays set.
    bool busy = false;
    for (const auto& slot : slots_) busy = busy || inFlight(slot->state);
    if (stop_ && !busy) return;  // stored records not yet submitted are dropped
    lk.unlock();
    waker_->sleep();
    lk.lock();
  }
}

// -- the owner --

int SwapStore::settle(Lock& lk, uint64_t id) {
  for (;;) {
    auto found = slotOf_.find(id);
    if (found == slotOf_.end()) return -1;
    Slot& slot = *slots_[found->second];
    switch (slot.state) {
      case State::kReading:
      case State::kChecking:
        ownerCv_.wait(lk);
        break;
      case State::kSeal:
      case State::kSealing:
      case State::kWriting: {
        slot.keep = true;
        const uint64_t t0 = nowNs();
        ownerCv_.wait(lk);
        stats_.writeWaitNs += nowNs() - t0;
        break;
      }
      default:
        return static_cast<int>(found->second);
    }
  }
}

void SwapStore::planReads(std::vector<RecordKey> keys) {
  std::lock_guard<std::mutex> lk(mu_);
  plan_.assign(keys.begin(), keys.end());
  startPlannedReads();
  wakePump();
}

bool SwapStore::prefetch(const RecordKey& key) {
  std::lock_guard<std::mutex> lk(mu_);
  if (key.generation == 0 || slotOf_.count(key.id) != 0) return false;
  if (recordBytes(key.payloadBytes) > bufferBytes_) return false;  // raised by reserve()
  if (files_.count(key.id) == 0) return false;  // fetch reports the missing file
  const int s = freeSlot();
  if (s < 0) {
    ++stats_.prefetchesRefused;
    return false;
  }
  return startRead(static_cast<size_t>(s), key, /*ahead=*/true, nullptr) == 0;  // fetch reads again and reports
}

int SwapStore::fetch(const RecordKey& key, void** payload, SwapFault* fault) {
  Lock lk(mu_);
  auto fail = [&](int err, std::string what) {
    *fault = {key.id, pathOf(key.id), err, std::move(what)};
    return -err;
  };
  const uint64_t length = recordBytes(key.payloadBytes);
  if (length > bufferBytes_) {
    return fail(EINVAL, "record of " + std::to_string(length) + " bytes exceeds the pool's buffers of " +
                            std::to_string(bufferBytes_));
  }
  for (auto it = plan_.begin(); it != plan_.end();) it = it->id == key.id ? plan_.erase(it) : it + 1;
  bool counted = false;
  for (;;) {
    auto found = slotOf_.find(key.id);
    if (found == slotOf_.end()) {
      const int a = acquireForOwner(lk, key.id);
      if (a < 0) return fail(-a, "no buffer for the record");
      if (slotOf_.count(key.id) != 0) continue;  // cannot happen (only the owner reads it now): look again
      Slot& slot = *slots_[a];
      if (key.generation == 0) {  // never written: fresh, zero-filled
        std::memset(slot.mem.data(), 0, length);
        slot.key = key;
        slot.dirty = slot.keep = slot.ahead = slot.linger = slot.fromWrite = false;
        slot.state = State::kHeld;
        slotOf_[key.id] = static_cast<size_t>(a);
        *payload = static_cast<char*>(slot.mem.data()) + kHeaderBytes;
        return 0;
      }
      if (files_.count(key.id) == 0) return fail(ENOENT, "record file missing");
      std::string why;
      const int rc = startRead(static_cast<size_t>(a), key, /*ahead=*/false, &why);
      if (rc < 0) return fail(-rc, why);
      continue;
    }
    const size_t s = found->second;
    Slot& slot = *slots_[s];
    switch (slot.state) {
      case State::kHeld:
        return fail(EBUSY, "record is already held");
      case State::kReading:
      case State::kChecking: {
        const uint64_t t0 = nowNs();
        ownerCv_.wait(lk);
        stats_.readWaitNs += nowNs() - t0;
        continue;
      }
      case State::kSeal:
      case State::kSealing:
      case State::kWriting: {  // its buffer holds the record: no read once the write ended
        if (!counted) ++stats_.fetchesInBuffer;
        counted = true;
        slot.keep = true;
        const uint64_t t0 = nowNs();
        ownerCv_.wait(lk);
        stats_.writeWaitNs += nowNs() - t0;
        continue;
      }
      case State::kDirty:  // its last write failed: the buffer is the record
        if (!counted) ++stats_.fetchesInBuffer;
        slot.dirty = true;
        slot.linger = false;
        slot.state = State::kHeld;
        break;
      case State::kCached:
      case State::kReady:
        if (!sameKey(slot.key, key)) {  // read or written for another generation: read again
          if (slot.linger) return fail(EBUSY, "record is still read by its owner (stored with linger)");
          slot.state = State::kFree;
          slotOf_.erase(found);
          continue;
        }
        if (slot.fromWrite) ++stats_.cacheHits;
        slot.fromWrite = false;
        slot.linger = false;
        if (slot.err != 0) {
          const int err = slot.err;
          std::string why = std::move(slot.why);
          slot.state = State::kFree;
          slotOf_.erase(found);
          return fail(err, std::move(why));
        }
        slot.dirty = false;
        slot.ahead = false;
        slot.state = State::kHeld;
        break;
      case State::kFree:
        slotOf_.erase(found);
        continue;
    }
    *payload = static_cast<char*>(slot.mem.data()) + kHeaderBytes;
    return 0;
  }
}

void SwapStore::store(const RecordKey& key, bool linger) {
  std::lock_guard<std::mutex> lk(mu_);
  auto found = slotOf_.find(key.id);
  if (found == slotOf_.end() || slots_[found->second]->state != State::kHeld) {
    noteFault(key.id, EINVAL, "store of a record that is not held");
    return;
  }
  Slot& slot = *slots_[found->second];
  if (const uint64_t length = recordBytes(key.payloadBytes); length > slot.mem.size()) {
    // The record grew while held in a buffer allocated before a reserve(): sealing it would
    // write past the buffer's end. It stays held as it was (the owner moves it: heldCapacity).
    noteFault(key.id, EINVAL,
              "store refused: record of " + std::to_string(length) + " bytes exceeds its held buffer of " +
                  std::to_string(slot.mem.size()) + " bytes");
    return;
  }
  slot.dirty = false;
  slot.key = key;
  slot.length = recordBytes(key.payloadBytes);
  slot.linger = linger;
  int err = 0;
  std::string what;
  auto file = fileFor(key.id, slot.length, &err, &what);
  if (!file) {
    slot.state = State::kDirty;
    noteFault(key.id, err, std::move(what));
    return;
  }
  slot.file = std::move(file);
  slot.state = State::kSeal;  // the pump seals it and starts the write
  slot.seq = ++seq_;
  wakePump();
}

void SwapStore::release(uint64_t id) {
  std::lock_guard<std::mutex> lk(mu_);
  auto found = slotOf_.find(id);
  if (found == slotOf_.end()) return;
  Slot& slot = *slots_[found->second];
  if (slot.state != State::kHeld) {  // the end of a linger
    if (slot.linger) {
      slot.linger = false;
      if (slot.state == State::kCached && !options_.keepWritten) {
        slot.state = State::kFree;
        slotOf_.erase(found);
      }
      wakePump();  // a planned read may take the buffer now
    }
    return;
  }
  if (slot.dirty) {  // the file is stale: this buffer is the record until its next store
    slot.state = State::kDirty;
    return;
  }
  if (options_.keepWritten && slot.key.generation != 0) {  // unchanged: still equals its file
    slot.state = State::kCached;
    slot.fromWrite = true;
    slot.seq = ++seq_;
    wakePump();
    return;
  }
  slot.state = State::kFree;
  slotOf_.erase(found);
}

int SwapStore::overwrite(uint64_t id, uint64_t payloadBytes, void** payload, SwapFault* fault) {
  Lock lk(mu_);
  auto fail = [&](int err, std::string what) {
    *fault = {id, pathOf(id), err, std::move(what)};
    return -err;
  };
  const uint64_t length = recordBytes(payloadBytes);
  if (length > bufferBytes_) {
    return fail(EINVAL, "record of " + std::to_string(length) + " bytes exceeds the pool's buffers of " +
                            std::to_string(bufferBytes_));
  }
  for (auto it = plan_.begin(); it != plan_.end();) it = it->id == id ? plan_.erase(it) : it + 1;
  auto found = slotOf_.find(id);
  if (found != slotOf_.end() && slots_[found->second]->state == State::kHeld) {
    return fail(EBUSY, "record is already held");
  }
  if (found != slotOf_.end() && slots_[found->second]->linger) {  // zeroing it would change what the owner reads
    return fail(EBUSY, "record is still read by its owner (stored with linger)");
  }
  // The buffer is reused: a transfer in flight must end first. Its outcome does not matter (a
  // read's bytes are discarded, a write's record is superseded by the one the caller stores next,
  // so its failure is not reported).
  const size_t faultsBefore = faults_.size();
  int s = settle(lk, id);
  for (size_t i = faults_.size(); i > faultsBefore; --i) {
    if (faults_[i - 1].id == id) faults_.erase(faults_.begin() + static_cast<std::ptrdiff_t>(i - 1));
  }
  if (s < 0) {
    s = acquireForOwner(lk, id);
    if (s < 0) return fail(-s, "no buffer for the record");
    slotOf_[id] = static_cast<size_t>(s);
  }
  if (const int rc = fit(static_cast<size_t>(s), length); rc < 0) {  // a buffer of before a reserve()
    slotOf_.erase(id);
    slots_[s]->state = State::kFree;
    return fail(-rc, "no buffer for the record");
  }
  Slot& slot = *slots_[s];
  slot.key = {id, 0, payloadBytes, 0};
  slot.dirty = slot.keep = slot.ahead = slot.linger = slot.fromWrite = false;
  slot.state = State::kHeld;
  std::memset(slot.mem.data(), 0, length);
  *payload = static_cast<char*>(slot.mem.data()) + kHeaderBytes;
  return 0;
}

std::vector<SwapFault> SwapStore::poll() {
  std::lock_guard<std::mutex> lk(mu_);  // the pump has taken the writes that ended
  return std::exchange(faults_, {});
}

std::vector<SwapFault> SwapStore::drain() {
  Lock lk(mu_);
  for (;;) {
    bool writing = false;
    for (const auto& slot : slots_) {
      writing = writing || slot->state == State::kSeal || slot->state == State::kSealing ||
                slot->state == State::kWriting;
    }
    if (!writing) break;
    const uint64_t t0 = nowNs();
    ownerCv_.wait(lk);
    stats_.writeWaitNs += nowNs() - t0;
  }
  return std::exchange(faults_, {});
}

}  // namespace zeroplus::swap

namespace zeroplus::swap {

void SwapStore::reserve(size_t bytes) {
  std::lock_guard<std::mutex> lk(mu_);
  bufferBytes_ = std::max(bufferBytes_, bytes);
}

size_t SwapStore::bufferBytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return bufferBytes_;
}

size_t SwapStore::heldCapacity(uint64_t id) const {
  std::lock_guard<std::mutex> lk(mu_);
  auto found = slotOf_.find(id);
  if (found == slotOf_.end() || slots_[found->second]->state != State::kHeld) return 0;
  return slots_[found->second]->mem.size() - kHeaderBytes;  // every buffer holds a header (constructor)
}

const char* SwapStore::engineName() const { return aio::toString(engine_->kind()); }

int SwapStore::drop(Lock& lk, uint64_t id) {
  auto found = slotOf_.find(id);
  // A lingering record's payload is still read by the owner (only the owner ends a linger, so
  // the check holds across settle()): freeing the buffer would hand it to another record.
  if (found != slotOf_.end() && (slots_[found->second]->state == State::kHeld || slots_[found->second]->linger)) {
    return -EBUSY;
  }
  for (auto it = plan_.begin(); it != plan_.end();) it = it->id == id ? plan_.erase(it) : it + 1;
  const int s = settle(lk, id);  // a transfer of the old record ends first (its outcome is moot)
  if (s >= 0) {
    Slot& slot = *slots_[s];
    if (slot.state == State::kHeld) return -EBUSY;
    slot.state = State::kFree;
    slot.dirty = slot.keep = slot.linger = slot.fromWrite = false;
    slotOf_.erase(id);
  }
  for (size_t i = faults_.size(); i > 0; --i) {
    if (faults_[i - 1].id == id) faults_.erase(faults_.begin() + static_cast<std::ptrdiff_t>(i - 1));
  }
  wakePump();
  return 0;
}

int SwapStore::forget(uint64_t id) {
  Lock lk(mu_);
  return drop(lk, id);
}

int SwapStore::adopt(uint64_t id, SwapFault* fault) {
  Lock lk(mu_);
  const std::string path = pathOf(id);
  if (drop(lk, id) < 0) {
    *fault = {id, path, EBUSY, "record is held, or still read by its owner (stored with linger)"};
    return -EBUSY;
  }
  files_.erase(id);  // the old file (its descriptor names the replaced inode)
  reserved_.erase(id);
  const std::string name = path.substr(dirPath_.size() + 1);
  fs::UniqueFd fd;
  struct stat st {};
  if (const int err = openExisting(dirFd_.get(), name, &fd, &st); err != 0) {
    *fault = {id, path, err, std::string("open failed: ") + std::strerror(err)};
    return -err;
  }
  if (std::find(createdIds_.begin(), createdIds_.end(), id) == createdIds_.end()) createdIds_.push_back(id);
  try {
    files_[id] = aio::File::adopt(fd.release(), path, options_.direct);
  } catch (const aio::IoError& e) {
    *fault = {id, path, e.error(), std::string("open failed: ") + e.what()};
    return -e.error();
  }
  reserved_[id] = static_cast<uint64_t>(st.st_size);
  return 0;
}

}  // namespace zeroplus::swap
