// Fuzzes the TCP set-up's rendezvous address entry (process_group/core/peer_address.hpp): it
// comes from the store, i.e. from whoever can write to it. decodePeerAddress must return false
// or an entry that survives encode/decode unchanged; it must never throw.
#include <cstdio>
#include <cstdlib>

#include "process_group/core/peer_address.hpp"

using zeroplus::pg::detail::PeerAddress;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::vector<uint8_t> bytes(data, data + size);
  PeerAddress a;
  if (!zeroplus::pg::detail::decodePeerAddress(bytes, &a)) return 0;
  PeerAddress b;
  const bool again = zeroplus::pg::detail::decodePeerAddress(zeroplus::pg::detail::encodePeerAddress(a), &b);
  if (!again || a.host != b.host || a.addr != b.addr || a.port != b.port || a.any != b.any || a.nonce != b.nonce ||
      a.port == 0) {
    std::fprintf(stderr, "peer_address_fuzz: decoded entry does not round-trip\n");
    std::abort();
  }
  return 0;
}
