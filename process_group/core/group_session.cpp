// Agreeing a fresh scope per group instance; see group_session.hpp for the protocol.
#include "process_group/core/group_session.hpp"

#include <algorithm>
#include <cstdio>
#include <random>
#include <set>
#include <thread>
#include <vector>

namespace zeroplus::pg {
namespace {

const std::string kRoot = "zeroplus/session/";

std::string joinKey(int rank) { return kRoot + "join/" + std::to_string(rank); }
std::string welcomeKey(int rank, const std::string& nonce) {
  return kRoot + "welcome/" + std::to_string(rank) + "/" + nonce;
}
std::string joinedKey(const std::string& scope, int rank) {
  return kRoot + scope + "/joined/" + std::to_string(rank);
}

std::vector<uint8_t> bytesOf(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
std::string stringOf(const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); }

std::string fmtSeconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", s);
  return buf;
}

std::chrono::milliseconds remaining(Deadline deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return std::max(left, std::chrono::milliseconds(1));
}

}  // namespace

namespace detail {

std::string freshToken() {
  // std::random_device reads the kernel's random source (getrandom/urandom in libstdc++): a
  // token repeats with probability 2^-128, so no earlier instance can have used it.
  std::random_device rd;
  static const char* kHex = "0123456789abcdef";
  std::string out;
  out.reserve(32);
  for (int i = 0; i < 4; ++i) {
    uint32_t word = rd();
    for (int j = 0; j < 8; ++j) {
      out.push_back(kHex[word & 0xF]);
      word >>= 4;
    }
  }
  return out;
}

bool isToken(const std::string& s) {
  return s.size() == 32 &&
         std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

}  // namespace detail

std::string agreeSession(Rendezvous& rendezvous, int rank, int size, Deadline deadline) {
  const auto start = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  if (rank != 0) {
    const std::string nonce = detail::freshToken();
    rendezvous.set(joinKey(rank), bytesOf(nonce));
    std::string scope;
    try {
      scope = stringOf(rendezvous.get(welcomeKey(rank, nonce), remaining(deadline)));
    } catch (const std::exception& e) {
      throw CommError("session", rank, 0, elapsed(),
                      "timed out after " + fmtSeconds(elapsed()) + " waiting for rank 0 to admit it to the group (" +
                          e.what() + ")");
    }
    // Only this instance's rank 0 can have written a welcome for a nonce made a moment ago.
    if (!detail::isToken(scope)) {
      throw CommError("session", rank, 0, elapsed(), "rank 0 answered with a malformed group scope");
    }
    rendezvous.set(joinedKey(scope, rank), bytesOf("1"));
    return scope;
  }

  const std::string scope = detail::freshToken();
  std::vector<bool> joined(static_cast<size_t>(size), false);
  joined[0] = true;
  std::vector<std::set<std::string>> welcomed(static_cast<size_t>(size));
  auto pause = std::chrono::microseconds(200);
  for (;;) {
    std::vector<int> missing;
    for (int r = 1; r < size; ++r) {
      if (joined[static_cast<size_t>(r)]) continue;
      if (rendezvous.check(joinedKey(scope, r))) {
        joined[static_cast<size_t>(r)] = true;
        continue;
      }
      missing.push_back(r);
      if (!rendezvous.check(joinKey(r))) continue;
      const std::string nonce = stringOf(rendezvous.get(joinKey(r), remaining(deadline)));
      // A value that is not a token was not written by zeroplus: ignore it rather than build a
      // key from it; the rank's real join will overwrite it.
      if (detail::isToken(nonce) && welcomed[static_cast<size_t>(r)].insert(nonce).second) {
        rendezvous.set(welcomeKey(r, nonce), bytesOf(scope));
        pause = std::chrono::microseconds(200);  // its answer is one round trip away
      }
    }
    if (missing.empty()) return scope;
    if (Clock::now() >= deadline) {
      std::string list;
      for (size_t i = 0; i < missing.size(); ++i) list += (i ? ", " : "") + std::to_string(missing[i]);
      throw CommError("session", 0, missing.size() == 1 ? missing[0] : -1, elapsed(),
                      "timed out after " + fmtSeconds(elapsed()) + " waiting for rank" +
                          (missing.size() > 1 ? "s " : " ") + list + " to join the group");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(10000));
  }
}

}  // namespace zeroplus::pg
