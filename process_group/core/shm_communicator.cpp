// The same-host shared-memory transport: set-up and agreement, the wait/publish primitives and
// the chunked algorithms. Protocol and safety argument: shm_communicator.hpp.
#include "process_group/core/shm_communicator.hpp"

#include <fcntl.h>
#include <immintrin.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <fstream>
#include <sstream>

#include "process_group/core/reduce.hpp"

namespace zeroplus::pg::detail {

struct alignas(64) ShmCommunicator::Control {
  uint64_t magic;
  int32_t pid;
  int32_t rank;
  uint64_t chunkBytes;
  alignas(64) std::atomic<uint32_t> phase;  // futex word: last phase this rank published
  alignas(64) std::atomic<uint32_t> waiters;  // peers sleeping (or about to) on `phase`
  // Set once, by the first error or abort (raiseFailed), never changed or cleared: 1, or 2 +
  // the rank this rank lost first (so peers name that rank rather than this one).
  std::atomic<uint32_t> failed;
  std::atomic<uint64_t> proposal[2];  // agreeMin values, slot = call counter & 1
  // The op descriptor (op_descriptor.hpp: packHead, count, seq) of op k in slot k & 1, and the
  // element counts of a fused batch's candidates (fused[slot][0] is desc[slot][1]).
  std::atomic<uint64_t> desc[2][3];
  std::atomic<uint64_t> fused[2][kShmMaxFusedOps];
};

namespace {

// The failed flag's value: 2 + the rank this one lost first, else 1.
uint32_t failedCode(int culprit) { return culprit >= 0 ? static_cast<uint32_t>(culprit) + 2 : 1; }

// shm=auto fell back to TCP although every rank shares this host: slower for large collectives
// and easy to miss, so say it once per process (what, why, how to fix, how to silence). A
// group spanning hosts falls back silently: there is nothing to fix.
void noteFallback(int rank, const std::string& why) {
  static std::once_flag once;
  std::call_once(once, [&] {
    // The space problem already names its fixes; others get the generic ones.
    const char* fix = why.find("enlarge /dev/shm") == std::string::npos
                          ? " To fix: check /dev/shm (mounted, writable, large enough: docker --shm-size)."
                          : "";
    std::fprintf(stderr,
                 "zeroplus: shared memory unavailable, so this group (rank %d) uses TCP over loopback, which is "
                 "slower for large collectives: %s.%s To silence this: ZEROPLUS_SHM=off. (Said once per process.)\n",
                 rank, why.c_str(), fix);
  });
}

constexpr uint64_t kControlMagic = 0x5A50534D31ull;  // "ZPSM1"
constexpr size_t kControlBytes = 4096;
static_assert(sizeof(ShmCommunicator::Control) <= kControlBytes);
static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "shared-memory atomics must be lock-free to work across processes");

size_t segmentBytes(size_t chunk) { return kControlBytes + 4 * chunk; }

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

std::string readFirstLine(const char* path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

std::string linkTarget(const char* path) {
  char buf[256];
  const ssize_t n = ::readlink(path, buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("?");
}

// Two ranks with equal host ids can map each other's /dev/shm segments and see each other's
// pids: same kernel boot, same pid and ipc namespaces, same /dev/shm file system.
std::string hostId() {
  char host[256] = {0};
  ::gethostname(host, sizeof(host) - 1);
  struct stat st {};
  const bool shm = ::stat("/dev/shm", &st) == 0;
  std::ostringstream os;
  os << host << '/' << readFirstLine("/proc/sys/kernel/random/boot_id") << '/' << linkTarget("/proc/self/ns/pid")
     << '/' << linkTarget("/proc/self/ns/ipc") << '/' << (shm ? st.st_dev : 0) << ':' << (shm ? st.st_ino : 0);
  return os.str();
}

// kill(pid, 0) alone is not enough: a dead rank whose parent has not reaped it yet is a zombie
// that still "exists". /proc/<pid>/stat's state field tells them apart.
bool processGone(int pid) {
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(f, stat)) return false;  // cannot tell: assume alive, the deadline still holds
  const auto close = stat.rfind(") ");
  if (close == std::string::npos || close + 2 >= stat.size()) return false;
  const char state = stat[close + 2];
  return state == 'Z' || state == 'X';
}

std::vector<uint8_t> bytesOf(const std::string& s) { return {s.begin(), s.end()}; }
std::string stringOf(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

double secondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string fmtSeconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", s);
  return buf;
}

// Block boundaries of a chunk of `count` elements split over n ranks, rounded to 64 bytes so
// every rank's reduction runs on aligned, full vectors.
size_t blockStart(size_t count, size_t es, int q, int n) {
  if (q >= n) return count;
  const size_t align = std::max<size_t>(1, 64 / es);
  const size_t at = (count * static_cast<size_t>(q) / static_cast<size_t>(n)) / align * align;
  return std::min(at, count);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Set-up

std::unique_ptr<Communicator> ShmCommunicator::maybeCreate(Rendezvous& rendezvous, const CommunicatorOptions& options,
                                                           std::unique_ptr<Communicator>& inner) {
  const int rank = options.rank, size = options.size;
  const auto start = Clock::now();
  auto fail = [&](const std::string& what) -> CommError {
    return CommError("connect", rank, -1, secondsSince(start), "shared-memory transport: " + what);
  };
  auto get = [&](const std::string& key) {
    try {
      return stringOf(rendezvous.get(key, options.connectTimeout));
    } catch (const std::exception& e) {
      throw fail(std::string("rendezvous failed: ") + e.what());
    }
  };

  // 1. Agree on eligibility: everyone sees every record, so everyone decides alike.
  const std::string me = std::string(toString(options.shm)) + "|" + std::to_string(options.shmChunkBytes) + "|" + hostId();
  rendezvous.set("zeroplus/shm/host/" + std::to_string(rank), bytesOf(me));
  bool off = false, on = false, sameHost = true, sameChunk = true;
  std::string firstHost, firstChunk;
  for (int r = 0; r < size; ++r) {
    const std::string rec = r == rank ? me : get("zeroplus/shm/host/" + std::to_string(r));
    const auto a = rec.find('|'), b = rec.find('|', a + 1);
    const std::string mode = rec.substr(0, a), chunk = rec.substr(a + 1, b - a - 1), host = rec.substr(b + 1);
    off |= mode == "off";
    on |= mode == "on";
    if (r == 0) {
      firstHost = host;
      firstChunk = chunk;
    }
    sameHost &= host == firstHost;
    sameChunk &= chunk == firstChunk;
  }
  if (off) return nullptr;
  if (!sameHost) {
    if (on) throw fail("ZEROPLUS_SHM=on, but the ranks of this group are not all on one host");
    return nullptr;
  }
  if (!sameChunk) throw fail("ranks disagree on ZEROPLUS_SHM_CHUNK_BYTES");

  // 2. Create and publish this rank's segment; map every peer's.
  const size_t bytes = segmentBytes(options.shmChunkBytes);
  std::vector<ShmSegment> segments(static_cast<size_t>(size));
  std::vector<int> pids(static_cast<size_t>(size), 0);
  std::string problem;
  ShmSegment::removeStaleSegments();
  ShmSegment& own = segments[static_cast<size_t>(rank)];
  if (int rc = own.create(rank, bytes); rc < 0) {
    problem = "cannot create a " + std::to_string(bytes) + "-byte segment: " + std::strerror(-rc);
    uint64_t free = 0;
    if (ShmSegment::freeBytes(&free) == 0) {
      problem += " (/dev/shm has " + std::to_string(free) + " bytes free; this group needs " +
                 std::to_string(bytes) + " bytes per rank, " + std::to_string(bytes * static_cast<size_t>(size)) +
                 " in all; enlarge /dev/shm, e.g. docker --shm-size, lower ZEROPLUS_SHM_CHUNK_BYTES, or set "
                 "ZEROPLUS_SHM=off)";
    }
  } else {
    auto* c = new (own.data()) Control{};
    c->pid = static_cast<int32_t>(::getpid());
    c->rank = rank;
    c->chunkBytes = options.shmChunkBytes;
    c->magic = kControlMagic;
  }
  // The segment's name, or "!" and why there is none, so every peer can name the cause.
  rendezvous.set("zeroplus/shm/seg/" + std::to_string(rank), bytesOf(problem.empty() ? own.name() : "!" + problem));
  for (int r = 0; r < size && problem.empty(); ++r) {
    if (r == rank) {
      pids[static_cast<size_t>(r)] = static_cast<int>(::getpid());
      continue;
    }
    const std::string name = get("zeroplus/shm/seg/" + std::to_string(r));
    if (name.empty() || name[0] == '!') {
      problem = "rank " + std::to_string(r) + " " + (name.empty() ? std::string("failed") : name.substr(1));
      break;
    }
    if (int rc = segments[static_cast<size_t>(r)].open(name, bytes); rc < 0) {
      problem = "cannot map rank " + std::to_string(r) + "'s segment " + name + ": " + std::strerror(-rc);
      break;
    }
    const auto* c = reinterpret_cast<const Control*>(segments[static_cast<size_t>(r)].data());
    if (c->magic != kControlMagic || c->rank != r) {
      problem = "segment " + name + " does not belong to rank " + std::to_string(r);
      break;
    }
    pids[static_cast<size_t>(r)] = c->pid;
  }

  // 3. Agree that everyone mapped everything; then no name is needed any more.
  rendezvous.set("zeroplus/shm/ok/" + std::to_string(rank), bytesOf(problem.empty() ? "1" : "0" + problem));
  for (int r = 0; r < size; ++r) {
    const std::string ok = r == rank ? (problem.empty() ? "1" : "0" + problem) : get("zeroplus/shm/ok/" + std::to_string(r));
    if (ok != "1" && problem.empty()) {
      // A peer writes "1" or "0<why>"; anything else in the store is reported, never substr'd blindly.
      problem = "rank " + std::to_string(r) + ": " +
                (ok.size() > 1 && ok[0] == '0' ? ok.substr(1) : "malformed agreement record '" + ok + "'");
    }
  }
  own.unlink();
  if (!problem.empty()) {
    if (on) throw fail(problem);
    noteFallback(rank, problem);
    return nullptr;
  }
  return std::unique_ptr<Communicator>(
      new ShmCommunicator(options, std::move(inner), std::move(segments), std::move(pids)));
}

ShmCommunicator::ShmCommunicator(const CommunicatorOptions& options, std::unique_ptr<Communicator> inner,
                                 std::vector<ShmSegment> segments, std::vector<int> pids)
    : rank_(options.rank),
      size_(options.size),
      chunkBytes_(options.shmChunkBytes),
      spin_(options.spinMicros),
      inner_(std::move(inner)),
      segments_(std::move(segments)),
      pids_(std::move(pids)) {}

ShmCommunicator::~ShmCommunicator() = default;

// ---------------------------------------------------------------------------------------------
// Primitives

ShmCommunicator::Control& ShmCommunicator::control(int r) const {
  return *reinterpret_cast<Control*>(segments_[static_cast<size_t>(r)].data());
}

uint8_t* ShmCommunicator::inSlot(int r, unsigned slot) const {
  return segments_[static_cast<size_t>(r)].data() + kControlBytes + 2 * chunkBytes_ * slot;
}

uint8_t* ShmCommunicator::outSlot(int r, unsigned slot) const { return inSlot(r, slot) + chunkBytes_; }

void ShmCommunicator::fail(int peer, const std::string& what) const {
  throw CommError(op_, rank_, peer, secondsSince(start_), what);
}

void ShmCommunicator::abort() { abortBecause(-1); }

void ShmCommunicator::raiseFailed(int culprit) {
  // First cause wins. A rank that failed because it lost rank P says so in its flag; the
  // abort() that commonly follows (the adapter's shutdown with ops still queued, Ctrl-C, a
  // markBroken) has no culprit and must not overwrite it: a survivor that only now looks would
  // blame this rank ("peer Q failed or aborted") instead of P.
  Control& me = control(rank_);
  uint32_t none = 0;
  me.failed.compare_exchange_strong(none, failedCode(culprit), std::memory_order_seq_cst);
  futex(&me.phase, FUTEX_WAKE, INT_MAX, nullptr);  // peers sleeping on us
}

void ShmCommunicator::abortBecause(int culprit) {
  if (aborted_.exchange(true)) return;
  raiseFailed(culprit);
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) futex(&control(r).phase, FUTEX_WAKE, INT_MAX, nullptr);  // our own sleeping worker
  }
  inner_->abortBecause(culprit);
}

void ShmCommunicator::publish() {
  Control& me = control(rank_);
  if (signaturePending_) {
    // Relaxed stores ordered before the phase by its seq_cst store (release) below.
    auto& d = me.desc[ops_ & 1];
    d[0].store(packHead(desc_), std::memory_order_relaxed);
    d[1].store(desc_.count, std::memory_order_relaxed);
    d[2].store(desc_.seq, std::memory_order_relaxed);
  }
  me.phase.store(++phase_, std::memory_order_seq_cst);
  if (me.waiters.load(std::memory_order_seq_cst) != 0) futex(&me.phase, FUTEX_WAKE, INT_MAX, nullptr);
}

void ShmCommunicator::checkPeer(int peer, bool checkPid) {
  if (aborted_.load(std::memory_order_acquire)) fail(-1, "aborted");
  // A peer whose process is gone is the cause; name it before any survivor that gave up
  // because of it (every survivor then blames the same, dead, rank). A gone peer that raised
  // its failed flag first is a survivor that exited after aborting: its flag (read below) names
  // the cause, its exit does not.
  if (checkPid) {
    for (int r = 0; r < size_; ++r) {
      if (r != rank_ && r != peer && processGone(pids_[static_cast<size_t>(r)]) &&
          control(r).failed.load(std::memory_order_acquire) == 0) {
        fail(r, "lost peer " + std::to_string(r) + " after " + fmtSeconds(secondsSince(start_)) + ": process " +
                    std::to_string(pids_[static_cast<size_t>(r)]) + " exited");
      }
    }
  }
  // Every peer's flag, not only the awaited one's: a rank waiting for a slow peer must still
  // learn at once that another peer gave up (failed, or was interrupted by Ctrl-C).
  for (int r = 0; r < size_; ++r) {
    const uint32_t code = r == rank_ ? 0 : control(r).failed.load(std::memory_order_acquire);
    if (code == 0) continue;
    const int culprit = code >= 2 ? static_cast<int>(code - 2) : -1;
    if (culprit >= 0 && culprit < size_ && culprit != rank_ && culprit != r) {
      fail(culprit, "lost peer " + std::to_string(culprit) + " after " + fmtSeconds(secondsSince(start_)) +
                        " (rank " + std::to_string(r) + " lost it first and aborted)");
    }
    fail(r, "peer " + std::to_string(r) + " failed or aborted after " + fmtSeconds(secondsSince(start_)));
  }
  if (Clock::now() >= deadline_) {
    fail(peer, "timed out after " + fmtSeconds(secondsSince(start_)) + " waiting for peer " + std::to_string(peer));
  }
  if (checkPid && processGone(pids_[static_cast<size_t>(peer)])) {
    fail(peer, "lost peer " + std::to_string(peer) + " after " + fmtSeconds(secondsSince(start_)) + ": process " +
                   std::to_string(pids_[static_cast<size_t>(peer)]) + " exited");
  }
}

void ShmCommunicator::waitPeer(int peer, uint32_t target) {
  Control& c = control(peer);
  auto reached = [&] { return static_cast<int32_t>(c.phase.load(std::memory_order_acquire) - target) >= 0; };
  if (reached()) return;
  const auto spinUntil = Clock::now() + spin_;
  do {
    for (int i = 0; i < 128; ++i) {
      if (reached()) return;
      _mm_pause();
    }
  } while (Clock::now() < spinUntil);
  checkPeer(peer, true);
  for (;;) {
    c.waiters.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = c.phase.load(std::memory_order_seq_cst);
    if (static_cast<int32_t>(seen - target) < 0) {
      const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline_ - Clock::now()).count();
      const long ns = std::clamp<long long>(left, 0, 10'000'000);
      timespec ts{0, ns};
      futex(&c.phase, FUTEX_WAIT, seen, &ts);
    }
    c.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (reached()) return;
    checkPeer(peer, true);
  }
}

