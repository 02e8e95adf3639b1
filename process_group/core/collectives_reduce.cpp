// Reducing collectives: allreduce, reduce, reduceScatter. Algorithm choice is described in
// tcp_communicator.hpp; this file only states why the orders used give identical bits.
#include <cstring>

#include "process_group/core/reduce.hpp"
#include "process_group/core/tcp_communicator.hpp"

namespace zeroplus::pg::detail {
namespace {

// The header tag carries dtype and op (and root where there is one), so ranks that disagree
// on them fail on the first header instead of reducing garbage.
uint32_t reduceTag(DataType type, ReduceOp op, int root = 0) {
  return static_cast<uint32_t>(type) | (static_cast<uint32_t>(op) << 8) | (static_cast<uint32_t>(root) << 16);
}

size_t mod(long a, long n) { return static_cast<size_t>(((a % n) + n) % n); }

}  // namespace

void TcpCommunicator::allreduce(void* data, size_t count, DataType type, ReduceOp op, Deadline deadline) {
  checkReduce(WireOp::kAllreduce, type, op);
  run(describe(WireOp::kAllreduce, count, type, op), deadline, [&] {
    if (size_ == 1) return;
    const size_t es = elementSize(type);
    const size_t bytes = count * es;
    const size_t n = static_cast<size_t>(size_);
    const WireHeader h = makeHeader(WireOp::kAllreduce, bytes, reduceTag(type, op));
    auto* d = static_cast<uint8_t*>(data);

    if (bytes <= kSmallBytes) {
      // One hop: everyone gets everyone's input. Slot rank_ of the scratch is free and serves
      // as the accumulator of the rank-order reduction.
      uint8_t* s = scratch(n * bytes);
      inputs_.assign(n, nullptr);
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        exchange_.postSend(p, d, bytes, 0, &h);
        exchange_.postRecv(p, s + static_cast<size_t>(p) * bytes, bytes, 0, &h);
        inputs_[static_cast<size_t>(p)] = s + static_cast<size_t>(p) * bytes;
      }
      exchange_.drain();  // also waits for our sends, which read `data`, before we overwrite it
      inputs_[static_cast<size_t>(rank_)] = d;
      reduceRankOrder(d, inputs_, s + static_cast<size_t>(rank_) * bytes, count, type, op);
      return;
    }

    // Ring: step t sends chunk (rank - t) and receives chunk (rank - t - 1). Steps 0..n-2
    // reduce (after them this rank holds the final chunk rank+1), steps n-1..2n-3 copy the
    // final chunks around. Each chunk is reduced in place exactly once per rank, along one
    // fixed order, and then only copied, so all ranks end bitwise identical.
    balancedBlocks(count, es);
    steps_.clear();
    const long r = rank_, ln = static_cast<long>(n);
    for (long t = 0; t < 2 * ln - 2; ++t) {
      const size_t sb = mod(r - t, ln), rb = mod(r - t - 1, ln);
      steps_.push_back({d + off_[sb], len_[sb], d + off_[rb], len_[rb], t < ln - 1 ? d + off_[rb] : nullptr});
    }
    runRing(exchange_, static_cast<int>(mod(r - 1, ln)), static_cast<int>(mod(r + 1, ln)), steps_, h,
            {es, type, op}, slots_);
  });
}

void TcpCommunicator::ringReduceScatter(const uint8_t* in, const std::vector<size_t>& off,
                                        const std::vector<size_t>& len, uint8_t* ownOut, uint8_t* work,
                                        const WireHeader& header, DataType type, ReduceOp op) {
  // Step t sends block (rank - t - 1) and receives block (rank - t - 2), so the last step
  // (t = n-2) receives this rank's own block. Partial results go to work + off[block] (a
  // distinct place per block, so a partial sum is never overwritten while still being sent),
  // and the caller's input is only read.
  const long r = rank_, ln = size_;
  steps_.clear();
  for (long t = 0; t < ln - 1; ++t) {
    const size_t sb = mod(r - t - 1, ln), rb = mod(r - t - 2, ln);
    const uint8_t* src = t == 0 ? in + off[sb] : steps_.back().recv;
    uint8_t* dst = rb == static_cast<size_t>(r) ? ownOut : work + off[rb];
    steps_.push_back({src, len[sb], dst, len[rb], in + off[rb]});
  }
  runRing(exchange_, static_cast<int>(mod(r - 1, ln)), static_cast<int>(mod(r + 1, ln)), steps_, header,
          {elementSize(type), type, op}, slots_);
}

