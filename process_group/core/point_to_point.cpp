// Point-to-point engine; see point_to_point.hpp for the contract.
#include "process_group/core/point_to_point.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "process_group/core/prefix_rendezvous.hpp"
#include "process_group/core/socket.hpp"
#include "process_group/core/tcp_mesh.hpp"

namespace zeroplus::pg {
namespace {

double secondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

std::string fmtSeconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", s);
  return buf;
}

}  // namespace

std::unique_ptr<PointToPoint> PointToPoint::connect(Rendezvous& rendezvous, const CommunicatorOptions& options) {
  // The engine's mesh under "p2p/": the collectives' mesh uses the same key names.
  PrefixRendezvous prefixed(rendezvous, "p2p/");
  return std::make_unique<PointToPoint>(detail::TcpMesh::connect(prefixed, options));
}

PointToPoint::PointToPoint(std::unique_ptr<detail::TcpMesh> mesh)
    : rank_(mesh->rank()), size_(mesh->size()), mesh_(std::move(mesh)), peers_(static_cast<size_t>(size_)) {
  wakeFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wakeFd_ < 0) throw CommError("connect", rank_, -1, 0.0, "eventfd failed: " + detail::errnoString(-errno));
  if (size_ > 1) thread_ = std::thread([this] { progressLoop(); });
}

PointToPoint::~PointToPoint() {
  close();
  detail::closeFd(wakeFd_);
}

void PointToPoint::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
  }
  wake();
  if (thread_.joinable()) thread_.join();
  // Ops still pending never completed: fail them (the links close gracefully; peers that still
  // expect something from this rank fail on their side when they see the close).
  std::vector<Done> done;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto error = [&](const char* op, int peer) {
      return std::make_exception_ptr(CommError(op, rank_, peer, 0.0, "process group was shut down before the op completed"));
    };
    for (int p = 0; p < size_; ++p) {
      Peer& pe = peers_[static_cast<size_t>(p)];
      for (SendOp& s : pe.sends) done.push_back({std::move(s.completion), {p, error("send", p)}});
      pe.sends.clear();
      if (pe.hasTarget) done.push_back({std::move(pe.target.completion), {p, error("recv", p)}});
      pe.hasTarget = false;
    }
    for (RecvOp& r : posted_) done.push_back({std::move(r.completion), {r.peer, error("recv", r.peer)}});
    posted_.clear();
  }
  runAll(done);
}

void PointToPoint::wake() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t rc = ::write(wakeFd_, &one, sizeof(one));
}

void PointToPoint::runAll(std::vector<Done>& done) {
  for (Done& d : done) d.completion(d.result);
  done.clear();
}

size_t PointToPoint::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t n = pendingSends_ + posted_.size();
  for (const Peer& pe : peers_) n += pe.hasTarget ? 1 : 0;
  return n;
}

bool PointToPoint::usable() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return !broken_;
}

std::exception_ptr PointToPoint::brokenError(const char* op) const {
  if (stopping_) return std::make_exception_ptr(CommError(op, rank_, -1, 0.0, "process group has been shut down"));
  return std::make_exception_ptr(CommError(
      op, rank_, -1, 0.0, "cannot run: point-to-point is unusable after an earlier error (" + brokenWhat_ + ")"));
}

void PointToPoint::abort() {
  std::vector<Done> done;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    breakAll("p2p", -1, 0.0, "was aborted", done);
  }
  wake();
  runAll(done);
}