void ShmCommunicator::waitAll() {
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) waitPeer(r, phase_);
  }
  if (!signaturePending_) return;
  signaturePending_ = false;
  // Every rank compares every peer with itself after the same sync, so if any two differ,
  // every rank fails here, before reading a peer's data (see op_descriptor.hpp).
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const auto& d = control(r).desc[ops_ & 1];
    const OpDescriptor theirs = unpack(d[0].load(std::memory_order_relaxed), d[1].load(std::memory_order_relaxed),
                                       d[2].load(std::memory_order_relaxed));
    const std::string what = describeMismatch(desc_, theirs, r);
    if (!what.empty()) fail(r, what);
  }
}

template <typename Body>
void ShmCommunicator::run(const char* op, OpDescriptor desc, Deadline deadline, Body&& body) {
  op_ = op;
  desc_ = desc;
  desc_.seq = ops_;
  signaturePending_ = true;
  start_ = Clock::now();
  deadline_ = deadline;
  if (aborted_.load()) fail(-1, "aborted");
  if (broken_) fail(-1, "cannot run: the communicator is unusable after an earlier error (" + brokenWhat_ + ")");
  try {
    body();
    // An op with nothing to move (0 bytes) still compares descriptors: otherwise a rank that
    // broadcasts 0 bytes returns while its peer waits for 100 bytes until the deadline.
    if (signaturePending_) {
      publish();
      waitAll();
    }
    ++ops_;
  } catch (const std::exception& e) {
    // A half-done op leaves the phase counters out of step: nothing may run again. Peers learn
    // it from our failed flag (shm) and from EOF on the TCP links.
    broken_ = true;
    brokenWhat_ = e.what();
    const auto* lost = dynamic_cast<const CommError*>(&e);
    const int culprit = lost ? lost->peer() : -1;
    raiseFailed(culprit);
    inner_->abortBecause(culprit);
    throw;
  }
}

