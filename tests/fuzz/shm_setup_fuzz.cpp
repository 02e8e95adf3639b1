// Fuzzes what the shared-memory transport decodes from its peers
// (process_group/core/shm_communicator.hpp): the set-up records a peer publishes through the
// rendezvous ("<mode>|<chunk bytes>|<host id>", its segment's name, its "1" / "0<why>"
// agreement) and the control block at the start of the peer's segment (magic, pid, rank, then
// the phase, failed flag, proposals and op signatures read at run time).
//
// Rank 0 is real (ShmCommunicator::maybeCreate over a real inner communicator); rank 1 is the
// input. Input: byte 0 = flags (bit 0: ZEROPLUS_SHM=on, else auto; bits 1-2: the op run if a
// communicator results: barrier, agreeMin, allreduce of 3 floats, allreduce of 40000 floats),
// then three '\n'-terminated records (host, segment, agreement; a missing record is a
// rendezvous timeout), then the control block bytes. In the host record "$H" stands for rank
// 0's host id, in the segment record "$S" for the name of a real segment the harness created
// for rank 1, so inputs can pass the checks that a fuzzer could not guess. Each op has a 2 ms
// deadline. Contract checked: maybeCreate returns nullptr, a communicator, or throws CommError;
// the op completes or throws CommError; nothing else escapes.
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "process_group/core/shm_communicator.hpp"
#include "process_group/core/shm_segment.hpp"

using namespace zeroplus::pg;
using namespace zeroplus::pg::detail;

namespace {

constexpr size_t kChunk = 4096;
constexpr size_t kSegmentBytes = 4096 + 4 * kChunk;  // control block + 2 x {in, out}

std::string replaceAll(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
  return s;
}

// Rank 0's records are stored; rank 1's come from the input; nothing ever waits.
class FuzzRendezvous : public Rendezvous {
 public:
  std::map<std::string, std::string> peer;  // key suffix "host", "seg", "ok" -> record of rank 1
  std::string segName;

  void set(const std::string& key, const std::vector<uint8_t>& value) override { own_[key] = {value.begin(), value.end()}; }
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds) override {
    if (auto it = own_.find(key); it != own_.end()) return {it->second.begin(), it->second.end()};
    for (const char* kind : {"host", "seg", "ok"}) {
      if (key == std::string("zeroplus/shm/") + kind + "/1") {
        const auto it = peer.find(kind);
        if (it == peer.end()) break;
        std::string v = it->second;
        if (std::strcmp(kind, "host") == 0) v = replaceAll(v, "$H", ownHostId());
        if (std::strcmp(kind, "seg") == 0) v = replaceAll(v, "$S", segName);
        return {v.begin(), v.end()};
      }
    }
    throw std::runtime_error("rendezvous: no key " + key);
  }

 private:
  std::string ownHostId() const {
    const auto it = own_.find("zeroplus/shm/host/0");
    if (it == own_.end()) return "";
    const auto b = it->second.find('|', it->second.find('|') + 1);
    return b == std::string::npos ? "" : it->second.substr(b + 1);
  }
  std::map<std::string, std::string> own_;
};

class NoRendezvous : public Rendezvous {
 public:
  void set(const std::string&, const std::vector<uint8_t>&) override {}
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds) override {
    throw std::runtime_error("unused " + key);
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size > 8192) return 0;
  const uint8_t flags = data[0];
  const std::string rest(reinterpret_cast<const char*>(data + 1), size - 1);

  FuzzRendezvous rendezvous;
  size_t at = 0;
  for (const char* kind : {"host", "seg", "ok"}) {
    const size_t nl = rest.find('\n', at);
    if (nl == std::string::npos) {
      at = std::string::npos;
      break;
    }
    rendezvous.peer[kind] = rest.substr(at, nl - at);
    at = nl + 1;
  }
  const std::string control = at == std::string::npos ? std::string() : rest.substr(at, 4096);

  // Rank 1's segment: a real one, holding the input's control block bytes.
  ShmSegment fake;
  if (fake.create(1, kSegmentBytes) != 0) return 0;
  std::memcpy(fake.data(), control.data(), control.size());
  rendezvous.segName = fake.name();

  CommunicatorOptions options;
  options.rank = 0;
  options.size = 2;
  options.connectTimeout = std::chrono::milliseconds(1);
  options.shm = (flags & 1) ? ShmMode::kOn : ShmMode::kAuto;
  options.shmChunkBytes = kChunk;
  options.spinMicros = 0;

  // The inner (TCP) communicator: a real one of size 1, enough for abort() and usable().
  CommunicatorOptions single;
  NoRendezvous none;
  std::unique_ptr<Communicator> inner = Communicator::connect(none, single);

  std::unique_ptr<Communicator> shm;
  try {
    shm = ShmCommunicator::maybeCreate(rendezvous, options, inner);
  } catch (const CommError&) {
    return 0;
  }
  fake.unlink();
  if (!shm) return 0;
  const auto deadline = Clock::now() + std::chrono::milliseconds(2);
  try {
    switch ((flags >> 1) & 3) {
      case 0: shm->barrier(deadline); break;
      case 1: shm->agreeMin(7, deadline); break;
      case 2: {
        float v[3] = {1, 2, 3};
        shm->allreduce(v, 3, DataType::kFloat32, ReduceOp::kSum, deadline);
        break;
      }
      case 3: {
        std::vector<float> v(40000, 1.0f);
        shm->allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, deadline);
        break;
      }
    }
  } catch (const CommError&) {
  }
  return 0;
}
