// The fused CPU kernels' thread pool: torch's own intra-op pool (at::parallel_for).
//
// Why: torch's CPU wheels run intra-op work on libgomp, whose idle workers keep spinning for a
// while after every parallel region (the default OMP_WAIT_POLICY). Kernel threads of our own,
// started right after a torch op (backward, or torch's fused Adam in a benchmark), then share
// the cores with those spinning workers and lose up to a third of their speed on 2 cores.
// Running our pieces as one more parallel region of the same pool keeps one set of threads.
//
// This translation unit is the only one compiled with -fopenmp (optimizers/CMakeLists.txt), and
// libzeroplus.so then needs libgomp.so.1: the loader reuses the copy torch already loaded (same
// SONAME), so there is one OpenMP runtime in the process. When torch is not an OpenMP build, or
// this build found no OpenMP, intraOpRunner() is empty and the kernels use std::threads.
//
// Threading: the runner may be called from any thread. Inside a parallel region (called from
// torch's own worker) at::parallel_for runs the body inline. The number of pieces is at most
// torch's thread count (torch.set_num_threads).
#pragma once

#include "optimizers/core/adam_kernels.hpp"

namespace zeroplus::optim::adapter {

// Empty when this build cannot run on torch's pool (see above).
ParallelRunner intraOpRunner();

}  // namespace zeroplus::optim::adapter