template <typename Body>
void ShmCommunicator::inner(Body&& body) {
  try {
    body();
  } catch (const CommError& e) {
    // Argument errors leave the inner transport usable; a transport failure does not, and
    // then peers that are (or will be) waiting in a shared-memory op must stop waiting too.
    if (!inner_->usable()) raiseFailed(e.peer());
    throw;
  }
}

// ---------------------------------------------------------------------------------------------
// Algorithms

void ShmCommunicator::allreduce(void* data, size_t count, DataType type, ReduceOp op, Deadline deadline) {
  Span span{data, count};
  allreducev(std::vector<Span>{span}, type, op, deadline);
}

template <typename Fn>
void ShmCommunicator::pieces(size_t a, size_t b, size_t es, Fn&& fn) const {
  // fn(pointer into the spans, offset into [a, b), elements) for each piece of [a, b).
  size_t i = static_cast<size_t>(std::upper_bound(prefix_.begin(), prefix_.end(), a) - prefix_.begin()) - 1;
  for (size_t at = a; at < b; ++i) {
    const size_t end = std::min(b, prefix_[i + 1]);
    if (end > at) fn(static_cast<uint8_t*>((*spans_)[i].data) + (at - prefix_[i]) * es, at - a, end - at);
    at = std::max(at, end);
  }
}

