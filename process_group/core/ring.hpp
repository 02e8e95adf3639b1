// Internal: the pipelined ring schedule shared by allreduce, reduce, reduce-scatter and
// allgather(v).
//
// A ring operation is a list of steps. At step t a rank sends one block to its right neighbour
// and receives one block from its left neighbour; the block it sends at step t+1 is exactly the
// block it received at step t (that is what makes it a ring). Blocks are cut into segments of
// at most kRingSegmentBytes, and segment k of step t+1 is sent as soon as segment k of step t
// has arrived (and been reduced), so a block does not wait for the whole previous block: the
// reduction of one segment overlaps the kernel moving the next ones, and for large messages
// every link stays busy (the "2 in flight, 1 MiB segments" idea of Gloo's ring, generalised).
//
// Receives that reduce land in a small slot buffer (kRingSlots segments) and are combined into
// place with reduceTo; receives that do not reduce land directly in their destination, so an
// allgather copies nothing in user space.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "process_group/core/datatype.hpp"
#include "process_group/core/exchange.hpp"

namespace zeroplus::pg::detail {

inline constexpr size_t kRingSegmentBytes = 256 * 1024;
inline constexpr size_t kRingSlots = 4;

struct RingStep {
  const uint8_t* send;        // block sent to the right at this step (== previous step's recv)
  size_t sendBytes;
  uint8_t* recv;              // where the block received from the left ends up
  size_t recvBytes;
  const uint8_t* reduceWith;  // non-null: recv = reduceWith (op) received; null: plain receive
};

struct RingReduction {
  size_t elementSize = 1;  // segment boundaries are multiples of this
  DataType type = DataType::kUInt8;
  ReduceOp op = ReduceOp::kSum;
};

// Runs `steps` on an exchange already begun. `header` goes first on both links (checked on
// receipt). `slots` is grown as needed and reused across calls.
void runRing(Exchange& ex, int left, int right, const std::vector<RingStep>& steps, const WireHeader& header,
             const RingReduction& reduction, std::vector<uint8_t>& slots);

}  // namespace zeroplus::pg::detail