void TcpCommunicator::reduce(void* data, size_t count, DataType type, ReduceOp op, int root, Deadline deadline) {
  checkReduce(WireOp::kReduce, type, op);
  checkRoot(WireOp::kReduce, root);
  run(describe(WireOp::kReduce, count, type, op, root), deadline, [&] {
    if (size_ == 1) return;
    const size_t es = elementSize(type);
    const size_t bytes = count * es;
    const size_t n = static_cast<size_t>(size_);
    const WireHeader h = makeHeader(WireOp::kReduce, bytes, reduceTag(type, op, root));
    auto* d = static_cast<uint8_t*>(data);

    if (bytes <= kSmallBytes) {
      if (rank_ != root) {
        exchange_.postSend(root, d, bytes, 0, &h);
        exchange_.drain();
        return;
      }
      uint8_t* s = scratch(n * bytes);
      inputs_.assign(n, nullptr);
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        exchange_.postRecv(p, s + static_cast<size_t>(p) * bytes, bytes, 0, &h);
        inputs_[static_cast<size_t>(p)] = s + static_cast<size_t>(p) * bytes;
      }
      exchange_.drain();
      inputs_[static_cast<size_t>(rank_)] = d;
      reduceRankOrder(d, inputs_, s + static_cast<size_t>(rank_) * bytes, count, type, op);
      return;
    }

    // Ring reduce-scatter, then every rank ships its finished block to root. Root's own block
    // is finished in place; root's other blocks are only read by the ring and overwritten by
    // the gather afterwards. Non-roots leave `data` untouched (partials go to scratch).
    balancedBlocks(count, es);
    uint8_t* work = scratch(bytes);
    uint8_t* own = (rank_ == root ? d : work) + off_[static_cast<size_t>(rank_)];
    ringReduceScatter(d, off_, len_, own, work, h, type, op);
    if (rank_ != root) {
      exchange_.postSend(root, own, len_[static_cast<size_t>(rank_)], 0);
    } else {
      for (int p = 0; p < size_; ++p) {
        if (p != root) exchange_.postRecv(p, d + off_[static_cast<size_t>(p)], len_[static_cast<size_t>(p)], 0);
      }
    }
    exchange_.drain();
  });
}

void TcpCommunicator::reduceScatter(const void* in, void* out, size_t count, DataType type, ReduceOp op,
                                    Deadline deadline) {
  checkReduce(WireOp::kReduceScatter, type, op);
  run(describe(WireOp::kReduceScatter, count, type, op), deadline, [&] {
    const size_t es = elementSize(type);
    const size_t bytes = count * es;
    const size_t n = static_cast<size_t>(size_);
    const auto* src = static_cast<const uint8_t*>(in);
    auto* dst = static_cast<uint8_t*>(out);
    const uint8_t* mine = src + static_cast<size_t>(rank_) * bytes;
    if (size_ == 1) {
      if (dst != mine && bytes > 0) std::memmove(dst, mine, bytes);
      return;
    }
    const WireHeader h = makeHeader(WireOp::kReduceScatter, bytes, reduceTag(type, op));

    if (n * bytes <= kSmallBytes) {
      // Direct: block p goes to rank p; rank-order reduction as in the small allreduce.
      uint8_t* s = scratch(n * bytes);
      inputs_.assign(n, nullptr);
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        exchange_.postSend(p, src + static_cast<size_t>(p) * bytes, bytes, 0, &h);
        exchange_.postRecv(p, s + static_cast<size_t>(p) * bytes, bytes, 0, &h);
        inputs_[static_cast<size_t>(p)] = s + static_cast<size_t>(p) * bytes;
      }
      exchange_.drain();
      inputs_[static_cast<size_t>(rank_)] = mine;
      reduceRankOrder(dst, inputs_, s + static_cast<size_t>(rank_) * bytes, count, type, op);
      return;
    }

    off_.resize(n);
    len_.assign(n, bytes);
    for (size_t b = 0; b < n; ++b) off_[b] = b * bytes;
    ringReduceScatter(src, off_, len_, dst, scratch(n * bytes), h, type, op);
  });
}

}  // namespace zeroplus::pg::detail
