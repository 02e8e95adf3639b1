// Data-movement collectives without reduction: broadcast, allgather(v), gather, scatter,
// alltoallv. Algorithm choice is described in tcp_communicator.hpp.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>

#include "process_group/core/tcp_communicator.hpp"

namespace zeroplus::pg::detail {
namespace {

constexpr uint64_t kSegmentBit = uint64_t{1} << 63;

size_t mod(long a, long n) { return static_cast<size_t>(((a % n) + n) % n); }

uint32_t rootTag(int root) { return static_cast<uint32_t>(root) << 16; }

void copyIfDistinct(void* dst, const void* src, size_t bytes) {
  if (dst != src && bytes > 0) std::memmove(dst, src, bytes);
}

}  // namespace

void TcpCommunicator::broadcast(void* data, size_t bytes, int root, Deadline deadline) {
  checkRoot(WireOp::kBroadcast, root);
  run(describe(WireOp::kBroadcast, bytes, root), deadline, [&] {
    if (size_ == 1) return;
    const WireHeader h = makeHeader(WireOp::kBroadcast, bytes, rootTag(root));
    auto* d = static_cast<uint8_t*>(data);
    if (bytes <= kSmallBytes || size_ == 2) {
      if (rank_ == root) {
        for (int p = 0; p < size_; ++p) {
          if (p != root) exchange_.postSend(p, d, bytes, 0, &h);
        }
      } else {
        exchange_.postRecv(root, d, bytes, 0, &h);
      }
      exchange_.drain();
      return;
    }
    // Chain root -> root+1 -> ... in segments: a middle rank forwards segment k as soon as it
    // has it, so the whole chain streams at link speed after n-1 segment latencies, and the
    // root sends the data once instead of n-1 times.
    const long vr = static_cast<long>(mod(rank_ - root, size_));
    const int next = static_cast<int>(mod(rank_ + 1, size_));
    const int prev = static_cast<int>(mod(rank_ - 1, size_));
    if (vr == 0) {
      exchange_.postSend(next, d, bytes, 0, &h);
      exchange_.drain();
      return;
    }
    if (vr == size_ - 1) {
      exchange_.postRecv(prev, d, bytes, 0, &h);
      exchange_.drain();
      return;
    }
    const size_t seg = kRingSegmentBytes;
    exchange_.postRecv(prev, nullptr, 0, 0, &h);
    exchange_.postSend(next, nullptr, 0, 0, &h);
    for (size_t off = 0; off < bytes; off += seg) {
      exchange_.postRecv(prev, d + off, std::min(seg, bytes - off), kSegmentBit | off);
    }
    uint64_t cookie;
    while (exchange_.next(&cookie)) {
      if (!(cookie & kSegmentBit)) continue;
      const size_t off = cookie & ~kSegmentBit;
      exchange_.postSend(next, d + off, std::min(seg, bytes - off), 0);
    }
  });
}

void TcpCommunicator::allgather(const void* in, size_t bytes, void* out, Deadline deadline) {
  const size_t n = static_cast<size_t>(size_);
  off_.resize(n);
  len_.assign(n, bytes);
  for (size_t b = 0; b < n; ++b) off_[b] = b * bytes;
  // Same schedule as allgatherv with equal blocks (off_/len_ are not touched by it).
  allgatherImpl(WireOp::kAllgather, in, out, len_, off_, deadline);
}

void TcpCommunicator::allgatherv(const void* in, void* out, const std::vector<size_t>& counts,
                                 const std::vector<size_t>& displs, Deadline deadline) {
  allgatherImpl(WireOp::kAllgatherv, in, out, counts, displs, deadline);
}

void TcpCommunicator::allgatherImpl(WireOp op, const void* in, void* out, const std::vector<size_t>& counts,
                                    const std::vector<size_t>& displs, Deadline deadline) {
  const size_t n = static_cast<size_t>(size_);
  require(op, counts.size() == n && displs.size() == n,
          "counts and displs need " + std::to_string(n) + " entries, got " + std::to_string(counts.size()) +
              " and " + std::to_string(displs.size()));
  // allgather: every rank's block size; allgatherv: the total (all ranks pass the same counts).
  const uint64_t described = op == WireOp::kAllgather ? counts[static_cast<size_t>(rank_)]
                                                      : std::accumulate(counts.begin(), counts.end(), uint64_t{0});
  run(describe(op, described), deadline, [&] {
    auto* o = static_cast<uint8_t*>(out);
    const size_t me = static_cast<size_t>(rank_);
    copyIfDistinct(o + displs[me], in, counts[me]);
    if (size_ == 1) return;
    const size_t total = std::accumulate(counts.begin(), counts.end(), size_t{0});
    const WireHeader h = makeHeader(op, total);
    if (total <= kSmallBytes) {
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        const size_t pp = static_cast<size_t>(p);
        exchange_.postSend(p, o + displs[me], counts[me], 0, &h);
        exchange_.postRecv(p, o + displs[pp], counts[pp], 0, &h);
      }
      exchange_.drain();
      return;
    }
    // Ring: step t forwards block (rank - t) and receives block (rank - t - 1) straight into
    // its final place.
    const long r = rank_, ln = size_;
    steps_.clear();
    for (long t = 0; t < ln - 1; ++t) {
      const size_t sb = mod(r - t, ln), rb = mod(r - t - 1, ln);
      steps_.push_back({o + displs[sb], counts[sb], o + displs[rb], counts[rb], nullptr});
    }
    runRing(exchange_, static_cast<int>(mod(r - 1, ln)), static_cast<int>(mod(r + 1, ln)), steps_, h, {},
            slots_);
  });
}

