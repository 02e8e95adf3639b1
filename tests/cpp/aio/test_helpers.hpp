// Shared helpers for the aio tests: a temporary directory on a real file system, random
// buffers, and running a check in a forked child (for rlimits, setuid and seccomp, which must
// not leak into the test process).
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "aio/core/aligned_buffer.hpp"
#include "aio/core/engine.hpp"
#include "tests/cpp/temp_dir.hpp"
#include "aio/core/file.hpp"
#include "aio/core/io_error.hpp"

namespace zeroplus::aio::test {

using zeroplus::test_util::TempDir;

// mkdtemp under $TMPDIR (or /tmp); removed with its contents on destruction.
inline void fillRandom(void* p, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto* b = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<unsigned char>(rng());
}

inline OpenOptions writeOptions(DirectMode direct, bool truncate = true) {
  OpenOptions o;
  o.write = o.create = true;
  o.truncate = truncate;
  o.direct = direct;
  return o;
}

inline OpenOptions readOptions(DirectMode direct) {
  OpenOptions o;
  o.direct = direct;
  return o;
}

// Creates an engine, or skips the test when the requested kind cannot exist on this kernel.
#define ZP_CREATE_ENGINE_OR_SKIP(var, opts)                                                   \
  std::unique_ptr<::zeroplus::aio::Engine> var;                                               \
  try {                                                                                       \
    var = ::zeroplus::aio::Engine::create(opts);                                              \
  } catch (const ::zeroplus::aio::IoError& e) {                                               \
    if (e.error() == ENOSYS || e.error() == EPERM || e.error() == EACCES)                     \
      GTEST_SKIP() << "io_uring unavailable: " << e.what();                                   \
    throw;                                                                                    \
  }

// Runs `body` in a forked child; the child's exit status is body's return value (0 = pass).
// Returns the status, or a negative value when the child crashed.
inline int runInChild(const std::function<int()>& body) {
  fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 99;
    try {
      rc = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: unexpected exception: %s\n", e.what());
      rc = 98;
    }
    ::_exit(rc);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
}

}  // namespace zeroplus::aio::test
