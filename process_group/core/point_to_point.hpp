// Torch-free point-to-point engine of the "zeroplus" backend: send, recv and recv-from-any-source
// that progress independently of the collectives and of each other.
//
// Why a separate engine: collectives run one at a time, in issue order, on the communicator's
// worker (every rank issues them in the same order). Point-to-point ops obey no such rule: a
// rank may post irecv before isend while its peer does the same (batch_isend_irecv, all-pairs
// exchanges), so running them in issue order on one queue deadlocks. Here they never wait for
// each other or for a collective:
// * Transport: its own full mesh of TCP connections (TcpMesh, set up through the rendezvous
//   under the "p2p/" prefix when the group is created), so point-to-point bytes never
//   interleave with a collective's stream.
// * One progress thread per engine polls every link. Each peer has a send FIFO (messages go out
//   in post order) and a receive side that reads message headers as they arrive.
// * Matching (as Gloo): messages from one peer are matched in send order per (peer, tag). An
//   arriving message goes to the earliest posted receive that accepts it (same tag, and that
//   peer or any source); a message nobody has asked for yet is read into a stash and handed to
//   the first matching receive posted later. A receive takes a stashed message first (for any
//   source: the one that arrived first). Messages to a receive already posted land directly in
//   its buffer.
//
// Wire format: each message is a WireHeader (op kSend, tag, bytes) followed by the payload.
//
// Contract
// * Threading: send()/recv() may be called from any thread. `done` runs exactly once, without
//   the engine's lock held, on the progress thread, or on the posting thread when the op
//   completes (or fails) at once (a stashed message, a small send that fits the socket buffer,
//   an engine that is already broken). A completion must not block on another point-to-point op
//   of this engine: the progress thread would wait for itself.
// * Buffers: owned by the caller, valid and untouched until `done` ran.
// * Deadlines: an op not done by its deadline fails.
// * Errors (CommError, op "send"/"recv"): a timeout, a lost or aborted peer, a corrupt header or
//   a receive whose size differs from the message's. Any of these breaks the engine: every
//   pending op fails with it, the links are aborted (peers learn at once, as TcpMesh::abort),
//   and later ops fail at once. A peer that closes its links gracefully (its group was
//   destroyed) is an error only for ops that still involve it.
// * abort(): thread-safe, idempotent; fails every pending and later op.
// * close() (and destruction) stops the progress thread and fails ops still pending.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "process_group/core/communicator.hpp"
#include "process_group/core/wire.hpp"

namespace zeroplus::pg {

namespace detail {
class TcpMesh;
}

// recv() from whichever peer's message with the tag arrives first.
inline constexpr int kAnySource = -1;

// Outcome of one op, handed to its completion.
struct P2pResult {
  int source = -1;           // recv: the rank the message came from; send: the destination
  std::exception_ptr error;  // a CommError; null on success
};

class PointToPoint {
 public:
  using Completion = std::function<void(const P2pResult&)>;

  // Connects the engine's own mesh (blocking, bounded by options.connectTimeout; every rank of
  // the group must call it) and starts the progress thread. Keys are prefixed "p2p/".
  static std::unique_ptr<PointToPoint> connect(Rendezvous& rendezvous, const CommunicatorOptions& options);
  explicit PointToPoint(std::unique_ptr<detail::TcpMesh> mesh);
  ~PointToPoint();
  PointToPoint(const PointToPoint&) = delete;
  PointToPoint& operator=(const PointToPoint&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }

  // Queues `bytes` from `data` to `peer` under `tag`; done once the bytes are in the kernel.
  void send(const void* data, size_t bytes, int peer, uint32_t tag, Deadline deadline, Completion done);
  // Receives the next message with `tag` from `peer` (or kAnySource) into `data`, which must be
  // exactly the message's size.
  void recv(void* data, size_t bytes, int peer, uint32_t tag, Deadline deadline, Completion done);

  void abort();
  // Stops the progress thread and fails the ops still pending ("shut down"); later ops fail at
  // once. The links stay open (no abort alert) until destruction. Idempotent; the destructor
  // calls it.
  void close();
  // Ops posted and not done yet.
  size_t pending() const;
  bool usable() const;

 private:
  struct SendOp {
    detail::WireHeader header;
    const uint8_t* data;
    size_t bytes;
    size_t done;  // header bytes, then payload bytes
    Deadline deadline;
    Clock::time_point start;
    Completion completion;
  };
  struct RecvOp {
    int peer;  // or kAnySource
    uint32_t tag;
    uint8_t* data;
    size_t bytes;
    Deadline deadline;
    Clock::time_point start;
    Completion completion;
  };
  struct Stashed {
    uint64_t arrival;  // engine-wide arrival order (any-source receives take the oldest)
    std::vector<uint8_t> payload;
  };
  struct Peer {
    std::deque<SendOp> sends;
    // The message being read: header, then its payload into target's buffer (a receive claimed
    // when the header arrived) or into `buffer` (to be stashed).
    detail::WireHeader header;
    size_t headerGot = 0;
    bool inPayload = false;
    bool hasTarget = false;
    RecvOp target;
    std::vector<uint8_t> buffer;
    size_t payloadGot = 0;
    bool closed = false;   // EOF: the peer closed its links gracefully
    bool aborted = false;  // the peer's abort alert (urgent byte) arrived
  };
  // A completion to run once the lock is released.
  struct Done {
    Completion completion;
    P2pResult result;
  };

  void progressLoop();
  // Reads what peer p sent, as far as it goes without blocking. Lock held.
  void readPeer(int p, std::vector<Done>& done);
  // Writes peer p's queued sends, as far as the socket takes them. Lock held.
  void writePeer(int p, std::vector<Done>& done);
  void finishMessage(int p, std::vector<Done>& done);
  // The earliest posted receive that accepts (p, tag), or posted_.end().
  std::list<RecvOp>::iterator findPosted(int p, uint32_t tag);
  // Fails the ops that can no longer complete because peer p is gone. Lock held.
  void checkClosed(std::vector<Done>& done);
  void checkDeadlines(std::vector<Done>& done);
  // Breaks the engine: records `what`, aborts the mesh, fails every pending op. Lock held.
  void breakAll(const std::string& op, int peer, double elapsed, const std::string& what, std::vector<Done>& done);
  std::exception_ptr brokenError(const char* op) const;
  void wake();
  static void runAll(std::vector<Done>& done);

  int rank_;
  int size_;
  std::unique_ptr<detail::TcpMesh> mesh_;
  int wakeFd_ = -1;

  mutable std::mutex mutex_;
  std::vector<Peer> peers_;
  std::list<RecvOp> posted_;  // post order
  std::map<std::pair<int, uint32_t>, std::deque<Stashed>> stash_;
  uint64_t arrivals_ = 0;
  size_t pendingSends_ = 0;
  bool broken_ = false;
  std::string brokenWhat_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace zeroplus::pg