void ShmCommunicator::copyIn(unsigned slot, size_t start, size_t count, size_t es) {
  uint8_t* mine = inSlot(rank_, slot);
  pieces(start, start + count, es, [&](uint8_t* p, size_t off, size_t n) { std::memcpy(mine + off * es, p, n * es); });
}

bool ShmCommunicator::copyInChunk(unsigned slot, size_t start, size_t c, size_t es) {
  if (c * es <= kShmSmallBytes) {
    copyIn(slot, start, c, es);  // every rank reads the whole chunk
    return true;
  }
  // Large chunk: peers read only their own blocks of our input.
  const size_t b0 = blockStart(c, es, rank_, size_), b1 = blockStart(c, es, rank_ + 1, size_);
  uint8_t* mine = inSlot(rank_, slot);
  pieces(start, start + b0, es, [&](uint8_t* p, size_t off, size_t n) { std::memcpy(mine + off * es, p, n * es); });
  pieces(start + b1, start + c, es,
         [&](uint8_t* p, size_t off, size_t n) { std::memcpy(mine + (b1 + off) * es, p, n * es); });
  return false;
}

void ShmCommunicator::finishChunk(unsigned slot, size_t start, size_t c, DataType type, ReduceOp op, bool ownInSlot) {
  const size_t es = elementSize(type);
  if (c * es <= kShmSmallBytes) {
    // Everyone reduces everything, in rank order, straight into its own buffers.
    pieces(start, start + c, es, [&](uint8_t* p, size_t off, size_t n) {
      reduceTo(p, inSlot(0, slot) + off * es, inSlot(1, slot) + off * es, n, type, op);
      for (int q = 2; q < size_; ++q) reduceTo(p, p, inSlot(q, slot) + off * es, n, type, op);
    });
    return;
  }
  const size_t b0 = blockStart(c, es, rank_, size_), b1 = blockStart(c, es, rank_ + 1, size_);
  // This rank's own input for its block is read where it lies (the caller's buffers) unless
  // the chunk was copied in whole; only the peers' blocks needed copying in (copyInPeers).
  pieces(start + b0, start + b1, es, [&](uint8_t* p, size_t off, size_t n) {
    uint8_t* dst = outSlot(rank_, slot) + (b0 + off) * es;
    auto in = [&](int q) -> const uint8_t* {
      return q == rank_ && !ownInSlot ? p : inSlot(q, slot) + (b0 + off) * es;
    };
    reduceTo(dst, in(0), in(1), n, type, op);
    for (int q = 2; q < size_; ++q) reduceTo(dst, dst, in(q), n, type, op);
  });
  publish();
  waitAll();
  for (int i = 0; i < size_; ++i) {
    const int q = (rank_ + i) % size_;  // own block first: it is hot in this core's cache
    const size_t q0 = blockStart(c, es, q, size_), q1 = blockStart(c, es, q + 1, size_);
    if (q1 <= q0) continue;
    const uint8_t* src = outSlot(q, slot);
    pieces(start + q0, start + q1, es,
           [&](uint8_t* p, size_t off, size_t n) { std::memcpy(p, src + (q0 + off) * es, n * es); });
  }
}

