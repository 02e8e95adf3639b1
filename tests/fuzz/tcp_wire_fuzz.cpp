// Fuzzes the receive side of the TCP transport: the WireHeader decode and check
// (process_group/core/wire.hpp, Exchange::checkHeader) and the progress engine that scatters
// one recvmsg over queued headers and payloads (Exchange::progressRecv), with the bytes a peer
// sends. Two real TcpMesh endpoints on loopback are connected once per process; per input,
// "rank 1" writes fuzz bytes into its socket and rank 0 runs an Exchange that expects 1 to 4
// transfers chosen by the input.
//
// Input: byte 0 = transfer count - 1 (low 2 bits); then 6 bytes per transfer
// {op u8, flags u8 (bit 0: the transfer carries a header), tag u16, bytes u16 % 2049}; the rest
// is the byte stream, cut or zero-padded to exactly what the transfers read, so no input can
// wait for the deadline. Contract checked: Exchange completes or throws CommError; payloads
// never land outside their buffers (each is its own heap block: ASan sees one byte past).
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include "tests/cpp/process_group/memory_rendezvous.hpp"
#include "process_group/core/exchange.hpp"
#include "process_group/core/tcp_mesh.hpp"

using namespace zeroplus::pg;
using namespace zeroplus::pg::detail;

namespace {

struct Pair {
  std::unique_ptr<TcpMesh> rank0, rank1;
};

Pair& meshes() {
  static Pair* pair = [] {
    auto* p = new Pair;
    testing::InMemoryRendezvous rendezvous;
    auto options = [](int rank) {
      CommunicatorOptions o;
      o.rank = rank;
      o.size = 2;
      o.connectTimeout = std::chrono::seconds(60);
      o.bindAddress = "127.0.0.1";
      return o;
    };
    std::thread t([&] { p->rank1 = TcpMesh::connect(rendezvous, options(1)); });
    p->rank0 = TcpMesh::connect(rendezvous, options(0));
    t.join();
    return p;
  }();
  return *pair;
}

void writeAll(int fd, const uint8_t* data, size_t n) {
  while (n > 0) {
    const ssize_t w = ::send(fd, data, n, MSG_NOSIGNAL);
    if (w < 0 && (errno == EAGAIN || errno == EINTR)) {
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 1000);
      continue;
    }
    if (w <= 0) {
      std::perror("tcp_wire_fuzz: send");
      std::abort();
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
}

// Discards whatever the failed exchange left unread, so the next input starts on a clean stream.
void drain(int fd) {
  uint8_t buf[4096];
  while (::recv(fd, buf, sizeof(buf), MSG_DONTWAIT) > 0) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Pair& m = meshes();
  if (size < 1) return 0;
  const size_t transfers = 1 + (data[0] & 3);
  if (size < 1 + 6 * transfers) return 0;
  struct Want {
    WireHeader expect;
    bool header;
    std::unique_ptr<uint8_t[]> buf;
    size_t bytes;
  };
  std::vector<Want> wants(transfers);
  size_t total = 0;
  for (size_t i = 0; i < transfers; ++i) {
    const uint8_t* d = data + 1 + 6 * i;
    const uint32_t tag = static_cast<uint32_t>(d[2] | (d[3] << 8));
    const size_t bytes = static_cast<size_t>(d[4] | (d[5] << 8)) % 2049;
    wants[i].expect = makeHeader(static_cast<WireOp>(d[0] % 13), bytes, tag);
    wants[i].header = (d[1] & 1) != 0;
    wants[i].bytes = bytes;
    wants[i].buf.reset(bytes ? new uint8_t[bytes] : nullptr);
    total += (wants[i].header ? sizeof(WireHeader) : 0) + bytes;
  }
  std::vector<uint8_t> stream(data + 1 + 6 * transfers, data + size);
  stream.resize(total, 0);
  writeAll(m.rank1->fd(0), stream.data(), stream.size());

  Exchange ex(*m.rank0);
  ex.begin(static_cast<WireOp>(wants[0].expect.op), Clock::now() + std::chrono::seconds(30));
  for (size_t i = 0; i < transfers; ++i) {
    ex.postRecv(1, wants[i].buf.get(), wants[i].bytes, i, wants[i].header ? &wants[i].expect : nullptr);
  }
  try {
    // Every transfer completes exactly once. (Not necessarily in post order: an empty transfer
    // completes when posted, ahead of a pending one before it.)
    std::vector<int> seen(transfers, 0);
    uint64_t cookie = 0;
    while (ex.next(&cookie)) {
      if (cookie >= transfers || seen[cookie]++) {
        std::fprintf(stderr, "tcp_wire_fuzz: completion %llu unknown or repeated\n", static_cast<unsigned long long>(cookie));
        std::abort();
      }
    }
    for (size_t i = 0; i < transfers; ++i) {
      if (!seen[i]) {
        std::fprintf(stderr, "tcp_wire_fuzz: transfer %zu of %zu never completed\n", i, transfers);
        std::abort();
      }
    }
  } catch (const CommError&) {
    // A header that does not match is the expected outcome for most inputs.
  }
  drain(m.rank0->fd(1));
  return 0;
}
