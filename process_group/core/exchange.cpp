// Progress engine; see exchange.hpp for the contract.
#include "process_group/core/exchange.hpp"

#include <sys/socket.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "process_group/core/socket.hpp"

namespace zeroplus::pg::detail {
namespace {

// Enough to batch header + many pipelined segments per syscall; far below IOV_MAX (1024).
constexpr int kMaxIov = 64;

std::string fmtSeconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", s);
  return buf;
}

}  // namespace

Exchange::Exchange(TcpMesh& mesh)
    : mesh_(mesh), peers_(static_cast<size_t>(mesh.size())), peerAborted_(static_cast<size_t>(mesh.size()), false),
      peerCulprit_(static_cast<size_t>(mesh.size()), -1) {
  iov_.resize(kMaxIov);
}

void Exchange::begin(WireOp op, Deadline deadline) {
  op_ = op;
  start_ = Clock::now();
  deadline_ = deadline;
  for (int p : active_) {
    Peer& pe = peers_[static_cast<size_t>(p)];
    pe.send.items.clear();
    pe.send.head = 0;
    pe.recv.items.clear();
    pe.recv.head = 0;
    pe.canWrite = true;
    pe.canRead = false;
    pe.active = false;
  }
  active_.clear();
  completions_.clear();
  completionHead_ = 0;
  pendingCount_ = 0;
  if (mesh_.aborted()) fail(-1, "was aborted");
}

double Exchange::elapsedSeconds() const {
  return std::chrono::duration<double>(Clock::now() - start_).count();
}

void Exchange::fail(int peer, const std::string& what) const {
  // Our own abort() shuts the sockets down, which surfaces as EOF; report the cause instead.
  const std::string text = mesh_.aborted() && what != "was aborted" ? "was aborted" : what;
  throw CommError(std::string(opName(op_)), mesh_.rank(), mesh_.aborted() ? -1 : peer, elapsedSeconds(), text);
}

void Exchange::failAborted(int peer) const {
  // A peer that aborted because it lost another rank first says which (TcpMesh::abort): name
  // that rank, so every survivor blames the rank that failed, not the survivor relaying it.
  const int culprit = peerCulprit_[static_cast<size_t>(peer)];
  if (culprit >= 0 && culprit < mesh_.size() && culprit != mesh_.rank() && culprit != peer) {
    fail(culprit, "lost peer " + std::to_string(culprit) + " after " + fmtSeconds(elapsedSeconds()) + " (rank " +
                      std::to_string(peer) + " lost it first and aborted)");
  }
  fail(peer, "lost peer " + std::to_string(peer) + " after " + fmtSeconds(elapsedSeconds()) +
                 ": it aborted (failed or was interrupted)");
}

void Exchange::readAlert(int peer) {
  // Non-blocking: EINVAL/EAGAIN when no urgent byte is pending, and nothing changes. Linux keeps
  // a received urgent byte readable after the connection was reset, so an error that reaches
  // us before poll reported POLLPRI (a write to a peer whose process has since closed the link
  // fails with EPIPE) can still be told apart from a peer that simply died.
  char alert = 0;
  const long got = ::recv(mesh_.fd(peer), &alert, 1, MSG_OOB | MSG_DONTWAIT);  // clears POLLPRI
  if (got != 1) return;
  peerAborted_[static_cast<size_t>(peer)] = true;
  const auto code = static_cast<uint8_t>(alert);
  if (code != 0xFF && code != 0) peerCulprit_[static_cast<size_t>(peer)] = code - 1;
}

void Exchange::failLost(int peer, const std::string& why) {
  // A peer that sent its abort alert before its link failed is a relay: name what it said.
  readAlert(peer);
  if (peerAborted_[static_cast<size_t>(peer)]) failAborted(peer);
  fail(peer, "lost peer " + std::to_string(peer) + " after " + fmtSeconds(elapsedSeconds()) + ": " + why);
}

void Exchange::activate(int peer) {
  if (peer < 0 || peer >= mesh_.size() || peer == mesh_.rank()) {
    fail(peer, "invalid peer " + std::to_string(peer) + " for world size " + std::to_string(mesh_.size()));
  }
  Peer& pe = peers_[static_cast<size_t>(peer)];
  if (!pe.active) {
    pe.active = true;
    active_.push_back(peer);
  }
}