void ShmCommunicator::setSpans(const std::vector<Span>& spans) {
  spans_ = &spans;
  prefix_.assign(1, 0);
  for (const Span& s : spans) prefix_.push_back(prefix_.back() + s.count);
}

void ShmCommunicator::allreducev(const std::vector<Span>& spans, DataType type, ReduceOp op, Deadline deadline) {
  if (!reduceSupported(type, op)) {
    throw CommError("allreduce", rank_, -1, 0.0,
                    "does not support " + std::string(toString(op)) + " on " + std::string(toString(type)));
  }
  setSpans(spans);
  const size_t total = prefix_.back();
  run("allreduce", describe(WireOp::kAllreduce, total, type, op), deadline, [&] {
    const size_t es = elementSize(type);
    const size_t chunkElems = std::max<size_t>(1, chunkBytes_ / es);
    for (size_t start = 0; start < total; start += chunkElems) {
      const size_t c = std::min(chunkElems, total - start);
      const unsigned slot = static_cast<unsigned>(chunk_++ & 1);
      const bool whole = copyInChunk(slot, start, c, es);
      publish();
      waitAll();
      finishChunk(slot, start, c, type, op, whole);
    }
  });
}

size_t ShmCommunicator::allreduceFused(const std::vector<Span>& candidates, DataType type, ReduceOp op,
                                       Deadline deadline) {
  if (!reduceSupported(type, op)) {
    throw CommError("allreduce", rank_, -1, 0.0,
                    "does not support " + std::string(toString(op)) + " on " + std::string(toString(type)));
  }
  setSpans(candidates);
  size_t agreed = 0;
  // The descriptor carries the first candidate's count (always part of the agreed prefix);
  // the others' counts go to the fused[] slots and are compared once the prefix is agreed.
  const size_t offered = std::min(candidates.size(), kShmMaxFusedOps);
  OpDescriptor desc = describe(WireOp::kAllreduce, candidates.empty() ? 0 : candidates[0].count, type, op);
  desc.flags = OpDescriptor::kFused;
  run("allreduce", desc, deadline, [&] {
    const size_t es = elementSize(type);
    const size_t chunkElems = std::max<size_t>(1, chunkBytes_ / es);
    // Chunk 0 is speculative: every rank copies the start of all its candidates and publishes
    // how many it has; everyone then reduces the first k = min(...) ops. The prefix of chunk 0
    // that belongs to those k ops is laid out identically on every rank (same ops, same order).
    const unsigned slot = static_cast<unsigned>(chunk_++ & 1);
    const unsigned aslot = static_cast<unsigned>(agree_++ & 1);
    copyIn(slot, 0, std::min(chunkElems, prefix_.back()), es);
    const unsigned dslot = static_cast<unsigned>(ops_ & 1);  // as the descriptor's slot
    for (size_t i = 1; i < offered; ++i) {
      control(rank_).fused[dslot][i].store(candidates[i].count, std::memory_order_relaxed);
    }
    control(rank_).proposal[aslot].store(offered, std::memory_order_relaxed);
    publish();
    waitAll();
    agreed = offered;
    for (int r = 0; r < size_; ++r) {
      agreed = std::min<size_t>(agreed, control(r).proposal[aslot].load(std::memory_order_relaxed));
    }
    // Candidate i is the same op on every rank, so its count must match everywhere; checked on
    // every rank against every peer before anyone reduces (all see the same slots: same verdict).
    for (size_t i = 1; i < agreed; ++i) {
      for (int r = 0; r < size_; ++r) {
        const uint64_t theirs = control(r).fused[dslot][i].load(std::memory_order_relaxed);
        if (r == rank_ || theirs == candidates[i].count) continue;
        fail(r, "collective mismatch with rank " + std::to_string(r) + " at collective #" + std::to_string(desc_.seq) +
                    " of this group: size differs in allreduce " + std::to_string(i) +
                    " of a fused batch of queued allreduces: this rank passes " + std::to_string(candidates[i].count) +
                    " elements, rank " + std::to_string(r) + " passes " + std::to_string(theirs) + " elements");
      }
    }
    const size_t total = prefix_[agreed];
    const size_t c0 = std::min(chunkElems, total);
    finishChunk(slot, 0, c0, type, op, true);
    for (size_t start = c0; start < total; start += chunkElems) {
      const size_t c = std::min(chunkElems, total - start);
      const unsigned s = static_cast<unsigned>(chunk_++ & 1);
      const bool whole = copyInChunk(s, start, c, es);
      publish();
      waitAll();
      finishChunk(s, start, c, type, op, whole);
    }
  });
  return agreed;
}

