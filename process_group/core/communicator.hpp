// Torch-free collective communicator: the byte-moving core of the "zeroplus" c10d backend.
//
// Contract
// * One Communicator per backend instance (per process group), connected once in connect().
//   Every rank of the group must call the same collectives in the same order with matching
//   sizes, datatype and root; this is the c10d rule and the reason no per-op tag is needed on
//   the wire beyond the per-pair stream order.
// * Threading: collectives are NOT thread-safe; the adapter calls them from one worker thread
//   in issue order. abort() is the exception: any thread may call it at any time; it makes the
//   in-flight and every later call fail with CommError promptly.
// * Buffers: raw pointers owned by the caller, valid and not touched by anyone else until the
//   call returns. In-place is allowed where the comment says so.
// * Blocking: every call blocks until done or until its deadline passes. A peer that closes its
//   connection, resets it, or does not make progress before the deadline raises CommError that
//   names the op, this rank, the peer and the elapsed time. The communicator is unusable after
//   a CommError (the adapter marks the backend broken; c10d semantics).
// * Error policy (docs/errors.md): socket helpers return -errno; this class is the edge that
//   turns them into CommError.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "process_group/core/config.hpp"
#include "process_group/core/datatype.hpp"
#include "process_group/core/rendezvous.hpp"

namespace zeroplus::pg {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// The one exception type of the torch-free process-group core. what() reads
// "zeroplus <op>: rank <rank> <what>", e.g. "zeroplus allreduce: rank 1 lost peer 0 after 2.3 s:
// connection closed" or "zeroplus connect: rank 0 timed out after 5.0 s waiting for rank 2".
class CommError : public std::runtime_error {
 public:
  CommError(std::string op, int rank, int peer, double elapsedSeconds, const std::string& what);
  const std::string& op() const { return op_; }
  int rank() const { return rank_; }
  int peer() const { return peer_; }  // -1 when no single peer is to blame
  double elapsedSeconds() const { return elapsedSeconds_; }

 private:
  std::string op_;
  int rank_;
  int peer_;
  double elapsedSeconds_;
};

struct CommunicatorOptions {
  int rank = 0;
  int size = 1;
  // Bounds the rendezvous and connection set-up in connect().
  std::chrono::milliseconds connectTimeout{std::chrono::minutes(30)};
  // Address the set-up listener binds and peers use to reach this rank; empty: the IPv4
  // address of socketIfname if set, else loopback when every rank reports the same network
  // identity (host_identity.hpp, agreed through the rendezvous), else the host's address
  // (tcp_mesh.hpp). The listener exists only during connect().
  std::string bindAddress;
  std::string socketIfname;
  // The variable or option that named socketIfname, quoted in errors.
  std::string socketIfnameSource = "ZEROPLUS_SOCKET_IFNAME";
  // Hosts the group spans (topology.hpp); > 1 keeps the shared-memory transport off, since
  // one shm segment set cannot serve ranks on different machines.
  int hostCount = 1;
  // Longest a connection to the listener may stay unauthenticated (no valid hello); at most
  // max(16, 2 x size) such connections are held at once, later ones are closed on arrival.
  std::chrono::milliseconds helloTimeout{std::chrono::seconds(10)};
  // SO_SNDBUF/SO_RCVBUF for the peer sockets; 0 keeps the kernel's autotuning, which on Linux
  // already grows loopback/LAN buffers to tcp_{w,r}mem max (4 MiB / 32 MiB by default) while an
  // explicit value is capped by net.core.{w,r}mem_max and switches autotuning off.
  int socketBufferBytes = 0;
  // Same-host shared-memory transport (shm_communicator.hpp). Off by default in the core so
  // that unit tests choose it explicitly; the adapter passes the group's PgTuning.
  ShmMode shm = ShmMode::kOff;
  size_t shmChunkBytes = 1u << 20;
  uint32_t spinMicros = 50;
};

// One buffer of a vectored allreduce: `count` elements at `data`.
struct Span {
  void* data;
  size_t count;
};

class Communicator {
 public:
  // Exchanges listening addresses through `rendezvous` (keys are namespaced by the caller) and
  // opens one TCP connection per peer. Blocks until every peer is connected or
  // options.connectTimeout passes (then throws CommError naming the missing peers).
  static std::unique_ptr<Communicator> connect(Rendezvous& rendezvous, const CommunicatorOptions& options);

  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Unblocks every current and future call with CommError("aborted"). Thread-safe, idempotent.
  virtual void abort() = 0;
  // abort() after this rank lost peer `culprit` (-1: no peer to blame): the alert peers receive
  // names it, so every survivor's error names the rank that failed first, not the survivor that
  // relayed the abort. Transports without a way to say it just abort().
  virtual void abortBecause(int culprit) {
    (void)culprit;
    abort();
  }

