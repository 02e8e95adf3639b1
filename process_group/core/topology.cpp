// Host topology exchange; see topology.hpp.
#include "process_group/core/topology.hpp"

#include <algorithm>
#include <cstdio>

#include "process_group/core/host_identity.hpp"

namespace zeroplus::pg {

std::vector<int> Topology::ranksOn(int h) const {
  std::vector<int> out;
  for (size_t r = 0; r < hostOf.size(); ++r) {
    if (hostOf[r] == h) out.push_back(static_cast<int>(r));
  }
  return out;
}

std::vector<int> Topology::leaders() const {
  std::vector<int> out;
  for (int h = 0; h < hostCount(); ++h) out.push_back(ranksOn(h).front());
  return out;
}

std::string Topology::describe() const {
  std::string s = std::to_string(hostCount()) + (hostCount() == 1 ? " host:" : " hosts:");
  for (int h = 0; h < hostCount(); ++h) {
    s += (h ? "; host " : " host ") + std::to_string(h) + " '" + hostNames[static_cast<size_t>(h)] + "' ranks ";
    const auto ranks = ranksOn(h);
    for (size_t i = 0; i < ranks.size(); ++i) s += (i ? "," : "") + std::to_string(ranks[i]);
  }
  return s;
}

Topology topologyFromIdentities(int rank, const std::vector<std::string>& identities,
                                const std::vector<std::string>& names) {
  Topology t;
  t.rank = rank;
  std::vector<std::string> seen;
  for (size_t r = 0; r < identities.size(); ++r) {
    const auto it = std::find(seen.begin(), seen.end(), identities[r]);
    if (it == seen.end()) {
      t.hostOf.push_back(static_cast<int>(seen.size()));
      seen.push_back(identities[r]);
      t.hostNames.push_back(r < names.size() ? names[r] : std::string("?"));
    } else {
      t.hostOf.push_back(static_cast<int>(it - seen.begin()));
    }
  }
  return t;
}

Topology exchangeTopology(Rendezvous& rendezvous, int rank, int size, Deadline deadline) {
  const auto start = Clock::now();
  const std::string mine = detail::hostIdentity() + "|" + detail::hostLabel();
  rendezvous.set("zeroplus/topo/" + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  std::vector<std::string> ids(static_cast<size_t>(size)), names(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    std::string entry = mine;
    if (r != rank) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      try {
        const auto bytes =
            rendezvous.get("zeroplus/topo/" + std::to_string(r), std::max(left, std::chrono::milliseconds(1)));
        entry.assign(bytes.begin(), bytes.end());
      } catch (const std::exception& e) {
        const double s = std::chrono::duration<double>(Clock::now() - start).count();
        char buf[32];
        std::snprintf(buf, sizeof(buf), "%.1f s", s);
        throw CommError("connect", rank, r, s,
                        std::string("timed out after ") + buf + " waiting for rank " + std::to_string(r) +
                            " to publish its host identity (" + e.what() + ")");
      }
    }
    const size_t bar = entry.find('|');
    ids[static_cast<size_t>(r)] = entry.substr(0, bar);
    names[static_cast<size_t>(r)] = bar == std::string::npos ? std::string("?") : entry.substr(bar + 1);
  }
  return topologyFromIdentities(rank, ids, names);
}

}  // namespace zeroplus::pg
