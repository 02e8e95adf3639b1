#include "optimizers/adapter/zero/optimizer_swapper.hpp"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <tuple>

#include "aio/core/io_error.hpp"
#include "optimizers/adapter/zero/flat_params.hpp"
#include "optimizers/core/swap_store.hpp"

namespace zeroplus::zero::engine {
namespace {

constexpr size_t kMaxSlots = 4;       // a master copy + Adam's three moments (amsgrad)
constexpr uint64_t kSlotAlign = 64;   // the SIMD kernels' width

at::Tensor SegmentState::*stateOf(int kind) {
  switch (kind) {
    case 1: return &SegmentState::exp_avg;
    case 2: return &SegmentState::exp_avg_sq;
    case 3: return &SegmentState::max_exp_avg_sq;
    default: return &SegmentState::momentum_buffer;
  }
}

// State kinds a group with these hyperparameters creates (bucket_stepper.cpp): Adam's two
// moments (+ max_exp_avg_sq with amsgrad); SGD's momentum buffer when momentum != 0.
size_t stateKinds(const StepHyper& hyper) {
  if (const auto* a = std::get_if<AdamHyper>(&hyper)) return a->amsgrad ? 3 : 2;
  return std::get<SgdHyper>(hyper).momentum != 0 ? 1 : 0;
}

bool isCopy(const at::Tensor& master, const Bucket& b) {
  if (b.flat.defined() && master.is_alias_of(b.flat)) return false;
  return !(b.shard.defined() && master.is_alias_of(b.shard));
}

}  // namespace

OptimizerSwapper::OptimizerSwapper(const Options& options, Placement& placement, std::vector<BucketStepper>& steppers,
                                   const std::vector<StepHyper>& groupHyper, int rank)
    : placement_(placement), steppers_(steppers), rank_(rank) {
  TORCH_CHECK_VALUE(options.offload_buffer_count() >= 1, "zeroplus::zero::initialize: options.offload_buffer_count "
                    "must be >= 1, got ", options.offload_buffer_count());
  const auto& buckets = placement_.buckets();
  uint64_t largest = 0;
  for (size_t b = 0; b < buckets.size(); ++b) {
    Home h;
    h.shardNumel = buckets[b].shardNumel;
    h.masterCopy = isCopy(placement_.master(b), buckets[b]);
    if (h.masterCopy) h.slots.push_back(kMaster);
    h.has.assign(steppers_[b].segments().size(), 0);
    const size_t group = static_cast<size_t>(buckets[b].group);
    TORCH_CHECK(group < groupHyper.size(), "zeroplus::zero::initialize: bucket ", b, " of group ", group, " but ",
                groupHyper.size(), " groups");
    // At least one slot: a record with an empty payload (fp32 SGD without momentum) is still a
    // valid record, but one slot keeps every buffer and file non-empty at negligible cost.
    h.capacity = std::max<size_t>(1, (h.masterCopy ? 1 : 0) + stateKinds(groupHyper[group]));
    largest = std::max(largest, slotBytes(h) * h.capacity);
    homes_.push_back(std::move(h));
  }
  payloads_.assign(buckets.size(), nullptr);
  swap::SwapStoreOptions so;
  so.parent = options.nvme_path();
  so.prefix = "zeroplus-cswap-" + std::to_string(::getpid()) + "-rank" + std::to_string(rank) + "-";
  so.stem = "optimizer-b";
  so.bufferBytes = swap::recordBytes(largest);
  so.bufferCount = static_cast<size_t>(options.offload_buffer_count());
  try {
    store_ = std::make_unique<swap::SwapStore>(so);
  } catch (const aio::IoError& e) {
    TORCH_CHECK(false, "zeroplus::zero::initialize: options.nvme_path: cannot create the swap directory: ", e.what());
  }
  // The masters that are copies go to their records at once: between steps they live there only.
  for (size_t b = 0; b < buckets.size(); ++b) {
    if (!homes_[b].masterCopy) continue;
    at::Tensor keep = placement_.master(b).clone();
    TORCH_CHECK(fetch(b), "zeroplus::zero::initialize: ", faults_.front());
    slotTensor(b, 0).copy_(keep);
    store(b);
  }
  noteFaults(store_->drain());
  if (!faults_.empty()) {
    const std::string first = faults_.front();
    faults_.clear();
    TORCH_CHECK(false, "zeroplus::zero::initialize: options.nvme_path: ", first);
  }
}

OptimizerSwapper::~OptimizerSwapper() = default;  // the store waits for its writes and removes its files

std::string OptimizerSwapper::directory() const { return store_->directory(); }
std::string OptimizerSwapper::pathOf(size_t b) const { return store_->pathOf(b); }
uint64_t OptimizerSwapper::bytesRead() const { return store_->stats().bytesRead; }
uint64_t OptimizerSwapper::bytesWritten() const { return store_->stats().bytesWritten; }
size_t OptimizerSwapper::bufferBytes() const { return store_->bufferBytes(); }
swap::SwapStats OptimizerSwapper::stats() const { return store_->stats(); }

uint64_t OptimizerSwapper::slotBytes(const Home& h) const {
  const uint64_t bytes = static_cast<uint64_t>(h.shardNumel) * sizeof(float);
  return (bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
}

uint64_t OptimizerSwapper::layoutTag(const Home& h) const {
  uint64_t tag = static_cast<uint64_t>(h.shardNumel) << 16;
  for (size_t k = 0; k < h.slots.size(); ++k) tag |= static_cast<uint64_t>(h.slots[k] + 1) << (3 * k);
  return tag;
}

at::Tensor OptimizerSwapper::slotTensor(size_t b, size_t k) const {
  char* base = static_cast<char*>(payloads_[b]) + k * slotBytes(homes_[b]);
  return at::from_blob(base, {homes_[b].shardNumel}, at::TensorOptions().dtype(at::kFloat));
}

at::Tensor OptimizerSwapper::paramsShardAsFp32(size_t b) const {
  const Bucket& bucket = placement_.buckets()[b];
  if (bucket.shard.defined()) return bucket.shard.to(at::kFloat, false, /*copy=*/true);
  const auto [lo, hi] = bucket.shardRange(rank_);
  return bucket.flat.slice(0, lo, hi).to(at::kFloat, false, /*copy=*/true);
}

void OptimizerSwapper::noteFaults(std::vector<swap::SwapFault> faults) {
  for (const auto& f : faults) {
    faults_.push_back("bucket " + std::to_string(f.id) + " (file " + f.path + "): " + f.what + " [" +
                      std::strerror(f.err) + "]; the step completed and the bucket's record is kept in memory "
                      "until a later step writes it");
  }
}

void OptimizerSwapper::prefetchAhead() { readAhead(0); }

void OptimizerSwapper::waitForWrites() { noteFaults(store_->drain()); }

void OptimizerSwapper::poll() { noteFaults(store_->poll()); }

void OptimizerSwapper::readAhead(size_t first) {
  // Every reader visits the buckets in order: the store reads them as its buffers free up, while
  // the caller computes (swap_store.hpp: a plan never waits, grows the pool or evicts).
  std::vector<swap::RecordKey> plan;
  for (size_t n = first; n < homes_.size(); ++n) {
    const Home& h = homes_[n];
    if (!h.held) plan.push_back({n, h.generation, payloadBytes(h), layoutTag(h)});
  }
  store_->planReads(std::move(plan));
}

bool OptimizerSwapper::fetch(size_t b) {
  Home& h = homes_[b];
  void* payload = nullptr;
  swap::SwapFault fault;
  const int rc = store_->fetch({b, h.generation, payloadBytes(h), layoutTag(h)}, &payload, &fault);
  at::Tensor& master = placement_.master(b);
  if (rc != 0) {
    faults_.push_back("bucket " + std::to_string(b) + " (file " + fault.path + "): " + fault.what + " [" +
                      std::strerror(fault.err) + "]; the bucket was not stepped (its parameters and optimizer "
                      "state keep their values) and the state in this file is unusable");
    if (h.masterCopy) {
      master.set_(paramsShardAsFp32(b));  // publish then leaves the parameters as they are
      steppers_[b].rebindMaster();
    }
    return false;
  }
  bind(b, payload);
  return true;
}

void OptimizerSwapper::bind(size_t b, void* payload) {
  Home& h = homes_[b];
  payloads_[b] = payload;
  h.held = true;
  if (h.masterCopy) {
    placement_.master(b).set_(slotTensor(b, 0));
    steppers_[b].rebindMaster();
  }
  auto& segments = steppers_[b].segments();
  for (size_t s = 0; s < segments.size(); ++s) {
    for (size_t k = 0; k < h.slots.size(); ++k) {
      if (h.slots[k] == kMaster || !(h.has[s] & (1u << h.slots[k]))) continue;
      segments[s].state.*stateOf(h.slots[k]) = slotTensor(b, k).slice(0, segments[s].lo, segments[s].hi);
    }
  }
}

void OptimizerSwapper::bindForRead(size_t b, const char* op) {
  TORCH_CHECK(!homes_[b].held, op, ": bucket ", b, "'s swap record is already held (called during a step?)");
  Home& h = homes_[b];
  void* payload = nullptr;
  swap::SwapFault fault;
  const int rc = store_->fetch({b, h.generation, payloadBytes(h), layoutTag(h)}, &payload, &fault);
  TORCH_CHECK(rc == 0, op, ": NVMe optimizer offload (rank ", rank_, "): bucket ", b, " (file ", fault.path, "): ",
              fault.what, " [", std::strerror(fault.err), "]; the optimizer state in this file is unusable");
  bind(b, payload);
  readAhead(b + 1);  // after the check: a failed read leaves nothing started on its behalf
}

void OptimizerSwapper::unbind(size_t b) {
  Home& h = homes_[b];
  if (!h.held) return;
  for (auto& seg : steppers_[b].segments()) {
    for (int kind = kExpAvg; kind < kKinds; ++kind) seg.state.*stateOf(kind) = at::Tensor();
  }
  if (h.masterCopy) {
    placement_.master(b).set_(at::empty({0}, at::TensorOptions().dtype(at::kFloat)));
    steppers_[b].rebindMaster();
  }
  h.held = false;
  payloads_[b] = nullptr;
  store_->release(b);
}

void OptimizerSwapper::bindForWrite(size_t b, const char* op) {
  Home& h = homes_[b];
  TORCH_CHECK(!h.held, op, ": bucket ", b, "'s swap record is already held (called during a step?)");
  void* payload = nullptr;
  swap::SwapFault fault;
  // Room for every slot the record may get (store() appends the kinds the caller assigns).
  const int rc = store_->overwrite(b, slotBytes(h) * h.capacity, &payload, &fault);
  TORCH_CHECK(rc == 0, op, ": NVMe optimizer offload (rank ", rank_, "): bucket ", b, " (file ", fault.path, "): ",
              fault.what, " [", std::strerror(fault.err), "]");
  h.slots.clear();
  if (h.masterCopy) h.slots.push_back(kMaster);
  std::fill(h.has.begin(), h.has.end(), 0);
  bind(b, payload);  // the master only: no segment has a kind yet
}

void OptimizerSwapper::store(size_t b) {
  Home& h = homes_[b];
  at::Tensor& master = placement_.master(b);
  if (!h.held) {
    if (h.masterCopy) {  // a bucket whose fetch failed: drop the stand-in master
      master.set_(at::empty({0}, at::TensorOptions().dtype(at::kFloat)));
      steppers_[b].rebindMaster();
    }
    return;
  }
  auto& segments = steppers_[b].segments();
  size_t needed = h.slots.size();  // the record's slots once this step's new kinds join it
  for (int kind = kExpAvg; kind < kKinds; ++kind) {
    if (std::find(h.slots.begin(), h.slots.end(), static_cast<Kind>(kind)) != h.slots.end()) continue;
    for (const auto& seg : segments) {
      if ((seg.state.*stateOf(kind)).defined()) {
        ++needed;
        break;
      }
    }
  }
  if (needed > h.capacity && !grow(b, needed)) return;  // the fault is kept for endStep
  for (size_t s = 0; s < segments.size(); ++s) {
    for (int kind = kExpAvg; kind < kKinds; ++kind) {
      at::Tensor& t = segments[s].state.*stateOf(kind);
      if (!t.defined()) continue;
      // State the stepper created this step (lazily, at a segment's first step) joins the record.
      auto slot = std::find(h.slots.begin(), h.slots.end(), static_cast<Kind>(kind));
      if (slot == h.slots.end()) {
        h.slots.push_back(static_cast<Kind>(kind));
        slot = h.slots.end() - 1;
      }
      at::Tensor dst = slotTensor(b, slot - h.slots.begin()).slice(0, segments[s].lo, segments[s].hi);
      if (t.data_ptr() != dst.data_ptr()) dst.copy_(t);
      h.has[s] |= static_cast<uint8_t>(1u << kind);
      t = at::Tensor();
    }
  }
  if (h.masterCopy) {
    master.set_(at::empty({0}, at::TensorOptions().dtype(at::kFloat)));
    steppers_[b].rebindMaster();
  }
  ++h.generation;
  h.held = false;
  payloads_[b] = nullptr;
  store_->store({b, h.generation, payloadBytes(h), layoutTag(h)});
}

bool OptimizerSwapper::grow(size_t b, size_t slots) {
  Home& h = homes_[b];
  TORCH_CHECK(slots <= kMaxSlots, "zeroplus::zero step: bucket ", b, " needs ", slots, " optimizer state slots, more "
              "than the ", kMaxSlots, " a record holds");
  const uint64_t bytes = slotBytes(h) * slots;
  // Always into a new buffer of the new size: the held one may predate an earlier reserve() (a
  // record read ahead while another bucket grew), so the pool's size says nothing about it. The
  // slots bound so far (the master, kinds of earlier steps: updated in place by this step) move
  // with their values; the old buffer goes back unwritten, the file keeps the last record.
  const at::Tensor kept =
      at::from_blob(payloads_[b], {static_cast<int64_t>(payloadBytes(h))}, at::TensorOptions().dtype(at::kByte))
          .clone();
  // State the stepper created this step (kinds not in the record yet): its own tensors, kept
  // across the unbind and joined to the record by store().
  auto& segments = steppers_[b].segments();
  std::vector<std::tuple<size_t, int, at::Tensor>> fresh;
  for (size_t s = 0; s < segments.size(); ++s) {
    for (int kind = kExpAvg; kind < kKinds; ++kind) {
      const at::Tensor& t = segments[s].state.*stateOf(kind);
      if (t.defined() && std::find(h.slots.begin(), h.slots.end(), static_cast<Kind>(kind)) == h.slots.end()) {
        fresh.emplace_back(s, kind, t);
      }
    }
  }
  unbind(b);  // gives the old buffer back unwritten; no tensor views it past this point
  store_->reserve(swap::recordBytes(bytes));
  void* payload = nullptr;
  swap::SwapFault fault;
  const int rc = store_->overwrite(b, bytes, &payload, &fault);
  if (rc != 0) {
    // Reported with the step's faults (endStep, after the last collective), not thrown mid-step.
    faults_.push_back("bucket " + std::to_string(b) + " (file " + fault.path + "): moving its record into a buffer "
                      "for " + std::to_string(slots) + " slots failed: " + fault.what + " [" + std::strerror(fault.err) +
                      "]; the parameters were stepped, but this step's optimizer state of the bucket is lost (the file "
                      "keeps the previous step's): load a checkpoint to continue exactly");
    return false;
  }
  std::memcpy(payload, kept.data_ptr(), static_cast<size_t>(kept.numel()));
  h.capacity = slots;
  bind(b, payload);
  for (auto& [s, kind, t] : fresh) segments[s].state.*stateOf(kind) = std::move(t);
  return true;
}

void OptimizerSwapper::abandon() {
  // The step raised half way: the records were not changed on disk; forget what was bound.
  store_->planReads({});
  for (size_t b = 0; b < homes_.size(); ++b) unbind(b);
}

void OptimizerSwapper::endStep() {
  if (faults_.empty()) return;
  std::string text;
  for (const auto& f : faults_) text += "\n  " + f;
  faults_.clear();
  TORCH_CHECK(false, "zeroplus::zero step: NVMe optimizer offload (rank ", rank_, "):", text);
}

}  // namespace zeroplus::zero::engine