  // data: `bytes` bytes, read on root and written on every other rank.
  virtual void broadcast(void* data, size_t bytes, int root, Deadline deadline) = 0;

  // In place: `count` elements of `type` reduced element-wise with `op` across ranks; every rank
  // ends with the identical result (bitwise: one rank's order of operations is used for all).
  // Precondition: reduceSupported(type, op).
  virtual void allreduce(void* data, size_t count, DataType type, ReduceOp op, Deadline deadline) = 0;

  // allreduce of the concatenation of `spans` (all of `type`), results written back in place.
  // Every rank must pass the same total count (span boundaries may differ between ranks). The
  // base version moves spans that sit back to back in memory as one buffer and packs the
  // others into a scratch buffer; the shared-memory transport packs straight into its segment.
  virtual void allreducev(const std::vector<Span>& spans, DataType type, ReduceOp op, Deadline deadline);

  // Fused allreduce of a prefix of `candidates` (this rank's compatible queued ops, in issue
  // order): the ranks agree on k = the smallest candidate count of any rank, allreduce the
  // concatenation of the first k candidates and return k. Candidate i must have the same count
  // on every rank (it is the same op). The base version is agreeMin + allreducev (two rounds);
  // transports with fusesCheaply() fold the agreement into the data exchange.
  virtual size_t allreduceFused(const std::vector<Span>& candidates, DataType type, ReduceOp op, Deadline deadline);
  virtual bool fusesCheaply() const { return false; }

  // Returns the minimum of `value` over all ranks (an allreduce MIN of one uint64). Used to
  // agree on how many queued ops to fuse without waiting for ops a rank has not issued yet.
  virtual uint64_t agreeMin(uint64_t value, Deadline deadline);

  // "tcp" or "shm+tcp": for diagnostics and tests.
  virtual std::string transport() const { return "tcp"; }

  // False once a transport failure made the communicator unusable (argument errors do not).
  virtual bool usable() const { return true; }

  // In place on root; other ranks' `data` is used as input and left unchanged.
  virtual void reduce(void* data, size_t count, DataType type, ReduceOp op, int root, Deadline deadline) = 0;

  // out: size() * bytes; rank r's `in` lands at out + r*bytes. `in` may alias out + rank()*bytes.
  virtual void allgather(const void* in, size_t bytes, void* out, Deadline deadline) = 0;

  // Variable-size allgather: rank r contributes counts[r] bytes, landing at out + displs[r].
  virtual void allgatherv(const void* in, void* out, const std::vector<size_t>& counts,
                          const std::vector<size_t>& displs, Deadline deadline) = 0;

  // out (root only, may be null elsewhere): size() * bytes, rank r's block at out + r*bytes.
  virtual void gather(const void* in, size_t bytes, void* out, int root, Deadline deadline) = 0;

  // in (root only, may be null elsewhere): size() * bytes; rank r receives block r into out.
  virtual void scatter(const void* in, size_t bytes, void* out, int root, Deadline deadline) = 0;

  // in: size() * count elements; out: count elements = the reduction of block rank() of every
  // rank's input. out may alias in + rank()*count*elementSize(type).
  virtual void reduceScatter(const void* in, void* out, size_t count, DataType type, ReduceOp op,
                             Deadline deadline) = 0;

  // Rank r sends sendCounts[p] bytes from in + sendDispls[p] to each peer p and receives
  // recvCounts[p] bytes from p into out + recvDispls[p]. Buffers must not overlap.
  virtual void alltoallv(const void* in, const std::vector<size_t>& sendCounts,
                         const std::vector<size_t>& sendDispls, void* out,
                         const std::vector<size_t>& recvCounts, const std::vector<size_t>& recvDispls,
                         Deadline deadline) = 0;

  // Point to point. A message is matched by (peer, tag) in send order; a recv whose posted size
  // differs from the sent size fails with CommError naming both sizes.
  virtual void send(const void* data, size_t bytes, int peer, uint32_t tag, Deadline deadline) = 0;
  virtual void recv(void* data, size_t bytes, int peer, uint32_t tag, Deadline deadline) = 0;

  virtual void barrier(Deadline deadline) = 0;

 protected:
  std::vector<uint8_t> packBuffer_;  // allreducev's scratch; grows only
};

}  // namespace zeroplus::pg