void Exchange::postSend(int peer, const void* data, size_t bytes, uint64_t cookie, const WireHeader* header) {
  activate(peer);
  const uint32_t hb = header ? sizeof(WireHeader) : 0;
  if (hb + bytes == 0) {
    completions_.push_back(cookie);
    return;
  }
  Transfer t{static_cast<uint8_t*>(const_cast<void*>(data)), bytes, 0, cookie, header ? *header : WireHeader{},
             WireHeader{}, hb};
  peers_[static_cast<size_t>(peer)].send.items.push_back(t);
  ++pendingCount_;
}

void Exchange::postRecv(int peer, void* data, size_t bytes, uint64_t cookie, const WireHeader* expect) {
  activate(peer);
  const uint32_t hb = expect ? sizeof(WireHeader) : 0;
  if (hb + bytes == 0) {
    completions_.push_back(cookie);
    return;
  }
  Transfer t{static_cast<uint8_t*>(data), bytes, 0, cookie, WireHeader{}, expect ? *expect : WireHeader{}, hb};
  peers_[static_cast<size_t>(peer)].recv.items.push_back(t);
  ++pendingCount_;
}

int Exchange::gather(Queue& q, bool /*includeHeaders*/) {
  int n = 0;
  for (size_t i = q.head; i < q.items.size() && n + 2 <= kMaxIov; ++i) {
    Transfer& t = q.items[i];
    if (t.done < t.headerBytes) {
      iov_[static_cast<size_t>(n++)] = {reinterpret_cast<uint8_t*>(&t.header) + t.done, t.headerBytes - t.done};
      if (t.bytes > 0) iov_[static_cast<size_t>(n++)] = {t.data, t.bytes};
    } else {
      const size_t off = t.done - t.headerBytes;
      iov_[static_cast<size_t>(n++)] = {t.data + off, t.bytes - off};
    }
  }
  return n;
}

void Exchange::checkHeader(int peer, const Transfer& t) const {
  const WireHeader& got = t.header;
  const WireHeader& want = t.expect;
  if (got.magic != kWireMagic) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "0x%04x", got.magic);
    fail(peer, "received a corrupt header from peer " + std::to_string(peer) + " (magic " + buf + ")");
  }
  if (got.op != want.op) {
    fail(peer, "collective mismatch: this rank runs " + std::string(opName(static_cast<WireOp>(want.op))) +
                   " but peer " + std::to_string(peer) + " runs " + std::string(opName(static_cast<WireOp>(got.op))));
  }
  // Collectives compared their op descriptors before any data (op_descriptor.hpp), so this is
  // mostly the point-to-point check; name each field that differs, not a raw tag.
  std::string what;
  if (got.bytes != want.bytes) {
    what = "size mismatch with peer " + std::to_string(peer) + ": this rank expects " + std::to_string(want.bytes) +
           " bytes, peer sends " + std::to_string(got.bytes) + " bytes";
  }
  if (got.tag != want.tag) {
    const bool p2p = static_cast<WireOp>(want.op) == WireOp::kSend;
    what += std::string(what.empty() ? "" : "; ") + (p2p ? "tag" : "dtype/reduce op/root (tag)") +
            " mismatch with peer " + std::to_string(peer) + ": this rank uses " + std::to_string(want.tag) +
            ", peer uses " + std::to_string(got.tag);
  }
  if (!what.empty()) fail(peer, what);
}

void Exchange::progressSend(int peer) {
  Peer& pe = peers_[static_cast<size_t>(peer)];
  Queue& q = pe.send;
  while (q.pending()) {
    const int cnt = gather(q, true);
    const long n = sendv(mesh_.fd(peer), iov_.data(), cnt);
    if (n == -EAGAIN) {
      pe.canWrite = false;
      return;
    }
    if (n < 0) failLost(peer, errnoString(static_cast<int>(n)));
    size_t left = static_cast<size_t>(n);
    while (left > 0) {
      Transfer& t = q.items[q.head];
      const size_t take = std::min(left, t.headerBytes + t.bytes - t.done);
      t.done += take;
      left -= take;
      if (t.done == t.headerBytes + t.bytes) {
        completions_.push_back(t.cookie);
        ++q.head;
        --pendingCount_;
      }
    }
  }
}

