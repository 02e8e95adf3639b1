// The shared-memory transport on a /dev/shm too small for its segments (a container's 6 MiB,
// Docker's 64 MiB with 16 MiB chunks): ZEROPLUS_SHM=auto must fall back to TCP on every rank
// and still reduce correctly, ZEROPLUS_SHM=on must fail on every rank naming /dev/shm, its free
// space and the bytes needed; nobody may die of SIGBUS.
//
// Each case runs in a forked child that unshares its mount namespace and mounts a small tmpfs
// over /dev/shm (root only; skipped with the reason otherwise). The child reports through its
// exit status: 0 pass, 77 skip, 1 failure (details on stderr), a signal (SIGBUS) = the bug.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "process_group/core/shm_segment.hpp"
#include "test_group.hpp"

namespace zeroplus::pg {
namespace {

using namespace std::chrono_literals;
using testing::InMemoryRendezvous;
using testing::runRanks;

constexpr int kSkip = 77;

// Runs body() in a child whose /dev/shm is a fresh tmpfs of `size` ("6m"); returns its wait status.
int inSmallDevShm(const char* size, const std::function<bool()>& body) {
  std::fflush(nullptr);
  const pid_t child = ::fork();
  if (child == 0) {
    if (::unshare(CLONE_NEWNS) != 0 || ::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
      std::fprintf(stderr, "cannot create a mount namespace: %s\n", std::strerror(errno));
      ::_exit(kSkip);
    }
    const std::string opts = std::string("size=") + size + ",mode=1777";
    if (::mount("tmpfs", "/dev/shm", "tmpfs", 0, opts.c_str()) != 0) {
      std::fprintf(stderr, "cannot mount a tmpfs on /dev/shm: %s\n", std::strerror(errno));
      ::_exit(kSkip);
    }
    bool ok = false;
    try {
      ok = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "unexpected exception: %s\n", e.what());
    }
    std::fflush(nullptr);
    ::_exit(ok ? 0 : 1);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return status;
}

void expectPassed(int status) {
  if (WIFEXITED(status) && WEXITSTATUS(status) == kSkip) GTEST_SKIP() << "needs root to mount a small /dev/shm";
  ASSERT_FALSE(WIFSIGNALED(status)) << "child died of signal " << WTERMSIG(status) << " (" << strsignal(WTERMSIG(status))
                                    << ")";
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child failed, see stderr";
}

// Connects 2 ranks (threads) with `mode` and `chunk`; returns each rank's connect error ("" on
// success) and, on success, checks a 1M-float allreduce (touches every slot of the segment).
std::vector<std::string> connectAndReduce(ShmMode mode, size_t chunk, std::vector<std::string>* transports) {
  InMemoryRendezvous rdv;
  std::vector<std::string> errors(2);
  transports->assign(2, "");
  runRanks(2, [&](int r) {
    CommunicatorOptions o;
    o.rank = r;
    o.size = 2;
    o.connectTimeout = 20s;
    o.shm = mode;
    o.shmChunkBytes = chunk;
    std::unique_ptr<Communicator> c;
    try {
      c = Communicator::connect(rdv, o);
    } catch (const CommError& e) {
      errors[static_cast<size_t>(r)] = e.what();
      return;
    }
    (*transports)[static_cast<size_t>(r)] = c->transport();
    std::vector<float> v(1 << 20, static_cast<float>(r + 1));
    c->allreduce(v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, testing::in(20s));
    for (float x : v) {
      if (x != 3.0f) throw std::runtime_error("wrong allreduce result");
    }
  });
  return errors;
}

bool autoFallsBackToTcp(size_t chunk) {
  std::vector<std::string> transports;
  const auto errors = connectAndReduce(ShmMode::kAuto, chunk, &transports);
  bool ok = true;
  for (size_t r = 0; r < 2; ++r) {
    if (!errors[r].empty() || transports[r] != "tcp") {
      std::fprintf(stderr, "rank %zu: transport '%s', error '%s'\n", r, transports[r].c_str(), errors[r].c_str());
      ok = false;
    }
  }
  return ok;
}

bool onFailsNamingDevShm(size_t chunk) {
  std::vector<std::string> transports;
  const auto errors = connectAndReduce(ShmMode::kOn, chunk, &transports);
  const std::string needed = std::to_string(4 * chunk + 4096);
  bool ok = true;
  for (size_t r = 0; r < 2; ++r) {
    const std::string& e = errors[r];
    if (e.find("/dev/shm has ") == std::string::npos || e.find("bytes free") == std::string::npos ||
        e.find(needed) == std::string::npos) {
      std::fprintf(stderr, "rank %zu: expected an error naming /dev/shm, its free space and %s bytes, got '%s'\n", r,
                   needed.c_str(), e.c_str());
      ok = false;
    }
  }
  return ok;
}

TEST(ShmSpace, AutoFallsBackToTcpOnEveryRankWhenDevShmIsSmall) {
  for (const char* size : {"6m", "3m"}) {
    SCOPED_TRACE(size);
    expectPassed(inSmallDevShm(size, [] { return autoFallsBackToTcp(1u << 20); }));
  }
}

TEST(ShmSpace, AutoFallsBackWhenChunkIsLargeForTheDockerDefault) {
  expectPassed(inSmallDevShm("64m", [] { return autoFallsBackToTcp(16u << 20); }));
}

TEST(ShmSpace, OnFailsOnEveryRankNamingDevShmAndTheBytesNeeded) {
  for (const char* size : {"6m", "3m"}) {
    SCOPED_TRACE(size);
    expectPassed(inSmallDevShm(size, [] { return onFailsNamingDevShm(1u << 20); }));
  }
}

TEST(ShmSpace, SegmentCreateReservesItsPages) {
  // The unit under the cases above: create() on a tmpfs that cannot hold the segment is an
  // error, not a mapping that faults later.
  expectPassed(inSmallDevShm("1m", [] {
    detail::ShmSegment s;
    const int rc = s.create(0, 2u << 20);
    if (rc != -ENOSPC) std::fprintf(stderr, "create of 2 MiB on a 1 MiB tmpfs returned %d\n", rc);
    return rc == -ENOSPC;
  }));
}

}  // namespace
}  // namespace zeroplus::pg