uint64_t ShmCommunicator::agreeMin(uint64_t value, Deadline deadline) {
  uint64_t result = value;
  run("agree", describe(WireOp::kAgree, 0), deadline, [&] {
    const unsigned slot = static_cast<unsigned>(agree_++ & 1);
    control(rank_).proposal[slot].store(value, std::memory_order_relaxed);
    publish();
    waitAll();
    for (int r = 0; r < size_; ++r) result = std::min(result, control(r).proposal[slot].load(std::memory_order_relaxed));
  });
  return result;
}

void ShmCommunicator::broadcast(void* data, size_t bytes, int root, Deadline deadline) {
  if (root < 0 || root >= size_) {
    throw CommError("broadcast", rank_, -1, 0.0, "invalid root " + std::to_string(root) + " for world size " +
                                                     std::to_string(size_));
  }
  run("broadcast", describe(WireOp::kBroadcast, bytes, root), deadline, [&] {
    auto* d = static_cast<uint8_t*>(data);
    for (size_t off = 0; off < bytes; off += chunkBytes_) {
      const size_t c = std::min(chunkBytes_, bytes - off);
      const unsigned slot = static_cast<unsigned>(chunk_++ & 1);
      if (rank_ == root) std::memcpy(inSlot(rank_, slot), d + off, c);
      publish();
      waitAll();
      if (rank_ != root) std::memcpy(d + off, inSlot(root, slot), c);
    }
  });
}

