// Built with -fopenmp (and without the plugin's precompiled header, whose flags differ) so that
// at::parallel_for below expands to torch's `#pragma omp parallel` region instead of its serial
// fallback. Nothing else in this file may use OpenMP: the core stays OpenMP-free.
#include "optimizers/adapter/intra_op_runner.hpp"

#include <ATen/Config.h>
#include <ATen/Parallel.h>

namespace zeroplus::optim::adapter {
namespace {

#if defined(_OPENMP) && AT_PARALLEL_OPENMP
void runOnIntraOpPool(int64_t count, int64_t grain, const RangeBody& body) {
  at::parallel_for(0, count, grain, [&body](int64_t b, int64_t e) { body(b, e); });
}
#endif

}  // namespace

ParallelRunner intraOpRunner() {
#if defined(_OPENMP) && AT_PARALLEL_OPENMP
  return &runOnIntraOpPool;
#else
  return {};
#endif
}

}  // namespace zeroplus::optim::adapter