void Exchange::progressRecv(int peer) {
  Peer& pe = peers_[static_cast<size_t>(peer)];
  Queue& q = pe.recv;
  const int cnt = gather(q, true);
  size_t want = 0;
  for (int i = 0; i < cnt; ++i) want += iov_[static_cast<size_t>(i)].iov_len;
  const long n = recvv(mesh_.fd(peer), iov_.data(), cnt);
  if (n == -EAGAIN) {
    pe.canRead = false;
    return;
  }
  if (n <= 0) failLost(peer, n == 0 ? std::string("connection closed") : errnoString(static_cast<int>(n)));
  // A short read means the socket is drained: wait for poll rather than paying an EAGAIN.
  if (static_cast<size_t>(n) < want) pe.canRead = false;
  size_t left = static_cast<size_t>(n);
  while (left > 0) {
    Transfer& t = q.items[q.head];
    const size_t before = t.done;
    const size_t take = std::min(left, t.headerBytes + t.bytes - t.done);
    t.done += take;
    left -= take;
    // The header is validated as soon as it is complete. Payload bytes that arrived in the same
    // recvmsg already sit in the caller's buffer (never past its end); the op fails anyway.
    if (before < t.headerBytes && t.done >= t.headerBytes) checkHeader(peer, t);
    if (t.done == t.headerBytes + t.bytes) {
      completions_.push_back(t.cookie);
      ++q.head;
      --pendingCount_;
    }
  }
}

void Exchange::pollOnce() {
  pfds_.clear();
  pollPeers_.clear();
  pfds_.push_back({mesh_.abortFd(), POLLIN, 0});
  pollPeers_.push_back(-1);
  int firstRecv = -1, firstSend = -1;
  for (int p : active_) {
    Peer& pe = peers_[static_cast<size_t>(p)];
    short ev = POLLPRI;
    if (pe.recv.pending()) {
      ev |= POLLIN;
      if (firstRecv < 0) firstRecv = p;
    }
    if (pe.send.pending()) {
      ev |= POLLOUT;
      if (firstSend < 0) firstSend = p;
    }
    pfds_.push_back({mesh_.fd(p), ev, 0});
    pollPeers_.push_back(p);
  }
  // Links this op does not use are watched for a peer's abort alert only.
  for (int p = 0; p < mesh_.size(); ++p) {
    if (p == mesh_.rank() || peers_[static_cast<size_t>(p)].active) continue;
    pfds_.push_back({mesh_.fd(p), POLLPRI, 0});
    pollPeers_.push_back(p);
  }
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now()).count();
  if (left <= 0) {
    const int peer = firstRecv >= 0 ? firstRecv : firstSend;
    fail(peer, "timed out after " + fmtSeconds(elapsedSeconds()) + " waiting for peer " + std::to_string(peer) +
                   (firstRecv >= 0 ? "" : " to accept data"));
  }
  const int timeoutMs = static_cast<int>(std::min<long long>(left + 1, 1 << 30));
  const int rc = ::poll(pfds_.data(), pfds_.size(), timeoutMs);
  if (rc < 0) {
    if (errno == EINTR) return;
    fail(-1, std::string("poll failed: ") + std::strerror(errno));
  }
  if (rc == 0) return;  // the deadline check above fires on the next round
  if (pfds_[0].revents) fail(-1, "was aborted");
  for (size_t i = 1; i < pfds_.size(); ++i) {
    const short re = pfds_[i].revents;
    if (!re) continue;
    const int p = pollPeers_[i];
    if (re & POLLPRI) {
      readAlert(p);
      peerAborted_[static_cast<size_t>(p)] = true;  // also when the byte could not be read
    }
    Peer& pe = peers_[static_cast<size_t>(p)];
    if (!pe.active) continue;
    // Errors and hang-ups are reported by the next read/write, which yields the errno.
    if (re & (POLLIN | POLLHUP | POLLERR)) pe.canRead = true;
    if (re & (POLLOUT | POLLHUP | POLLERR)) pe.canWrite = true;
  }
  // A peer that aborted fails the op, once nothing it sent before remains to be read.
  for (int p = 0; p < mesh_.size(); ++p) {
    if (peerAborted_[static_cast<size_t>(p)] && !peers_[static_cast<size_t>(p)].recv.pending()) failAborted(p);
  }
}

bool Exchange::next(uint64_t* cookie) {
  for (;;) {
    if (completionHead_ < completions_.size()) {
      *cookie = completions_[completionHead_++];
      return true;
    }
    if (pendingCount_ == 0) return false;
    if (mesh_.aborted()) fail(-1, "was aborted");
    bool stillReady = false;
    for (int p : active_) {
      Peer& pe = peers_[static_cast<size_t>(p)];
      if (pe.send.pending() && pe.canWrite) progressSend(p);
      if (pe.recv.pending() && pe.canRead) progressRecv(p);
      stillReady |= (pe.send.pending() && pe.canWrite) || (pe.recv.pending() && pe.canRead);
    }
    if (completionHead_ < completions_.size() || stillReady) continue;
    pollOnce();
  }
}

void Exchange::drain() {
  uint64_t cookie;
  while (next(&cookie)) {
  }
}

}  // namespace zeroplus::pg::detail
