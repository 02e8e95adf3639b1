// Internal: the progress engine every algorithm runs on.
//
// An algorithm posts transfers (send or receive of one contiguous buffer, optionally preceded
// by a WireHeader) to per-peer FIFO queues and then pulls completions one at a time with
// next(), posting follow-up transfers as data arrives (e.g. forward a segment once it has been
// reduced). All queued transfers, in both directions and to all peers, progress together in
// one poll() loop over non-blocking sockets, so two ranks that send large buffers to each other
// at the same time cannot deadlock on full socket buffers. Adjacent queued transfers to one
// peer go out in a single sendmsg()/recvmsg() (header + payload, consecutive segments).
//
// Blocking: next() sleeps in poll() (never spins) with the time left until the deadline; the
// communicator's abort eventfd is in every poll set, and so is every link for POLLPRI: the
// urgent byte a peer's TcpMesh::abort() sends fails the op at once, unless this rank still has
// data to read from that peer (it is read first, so a mismatch it reveals is reported as such).
// A link that fails (EOF, EPIPE, reset) is checked for such a byte before the peer is blamed: a
// peer that aborted because it lost rank P named P in it, and then this rank names P too.
// Any failure (deadline, EOF, reset, header mismatch, abort) throws CommError naming the op,
// this rank, the peer and the elapsed time.
//
// Threading and lifetime: one Exchange per communicator, used by its one worker thread; begin()
// starts an operation and resets the queues, keeping their capacity. Posted buffers must stay
// valid until their completion is returned (or the exchange throws).
#pragma once

#include <poll.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "process_group/core/communicator.hpp"
#include "process_group/core/tcp_mesh.hpp"
#include "process_group/core/wire.hpp"

namespace zeroplus::pg::detail {

class Exchange {
 public:
  explicit Exchange(TcpMesh& mesh);

  void begin(WireOp op, Deadline deadline);
  WireOp op() const { return op_; }

  // Queue `bytes` from `data` to `peer`; with `header`, the header goes first. Completion is
  // reported by next() with `cookie` once the bytes are in the kernel.
  void postSend(int peer, const void* data, size_t bytes, uint64_t cookie, const WireHeader* header = nullptr);
  // Queue a receive of exactly `bytes` into `data` from `peer`. With `expect`, a header is
  // read first and must match expect's op, tag and bytes (else CommError naming both sides).
  void postRecv(int peer, void* data, size_t bytes, uint64_t cookie, const WireHeader* expect = nullptr);

  // Blocks until some posted transfer completes and stores its cookie; returns false when
  // nothing is pending any more. Completions of one peer's queue come in post order.
  bool next(uint64_t* cookie);
  // Waits for every posted transfer.
  void drain();

  [[noreturn]] void fail(int peer, const std::string& what) const;
  double elapsedSeconds() const;

 private:
  struct Transfer {
    uint8_t* data;
    size_t bytes;
    size_t done;  // counts header bytes, then payload bytes
    uint64_t cookie;
    WireHeader header;  // send: the header to write; recv: the header read
    WireHeader expect;
    uint32_t headerBytes;  // 0 or sizeof(WireHeader)
  };
  struct Queue {
    std::vector<Transfer> items;
    size_t head = 0;
    bool pending() const { return head < items.size(); }
  };
  struct Peer {
    Queue send;
    Queue recv;
    bool canWrite = true;   // last sendmsg did not return EAGAIN
    bool canRead = false;   // poll first: data is rarely already there when we post
    bool active = false;    // listed in active_
  };

  void activate(int peer);
  void progressSend(int peer);
  void progressRecv(int peer);
  void checkHeader(int peer, const Transfer& t) const;
  int gather(Queue& q, bool includeHeaders);
  void pollOnce();

  TcpMesh& mesh_;
  WireOp op_ = WireOp::kConnect;
  Clock::time_point start_{};
  Deadline deadline_{};
  std::vector<Peer> peers_;
  std::vector<int> active_;  // peers touched by the current operation
  std::vector<uint64_t> completions_;
  size_t completionHead_ = 0;
  size_t pendingCount_ = 0;
  std::vector<iovec> iov_;
  std::vector<pollfd> pfds_;
  std::vector<int> pollPeers_;
  std::vector<bool> peerAborted_;  // the peer sent its abort alert; sticky
  std::vector<int> peerCulprit_;   // the rank that peer lost first, as its alert said (-1: none)
  [[noreturn]] void failAborted(int peer) const;
  // Reads a pending abort alert from `peer` into peerAborted_/peerCulprit_, if there is one.
  void readAlert(int peer);
  // The link to `peer` failed (EOF or an errno, `why`): fails naming the rank the peer's abort
  // alert named if it sent one (failAborted), else the peer.
  [[noreturn]] void failLost(int peer, const std::string& why);
};

}  // namespace zeroplus::pg::detail
