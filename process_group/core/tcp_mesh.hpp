// Internal: the full mesh of TCP connections of one communicator, plus its abort signal.
//
// Set-up (connect): every rank listens on an ephemeral port of one address and publishes
// "host=..;net=..;addr=..;port=..;any=..;nonce=.." under "zeroplus/addr/<rank>". The address is
// options.bindAddress, else the IPv4 address of options.socketIfname (ZEROPLUS_SOCKET_IFNAME or
// GLOO_SOCKET_IFNAME), else 127.0.0.1 when every rank published the same network identity
// (host_identity.hpp) under "zeroplus/hostname/<rank>", else the host name's resolved address
// if it is numeric and not loopback, else the first non-loopback interface that is up. A host
// name is never published as the address. When the resolved address is not local (NAT), the
// listener takes every interface (any=1). A peer on another host that publishes a loopback
// address fails the set-up at once with a message naming it. Rank r connects to every lower
// rank and accepts every higher one, so each pair has exactly one connection and
// nobody needs to agree on who goes first. A 24-byte hello in each direction carries a magic,
// the protocol version, the rank, the world size and a session nonce chosen by rank 0, so a
// stray or stale connection (another job, a previous group on a reused port) is refused rather
// than mistaken for a peer.
//
// Trust model (as Gloo's): whoever can write to the store can join the group; the listener is
// open only during connect(), an inbound connection without a valid hello is closed after
// options.helloTimeout, and at most max(16, 2 x size) of them are held at once: one more
// closes the oldest, so idle strangers cannot keep a real peer (whose hello comes at once) out.
//
// Ownership: the mesh owns its sockets and the eventfd; the destructor closes them. abort() is
// the only member that may be called concurrently with anything else.
#pragma once

#include <atomic>
#include <memory>
#include <vector>

#include "process_group/core/communicator.hpp"

namespace zeroplus::pg::detail {

class TcpMesh {
 public:
  // Throws CommError("connect", ...) naming the missing ranks on timeout or failure.
  static std::unique_ptr<TcpMesh> connect(Rendezvous& rendezvous, const CommunicatorOptions& options);

  TcpMesh(const TcpMesh&) = delete;
  TcpMesh& operator=(const TcpMesh&) = delete;
  ~TcpMesh();

  int rank() const { return rank_; }
  int size() const { return size_; }
  int fd(int peer) const { return fds_[static_cast<size_t>(peer)]; }
  // Readable forever once abort() ran; every poll set of the communicator includes it.
  int abortFd() const { return abortFd_; }
  bool aborted() const { return aborted_.load(std::memory_order_acquire); }
  // Sets the flag, signals the eventfd, sends every peer one urgent (MSG_OOB) byte and shuts the
  // sockets down, so this rank's blocked call wakes at once and peers learn of it at once, even
  // those blocked on another peer (Exchange polls every link for POLLPRI).
  // `culprit` >= 0: the peer this rank lost, sent as the urgent byte (culprit + 1; 0xFF: none),
  // so peers can name it (Exchange).
  void abort(int culprit = -1);

 private:
  TcpMesh(int rank, int size);

  int rank_;
  int size_;
  std::vector<int> fds_;  // fds_[rank_] == -1
  int abortFd_ = -1;
  std::atomic<bool> aborted_{false};
};

}  // namespace zeroplus::pg::detail
