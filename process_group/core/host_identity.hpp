// Internal: who this process runs beside. Two questions matter to the transports, and they have
// different answers in containers and network namespaces:
// * networkIdentity(): can a peer reach my loopback? Equal values mean the same kernel boot and
//   the same network namespace (host name joined in for readable logs). The TCP set-up uses
//   127.0.0.1 only when every rank reports the same value.
// * hostIdentity(): do we share a machine, i.e. one kernel and one /dev/shm? Equal values mean
//   the same boot id and the same /dev/shm token: a random token file that the first process
//   on a /dev/shm creates (link(2) makes the creation atomic; the temporary is created
//   exclusively under a random name, and a malformed token is left alone: docs/security.md)
//   and every later one reads. Two
//   containers with one host name but their own /dev/shm get different tokens, so they are
//   two hosts; the topology (topology.hpp) is built from this value.
// Both are plain strings, compared for equality only. Torch-free, thread-safe (no state
// besides the token file).
#pragma once

#include <string>

namespace zeroplus::pg::detail {

std::string networkIdentity();
std::string hostIdentity();
// The kernel's host name (for messages and logs; never used to decide anything alone).
std::string hostLabel();

}  // namespace zeroplus::pg::detail
