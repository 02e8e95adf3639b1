// Full-mesh connection set-up; see tcp_mesh.hpp for the protocol.
#include "process_group/core/tcp_mesh.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include "process_group/core/host_identity.hpp"
#include "process_group/core/peer_address.hpp"
#include "process_group/core/socket.hpp"

namespace zeroplus::pg::detail {
namespace {

constexpr uint32_t kHelloMagic = 0x5A504C53;  // "ZPLS"
constexpr uint32_t kProtocolVersion = 1;

struct Hello {
  uint32_t magic;
  uint32_t version;
  int32_t rank;
  int32_t size;
  uint64_t nonce;
};
static_assert(sizeof(Hello) == 24);

// Rendezvous entries (peer_address.hpp): the strict decoder returns false on a malformed entry
// instead of throwing from std::stoul, and refuses ports past 65535 instead of truncating them.
std::string addressKey(int rank) { return "zeroplus/addr/" + std::to_string(rank); }
std::vector<uint8_t> encode(const PeerAddress& a) { return encodePeerAddress(a); }
bool decode(const std::vector<uint8_t>& bytes, PeerAddress* out) { return decodePeerAddress(bytes, out); }

double secondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string fmtSeconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", s);
  return buf;
}

int remainingMs(Deadline deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<long long>(left + 1, 1 << 30));
}

// One connection being set up, in either direction.
struct Pending {
  enum Phase { kConnecting, kSendingHello, kAwaitingHello, kDone, kDead };
  int fd = -1;
  int peer = -1;  // known for outbound, learnt from the hello for inbound
  bool outbound = false;
  Phase phase = kConnecting;
  Hello out{};
  size_t sent = 0;
  Hello in{};
  size_t got = 0;
  PeerAddress target;
  Clock::time_point retryAt{};
  Clock::time_point helloBy{};  // inbound: closed unless a valid hello arrived by then
};

}  // namespace

TcpMesh::TcpMesh(int rank, int size) : rank_(rank), size_(size), fds_(static_cast<size_t>(size), -1) {}

TcpMesh::~TcpMesh() {
  for (int& fd : fds_) closeFd(fd);
  closeFd(abortFd_);
}

void TcpMesh::abort(int culprit) {
  if (aborted_.exchange(true, std::memory_order_acq_rel)) return;
  const uint64_t one = 1;
  // The eventfd stays readable (nobody reads it), so every later poll returns at once too.
  [[maybe_unused]] ssize_t rc = ::write(abortFd_, &one, sizeof(one));
  // shutdown() (not close()) is safe while the worker thread still uses the descriptors; it
  // makes peers see EOF now instead of at their own deadline. The urgent byte first tells
  // peers that are not reading from us right now (waiting on another peer) that we aborted: a
  // graceful close sends none, so a peer that simply finished is not mistaken for a failure.
  for (int fd : fds_) {
    if (fd < 0) continue;
    const char alert = static_cast<char>(culprit >= 0 && culprit < 0xFE ? culprit + 1 : 0xFF);
    [[maybe_unused]] ssize_t rc = ::send(fd, &alert, 1, MSG_OOB | MSG_DONTWAIT | MSG_NOSIGNAL);
    ::shutdown(fd, SHUT_RDWR);
  }
}

