// The one owner of "where bucket b's gradient lives" in the C++ ZeRO engine (stages 1-2):
// gradients are copied into their bucket's buffer as autograd finishes them, buckets are reduced
// in bucket order while backward goes on, and this rank's share of each result is accumulated.
//
// The math is the Python engine's (zero/grad_reducer.py), operation for operation, so both
// front-ends produce the same bits:
//  * fp16 buckets are divided by N before the sum (DDP's and DeepSpeed's order: the sum cannot
//    overflow) and accumulated without a further 1/N; the first stage-1 pass is as below.
//  * stage 2: a bucket's buffer (the gradients, zeros for parameters without one and for gaps) is
//    reduce-scattered with SUM; the first pass since zero() takes the result into the
//    accumulator and multiplies it by 1/N; a later pass adds it with alpha 1/N.
//  * stage 1 (gradients kept whole): the first pass writes grad * (1/N) straight into the
//    accumulator and all-reduces it in place (DDP's bits); a later pass all-reduces a separate
//    buffer and adds it with alpha 1/N.
//  * buckets are launched strictly in bucket order (every rank issues the same collectives in the
//    same order) as soon as all their gradients are in; at the end of backward the rest are
//    launched, every collective is waited on and the pass's "had a gradient" flags are committed.
//    At most two full-size inputs are in flight: older ones are waited on during backward.
//  * usage: one flag per trainable parameter. agree() (an all-reduce MAX at step) turns "used on
//    any rank" into "defined"; the step updates defined parameters only (torch's None-grad rule).
//
// Threading: onGrad runs on the autograd thread, everything else on the training thread, never
// concurrently. Errors: a collective failure raises from endBackward/flush and leaves the
// accumulators as they were before the pass (freed when the pass started from none).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <optional>
#include <vector>

#include "optimizers/adapter/zero/collectives.hpp"
#include "optimizers/adapter/zero/flat_params.hpp"

namespace zeroplus::zero::engine {

class GradReducer {
 public:
  // accumDtype: the dtype of the gradient shards (DeepSpeed's data_types.grad_accum_dtype, e.g.
  // fp32 sums of bf16 gradients); nullopt: each bucket's own dtype. A bucket's result is then
  // added into a zero accumulator of that dtype (0 + scale * sum), as the Python engine does.
  GradReducer(std::vector<Bucket>& buckets, Collectives& comm, bool shardGradients,
              std::optional<at::ScalarType> accumDtype = std::nullopt);

  // -- backward (events) --
  // Trainable parameter at (bucket, entry) has its gradient in .grad: take it (and free .grad).
  void onGrad(int64_t bucket, int64_t entry);
  // The backward pass ended: launch what is left, wait, accumulate, commit the usage flags.
  void endBackward();
  bool passOpen() const { return inPass_; }
  // no_sync: gradients stay in .grad (local accumulation); the next pass or flush() sends them.
  void setNoSync(bool on) { noSync_ = on; }
  bool noSync() const { return noSync_; }
  // Reduce what no_sync accumulated when a step comes without a synced backward. Collective.
  void flush();

  // -- step --
  bool hasGrads() const { return hasGrads_; }
  // This rank's gradient shard of bucket b (a zero tensor where no gradient exists yet).
  at::Tensor shard(size_t b);
  // No inf or NaN in any of this rank's shards (the fp16 overflow check; local).
  bool allFinite();
  // Multiply every shard by coef (a 0-d tensor), in place.
  void scale(const at::Tensor& coef);
  // Agree on which parameters had a gradient (collective); per trainable flag (bucket order),
  // whether the step updates it.
  std::vector<uint8_t> agree();
  int64_t flagBase(size_t b) const { return base_[b]; }
  // The agreed flags as they stand (no collective): gradients defined since zero_grad.
  const std::vector<uint8_t>& defined() const { return defined_; }
  // zero_grad: free the accumulators (setToNone) or keep them as zeros.
  void zero(bool setToNone);

 private:
  struct InFlight {
    int64_t bucket;
    c10::intrusive_ptr<c10d::Work> work;  // null once waited on
    at::Tensor out;                        // where this rank's result lands
    at::Tensor input;                      // the full-size input while it may be read
    bool settled = false;
  };
  bool directPass();
  at::Tensor& buffer(int64_t b);
  at::Tensor& accum(int64_t b);            // zeros when absent
  at::Tensor& accumToOverwrite(int64_t b);  // uninitialised when absent
  double scaleOf(int64_t b);
  void takeGrad(int64_t b, int64_t e);
  void launchReady();
  void launch(int64_t b);
  void retireInputs();
  void settle(InFlight& f);
  void finishPass();
  void abandonPass();
  void resetPass();

  std::vector<Bucket>& buckets_;
  Collectives& comm_;
  const bool shardGradients_;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> gaps_;
  std::vector<at::Tensor> accum_;  // undefined while no gradient exists
  std::vector<at::ScalarType> accumDtypes_;  // per bucket
  bool sameDtypes_ = true;                   // every accumulator in its bucket's dtype
  std::vector<int64_t> base_;
  std::vector<uint8_t> used_, defined_;
  bool noSync_ = false, hasGrads_ = false, localPending_ = false;
  // the open pass
  bool inPass_ = false;
  int direct_ = -1;  // -1: not decided yet this pass
  std::vector<std::vector<bool>> arrived_;
  std::vector<int64_t> remaining_;
  std::vector<at::Tensor> buffers_;
  std::vector<int64_t> passUsed_;
  std::vector<InFlight> inflight_;
  int64_t next_ = 0;
};

}  // namespace zeroplus::zero::engine
