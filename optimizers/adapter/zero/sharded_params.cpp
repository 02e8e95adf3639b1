#include "optimizers/adapter/zero/sharded_params.hpp"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <tuple>


namespace zeroplus::zero::engine {
namespace {

// Gives `t`'s storage `bytes` fresh bytes (uninitialised) from its own allocator, or none (0):
// the storage object stays, so views of it (saved by autograd) see the new bytes. On CUDA the
// caching allocator hands out memory of the storage's device, ordered on the current stream.
void setStorageBytes(const at::Tensor& t, size_t bytes) {
  at::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  if (bytes == 0) {
    impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
  } else {
    const c10::DeviceGuard onDevice(impl->device());
    impl->set_data_ptr_noswap(impl->allocator()->allocate(bytes));
  }
  impl->set_nbytes(bytes);
}

}  // namespace

ShardedParams::ShardedParams(const std::vector<std::vector<at::Tensor>>& groups, const UnitLayout& layout,
                             Collectives& comm, std::optional<at::ScalarType> computeDtype)
    : comm_(comm), unitOfParam_(layout.unitOf), units_(layout.unitCount) {
  std::vector<int64_t> firstIndex(groups.size(), 0);
  for (size_t g = 1; g < groups.size(); ++g) firstIndex[g] = firstIndex[g - 1] + groups[g - 1].size();
  const auto count = static_cast<int64_t>(layout.unitOf.size());
  const std::vector<int64_t>& homeUnit = layout.homeUnit.empty() ? layout.unitOf : layout.homeUnit;
  TORCH_CHECK(static_cast<int64_t>(layout.position.size()) == count &&
                  static_cast<int64_t>(homeUnit.size()) == count &&
                  (groups.empty() || firstIndex.back() + static_cast<int64_t>(groups.back().size()) == count),
              "zeroplus::zero::initialize: stage-3 unit layout of ", count, " parameters does not match the groups");
  // Readiness order: the reverse of registration. A unit sits where its first parameter is
  // registered (its parameters stay together: one bucket per group and dtype, and one per run of
  // those kept whole by the persistence threshold); a parameter in no unit where it is. Inside a
  // unit, groups and parameters from the last.
  std::vector<int64_t> unitAt(layout.unitCount, std::numeric_limits<int64_t>::max());
  for (int64_t i = 0; i < count; ++i) {
    const int64_t u = layout.unitOf[i], home = homeUnit[i];
    TORCH_CHECK(u >= -1 && u < layout.unitCount && home >= -1 && home < layout.unitCount && (u < 0 || u == home),
                "zeroplus::zero::initialize: unit ", u, " (home ", home, ") of parameter ", i,
                " is out of range [-1, ", layout.unitCount, ")");
    if (home >= 0) unitAt[home] = std::min(unitAt[home], layout.position[i]);
  }
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> order;  // (place, home unit, group, index in group)
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i = 0; i < groups[g].size(); ++i) {
      const int64_t index = firstIndex[g] + static_cast<int64_t>(i);
      const int64_t home = homeUnit[index];
      order.emplace_back(home >= 0 ? unitAt[home] : layout.position[index], home, g, i);
    }
  }
  std::sort(order.begin(), order.end(), std::greater<>());
  std::vector<PlanItem> items;
  for (const auto& [place, home, g, i] : order) {
    const at::Tensor& p = groups[g][i];
    const int64_t u = layout.unitOf[firstIndex[g] + i];
    // The bucket key carries the home unit: a unit's persistent run is its own bucket.
    items.push_back({p, firstIndex[g] + i, g, home, computeDtype.value_or(p.scalar_type()), u < 0});
    if (u >= 0) ++units_[u].params;
  }
  slots_.resize(count);
  // One bucket per (unit, group, dtype), and per run of persistent parameters: a unit is gathered
  // and reduced as a whole.
  constexpr int64_t kUnbounded = int64_t{1} << 56;
  buckets_ = planBuckets(items, comm.worldSize(), kUnbounded, slots_);
  const int rank = comm.rank();
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    Bucket& b = buckets_[bi];
    const at::Tensor staged = stageRankZeroValues(b, computeDtype.has_value(), comm);
    const auto [lo, hi] = b.shardRange(rank);
    if (b.persistent) {  // FlatParams' placement: whole, the parameters view it for good
      b.flat = staged.scalar_type() == b.dtype ? staged : staged.to(b.dtype);
      b.shard = b.flat.slice(0, lo, hi);
      masters_.push_back(b.flat.scalar_type() == at::kFloat && staged.scalar_type() == at::kFloat
                             ? b.shard
                             : staged.slice(0, lo, hi).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true));
      fullViews_.emplace_back();
      for (const Entry& e : b.entries) e.param.set_data(b.flat.slice(0, e.offset, e.offset + e.numel).view(e.shape));
      continue;
    }
    b.shard = staged.slice(0, lo, hi).to(b.dtype, /*non_blocking=*/false, /*copy=*/true);
    masters_.push_back(b.dtype == at::kFloat ? b.shard : staged.slice(0, lo, hi).to(at::kFloat, false, true));
    b.flat = at::empty({b.numel}, b.options(b.dtype));
    // The views first: making a view checks it fits the storage, which is then freed until gathered.
    std::vector<at::Tensor> views;
    for (const Entry& e : b.entries) views.push_back(b.flat.slice(0, e.offset, e.offset + e.numel).view(e.shape));
    fullViews_.push_back(std::move(views));
    setStorageBytes(b.flat, 0);
    units_[b.unit].buckets.push_back(bi);
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (!buckets_[b].persistent) showResting(b);
  }
}

