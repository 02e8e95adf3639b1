// Internal: the rendezvous entry through which a rank tells its peers where it listens
// ("host=..;net=..;addr=..;port=..;any=..;nonce=..", see tcp_mesh.hpp).
//
// The entry comes from the store, i.e. from outside this process: decodePeerAddress() accepts
// exactly what encodePeerAddress() writes (fields in any order, unknown keys ignored) and
// returns false for anything else, never throws. tests/fuzz/peer_address_fuzz.cpp holds it to
// that. Torch-free, no state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zeroplus::pg::detail {

struct PeerAddress {
  std::string host;
  std::string net;  // networkIdentity() (host_identity.hpp); empty from an older peer
  std::string addr;
  uint16_t port = 0;
  bool any = false;  // listening on every interface, so loopback reaches it from the same host
  uint64_t nonce = 0;
};

std::vector<uint8_t> encodePeerAddress(const PeerAddress& a);

// False (and *out unspecified) unless addr, port and nonce are present, port is a decimal in
// 1..65535, nonce a decimal that fits 64 bits and any is absent, 0 or 1.
bool decodePeerAddress(const std::vector<uint8_t>& bytes, PeerAddress* out);

}  // namespace zeroplus::pg::detail