void ShmCommunicator::allgather(const void* in, size_t bytes, void* out, Deadline deadline) {
  run("allgather", describe(WireOp::kAllgather, bytes), deadline, [&] {
    const auto* src = static_cast<const uint8_t*>(in);
    auto* o = static_cast<uint8_t*>(out);
    for (size_t off = 0; off < bytes; off += chunkBytes_) {
      const size_t c = std::min(chunkBytes_, bytes - off);
      const unsigned slot = static_cast<unsigned>(chunk_++ & 1);
      std::memcpy(inSlot(rank_, slot), src + off, c);
      publish();
      waitAll();
      for (int q = 0; q < size_; ++q) std::memcpy(o + static_cast<size_t>(q) * bytes + off, inSlot(q, slot), c);
    }
  });
}

void ShmCommunicator::barrier(Deadline deadline) {
  run("barrier", describe(WireOp::kBarrier, 0), deadline, [&] {
    publish();
    waitAll();
  });
}

// ---------------------------------------------------------------------------------------------
// Delegated to the inner (TCP) transport

void ShmCommunicator::reduce(void* data, size_t count, DataType type, ReduceOp op, int root, Deadline deadline) {
  inner([&] { inner_->reduce(data, count, type, op, root, deadline); });
}
void ShmCommunicator::allgatherv(const void* in, void* out, const std::vector<size_t>& counts,
                                 const std::vector<size_t>& displs, Deadline deadline) {
  inner([&] { inner_->allgatherv(in, out, counts, displs, deadline); });
}
void ShmCommunicator::gather(const void* in, size_t bytes, void* out, int root, Deadline deadline) {
  inner([&] { inner_->gather(in, bytes, out, root, deadline); });
}
void ShmCommunicator::scatter(const void* in, size_t bytes, void* out, int root, Deadline deadline) {
  inner([&] { inner_->scatter(in, bytes, out, root, deadline); });
}
void ShmCommunicator::reduceScatter(const void* in, void* out, size_t count, DataType type, ReduceOp op,
                                    Deadline deadline) {
  inner([&] { inner_->reduceScatter(in, out, count, type, op, deadline); });
}
void ShmCommunicator::alltoallv(const void* in, const std::vector<size_t>& sendCounts,
                                const std::vector<size_t>& sendDispls, void* out,
                                const std::vector<size_t>& recvCounts, const std::vector<size_t>& recvDispls,
                                Deadline deadline) {
  inner([&] { inner_->alltoallv(in, sendCounts, sendDispls, out, recvCounts, recvDispls, deadline); });
}
void ShmCommunicator::send(const void* data, size_t bytes, int peer, uint32_t tag, Deadline deadline) {
  inner([&] { inner_->send(data, bytes, peer, tag, deadline); });
}
void ShmCommunicator::recv(void* data, size_t bytes, int peer, uint32_t tag, Deadline deadline) {
  inner([&] { inner_->recv(data, bytes, peer, tag, deadline); });
}

}  // namespace zeroplus::pg::detail
