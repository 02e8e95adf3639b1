// Point-to-point messages and the barrier.
#include <cstring>

#include "process_group/core/tcp_communicator.hpp"

namespace zeroplus::pg::detail {

void TcpCommunicator::send(const void* data, size_t bytes, int peer, uint32_t tag, Deadline deadline) {
  require(WireOp::kSend, peer >= 0 && peer < size_ && peer != rank_,
          "does not support send to peer " + std::to_string(peer) + " (world size " + std::to_string(size_) + ")");
  run(describe(WireOp::kSend, bytes), deadline, [&] {
    const WireHeader h = makeHeader(WireOp::kSend, bytes, tag);
    exchange_.postSend(peer, data, bytes, 0, &h);
    exchange_.drain();
  });
}

void TcpCommunicator::recv(void* data, size_t bytes, int peer, uint32_t tag, Deadline deadline) {
  require(WireOp::kRecv, peer >= 0 && peer < size_ && peer != rank_,
          "does not support recv from peer " + std::to_string(peer) + " (world size " + std::to_string(size_) + ")");
  run(describe(WireOp::kRecv, bytes), deadline, [&] {
    auto sizeError = [&](size_t sent) {
      exchange_.fail(peer, "posted a receive of " + std::to_string(bytes) + " bytes with tag " + std::to_string(tag) +
                               " but peer " + std::to_string(peer) + " sent " + std::to_string(sent) + " bytes");
    };
    // A message that arrived earlier for this (peer, tag) while we were looking for another tag.
    if (auto it = stash_.find({peer, tag}); it != stash_.end() && !it->second.empty()) {
      std::vector<uint8_t> msg = std::move(it->second.front());
      it->second.pop_front();
      if (it->second.empty()) stash_.erase(it);
      if (msg.size() != bytes) sizeError(msg.size());
      if (bytes > 0) std::memcpy(data, msg.data(), bytes);
      return;
    }
    // Messages from one peer arrive in send order; read headers until ours shows up, keeping
    // the payloads of other tags for later receives. The header is read on its own so that a
    // payload never lands in the caller's buffer before its tag and size are checked.
    for (;;) {
      WireHeader h;
      exchange_.postRecv(peer, &h, sizeof(h), 0);
      exchange_.drain();
      if (h.magic != kWireMagic) exchange_.fail(peer, "received a corrupt header from peer " + std::to_string(peer));
      if (h.op != static_cast<uint8_t>(WireOp::kSend)) {
        exchange_.fail(peer, "collective mismatch: this rank runs recv but peer " + std::to_string(peer) + " runs " +
                                 std::string(opName(static_cast<WireOp>(h.op))));
      }
      if (h.tag == tag) {
        if (h.bytes != bytes) sizeError(h.bytes);
        exchange_.postRecv(peer, data, bytes, 0);
        exchange_.drain();
        return;
      }
      std::vector<uint8_t> other(h.bytes);
      exchange_.postRecv(peer, other.data(), other.size(), 0);
      exchange_.drain();
      stash_[{peer, h.tag}].push_back(std::move(other));
    }
  });
}

void TcpCommunicator::barrier(Deadline deadline) {
  // The descriptor exchange run() does first is already a barrier: each rank sends its
  // descriptor on entry and leaves only after it has received every peer's.
  run(describe(WireOp::kBarrier, 0), deadline, [] {});
}

}  // namespace zeroplus::pg::detail