void PointToPoint::send(const void* data, size_t bytes, int peer, uint32_t tag, Deadline deadline, Completion done) {
  if (peer < 0 || peer >= size_ || peer == rank_) {
    throw CommError("send", rank_, peer, 0.0,
                    "does not support send to peer " + std::to_string(peer) + " (world size " + std::to_string(size_) + ")");
  }
  std::vector<Done> finished;
  bool wakeThread = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (broken_ || stopping_) {
      finished.push_back({std::move(done), {peer, brokenError("send")}});
    } else {
      Peer& pe = peers_[static_cast<size_t>(peer)];
      const bool idle = pe.sends.empty();
      pe.sends.push_back(SendOp{detail::makeHeader(detail::WireOp::kSend, bytes, tag), static_cast<const uint8_t*>(data),
                                bytes, 0, deadline, Clock::now(), std::move(done)});
      ++pendingSends_;
      // Nothing queued ahead: write on this thread (a small message then completes at once).
      if (idle) writePeer(peer, finished);
      if (pe.closed) checkClosed(finished);
      wakeThread = !pe.sends.empty();
    }
  }
  if (wakeThread) wake();
  runAll(finished);
}

void PointToPoint::recv(void* data, size_t bytes, int peer, uint32_t tag, Deadline deadline, Completion done) {
  if (peer != kAnySource && (peer < 0 || peer >= size_ || peer == rank_)) {
    throw CommError("recv", rank_, peer, 0.0,
                    "does not support recv from peer " + std::to_string(peer) + " (world size " +
                        std::to_string(size_) + ")");
  }
  if (peer == kAnySource && size_ == 1) {
    throw CommError("recv", rank_, peer, 0.0, "does not support recv from any source in a group of one rank");
  }
  std::vector<Done> finished;
  bool wakeThread = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (broken_ || stopping_) {
      finished.push_back({std::move(done), {peer, brokenError("recv")}});
    } else {
      // A message that already arrived: for one peer the oldest with this tag, for any source
      // the oldest of any peer.
      auto best = stash_.end();
      if (peer == kAnySource) {
        for (int p = 0; p < size_; ++p) {
          auto it = stash_.find({p, tag});
          if (it != stash_.end() && (best == stash_.end() || it->second.front().arrival < best->second.front().arrival)) {
            best = it;
          }
        }
      } else {
        best = stash_.find({peer, tag});
      }
      if (best != stash_.end()) {
        const int from = best->first.first;
        std::vector<uint8_t> msg = std::move(best->second.front().payload);
        best->second.pop_front();
        if (best->second.empty()) stash_.erase(best);
        if (msg.size() != bytes) {
          breakAll("recv", from, 0.0,
                   "posted a receive of " + std::to_string(bytes) + " bytes with tag " + std::to_string(tag) +
                       " but peer " + std::to_string(from) + " sent " + std::to_string(msg.size()) + " bytes",
                   finished);
          finished.push_back({std::move(done), {from, brokenError("recv")}});
        } else {
          if (bytes > 0) std::memcpy(data, msg.data(), bytes);
          finished.push_back({std::move(done), {from, nullptr}});
        }
      } else {
        posted_.push_back(RecvOp{peer, tag, static_cast<uint8_t*>(data), bytes, deadline, Clock::now(), std::move(done)});
        checkClosed(finished);
        wakeThread = true;  // the progress thread recomputes its poll timeout
      }
    }
  }
  if (wakeThread) wake();
  runAll(finished);
}

std::list<PointToPoint::RecvOp>::iterator PointToPoint::findPosted(int p, uint32_t tag) {
  return std::find_if(posted_.begin(), posted_.end(),
                      [&](const RecvOp& r) { return r.tag == tag && (r.peer == p || r.peer == kAnySource); });
}