std::unique_ptr<TcpMesh> TcpMesh::connect(Rendezvous& rendezvous, const CommunicatorOptions& options) {
  const auto start = Clock::now();
  const Deadline deadline = start + options.connectTimeout;
  const int rank = options.rank;
  const int size = options.size;
  std::unique_ptr<TcpMesh> mesh(new TcpMesh(rank, size));
  auto fail = [&](int peer, const std::string& what) {
    throw CommError("connect", rank, peer, secondsSince(start), what);
  };

  mesh->abortFd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (mesh->abortFd_ < 0) fail(-1, "eventfd failed: " + errnoString(-errno));
  if (size == 1) return mesh;

  PeerAddress self;
  self.host = hostName();
  self.net = networkIdentity();
  self.addr = options.bindAddress;
  if (self.addr.empty() && !options.socketIfname.empty()) {
    std::string addr;
    if (interfaceAddress(options.socketIfname, &addr) < 0) {
      fail(-1, options.socketIfnameSource + "=" + options.socketIfname +
                   ": no such interface with an IPv4 address (have: " + addr + ")");
    }
    self.addr = addr;
  }
  bool oneNetwork = true;
  if (self.addr.empty()) {
    // Bind the address peers will use, not every interface: loopback when the whole group
    // shares this network namespace (nothing elsewhere can then reach the listener), else the
    // host's address. The network identity, not the host name, decides: containers and network
    // namespaces often share a name but not a loopback.
    const std::string netKey = "zeroplus/hostname/";
    rendezvous.set(netKey + std::to_string(rank), std::vector<uint8_t>(self.net.begin(), self.net.end()));
    for (int p = 0; p < size && oneNetwork; ++p) {
      if (p == rank) continue;
      try {
        const int ms = remainingMs(deadline);
        if (ms == 0) throw std::runtime_error("deadline passed");
        const auto h = rendezvous.get(netKey + std::to_string(p), std::chrono::milliseconds(ms));
        oneNetwork = std::string(h.begin(), h.end()) == self.net;
      } catch (const std::exception& e) {
        fail(p, "timed out after " + fmtSeconds(secondsSince(start)) + " waiting for rank " + std::to_string(p) +
                    " to publish its address (its network identity: " + e.what() + ")");
      }
    }
    if (oneNetwork) {
      self.addr = "127.0.0.1";
    } else {
      // Publish an address, never a host name: other hosts may not resolve ours (a container's
      // made-up name). A name that resolves to loopback (Debian's 127.0.1.1) is no use either.
      self.addr = resolveHostAddress(self.host);
      const bool numeric = self.addr != self.host;
      if (!numeric || isLoopbackAddress(self.addr)) {
        std::string addr;
        if (defaultInterfaceAddress(&addr) < 0) {
          fail(-1, "the group spans hosts, but host name '" + self.host +
                       "' does not resolve to a reachable address and no interface other than loopback has an "
                       "IPv4 address; set ZEROPLUS_SOCKET_IFNAME to the interface peers can reach");
        }
        self.addr = addr;
      }
    }
  }
  uint16_t port = 0;
  int listenFd = listenTcp(self.addr, size + 16, &port);
  if (listenFd == -EADDRNOTAVAIL && options.bindAddress.empty() && options.socketIfname.empty()) {
    // The name resolves to an address that is not on a local interface (NAT, a stale
    // /etc/hosts): listen everywhere and let peers try that address, as before.
    self.any = true;
    listenFd = listenTcp("", size + 16, &port);
  }
  if (listenFd < 0) fail(-1, "cannot listen on '" + self.addr + "': " + errnoString(listenFd));
  struct ListenGuard {
    int& fd;
    ~ListenGuard() { closeFd(fd); }
  } listenGuard{listenFd};
  self.port = port;
  if (rank == 0) {
    std::random_device rd;
    self.nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                 static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  }
  rendezvous.set(addressKey(rank), encode(self));

  std::vector<Pending> pending;
  uint64_t nonce = self.nonce;
  // Lower ranks: fetch their address, then start connecting. Rank 0's entry comes first and
  // carries the session nonce every hello must present.
  for (int p = 0; p < rank; ++p) {
    PeerAddress a;
    try {
      const int ms = remainingMs(deadline);
      if (ms == 0) throw std::runtime_error("deadline passed");
      if (!decode(rendezvous.get(addressKey(p), std::chrono::milliseconds(ms)), &a)) {
        fail(p, "got a malformed address entry for rank " + std::to_string(p));
      }
    } catch (const CommError&) {
      throw;
    } catch (const std::exception& e) {
      fail(p, "timed out after " + fmtSeconds(secondsSince(start)) + " waiting for rank " + std::to_string(p) +
                  " to publish its address (" + e.what() + ")");
    }
    if (p == 0) nonce = a.nonce;
    // A peer on another host that listens on loopback (told to use "lo", or a host name that
    // resolves to 127.0.1.1) can never be reached from here; say so now, not at the deadline.
    if (!a.any && isLoopbackAddress(a.addr) && !a.net.empty() && a.net != self.net) {
      fail(p, "rank " + std::to_string(p) + " on host '" + a.host + "' listens on loopback address " + a.addr +
                  ", which cannot be reached from this host ('" + self.host +
                  "'); set ZEROPLUS_SOCKET_IFNAME (or GLOO_SOCKET_IFNAME) on that rank to an interface other hosts "
                  "can reach");
    }
    Pending c;
    c.peer = p;
    c.outbound = true;
    c.target = a;
    // Same host name and the peer listens everywhere: loopback is the fastest path.
    if (a.any && (a.net.empty() ? a.host == self.host : a.net == self.net)) c.target.addr = "127.0.0.1";
    pending.push_back(c);
  }

  const Hello myHello{kHelloMagic, kProtocolVersion, rank, size, nonce};
  std::vector<std::string> refusals;  // why the last inbound connection was rejected (kept to one)
  auto connected = [&](int peer) { return mesh->fds_[static_cast<size_t>(peer)] >= 0; };
  auto missing = [&]() {
    std::vector<int> m;
    for (int p = 0; p < size; ++p) {
      if (p != rank && !connected(p)) m.push_back(p);
    }
    return m;
  };

  auto startOutbound = [&](Pending& c) {
    c.fd = startConnect(c.target.addr, c.target.port);
    if (c.fd < 0) fail(c.peer, "cannot connect to rank " + std::to_string(c.peer) + " at " + c.target.addr + ":" +
                                   std::to_string(c.target.port) + ": " + errnoString(c.fd));
    c.phase = Pending::kConnecting;
    c.out = myHello;
    c.sent = 0;
    c.got = 0;
  };
  for (Pending& c : pending) startOutbound(c);

  auto validHello = [&](const Hello& h, std::string* why) {
    if (h.magic != kHelloMagic || h.version != kProtocolVersion) {
      *why = "bad magic/version";
      return false;
    }
    if (h.size != size) {
      *why = "world size " + std::to_string(h.size) + " != " + std::to_string(size);
      return false;
    }
    if (h.nonce != nonce) {
      *why = "session nonce differs (stale or foreign connection)";
      return false;
    }
    return true;
  };

  // Drives one connection as far as it goes without blocking.
  auto step = [&](Pending& c) {
    if (c.phase == Pending::kConnecting) {
      const int rc = finishConnect(c.fd);
      if (rc == -ECONNREFUSED || rc == -ETIMEDOUT || rc == -ECONNRESET) {
        // The peer published its address after listen(), so refusal means a stale address
        // or a transient failure: retry until the deadline.
        closeFd(c.fd);
        c.retryAt = Clock::now() + std::chrono::milliseconds(50);
        return;
      }
      if (rc < 0) fail(c.peer, "connect to rank " + std::to_string(c.peer) + " failed: " + errnoString(rc));
      c.phase = Pending::kSendingHello;
    }
    if (c.phase == Pending::kSendingHello) {
      while (c.sent < sizeof(Hello)) {
        iovec iov{reinterpret_cast<char*>(&c.out) + c.sent, sizeof(Hello) - c.sent};
        const long n = sendv(c.fd, &iov, 1);
        if (n == -EAGAIN) return;
        if (n < 0) {
          c.phase = Pending::kDead;
          return;
        }
        c.sent += static_cast<size_t>(n);
      }
      c.phase = Pending::kAwaitingHello;
    }
    if (c.phase == Pending::kAwaitingHello) {
      while (c.got < sizeof(Hello)) {
        iovec iov{reinterpret_cast<char*>(&c.in) + c.got, sizeof(Hello) - c.got};
        const long n = recvv(c.fd, &iov, 1);
        if (n == -EAGAIN) return;
        if (n <= 0) {
          c.phase = Pending::kDead;
          return;
        }
        c.got += static_cast<size_t>(n);
      }
      std::string why;
      if (!validHello(c.in, &why)) {
        if (c.outbound) fail(c.peer, "rank " + std::to_string(c.peer) + " answered with an invalid hello: " + why);
        refusals.assign(1, why);
        c.phase = Pending::kDead;
        return;
      }
      if (c.outbound && c.in.rank != c.peer) {
        fail(c.peer, "expected rank " + std::to_string(c.peer) + " at " + c.target.addr + " but rank " +
                         std::to_string(c.in.rank) + " answered");
      }
      if (!c.outbound) {
        const int p = c.in.rank;
        if (p <= rank || p >= size || connected(p)) {
          refusals.assign(1, "unexpected or duplicate rank " + std::to_string(p));
          c.phase = Pending::kDead;
          return;
        }
        c.peer = p;
        c.out = myHello;
        c.phase = Pending::kSendingHello;
        c.sent = 0;
        // Reply with our own hello; the connector waits for it before using the link.
        while (c.sent < sizeof(Hello)) {
          iovec iov{reinterpret_cast<char*>(&c.out) + c.sent, sizeof(Hello) - c.sent};
          const long n = sendv(c.fd, &iov, 1);
          if (n < 0) {  // 24 bytes into an empty socket buffer: only a dead socket refuses
            c.phase = Pending::kDead;
            return;
          }
          c.sent += static_cast<size_t>(n);
        }
      }
      if (const int rc = tuneSocket(c.fd, options.socketBufferBytes); rc < 0) {
        fail(c.peer, "cannot configure socket: " + errnoString(rc));
      }
      mesh->fds_[static_cast<size_t>(c.peer)] = c.fd;
      c.fd = -1;
      c.phase = Pending::kDone;
    }
  };

  const long maxUnauthenticated = std::max(16, 2 * size);
  std::vector<pollfd> pfds;
  std::vector<Pending*> owners;
  try {
    while (!missing().empty()) {
      if (Clock::now() >= deadline) {
        const auto m = missing();
        std::string list;
        for (size_t i = 0; i < m.size(); ++i) list += (i ? ", " : "") + std::to_string(m[i]);
        std::string what = "timed out after " + fmtSeconds(secondsSince(start)) + " waiting for rank" +
                           (m.size() > 1 ? "s " : " ") + list + " to connect";
        if (!refusals.empty()) what += " (refused a connection: " + refusals.back() + ")";
        fail(m.size() == 1 ? m[0] : -1, what);
      }
      // Unauthenticated inbound connections are bounded in time and number (anyone who can
      // reach the port can connect; only a valid hello makes a peer).
      const auto now = Clock::now();
      for (Pending& c : pending) {
        if (!c.outbound && c.phase == Pending::kAwaitingHello && now >= c.helloBy) {
          const double limit = std::chrono::duration<double>(options.helloTimeout).count();
          refusals.assign(1, "no valid hello within " + fmtSeconds(limit));
          c.phase = Pending::kDead;
          closeFd(c.fd);
        }
      }
      pending.erase(std::remove_if(pending.begin(), pending.end(),
                                   [](const Pending& c) { return !c.outbound && c.phase == Pending::kDead; }),
                    pending.end());
      pfds.clear();
      owners.clear();
      pfds.push_back({listenFd, POLLIN, 0});
      owners.push_back(nullptr);
      int waitMs = remainingMs(deadline);
      for (Pending& c : pending) {
        if (!c.outbound && c.phase == Pending::kAwaitingHello) waitMs = std::min(waitMs, remainingMs(c.helloBy));
        if (c.phase == Pending::kDead && c.outbound) {
          // The acceptor dropped us (e.g. it restarted): start over.
          closeFd(c.fd);
          c.retryAt = Clock::now() + std::chrono::milliseconds(50);
          c.phase = Pending::kConnecting;
        }
        if (c.phase == Pending::kDone || c.phase == Pending::kDead) continue;
        if (c.fd < 0) {
          if (Clock::now() >= c.retryAt) {
            startOutbound(c);
          } else {
            waitMs = std::min(waitMs, remainingMs(c.retryAt));
            continue;
          }
        }
        const short ev = c.phase == Pending::kAwaitingHello ? POLLIN : POLLOUT;
        pfds.push_back({c.fd, ev, 0});
        owners.push_back(&c);
      }
      const int rc = ::poll(pfds.data(), pfds.size(), waitMs);
      if (rc < 0 && errno != EINTR) fail(-1, std::string("poll failed: ") + std::strerror(errno));
      if (rc <= 0) continue;
      for (size_t i = 1; i < pfds.size(); ++i) {
        if (pfds[i].revents) step(*owners[i]);
      }
      if (pfds[0].revents & POLLIN) {
        for (;;) {
          int fd = acceptTcp(listenFd);
          if (fd < 0) break;
          const auto unauthenticated = std::count_if(pending.begin(), pending.end(), [](const Pending& c) {
            return !c.outbound && c.phase == Pending::kAwaitingHello;
          });
          if (unauthenticated >= maxUnauthenticated) {
            // Make room by dropping the oldest stranger, not the newcomer: refusing newcomers
            // would let a few idle connections keep every real peer out until they time out.
            // A peer sends its hello at once, so it is never the oldest idle one for long (and
            // an outbound peer that is dropped retries).
            auto oldest = pending.end();
            for (auto it = pending.begin(); it != pending.end(); ++it) {
              if (it->outbound || it->phase != Pending::kAwaitingHello) continue;
              if (oldest == pending.end() || it->helloBy < oldest->helloBy) oldest = it;
            }
            refusals.assign(1, "dropped an idle unauthenticated connection (more than " +
                                   std::to_string(maxUnauthenticated) + " at once)");
            closeFd(oldest->fd);
            oldest->phase = Pending::kDead;
          }
          Pending c;
          c.fd = fd;
          c.phase = Pending::kAwaitingHello;
          c.helloBy = Clock::now() + options.helloTimeout;
          pending.push_back(c);  // owners[] is rebuilt before the next use, so growth is fine
          step(pending.back());
        }
      }
      for (Pending& c : pending) {
        if (c.phase == Pending::kDead && !c.outbound) closeFd(c.fd);
      }
    }
  } catch (...) {
    for (Pending& c : pending) closeFd(c.fd);
    throw;
  }
  for (Pending& c : pending) closeFd(c.fd);
  return mesh;
}

}  // namespace zeroplus::pg::detail
