// Which ranks of a group share a host, learnt once at group creation through the rendezvous.
//
// Every rank publishes "<host identity>|<host name>" (host_identity.hpp: boot id + /dev/shm
// token, so a host is "one kernel and one /dev/shm", not a host name) under
// "zeroplus/topo/<rank>" and reads everyone's. Hosts are numbered in order of their lowest
// rank, so host 0 holds rank 0 and every rank computes the same numbering. A host's leader is
// its lowest rank.
//
// Uses: the shared-memory transport is only tried among ranks of one host (Communicator::
// connect), ZEROPLUS_DEBUG=1 logs it, and zeroplus.topology(group) returns it to Python.
// Torch-free; a Topology is an immutable value after exchangeTopology() returns.
#pragma once

#include <string>
#include <vector>

#include "process_group/core/communicator.hpp"

namespace zeroplus::pg {

struct Topology {
  int rank = 0;
  std::vector<int> hostOf;              // [group rank] -> host index
  std::vector<std::string> hostNames;   // [host index] -> host name of its leader (for logs)

  int hostCount() const { return static_cast<int>(hostNames.size()); }
  int host() const { return hostOf[static_cast<size_t>(rank)]; }
  // Group ranks on host h, ascending; the first is its leader.
  std::vector<int> ranksOn(int h) const;
  std::vector<int> leaders() const;
  // One line: "2 hosts: host 0 'a' ranks 0,1; host 1 'b' ranks 2,3".
  std::string describe() const;
};

// Blocks until every rank of the group published its entry or `deadline` passes; throws
// CommError("connect") naming the first missing rank on timeout. Every rank must call it.
Topology exchangeTopology(Rendezvous& rendezvous, int rank, int size, Deadline deadline);

// Builds a Topology from every rank's host identity (exposed for unit tests).
Topology topologyFromIdentities(int rank, const std::vector<std::string>& identities,
                                const std::vector<std::string>& names);

}  // namespace zeroplus::pg