void PointToPoint::writePeer(int p, std::vector<Done>& done) {
  Peer& pe = peers_[static_cast<size_t>(p)];
  while (!broken_ && !pe.sends.empty()) {
    SendOp& s = pe.sends.front();
    iovec iov[2];
    int n = 0;
    constexpr size_t kHeader = sizeof(detail::WireHeader);
    if (s.done < kHeader) {
      iov[n++] = {reinterpret_cast<uint8_t*>(&s.header) + s.done, kHeader - s.done};
      if (s.bytes > 0) iov[n++] = {const_cast<uint8_t*>(s.data), s.bytes};
    } else {
      iov[n++] = {const_cast<uint8_t*>(s.data) + (s.done - kHeader), s.bytes - (s.done - kHeader)};
    }
    const long rc = detail::sendv(mesh_->fd(p), iov, n);
    if (rc == -EAGAIN) return;
    if (rc < 0) {
      breakAll("send", p, secondsSince(s.start),
               "lost peer " + std::to_string(p) + " after " + fmtSeconds(secondsSince(s.start)) + ": " +
                   detail::errnoString(static_cast<int>(rc)),
               done);
      return;
    }
    s.done += static_cast<size_t>(rc);
    if (s.done == kHeader + s.bytes) {
      done.push_back({std::move(s.completion), {p, nullptr}});
      pe.sends.pop_front();
      --pendingSends_;
    }
  }
}

void PointToPoint::readPeer(int p, std::vector<Done>& done) {
  Peer& pe = peers_[static_cast<size_t>(p)];
  constexpr size_t kHeader = sizeof(detail::WireHeader);
  while (!broken_ && !pe.closed) {
    iovec iov;
    if (!pe.inPayload) {
      iov = {reinterpret_cast<uint8_t*>(&pe.header) + pe.headerGot, kHeader - pe.headerGot};
    } else {
      uint8_t* dst = pe.hasTarget ? pe.target.data : pe.buffer.data();
      iov = {dst + pe.payloadGot, static_cast<size_t>(pe.header.bytes) - pe.payloadGot};
    }
    const long rc = detail::recvv(mesh_->fd(p), &iov, 1);
    if (rc == -EAGAIN) return;
    if (rc <= 0) {
      const bool midMessage = pe.inPayload || pe.headerGot > 0;
      if (rc == 0 && !midMessage && !pe.aborted) {
        pe.closed = true;  // graceful: only ops that still involve p fail (checkClosed)
        return;
      }
      const double elapsed = pe.hasTarget ? secondsSince(pe.target.start) : 0.0;
      std::string why = pe.aborted ? "it aborted (failed or was interrupted)"
                        : rc == 0  ? "connection closed in the middle of a message"
                                   : detail::errnoString(static_cast<int>(rc));
      breakAll("recv", p, elapsed, "lost peer " + std::to_string(p) + ": " + why, done);
      return;
    }
    if (!pe.inPayload) {
      pe.headerGot += static_cast<size_t>(rc);
      if (pe.headerGot < kHeader) continue;
      const detail::WireHeader& h = pe.header;
      if (h.magic != detail::kWireMagic || h.op != static_cast<uint8_t>(detail::WireOp::kSend)) {
        breakAll("recv", p, 0.0, "received a corrupt message header from peer " + std::to_string(p), done);
        return;
      }
      pe.inPayload = true;
      pe.payloadGot = 0;
      auto it = findPosted(p, h.tag);
      if (it != posted_.end()) {
        if (it->bytes != h.bytes) {
          breakAll("recv", p, secondsSince(it->start),
                   "posted a receive of " + std::to_string(it->bytes) + " bytes with tag " + std::to_string(h.tag) +
                       " but peer " + std::to_string(p) + " sent " + std::to_string(h.bytes) + " bytes",
                   done);
          return;
        }
        pe.hasTarget = true;
        pe.target = std::move(*it);
        posted_.erase(it);
      } else {
        pe.buffer.assign(static_cast<size_t>(h.bytes), 0);
      }
    } else {
      pe.payloadGot += static_cast<size_t>(rc);
    }
    if (pe.payloadGot == pe.header.bytes) finishMessage(p, done);
  }
}