void TcpCommunicator::gather(const void* in, size_t bytes, void* out, int root, Deadline deadline) {
  checkRoot(WireOp::kGather, root);
  run(describe(WireOp::kGather, bytes, root), deadline, [&] {
    auto* o = static_cast<uint8_t*>(out);
    if (rank_ == root) copyIfDistinct(o + static_cast<size_t>(root) * bytes, in, bytes);
    if (size_ == 1) return;
    const WireHeader h = makeHeader(WireOp::kGather, bytes, rootTag(root));
    if (rank_ == root) {
      for (int p = 0; p < size_; ++p) {
        if (p != root) exchange_.postRecv(p, o + static_cast<size_t>(p) * bytes, bytes, 0, &h);
      }
    } else {
      exchange_.postSend(root, in, bytes, 0, &h);
    }
    exchange_.drain();
  });
}

void TcpCommunicator::scatter(const void* in, size_t bytes, void* out, int root, Deadline deadline) {
  checkRoot(WireOp::kScatter, root);
  run(describe(WireOp::kScatter, bytes, root), deadline, [&] {
    const auto* i = static_cast<const uint8_t*>(in);
    if (rank_ == root) copyIfDistinct(out, i + static_cast<size_t>(root) * bytes, bytes);
    if (size_ == 1) return;
    const WireHeader h = makeHeader(WireOp::kScatter, bytes, rootTag(root));
    if (rank_ == root) {
      for (int p = 0; p < size_; ++p) {
        if (p != root) exchange_.postSend(p, i + static_cast<size_t>(p) * bytes, bytes, 0, &h);
      }
    } else {
      exchange_.postRecv(root, out, bytes, 0, &h);
    }
    exchange_.drain();
  });
}

void TcpCommunicator::alltoallv(const void* in, const std::vector<size_t>& sendCounts,
                                const std::vector<size_t>& sendDispls, void* out,
                                const std::vector<size_t>& recvCounts, const std::vector<size_t>& recvDispls,
                                Deadline deadline) {
  const size_t n = static_cast<size_t>(size_);
  const size_t me = static_cast<size_t>(rank_);
  require(WireOp::kAlltoallv,
          sendCounts.size() == n && sendDispls.size() == n && recvCounts.size() == n && recvDispls.size() == n,
          "count and displacement vectors need " + std::to_string(n) + " entries");
  // Per-pair sizes legitimately differ: the descriptor checks the collective, the per-link
  // headers check each pair's sizes. A rank whose own split sizes disagree still takes part in
  // the descriptor exchange (kBadArgs), so its peers fail naming it instead of seeing a reset.
  const bool selfConsistent = sendCounts[me] == recvCounts[me];
  OpDescriptor desc = describe(WireOp::kAlltoallv, 0);
  if (!selfConsistent) {
    desc.flags |= OpDescriptor::kBadArgs;
    desc.count = sendCounts[me];
    desc.reserved2 = static_cast<uint32_t>(std::min<size_t>(recvCounts[me], UINT32_MAX));
  }
  run(desc, deadline, [&] {
    require(WireOp::kAlltoallv, selfConsistent,
            "sends " + std::to_string(sendCounts[me]) + " bytes to itself but expects " +
                std::to_string(recvCounts[me]));
    const auto* i = static_cast<const uint8_t*>(in);
    auto* o = static_cast<uint8_t*>(out);
    // Every pair exchanges concurrently: all sends and receives sit in one poll loop, so the
    // pairwise traffic cannot deadlock however large it is. The headers carry each side's
    // count, so a rank that expects a different size from a peer fails instead of corrupting.
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const size_t pp = static_cast<size_t>(p);
      const WireHeader hs = makeHeader(WireOp::kAlltoallv, sendCounts[pp]);
      const WireHeader hr = makeHeader(WireOp::kAlltoallv, recvCounts[pp]);
      exchange_.postSend(p, i + sendDispls[pp], sendCounts[pp], 0, &hs);
      exchange_.postRecv(p, o + recvDispls[pp], recvCounts[pp], 0, &hr);
    }
    if (sendCounts[me] > 0) std::memcpy(o + recvDispls[me], i + sendDispls[me], sendCounts[me]);
    exchange_.drain();
  });
}

}  // namespace zeroplus::pg::detail
