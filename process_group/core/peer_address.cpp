// Rendezvous address entries of the TCP set-up; see peer_address.hpp.
#include "process_group/core/peer_address.hpp"

#include <map>
#include <sstream>
#include <string_view>

namespace zeroplus::pg::detail {
namespace {

// Plain decimal digits (no sign, no blanks, no base prefix) into a value <= limit. std::stoul
// would accept " 12", "-1" (wrapped) and "12abc", and throw on the rest.
bool parseDecimal(std::string_view s, uint64_t limit, uint64_t* out) {
  if (s.empty() || s.size() > 20) return false;
  uint64_t v = 0;
  for (const char c : s) {
    if (c < '0' || c > '9') return false;
    const uint64_t d = static_cast<uint64_t>(c - '0');
    if (v > (limit - d) / 10) return false;
    v = v * 10 + d;
  }
  *out = v;
  return true;
}

}  // namespace

std::vector<uint8_t> encodePeerAddress(const PeerAddress& a) {
  std::ostringstream os;
  os << "host=" << a.host << ";net=" << a.net << ";addr=" << a.addr << ";port=" << a.port << ";any=" << (a.any ? 1 : 0)
     << ";nonce=" << a.nonce;
  const std::string s = os.str();
  return {s.begin(), s.end()};
}

bool decodePeerAddress(const std::vector<uint8_t>& bytes, PeerAddress* out) {
  std::map<std::string, std::string, std::less<>> kv;
  const std::string s(bytes.begin(), bytes.end());
  size_t at = 0;
  while (at <= s.size()) {
    size_t end = s.find(';', at);
    if (end == std::string::npos) end = s.size();
    const std::string_view item(s.data() + at, end - at);
    const size_t eq = item.find('=');
    if (eq != std::string_view::npos) kv[std::string(item.substr(0, eq))] = std::string(item.substr(eq + 1));
    at = end + 1;
  }
  auto field = [&](const char* key) -> const std::string* {
    const auto it = kv.find(key);
    return it == kv.end() ? nullptr : &it->second;
  };
  const std::string* addr = field("addr");
  const std::string* port = field("port");
  const std::string* nonce = field("nonce");
  const std::string* any = field("any");
  const std::string* host = field("host");
  const std::string* net = field("net");
  uint64_t p = 0, n = 0;
  if (addr == nullptr || port == nullptr || nonce == nullptr) return false;
  if (!parseDecimal(*port, 65535, &p) || p == 0) return false;
  if (!parseDecimal(*nonce, UINT64_MAX, &n)) return false;
  if (any != nullptr && *any != "0" && *any != "1") return false;
  out->host = host ? *host : std::string();
  out->net = net ? *net : std::string();
  out->addr = *addr;
  out->port = static_cast<uint16_t>(p);
  out->any = any != nullptr && *any == "1";
  out->nonce = n;
  return true;
}

}  // namespace zeroplus::pg::detail