void PointToPoint::finishMessage(int p, std::vector<Done>& done) {
  Peer& pe = peers_[static_cast<size_t>(p)];
  const uint32_t tag = pe.header.tag;
  pe.inPayload = false;
  pe.headerGot = 0;
  if (pe.hasTarget) {
    pe.hasTarget = false;
    done.push_back({std::move(pe.target.completion), {p, nullptr}});
    return;
  }
  // Read into the stash: a receive posted meanwhile takes it now, else it waits for one.
  auto it = findPosted(p, tag);
  if (it != posted_.end()) {
    if (it->bytes != pe.buffer.size()) {
      breakAll("recv", p, secondsSince(it->start),
               "posted a receive of " + std::to_string(it->bytes) + " bytes with tag " + std::to_string(tag) +
                   " but peer " + std::to_string(p) + " sent " + std::to_string(pe.buffer.size()) + " bytes",
               done);
      return;
    }
    if (it->bytes > 0) std::memcpy(it->data, pe.buffer.data(), it->bytes);
    done.push_back({std::move(it->completion), {p, nullptr}});
    posted_.erase(it);
    return;
  }
  stash_[{p, tag}].push_back(Stashed{arrivals_++, std::move(pe.buffer)});
  pe.buffer = {};
}

void PointToPoint::checkClosed(std::vector<Done>& done) {
  bool allClosed = true;
  for (int p = 0; p < size_; ++p) {
    if (p != rank_ && !peers_[static_cast<size_t>(p)].closed) allClosed = false;
  }
  for (int p = 0; p < size_ && !broken_; ++p) {
    Peer& pe = peers_[static_cast<size_t>(p)];
    if (!pe.closed) continue;
    if (!pe.sends.empty()) {
      breakAll("send", p, secondsSince(pe.sends.front().start),
               "cannot send to peer " + std::to_string(p) + ": it closed the connection (its group was destroyed)",
               done);
      return;
    }
    for (const RecvOp& r : posted_) {
      if (r.peer == p || (r.peer == kAnySource && allClosed)) {
        breakAll("recv", p, secondsSince(r.start),
                 "lost peer " + std::to_string(p) + ": connection closed (its group was destroyed) while this rank " +
                     "waits for a message with tag " + std::to_string(r.tag),
                 done);
        return;
      }
    }
  }
}

void PointToPoint::checkDeadlines(std::vector<Done>& done) {
  const auto now = Clock::now();
  for (int p = 0; p < size_ && !broken_; ++p) {
    Peer& pe = peers_[static_cast<size_t>(p)];
    for (const SendOp& s : pe.sends) {
      if (now < s.deadline) continue;
      const double t = secondsSince(s.start);
      breakAll("send", p, t,
               "timed out after " + fmtSeconds(t) + " waiting for peer " + std::to_string(p) + " to accept data", done);
      return;
    }
    if (pe.hasTarget && now >= pe.target.deadline) {
      const double t = secondsSince(pe.target.start);
      breakAll("recv", p, t, "timed out after " + fmtSeconds(t) + " waiting for peer " + std::to_string(p), done);
      return;
    }
  }
  for (const RecvOp& r : posted_) {
    if (now < r.deadline) continue;
    const double t = secondsSince(r.start);
    breakAll("recv", r.peer, t,
             "timed out after " + fmtSeconds(t) + " waiting for " +
                 (r.peer == kAnySource ? std::string("a message from any peer")
                                       : "peer " + std::to_string(r.peer)) +
                 " (tag " + std::to_string(r.tag) + ", " + std::to_string(r.bytes) + " bytes)",
             done);
    return;
  }
}

void PointToPoint::breakAll(const std::string& op, int peer, double elapsed, const std::string& what,
                            std::vector<Done>& done) {
  if (broken_) return;
  broken_ = true;
  brokenWhat_ = CommError(op, rank_, peer, elapsed, what).what();
  // Peers blocked on this rank learn at once (TcpMesh::abort's urgent byte), as for collectives.
  mesh_->abort();
  auto fail = [&](const char* myOp, int myPeer, Clock::time_point start) {
    return std::make_exception_ptr(CommError(myOp, rank_, peer >= 0 ? peer : myPeer, secondsSince(start), what));
  };
  for (int p = 0; p < size_; ++p) {
    Peer& pe = peers_[static_cast<size_t>(p)];
    for (SendOp& s : pe.sends) done.push_back({std::move(s.completion), {p, fail("send", p, s.start)}});
    pe.sends.clear();
    if (pe.hasTarget) done.push_back({std::move(pe.target.completion), {p, fail("recv", p, pe.target.start)}});
    pe.hasTarget = false;
  }
  pendingSends_ = 0;
  for (RecvOp& r : posted_) done.push_back({std::move(r.completion), {r.peer, fail("recv", r.peer, r.start)}});
  posted_.clear();
  stash_.clear();
}

