#include "optimizers/adapter/zero/bucket_states.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace zeroplus::zero::engine {
namespace {

at::Tensor copyOf(const at::Tensor& t) { return t.defined() ? t.clone() : at::Tensor(); }

// Loaded state where the stepper keeps it: elementwise tensors beside the master (a checkpoint is
// read into host memory), `step` on the host (bucket_stepper.hpp). A tensor already there is kept.
SegmentState placedFor(const SegmentState& s, const at::Tensor& master) {
  auto beside = [&](const at::Tensor& t) { return t.defined() ? t.to(master.device()) : t; };
  return {beside(s.exp_avg), beside(s.exp_avg_sq), beside(s.max_exp_avg_sq), s.step.defined() ? s.step.cpu() : s.step,
          beside(s.momentum_buffer)};
}

}  // namespace

void BucketStates::beginRead() {
  if (swapper_ != nullptr) swapper_->waitForWrites();
}

BucketValues BucketStates::read(size_t b, const char* op) {
  auto& segments = steppers_[b].segments();
  BucketValues out;
  out.reserve(segments.size());
  if (swapper_ == nullptr) {
    for (const Segment& seg : segments) out.push_back({seg.master, seg.state});
    return out;
  }
  // The record is bound to the stepper's tensors only while they are copied out.
  swapper_->bindForRead(b, op);
  try {
    for (const Segment& seg : segments) {
      const SegmentState& st = seg.state;
      out.push_back({seg.master.clone(),
                     {copyOf(st.exp_avg), copyOf(st.exp_avg_sq), copyOf(st.max_exp_avg_sq), copyOf(st.step),
                      copyOf(st.momentum_buffer)}});
    }
  } catch (...) {
    swapper_->unbind(b);
    throw;
  }
  swapper_->unbind(b);
  return out;
}

c10::intrusive_ptr<c10d::Work> BucketStates::write(size_t b, const BucketValues& values, const char* op) {
  auto& segments = steppers_[b].segments();
  TORCH_CHECK(values.size() == segments.size(), op, ": bucket ", b, " has ", segments.size(), " segments, got values "
              "for ", values.size());
  // Offloaded: a fresh record bound in place of the old one (the master too, when it is a copy),
  // so the copies below land in it and store() writes what they left.
  if (swapper_ != nullptr) swapper_->bindForWrite(b, op);
  c10::intrusive_ptr<c10d::Work> work;
  try {
    for (size_t s = 0; s < segments.size(); ++s) {
      segments[s].master.copy_(values[s].master);
      segments[s].state = placedFor(values[s].state, segments[s].master);
    }
    work = placement_.publish(b);  // while an offloaded master is still bound
  } catch (...) {
    // The record must be sealed with the layout bindForWrite gave it: store what is there.
    if (swapper_ != nullptr) swapper_->store(b);
    throw;
  }
  if (swapper_ != nullptr) swapper_->store(b);  // the state tensors join the record; its write starts
  return work;
}

void BucketStates::finish() {
  if (swapper_ != nullptr) swapper_->waitForWrites();
}

}  // namespace zeroplus::zero::engine
