#include "optimizers/adapter/zero/sharded_params.hpp"

#include <ATen/ATen.h>
#include <ATen/native/Resize.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <limits>


namespace zeroplus::zero::engine {
namespace {

void setStorageBytes(const at::Tensor& t, size_t bytes) {
  at::native::resize_bytes_cpu(t.storage().unsafeGetStorageImpl(), bytes);
}

}  // namespace

ShardedParams::ShardedParams(const std::vector<std::vector<at::Tensor>>& groups, const std::vector<int64_t>& unitOf,
                             int64_t unitCount, Collectives& comm, std::optional<at::ScalarType> computeDtype)
    : comm_(comm), unitOfParam_(unitOf), units_(unitCount) {
  std::vector<int64_t> firstIndex(groups.size(), 0);
  for (size_t g = 1; g < groups.size(); ++g) firstIndex[g] = firstIndex[g - 1] + groups[g - 1].size();
  // Readiness order: the last unit first; inside a unit, groups and parameters from the last.
  std::vector<PlanItem> items;
  for (int64_t u = unitCount - 1; u >= 0; --u) {
    for (int64_t g = static_cast<int64_t>(groups.size()) - 1; g >= 0; --g) {
      for (int64_t i = static_cast<int64_t>(groups[g].size()) - 1; i >= 0; --i) {
        const int64_t index = firstIndex[g] + i;
        if (unitOf[index] != u) continue;
        const at::Tensor& p = groups[g][i];
        items.push_back({p, index, g, u, computeDtype.value_or(p.scalar_type())});
        ++units_[u].params;
      }
    }
  }
  slots_.resize(unitOf.size());
  // One bucket per (unit, group, dtype): a unit is gathered and reduced as a whole.
  constexpr int64_t kUnbounded = int64_t{1} << 56;
  buckets_ = planBuckets(items, comm.worldSize(), kUnbounded, slots_);
  const int rank = comm.rank();
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    Bucket& b = buckets_[bi];
    const at::Tensor staged = stageRankZeroValues(b, computeDtype.has_value(), comm);
    const auto [lo, hi] = b.shardRange(rank);
    b.shard = staged.slice(0, lo, hi).to(b.dtype, /*non_blocking=*/false, /*copy=*/true);
    masters_.push_back(b.dtype == at::kFloat ? b.shard : staged.slice(0, lo, hi).to(at::kFloat, false, true));
    b.flat = at::empty({b.numel}, at::TensorOptions().dtype(b.dtype));
    // The views first: making a view checks it fits the storage, which is then freed until gathered.
    std::vector<at::Tensor> views;
    for (const Entry& e : b.entries) views.push_back(b.flat.slice(0, e.offset, e.offset + e.numel).view(e.shape));
    fullViews_.push_back(std::move(views));
    setStorageBytes(b.flat, 0);
    units_[b.unit].buckets.push_back(bi);
  }
  for (size_t b = 0; b < buckets_.size(); ++b) showResting(b);
}

at::Tensor ShardedParams::restingBase(at::ScalarType dtype) {
  for (const auto& t : restingBases_) {
    if (t.scalar_type() == dtype) return t;
  }
  restingBases_.push_back(at::full({1}, std::numeric_limits<double>::quiet_NaN(), at::TensorOptions().dtype(dtype)));
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
  if (pooledBytes_ + bytes <= peakLive_) {
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
  for (const Bucket& b : buckets_) n += static_cast<int64_t>(b.flat.storage().nbytes());
  return n;
}

c10::intrusive_ptr<c10d::Work> ShardedParams::publish(size_t b) {
  if (masters_[b].data_ptr() != buckets_[b].shard.data_ptr()) buckets_[b].shard.copy_(masters_[b]);
  return {};
}

const Entry* ShardedParams::strayParam() const {
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bucket = buckets_[b];
    const at::StorageImpl* flat = bucket.flat.storage().unsafeGetStorageImpl();
    for (const Entry& e : bucket.entries) {
      const at::StorageImpl* home = e.param.storage().unsafeGetStorageImpl();
      bool resting = false;
      for (const auto& base : restingBases_) resting = resting || base.storage().unsafeGetStorageImpl() == home;
      if (home != flat && !resting) return &e;
    }
  }
  return nullptr;
}

}  // namespace zeroplus::zero::engine