at::Tensor ShardedParams::restingBase(at::ScalarType dtype) {
  for (const auto& t : restingBases_) {
    if (t.scalar_type() == dtype) return t;
  }
  restingBases_.push_back(at::full({1}, std::numeric_limits<double>::quiet_NaN(),
                                   at::TensorOptions().dtype(dtype).device(comm_.device())));
  return restingBases_.back();
}

void ShardedParams::showFull(size_t b) {
  for (size_t e = 0; e < buckets_[b].entries.size(); ++e) buckets_[b].entries[e].param.set_data(fullViews_[b][e]);
}

void ShardedParams::showResting(size_t b) {
  const at::Tensor base = restingBase(buckets_[b].dtype);
  for (const Entry& e : buckets_[b].entries) e.param.set_data(base.expand(e.shape));
}

void ShardedParams::attachStorage(Bucket& bucket) {
  const size_t bytes = static_cast<size_t>(bucket.numel) * bucket.flat.element_size();
  liveBytes_ += bytes;
  peakLive_ = std::max(peakLive_, liveBytes_);
  auto& pool = freeStorage_[bytes];
  if (pool.empty()) {
    setStorageBytes(bucket.flat, bytes);
    return;
  }
  at::StorageImpl* impl = bucket.flat.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(std::move(pool.back()));
  impl->set_nbytes(bytes);
  pool.pop_back();
  pooledBytes_ -= bytes;
}

void ShardedParams::detachStorage(Bucket& bucket) {
  at::StorageImpl* impl = bucket.flat.storage().unsafeGetStorageImpl();
  const size_t bytes = impl->nbytes();
  if (bytes == 0) return;
  at::DataPtr old = impl->set_data_ptr(at::DataPtr(nullptr, impl->device()));
  impl->set_nbytes(0);
  liveBytes_ -= bytes;
  // CUDA: back to the caching allocator, which caches by stream (a block kept here would skip its
  // stream bookkeeping). The pool saves CPU training the page faults of fresh memory.
  if (impl->device().is_cpu() && pooledBytes_ + bytes <= peakLive_) {
    freeStorage_[bytes].push_back(std::move(old));
    pooledBytes_ += bytes;
  }  // else `old` frees it here
}

void ShardedParams::prefetch(int64_t u) {
  Unit& unit = units_[u];
  if (unit.state != State::kReleased) return;
  for (size_t b : unit.buckets) {
    Bucket& bucket = buckets_[b];
    attachStorage(bucket);
    unit.works.push_back(comm_.allGather(bucket.flat, bucket.shard));
  }
  unit.state = State::kInFlight;
}

void ShardedParams::gather(int64_t u) {
  prefetch(u);
  Unit& unit = units_[u];
  if (unit.state == State::kGathered) return;
  auto works = std::move(unit.works);
  unit.works.clear();
  for (auto& w : works) w->wait();
  for (size_t b : unit.buckets) showFull(b);
  unit.state = State::kGathered;
}

void ShardedParams::release(int64_t u) {
  Unit& unit = units_[u];
  if (unit.state == State::kReleased) return;
  auto works = std::move(unit.works);
  unit.works.clear();
  for (auto& w : works) w->wait();  // a prefetch still writing into the storage
  for (size_t b : unit.buckets) {
    showResting(b);
    detachStorage(buckets_[b]);
  }
  unit.state = State::kReleased;
}

void ShardedParams::releaseAll() {
  for (int64_t u = 0; u < unitCount(); ++u) release(u);
}

int64_t ShardedParams::gatheredBytes() const {
  int64_t n = 0;
  for (const Bucket& b : buckets_) {
    if (!b.persistent) n += static_cast<int64_t>(b.flat.storage().nbytes());
  }
  return n;
}

c10::intrusive_ptr<c10d::Work> ShardedParams::publish(size_t b) {
  Bucket& bucket = buckets_[b];
  if (masters_[b].data_ptr() != bucket.shard.data_ptr()) bucket.shard.copy_(masters_[b]);
  if (!bucket.persistent) return {};
  at::Tensor input = comm_.gatherInput(bucket.shard);  // kept alive until the work was waited on
  gatherInputs_.push_back(input);
  return comm_.allGather(bucket.flat, input);
}

const Entry* ShardedParams::strayParam() const {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bucket = buckets_[b];
    const at::StorageImpl* flat = bucket.flat.storage().unsafeGetStorageImpl();
    for (const Entry& e : bucket.entries) {
      const at::StorageImpl* home = e.param.storage().unsafeGetStorageImpl();
      if (bucket.persistent) {
        if (home != flat) return &e;
        continue;
      }
      bool resting = false;
      for (const auto& base : restingBases_) resting = resting || base.storage().unsafeGetStorageImpl() == home;
      if (home != flat && !resting) return &e;
    }
  }
  return nullptr;
}

}  // namespace zeroplus::zero::engine
