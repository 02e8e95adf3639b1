// Gather/scatter-shaped collectives of ZeroPlusBackend: allgather (list, flat, coalesced),
// gather, scatter, reduce_scatter (list, flat, coalesced), alltoall (list, flat with splits).
// List forms stage through one flat buffer because the caller's tensors may live anywhere;
// flat forms move the caller's memory directly.
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>

#include <cstring>

#include "process_group/adapter/backend.hpp"
#include "process_group/adapter/tensor_checks.hpp"

namespace zeroplus::pg {
namespace {

void checkFlatPair(const char* op, const at::Tensor& small, const char* smallName, const at::Tensor& big,
                   const char* bigName, int size) {
  checkCpuDense(op, smallName, small);
  checkCpuDense(op, bigName, big);
  TORCH_CHECK(big.scalar_type() == small.scalar_type(), "zeroplus ", op, ": ", bigName, " has dtype ",
              big.scalar_type(), ", expected ", small.scalar_type(), " (the ", smallName, "'s dtype)");
  TORCH_CHECK(big.numel() == small.numel() * size, "zeroplus ", op, ": ", bigName, " has ", big.numel(),
              " elements, expected world size (", size, ") x ", smallName, " (", small.numel(), ")");
}

void checkPerRankList(const char* op, const char* arg, const std::vector<at::Tensor>& list, const at::Tensor& like,
                      int size) {
  TORCH_CHECK(static_cast<int>(list.size()) == size, "zeroplus ", op, ": ", arg, " has ", list.size(),
              " tensors, expected one per rank (", size, ")");
  for (const auto& t : list) {
    checkCpuDense(op, arg, t);
    checkSameTypeAndNumel(op, arg, t, like);
  }
}

// Copies `list` into one flat byte buffer, rank-major.
at::Tensor packList(const std::vector<at::Tensor>& list) {
  std::vector<at::Tensor> flat;
  flat.reserve(list.size());
  for (const auto& t : list) flat.push_back(t.view(-1));
  return at::cat(flat);
}

void unpackList(const at::Tensor& flat, const std::vector<at::Tensor>& list) {
  int64_t offset = 0;
  for (const auto& t : list) {
    t.view(-1).copy_(flat.narrow(0, offset, t.numel()));
    offset += t.numel();
  }
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  static constexpr const char* kOp = "allgather";
  checkSingleTensor(kOp, "input_tensors", inputs.size());
  checkSingleTensor(kOp, "output_tensors", outputs.size());
  at::Tensor input = inputs[0];
  checkCpuDense(kOp, "input tensor", input);
  toDataType(kOp, "input tensor", input.scalar_type());
  std::vector<at::Tensor> outs = outputs[0];
  checkPerRankList(kOp, "output tensor list", outs, input, size_);
  return collective(c10d::OpType::ALLGATHER, kOp, outs, opts.timeout, [this, input, outs](Deadline deadline) {
    at::Tensor flat = at::empty({input.numel() * size_}, input.options());
    comm_->allgather(input.data_ptr(), input.nbytes(), flat.data_ptr(), deadline);
    unpackList(flat, outs);
  });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                                const c10d::AllgatherOptions& opts) {
  static constexpr const char* kOp = "_allgather_base";
  checkFlatPair(kOp, input, "input tensor", output, "output tensor", size_);
  toDataType(kOp, "input tensor", input.scalar_type());
  at::Tensor in = input;
  at::Tensor out = output;
  return collective(c10d::OpType::_ALLGATHER_BASE, kOp, {out}, opts.timeout, [this, in, out](Deadline deadline) {
    comm_->allgather(in.data_ptr(), in.nbytes(), out.data_ptr(), deadline);
  });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                                std::vector<at::Tensor>& inputs,
                                                                                const c10d::AllgatherOptions& opts) {
  static constexpr const char* kOp = "allgather_into_tensor_coalesced";
  TORCH_CHECK(outputs.size() == inputs.size(), "zeroplus ", kOp, ": got ", outputs.size(), " outputs and ",
              inputs.size(), " inputs, expected equal counts");
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkFlatPair(kOp, inputs[i], "inputs[i]", outputs[i], "outputs[i]", size_);
    toDataType(kOp, "inputs[i]", inputs[i].scalar_type());
  }
  std::vector<at::Tensor> ins = inputs;
  std::vector<at::Tensor> outs = outputs;
  return collective(c10d::OpType::COALESCED, kOp, outs, opts.timeout, [this, ins, outs](Deadline deadline) {
    for (size_t i = 0; i < ins.size(); ++i) {
      comm_->allgather(ins[i].data_ptr(), ins[i].nbytes(), outs[i].data_ptr(), deadline);
    }
  });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                       std::vector<at::Tensor>& inputs,
                                                       const c10d::GatherOptions& opts) {
  static constexpr const char* kOp = "gather";
  checkRank(kOp, "root rank", opts.rootRank, size_);
  checkSingleTensor(kOp, "input_tensors", inputs.size());
  at::Tensor input = inputs[0];
  checkCpuDense(kOp, "input tensor", input);
  toDataType(kOp, "input tensor", input.scalar_type());
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    checkSingleTensor(kOp, "output_tensors", outputs.size());
    outs = outputs[0];
    checkPerRankList(kOp, "gather_list", outs, input, size_);
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()), "zeroplus gather: gather_list must ",
                "be empty on non-root rank ", rank_, " (root is ", root, ")");
  }
  return collective(c10d::OpType::GATHER, kOp, outs, opts.timeout, [this, input, outs, root](Deadline deadline) {
    at::Tensor flat = rank_ == root ? at::empty({input.numel() * size_}, input.options()) : at::Tensor();
    comm_->gather(input.data_ptr(), input.nbytes(), flat.defined() ? flat.data_ptr() : nullptr, root, deadline);
    if (rank_ == root) unpackList(flat, outs);
  });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::scatter(std::vector<at::Tensor>& outputs,
                                                        std::vector<std::vector<at::Tensor>>& inputs,
                                                        const c10d::ScatterOptions& opts) {
  static constexpr const char* kOp = "scatter";
  checkRank(kOp, "root rank", opts.rootRank, size_);
  checkSingleTensor(kOp, "output_tensors", outputs.size());
  at::Tensor output = outputs[0];
  checkCpuDense(kOp, "output tensor", output);
  toDataType(kOp, "output tensor", output.scalar_type());
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> ins;
  if (rank_ == root) {
    checkSingleTensor(kOp, "input_tensors", inputs.size());
    ins = inputs[0];
    checkPerRankList(kOp, "scatter_list", ins, output, size_);
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()), "zeroplus scatter: scatter_list must ",
                "be empty on non-root rank ", rank_, " (root is ", root, ")");
  }
  return collective(c10d::OpType::SCATTER, kOp, {output}, opts.timeout, [this, output, ins, root](Deadline deadline) {
    at::Tensor flat = rank_ == root ? packList(ins) : at::Tensor();
    comm_->scatter(flat.defined() ? flat.data_ptr() : nullptr, output.nbytes(), output.data_ptr(), root, deadline);
  });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                               std::vector<std::vector<at::Tensor>>& inputs,
                                                               const c10d::ReduceScatterOptions& opts) {
  static constexpr const char* kOp = "reduce_scatter";
  checkSingleTensor(kOp, "output_tensors", outputs.size());
  checkSingleTensor(kOp, "input_tensors", inputs.size());
  at::Tensor output = outputs[0];
  checkCpuDense(kOp, "output tensor", output);
  const DataType type = toDataType(kOp, "output tensor", output.scalar_type());
  const Reduction reduction = toReduction(kOp, opts.reduceOp, output.scalar_type());
  std::vector<at::Tensor> ins = inputs[0];
  checkPerRankList(kOp, "input tensor list", ins, output, size_);
  return collective(c10d::OpType::REDUCE_SCATTER, kOp, {output}, opts.timeout,
                    [this, output, ins, type, reduction](Deadline deadline) mutable {
                      at::Tensor flat = packList(ins);
                      applyPremultiply(reduction, flat);
                      comm_->reduceScatter(flat.data_ptr(), output.data_ptr(), output.numel(), type, reduction.op,
                                           deadline);
                      applyAverage(reduction, output, size_);
                    });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                     const c10d::ReduceScatterOptions& opts) {
  static constexpr const char* kOp = "_reduce_scatter_base";
  checkFlatPair(kOp, output, "output tensor", input, "input tensor", size_);
  const DataType type = toDataType(kOp, "input tensor", input.scalar_type());
  const Reduction reduction = toReduction(kOp, opts.reduceOp, input.scalar_type());
  at::Tensor in = input;
  at::Tensor out = output;
  return collective(c10d::OpType::_REDUCE_SCATTER_BASE, kOp, {out}, opts.timeout,
                    [this, in, out, type, reduction](Deadline deadline) mutable {
                      // The caller's input must survive unchanged, so a pre-scale works on a copy.
                      at::Tensor src = reduction.premultiply ? in.clone() : in;
                      applyPremultiply(reduction, src);
                      comm_->reduceScatter(src.data_ptr(), out.data_ptr(), out.numel(), type, reduction.op, deadline);
                      applyAverage(reduction, out, size_);
                    });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs, const c10d::ReduceScatterOptions& opts) {
  static constexpr const char* kOp = "reduce_scatter_tensor_coalesced";
  TORCH_CHECK(outputs.size() == inputs.size(), "zeroplus ", kOp, ": got ", outputs.size(), " outputs and ",
              inputs.size(), " inputs, expected equal counts");
  std::vector<DataType> types;
  std::vector<Reduction> reductions;
  for (size_t i = 0; i < inputs.size(); ++i) {
    checkFlatPair(kOp, outputs[i], "outputs[i]", inputs[i], "inputs[i]", size_);
    types.push_back(toDataType(kOp, "inputs[i]", inputs[i].scalar_type()));
    reductions.push_back(toReduction(kOp, opts.reduceOp, inputs[i].scalar_type()));
  }
  std::vector<at::Tensor> ins = inputs;
  std::vector<at::Tensor> outs = outputs;
  return collective(c10d::OpType::COALESCED, kOp, outs, opts.timeout,
                    [this, ins, outs, types, reductions](Deadline deadline) mutable {
                      for (size_t i = 0; i < ins.size(); ++i) {
                        at::Tensor src = reductions[i].premultiply ? ins[i].clone() : ins[i];
                        applyPremultiply(reductions[i], src);
                        comm_->reduceScatter(src.data_ptr(), outs[i].data_ptr(), outs[i].numel(), types[i],
                                             reductions[i].op, deadline);
                        applyAverage(reductions[i], outs[i], size_);
                      }
                    });
}

}  // namespace zeroplus::pg
