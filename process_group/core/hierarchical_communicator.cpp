// The hierarchical collectives; see hierarchical_communicator.hpp for the algorithms.
#include "process_group/core/hierarchical_communicator.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "process_group/core/prefix_rendezvous.hpp"

namespace zeroplus::pg {
namespace {

double secondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

}  // namespace

int HierarchicalCommunicator::localSize(const Topology& topology) {
  const size_t l = topology.ranksOn(0).size();
  for (int h = 1; h < topology.hostCount(); ++h) {
    if (topology.ranksOn(h).size() != l) return 0;
  }
  return static_cast<int>(l);
}

std::unique_ptr<Communicator> HierarchicalCommunicator::connectLocal(Rendezvous& rendezvous, const Topology& topology,
                                                                     CommunicatorOptions options) {
  const auto ranks = topology.ranksOn(topology.host());
  // Keys per host: the hosts' local groups set up concurrently on one store.
  PrefixRendezvous local(rendezvous, "zeroplus/local/" + std::to_string(topology.host()) + "/");
  options.rank = static_cast<int>(std::find(ranks.begin(), ranks.end(), topology.rank) - ranks.begin());
  options.size = static_cast<int>(ranks.size());
  options.hostCount = 1;
  // Within a host the mesh takes loopback when the ranks share a network namespace (tcp_mesh.hpp);
  // the interface chosen for crossing hosts has no say here.
  options.socketIfname.clear();
  options.bindAddress.clear();
  return Communicator::connect(local, options);
}

HierarchicalCommunicator::HierarchicalCommunicator(Topology topology, std::unique_ptr<Communicator> flat,
                                                   std::unique_ptr<Communicator> local,
                                                   std::unique_ptr<InterHostChannel> inter, size_t flatBytes)
    : topology_(std::move(topology)),
      host_(topology_.host()),
      hosts_(topology_.hostCount()),
      localSize_(local->size()),
      flatBytes_(flatBytes),
      flat_(std::move(flat)),
      local_(std::move(local)),
      inter_(std::move(inter)) {
  localIndex_ = local_->rank();
  for (int h = 0; h < hosts_; ++h) hostRanks_.push_back(topology_.ranksOn(h));
}

std::string HierarchicalCommunicator::transport() const {
  return local_->transport() + " within hosts, " + inter_->name() + " between " + std::to_string(hosts_) + " hosts";
}

void HierarchicalCommunicator::abort() {
  flat_->abort();
  local_->abort();
  inter_->abort();
}

uint8_t* HierarchicalCommunicator::scratch(std::vector<uint8_t>& buf, size_t bytes) {
  if (buf.size() < bytes) buf.resize(bytes);
  return buf.data();
}

template <typename Body>
void HierarchicalCommunicator::run(const char* op, Body&& body) {
  if (broken_) {
    throw CommError(op, rank(), -1, 0.0,
                    "cannot run: the communicator is unusable after an earlier error (" + brokenWhat_ + ")");
  }
  start_ = Clock::now();
  try {
    body();
  } catch (const CommError& e) {
    // An argument error of a flat op (say, an invalid root) leaves every part usable: so does
    // it leave this communicator, as TcpCommunicator does.
    if (!crossFailed_ && flat_->usable() && local_->usable()) throw;
    broken_ = true;
    brokenWhat_ = e.what();
    abort();  // local peers and the flat mesh's peers must not wait for their deadline
    throw;
  } catch (const std::exception& e) {
    broken_ = true;
    CommError error(op, rank(), -1, secondsSince(start_), e.what());
    brokenWhat_ = error.what();
    abort();
    throw error;
  }
}

template <typename Call>
void HierarchicalCommunicator::within(const char* op, Call&& call) {
  try {
    call();
  } catch (const CommError& e) {
    // The local communicator names its own op and local indices; say which group op and
    // which group ranks, keeping its explanation.
    const std::string prefix = "zeroplus " + e.op() + ": rank " + std::to_string(e.rank()) + " ";
    std::string what = e.what();
    if (what.rfind(prefix, 0) == 0) what = what.substr(prefix.size());
    const auto& mine = hostRanks_[static_cast<size_t>(host_)];
    const int peer = e.peer() >= 0 && e.peer() < localSize_ ? mine[static_cast<size_t>(e.peer())] : -1;
    throw CommError(op, rank(), peer, e.elapsedSeconds(),
                    "intra-host phase (local " + e.op() + " on host " + std::to_string(host_) + " '" +
                        topology_.hostNames[static_cast<size_t>(host_)] + "'" +
                        (peer >= 0 ? ", peer is rank " + std::to_string(peer) : std::string()) + ") failed: " + what);
  }
}

template <typename Call>
void HierarchicalCommunicator::cross(const char* op, Call&& call) {
  try {
    call();
  } catch (const std::exception& e) {
    crossFailed_ = true;
    // Name the ranks this rank was exchanging with: on a lost host, that is where to look.
    std::string peers;
    int first = -1;
    for (int h = 0; h < hosts_; ++h) {
      if (h == host_) continue;
      const int r = rankOf(h, localIndex_);
      if (first < 0) first = r;
      peers += (peers.empty() ? "rank " : ", rank ") + std::to_string(r) + " (host " + std::to_string(h) + " '" +
               topology_.hostNames[static_cast<size_t>(h)] + "')";
    }
    const double s = secondsSince(start_);
    char elapsed[32];
    std::snprintf(elapsed, sizeof(elapsed), "%.1f s", s);
    throw CommError(op, rank(), first, s,
                    "inter-host phase over " + inter_->name() + " with " + peers + " failed after " + elapsed + ": " +
                        e.what());
  }
}

void HierarchicalCommunicator::localAllgatherInPlace(const char* op, uint8_t* out, size_t chunk, Deadline deadline) {
  if (localSize_ == 1) return;
  within(op, [&] { local_->allgather(out + static_cast<size_t>(localIndex_) * chunk, chunk, out, deadline); });
}

void HierarchicalCommunicator::allreduce(void* data, size_t count, DataType type, ReduceOp op, Deadline deadline) {
  if (!inter_->supports(type, op) || count * elementSize(type) <= flatBytes_) {
    run("allreduce", [&] { flat_->allreduce(data, count, type, op, deadline); });
    return;
  }
  run("allreduce", [&] {
    const size_t es = elementSize(type);
    auto* p = static_cast<uint8_t*>(data);
    within("allreduce", [&] { local_->allreduce(data, count, type, op, deadline); });
    if (count == 0) return;
    const size_t L = static_cast<size_t>(localSize_);
    // Striped: local rank i owns chunk i (the last ones may be short or empty).
    const size_t c = (count + L - 1) / L;
    const size_t begin = std::min(count, static_cast<size_t>(localIndex_) * c);
    const size_t end = std::min(count, begin + c);
    if (end > begin) cross("allreduce", [&] { inter_->allreduce(p + begin * es, end - begin, type, op, deadline); });
    if (count == c * L) {
      localAllgatherInPlace("allreduce", p, c * es, deadline);
    } else {  // equal blocks for the allgather: pad the chunks in scratch
      uint8_t* buf = scratch(scratchA_, c * L * es);
      std::memcpy(buf + static_cast<size_t>(localIndex_) * c * es, p + begin * es, (end - begin) * es);
      localAllgatherInPlace("allreduce", buf, c * es, deadline);
      std::memcpy(p, buf, count * es);
    }
  });
}

void HierarchicalCommunicator::broadcast(void* data, size_t bytes, int root, Deadline deadline) {
  if (root < 0 || root >= size()) {  // an argument error: leaves the communicator usable
    throw CommError("broadcast", rank(), -1, 0.0,
                    "invalid root " + std::to_string(root) + " for world size " + std::to_string(size()));
  }
  if (bytes <= flatBytes_) {
    run("broadcast", [&] { flat_->broadcast(data, bytes, root, deadline); });
    return;
  }
  run("broadcast", [&] {
    auto* p = static_cast<uint8_t*>(data);
    const int rootHost = topology_.hostOf[static_cast<size_t>(root)];
    const auto& rootRanks = hostRanks_[static_cast<size_t>(rootHost)];
    const int rootLocal = static_cast<int>(std::find(rootRanks.begin(), rootRanks.end(), root) - rootRanks.begin());
    if (host_ == rootHost) within("broadcast", [&] { local_->broadcast(data, bytes, rootLocal, deadline); });
    if (bytes == 0) return;
    const size_t L = static_cast<size_t>(localSize_);
    const size_t c = (bytes + L - 1) / L;
    const size_t begin = std::min(bytes, static_cast<size_t>(localIndex_) * c);
    const size_t end = std::min(bytes, begin + c);
    if (end > begin) cross("broadcast", [&] { inter_->broadcast(p + begin, end - begin, rootHost, deadline); });
    if (host_ == rootHost) return;  // it had every chunk already
    if (bytes == c * L) {
      localAllgatherInPlace("broadcast", p, c, deadline);
    } else {
      uint8_t* buf = scratch(scratchA_, c * L);
      std::memcpy(buf + static_cast<size_t>(localIndex_) * c, p + begin, end - begin);
      localAllgatherInPlace("broadcast", buf, c, deadline);
      std::memcpy(p, buf, bytes);
    }
  });
}

void HierarchicalCommunicator::allgather(const void* in, size_t bytes, void* out, Deadline deadline) {
  if (bytes * static_cast<size_t>(size()) <= flatBytes_) {
    run("allgather", [&] { flat_->allgather(in, bytes, out, deadline); });
    return;
  }
  run("allgather", [&] {
    const size_t H = static_cast<size_t>(hosts_), L = static_cast<size_t>(localSize_);
    // byHost[h] = the block of (host h, my local index); all[i][h] = that of (h, i).
    uint8_t* byHost = scratch(scratchA_, H * bytes);
    uint8_t* all = scratch(scratchB_, L * H * bytes);
    if (bytes > 0) cross("allgather", [&] { inter_->allgather(in, bytes, byHost, deadline); });
    within("allgather", [&] { local_->allgather(byHost, H * bytes, all, deadline); });
    auto* o = static_cast<uint8_t*>(out);
    for (size_t i = 0; i < L; ++i) {
      for (size_t h = 0; h < H; ++h) {
        const int r = rankOf(static_cast<int>(h), static_cast<int>(i));
        std::memcpy(o + static_cast<size_t>(r) * bytes, all + (i * H + h) * bytes, bytes);
      }
    }
  });
}

void HierarchicalCommunicator::reduceScatter(const void* in, void* out, size_t count, DataType type, ReduceOp op,
                                             Deadline deadline) {
  if (!inter_->supports(type, op) || count * elementSize(type) * static_cast<size_t>(size()) <= flatBytes_) {
    run("reduce_scatter", [&] { flat_->reduceScatter(in, out, count, type, op, deadline); });
    return;
  }
  run("reduce_scatter", [&] {
    const size_t H = static_cast<size_t>(hosts_), L = static_cast<size_t>(localSize_);
    const size_t block = count * elementSize(type);
    // part[i][h] = block of group rank (h, i): after the local allreduce, part i holds this
    // host's sums of every block that local index i owns on some host.
    uint8_t* part = scratch(scratchA_, L * H * block);
    const auto* src = static_cast<const uint8_t*>(in);
    for (size_t i = 0; i < L; ++i) {
      for (size_t h = 0; h < H; ++h) {
        const int r = rankOf(static_cast<int>(h), static_cast<int>(i));
        std::memcpy(part + (i * H + h) * block, src + static_cast<size_t>(r) * block, block);
      }
    }
    within("reduce_scatter", [&] { local_->allreduce(part, L * H * count, type, op, deadline); });
    if (count == 0) return;
    cross("reduce_scatter", [&] {
      inter_->reduceScatter(part + static_cast<size_t>(localIndex_) * H * block, out, count, type, op, deadline);
    });
  });
}

// Ops without a hierarchical algorithm run on the group-wide mesh.
void HierarchicalCommunicator::reduce(void* data, size_t count, DataType type, ReduceOp op, int root,
                                      Deadline deadline) {
  run("reduce", [&] { flat_->reduce(data, count, type, op, root, deadline); });
}
void HierarchicalCommunicator::allgatherv(const void* in, void* out, const std::vector<size_t>& counts,
                                          const std::vector<size_t>& displs, Deadline deadline) {
  run("allgatherv", [&] { flat_->allgatherv(in, out, counts, displs, deadline); });
}
void HierarchicalCommunicator::gather(const void* in, size_t bytes, void* out, int root, Deadline deadline) {
  run("gather", [&] { flat_->gather(in, bytes, out, root, deadline); });
}
void HierarchicalCommunicator::scatter(const void* in, size_t bytes, void* out, int root, Deadline deadline) {
  run("scatter", [&] { flat_->scatter(in, bytes, out, root, deadline); });
}
void HierarchicalCommunicator::alltoallv(const void* in, const std::vector<size_t>& sendCounts,
                                         const std::vector<size_t>& sendDispls, void* out,
                                         const std::vector<size_t>& recvCounts, const std::vector<size_t>& recvDispls,
                                         Deadline deadline) {
  run("alltoall", [&] { flat_->alltoallv(in, sendCounts, sendDispls, out, recvCounts, recvDispls, deadline); });
}
void HierarchicalCommunicator::send(const void* data, size_t bytes, int peer, uint32_t tag, Deadline deadline) {
  run("send", [&] { flat_->send(data, bytes, peer, tag, deadline); });
}
void HierarchicalCommunicator::recv(void* data, size_t bytes, int peer, uint32_t tag, Deadline deadline) {
  run("recv", [&] { flat_->recv(data, bytes, peer, tag, deadline); });
}
void HierarchicalCommunicator::barrier(Deadline deadline) {
  run("barrier", [&] { flat_->barrier(deadline); });
}

}  // namespace zeroplus::pg
