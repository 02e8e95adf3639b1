// GroupSession: the scope every other set-up key of one group instance lives under, agreed
// through the rendezvous so that nothing an earlier instance of the group wrote can be mistaken
// for this one's (issue 30).
//
// Why: a store can outlive a group. torchrun's agent keeps its TCPStore across restarts, and a
// restarted job creates its groups under the same names ("default_pg/0/..."), so every key of
// the previous attempt is still there: an address to a port nobody listens on any more, a
// shared-memory segment name, a tuning or topology record. A rank that reads such a key before
// the new owner overwrites it cannot tell it is stale. Overwriting does not help, and counting
// arrivals with store.add() does not either (a rank that died before it counted leaves the count
// off by one forever).
//
// Protocol (rank 0 admits every other rank; all keys under "zeroplus/session/"):
//   rank r > 0: picks a fresh random nonce n (128 bits), sets "join/<r>" = n, waits for
//               "welcome/<r>/<n>" (= the scope S), then sets "<S>/joined/<r>".
//   rank 0:     picks a fresh random scope S (128 bits); until every "<S>/joined/<r>" exists, it
//               reads each "join/<r>" and sets "welcome/<r>/<value>" = S for every value it has
//               not welcomed yet (it cannot tell a stale value from a fresh one, so it welcomes
//               both; the stale one's owner is gone).
// A welcome names a nonce only its current owner knows, and a "joined" key names a scope only
// the current rank 0 knows, so each side trusts only what the other side of *this* instance
// wrote. After agree() every rank has the same S and rank 0 knows every rank has it; the group
// then prefixes every key with scopePrefix(S). Stale keys are left in the store (a Rendezvous
// cannot delete): a few short keys per group instance.
//
// Cost: one store round trip per rank; rank 0 polls "join/<r>" and "<S>/joined/<r>" with
// check() and a backoff from 0.2 to 10 ms while ranks are missing.
//
// Threading: call once per group instance on every rank, concurrently across ranks. Blocking up
// to `deadline`; throws CommError("session", ...) naming the missing ranks (rank 0) or rank 0
// (other ranks) when it passes. Torch-free.
#pragma once

#include <string>

#include "process_group/core/communicator.hpp"
#include "process_group/core/rendezvous.hpp"

namespace zeroplus::pg {

// Returns the agreed scope S (32 lowercase hex digits).
std::string agreeSession(Rendezvous& rendezvous, int rank, int size, Deadline deadline);

// The key prefix of everything the group instance with scope S writes: "zeroplus/<S>" (c10d's
// PrefixStore adds the "/").
inline std::string scopePrefix(const std::string& scope) { return "zeroplus/" + scope; }

namespace detail {
// 32 lowercase hex digits from the kernel's random source (getrandom via std::random_device).
std::string freshToken();
bool isToken(const std::string& s);
}  // namespace detail

}  // namespace zeroplus::pg
