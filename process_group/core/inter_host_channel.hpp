// InterHostChannel: the inter-host phase of the hierarchical collectives
// (hierarchical_communicator.hpp), as a torch-free interface over raw buffers.
//
// One channel joins the ranks that hold the same local index on every host of a group: its
// rank is this rank's host index, its size the host count. The adapter implements it over
// torch's ProcessGroupGloo (adapter/gloo_channel.cpp), created by the Python registration
// hook; unit tests implement it over a Communicator (communicator_channel.hpp).
//
// Contract
// * Every member of the channel calls the same operations in the same order with matching
//   sizes (the c10d rule); buffers are owned by the caller and untouched by anyone else until
//   the call returns. Calls come from one thread at a time; abort() from any thread.
// * Blocking: each call returns when done or throws (any std::exception) by `deadline`; the
//   caller turns the exception into CommError naming the op and the peer ranks. After a
//   throw the channel is unusable.
#pragma once

#include <cstddef>
#include <string>

#include "process_group/core/communicator.hpp"

namespace zeroplus::pg {

class InterHostChannel {
 public:
  virtual ~InterHostChannel() = default;
  virtual int rank() const = 0;  // this rank's host index
  virtual int size() const = 0;  // host count
  // "gloo" or "tcp": for logs and zeroplus.topology(group).transport.
  virtual std::string name() const = 0;
  // Whether allreduce/reduceScatter take this element type and operator; unsupported ones go
  // over the flat path. Must give the same answer on every rank.
  virtual bool supports(DataType type, ReduceOp op) const = 0;

  // In place, `count` elements.
  virtual void allreduce(void* data, size_t count, DataType type, ReduceOp op, Deadline deadline) = 0;
  // out: size() * bytes; host h's `in` lands at out + h*bytes. in must not alias out.
  virtual void allgather(const void* in, size_t bytes, void* out, Deadline deadline) = 0;
  // root: a host index.
  virtual void broadcast(void* data, size_t bytes, int root, Deadline deadline) = 0;
  // in: size() * count elements; out: count elements = the reduction of block rank(). No alias.
  virtual void reduceScatter(const void* in, void* out, size_t count, DataType type, ReduceOp op,
                             Deadline deadline) = 0;
  // Makes the current and later calls fail promptly. Thread-safe, idempotent.
  virtual void abort() = 0;
};

}  // namespace zeroplus::pg
