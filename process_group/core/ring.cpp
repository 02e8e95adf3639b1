// Pipelined ring schedule; see ring.hpp.
#include "process_group/core/ring.hpp"

#include <algorithm>

#include "process_group/core/reduce.hpp"

namespace zeroplus::pg::detail {
namespace {

constexpr uint64_t kIgnoredCookie = 0;
constexpr uint64_t kHeaderCookie = 1;
constexpr uint64_t kRecvBit = uint64_t{1} << 63;

}  // namespace

void runRing(Exchange& ex, int left, int right, const std::vector<RingStep>& steps, const WireHeader& header,
             const RingReduction& reduction, std::vector<uint8_t>& slots) {
  const size_t es = reduction.elementSize;
  const size_t seg = kRingSegmentBytes / es * es;
  if (slots.size() < kRingSlots * seg) slots.resize(kRingSlots * seg);
  const size_t nsteps = steps.size();
  auto segments = [&](size_t t) { return (steps[t].recvBytes + seg - 1) / seg; };
  // Cursor over (step, segment) pairs in wire order, skipping empty blocks.
  auto settle = [&](size_t& t, size_t& k) {
    while (t < nsteps && k >= segments(t)) {
      ++t;
      k = 0;
    }
  };

  ex.postSend(right, nullptr, 0, kIgnoredCookie, &header);
  ex.postRecv(left, nullptr, 0, kHeaderCookie, &header);
  if (nsteps > 0) {
    for (size_t off = 0; off < steps[0].sendBytes; off += seg) {
      ex.postSend(right, steps[0].send + off, std::min(seg, steps[0].sendBytes - off), kIgnoredCookie);
    }
  }

  size_t postT = 0, postK = 0, doneT = 0, doneK = 0;
  uint64_t posted = 0, done = 0;
  settle(postT, postK);
  settle(doneT, doneK);
  // Keeps at most kRingSlots receives outstanding: reducing receives own one slot each, and the
  // slot of receive #i is free again once #i completed (completions arrive in order).
  auto fill = [&] {
    while (postT < nsteps && posted - done < kRingSlots) {
      const RingStep& s = steps[postT];
      const size_t off = postK * seg;
      const size_t len = std::min(seg, s.recvBytes - off);
      uint8_t* dst = s.reduceWith ? slots.data() + (posted % kRingSlots) * seg : s.recv + off;
      ex.postRecv(left, dst, len, kRecvBit | posted);
      ++posted;
      ++postK;
      settle(postT, postK);
    }
  };
  fill();

  uint64_t cookie;
  while (ex.next(&cookie)) {
    if (!(cookie & kRecvBit)) continue;
    const RingStep& s = steps[doneT];
    const size_t off = doneK * seg;
    const size_t len = std::min(seg, s.recvBytes - off);
    if (s.reduceWith) {
      reduceTo(s.recv + off, s.reduceWith + off, slots.data() + (done % kRingSlots) * seg, len / es, reduction.type,
               reduction.op);
    }
    // Forward the segment right away: this is the pipelining.
    if (doneT + 1 < nsteps) ex.postSend(right, steps[doneT + 1].send + off, len, kIgnoredCookie);
    ++done;
    ++doneK;
    settle(doneT, doneK);
    fill();
  }
}

}  // namespace zeroplus::pg::detail