void PointToPoint::progressLoop() {
  std::vector<pollfd> pfds;
  std::vector<int> who;  // peer of pfds[i]; -1 the wake eventfd, -2 the mesh's abort eventfd
  std::vector<Done> done;
  for (;;) {
    int timeoutMs = -1;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
      pfds.clear();
      who.clear();
      pfds.push_back({wakeFd_, POLLIN, 0});
      who.push_back(-1);
      if (!broken_) {
        pfds.push_back({mesh_->abortFd(), POLLIN, 0});
        who.push_back(-2);
        Deadline earliest = Deadline::max();
        for (int p = 0; p < size_; ++p) {
          Peer& pe = peers_[static_cast<size_t>(p)];
          if (p == rank_ || pe.closed) continue;
          short ev = POLLIN | POLLPRI;
          if (!pe.sends.empty()) ev |= POLLOUT;
          for (const SendOp& s : pe.sends) earliest = std::min(earliest, s.deadline);
          if (pe.hasTarget) earliest = std::min(earliest, pe.target.deadline);
          pfds.push_back({mesh_->fd(p), ev, 0});
          who.push_back(p);
        }
        for (const RecvOp& r : posted_) earliest = std::min(earliest, r.deadline);
        if (earliest != Deadline::max()) {
          const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(earliest - Clock::now()).count();
          timeoutMs = static_cast<int>(std::clamp<long long>(left + 1, 0, 1 << 30));
        }
      }
    }
    const int rc = ::poll(pfds.data(), pfds.size(), timeoutMs);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
      if (rc < 0 && errno != EINTR) breakAll("p2p", -1, 0.0, std::string("poll failed: ") + std::strerror(errno), done);
      if (rc > 0 && pfds[0].revents) {
        uint64_t count;
        [[maybe_unused]] ssize_t n = ::read(wakeFd_, &count, sizeof(count));
      }
      // Everything below was built for this poll set; a break in between leaves it stale.
      if (!broken_ && rc > 0 && pfds.size() > 1) {
        if (pfds[1].revents) breakAll("p2p", -1, 0.0, "was aborted", done);
        // Abort alerts first: an EOF that follows one is a failure, not a graceful close.
        for (size_t i = 2; i < pfds.size() && !broken_; ++i) {
          if (pfds[i].revents & POLLPRI) {
            char alert;
            [[maybe_unused]] long got = ::recv(pfds[i].fd, &alert, 1, MSG_OOB | MSG_DONTWAIT);
            peers_[static_cast<size_t>(who[i])].aborted = true;
          }
        }
        for (size_t i = 2; i < pfds.size() && !broken_; ++i) {
          const short re = pfds[i].revents;
          if (re & (POLLIN | POLLHUP | POLLERR)) readPeer(who[i], done);
          if (!broken_ && (re & (POLLOUT | POLLERR))) writePeer(who[i], done);
        }
        // What an aborting peer sent before its alert has been read; now it fails the engine.
        for (size_t i = 2; i < pfds.size() && !broken_; ++i) {
          if (peers_[static_cast<size_t>(who[i])].aborted) {
            breakAll("recv", who[i], 0.0, "lost peer " + std::to_string(who[i]) + ": it aborted (failed or was interrupted)",
                     done);
          }
        }
      }
      if (!broken_) checkClosed(done);
      if (!broken_) checkDeadlines(done);
    }
    runAll(done);
  }
}

}  // namespace zeroplus::pg
