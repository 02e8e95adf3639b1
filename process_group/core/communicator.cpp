// CommError, the connect() factory, and the small shared pieces of TcpCommunicator
// (argument checks, scratch, rank-order reduction). The collective algorithms live in
// collectives_*.cpp.
#include "process_group/core/communicator.hpp"

#include <algorithm>
#include <cstring>

#include "process_group/core/reduce.hpp"
#include "process_group/core/shm_communicator.hpp"
#include "process_group/core/tcp_communicator.hpp"

namespace zeroplus::pg {

CommError::CommError(std::string op, int rank, int peer, double elapsedSeconds, const std::string& what)
    : std::runtime_error("zeroplus " + op + ": rank " + std::to_string(rank) + " " + what),
      op_(std::move(op)),
      rank_(rank),
      peer_(peer),
      elapsedSeconds_(elapsedSeconds) {}

std::unique_ptr<Communicator> Communicator::connect(Rendezvous& rendezvous, const CommunicatorOptions& options) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    throw CommError("connect", options.rank, -1, 0.0,
                    "invalid rank " + std::to_string(options.rank) + " for world size " + std::to_string(options.size));
  }
  std::unique_ptr<Communicator> tcp =
      std::make_unique<detail::TcpCommunicator>(detail::TcpMesh::connect(rendezvous, options));
  if (options.hostCount > 1 && options.shm == ShmMode::kOn) {
    throw CommError("connect", options.rank, -1, 0.0,
                    "shared-memory transport: ZEROPLUS_SHM=on, but the group spans " +
                        std::to_string(options.hostCount) + " hosts");
  }
  // Across hosts the segments of one set cannot reach every rank: TCP only (topology.hpp).
  if (options.size > 1 && options.shm != ShmMode::kOff && options.hostCount == 1) {
    if (auto shm = detail::ShmCommunicator::maybeCreate(rendezvous, options, tcp)) return shm;
  }
  return tcp;
}

void Communicator::allreducev(const std::vector<Span>& spans, DataType type, ReduceOp op, Deadline deadline) {
  const size_t es = elementSize(type);
  size_t total = 0;
  bool contiguous = true;
  for (size_t i = 0; i < spans.size(); ++i) {
    total += spans[i].count;
    if (i > 0 && static_cast<uint8_t*>(spans[i - 1].data) + spans[i - 1].count * es != spans[i].data) {
      contiguous = false;
    }
  }
  if (spans.empty()) {
    allreduce(nullptr, 0, type, op, deadline);
    return;
  }
  if (contiguous) {  // already one flat buffer (e.g. views of one bucket): no copy
    allreduce(spans[0].data, total, type, op, deadline);
    return;
  }
  if (packBuffer_.size() < total * es) packBuffer_.resize(total * es);
  uint8_t* p = packBuffer_.data();
  for (const Span& s : spans) {
    std::memcpy(p, s.data, s.count * es);
    p += s.count * es;
  }
  allreduce(packBuffer_.data(), total, type, op, deadline);
  p = packBuffer_.data();
  for (const Span& s : spans) {
    std::memcpy(s.data, p, s.count * es);
    p += s.count * es;
  }
}

size_t Communicator::allreduceFused(const std::vector<Span>& candidates, DataType type, ReduceOp op,
                                    Deadline deadline) {
  const size_t k = static_cast<size_t>(agreeMin(candidates.size(), deadline));
  allreducev(std::vector<Span>(candidates.begin(), candidates.begin() + static_cast<long>(std::min(k, candidates.size()))),
             type, op, deadline);
  return k;
}

uint64_t Communicator::agreeMin(uint64_t value, Deadline deadline) {
  int64_t v = static_cast<int64_t>(value < (1ull << 62) ? value : (1ull << 62));
  allreduce(&v, 1, DataType::kInt64, ReduceOp::kMin, deadline);
  return static_cast<uint64_t>(v);
}

namespace detail {

TcpCommunicator::TcpCommunicator(std::unique_ptr<TcpMesh> mesh)
    : rank_(mesh->rank()), size_(mesh->size()), mesh_(std::move(mesh)), exchange_(*mesh_) {}

void TcpCommunicator::checkDescriptors(OpDescriptor desc) {
  desc.seq = seq_++;
  if (size_ == 1) return;
  // One 32-byte all-to-all: every rank learns every peer's descriptor before any data moves,
  // so all ranks reach the same verdict and each names the difference it saw. Nothing is
  // written to the caller's buffers before this returns.
  peerDescs_.assign(static_cast<size_t>(size_), OpDescriptor{});
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    exchange_.postSend(p, &desc, sizeof(desc), 0);
    exchange_.postRecv(p, &peerDescs_[static_cast<size_t>(p)], sizeof(OpDescriptor), 0);
  }
  exchange_.drain();
  // A rank with inconsistent arguments of its own has told its peers (kBadArgs) and raises its
  // own, more precise error in the op body; it compares nothing.
  if (desc.flags & OpDescriptor::kBadArgs) return;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    const std::string what = describeMismatch(desc, peerDescs_[static_cast<size_t>(p)], p);
    if (!what.empty()) exchange_.fail(p, what);
  }
}

void TcpCommunicator::require(WireOp op, bool ok, const std::string& what) const {
  if (!ok) throw CommError(std::string(opName(op)), rank_, -1, 0.0, what);
}

void TcpCommunicator::checkRoot(WireOp op, int root) const {
  require(op, root >= 0 && root < size_,
          "invalid root " + std::to_string(root) + " for world size " + std::to_string(size_));
}

void TcpCommunicator::checkReduce(WireOp op, DataType type, ReduceOp reduceOp) const {
  require(op, reduceSupported(type, reduceOp),
          "does not support " + std::string(toString(reduceOp)) + " on " + std::string(toString(type)));
}

uint8_t* TcpCommunicator::scratch(size_t bytes) {
  if (scratch_.size() < bytes) scratch_.resize(bytes);
  return scratch_.data();
}

void TcpCommunicator::reduceRankOrder(void* dst, const std::vector<const uint8_t*>& inputs, uint8_t* acc,
                                      size_t count, DataType type, ReduceOp op) const {
  const size_t n = inputs.size();
  if (n == 2) {
    reduceTo(dst, inputs[0], inputs[1], count, type, op);
    return;
  }
  // ((x0 op x1) op x2) ... op x{n-1}: the partial result lives in acc so that dst (which may
  // be one of the inputs) is written only by the last step.
  reduceTo(acc, inputs[0], inputs[1], count, type, op);
  for (size_t p = 2; p + 1 < n; ++p) reduceTo(acc, acc, inputs[p], count, type, op);
  reduceTo(dst, acc, inputs[n - 1], count, type, op);
}

void TcpCommunicator::balancedBlocks(size_t count, size_t elementSize) {
  off_.assign(static_cast<size_t>(size_), 0);
  len_.assign(static_cast<size_t>(size_), 0);
  const size_t n = static_cast<size_t>(size_);
  const size_t base = count / n, rem = count % n;
  size_t at = 0;
  for (size_t b = 0; b < n; ++b) {
    const size_t elems = base + (b < rem ? 1 : 0);
    off_[b] = at * elementSize;
    len_[b] = elems * elementSize;
    at += elems;
  }
}

}  // namespace detail
}  // namespace zeroplus::pg
