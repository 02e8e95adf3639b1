#include "optimizers/adapter/zero/collectives.hpp"

#include <string>
#include <vector>

namespace zeroplus::zero::engine {

Collectives::Collectives(c10::intrusive_ptr<c10d::ProcessGroup> pg, at::Device device)
    : pg_(std::move(pg)), rank_(pg_->getRank()), world_(pg_->getSize()), device_(device) {
  std::string backend;
  try {
    backend = pg_->getBackend(device_.type())->getBackendName();
  } catch (const c10::Error&) {  // no backend for this device yet: the first collective reports it
  }
  gatherInPlace_ = backend == "zeroplus" || backend == "nccl";
}

c10::intrusive_ptr<c10d::Work> Collectives::reduceScatter(at::Tensor& output, at::Tensor& input) {
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  return pg_->_reduce_scatter_base(output, input, opts);
}

c10::intrusive_ptr<c10d::Work> Collectives::allReduce(at::Tensor& tensor) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  return pg_->allreduce(tensors, opts);
}

c10::intrusive_ptr<c10d::Work> Collectives::allGather(at::Tensor& output, at::Tensor& input) {
  return pg_->_allgather_base(output, input);
}

void Collectives::broadcastFromZero(at::Tensor& tensor) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = 0;
  pg_->broadcast(tensors, opts)->wait();
}

void Collectives::allReduceMax(at::Tensor& tensor) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  pg_->allreduce(tensors, opts)->wait();
}

void Collectives::allReduceSum(at::Tensor& tensor) {
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  pg_->allreduce(tensors, opts)->wait();
}

}  // namespace zeroplus::zero::engine
