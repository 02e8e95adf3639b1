// Gather/scatter-shaped collectives of ZeroPlusBackend: allgather (list, several tensors per
// process, flat, coalesced into tensors, coalesced lists),
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
  // Strided tensors are accepted (as Gloo) and staged through a contiguous copy by the op.
  checkCpuStrided(op, smallName, small);
  checkCpuStrided(op, bigName, big);
  TORCH_CHECK(big.scalar_type() == small.scalar_type(), "zeroplus ", op, ": ", bigName, " has dtype ",
              big.scalar_type(), ", expected ", small.scalar_type(), " (the ", smallName, "'s dtype)");
  TORCH_CHECK(big.numel() == small.numel() * size, "zeroplus ", op, ": ", bigName, " has ", big.numel(),
              " elements, expected world size (", size, ") x ", smallName, " (", small.numel(), ")");
}

// `list` holds `count` tensors (strided ones allowed: they are packed and unpacked by copy)
// of `like`'s dtype and size.
void checkPerRankList(const char* op, const char* arg, const std::vector<at::Tensor>& list, const at::Tensor& like,
                      int count) {
  TORCH_CHECK(static_cast<int>(list.size()) == count, "zeroplus ", op, ": invalid output tensor list: ", arg, " has ",
              list.size(), " tensors, expected ", count);
  for (const auto& t : list) {
    checkCpuStrided(op, arg, t);
    checkSameTypeAndNumel(op, arg, t, like);
  }
}

// Copies `list` into one new flat buffer of its dtype, in list order (any strides).
at::Tensor packList(const std::vector<at::Tensor>& list) {
  std::vector<at::Tensor> flat;
  flat.reserve(list.size());
  for (const auto& t : list) flat.push_back(t.reshape(-1));
  return at::cat(flat);
}

// Copies consecutive pieces of `flat`, starting at element `offset`, into the tensors of `list`.
int64_t unpackList(const at::Tensor& flat, const std::vector<at::Tensor>& list, int64_t offset = 0) {
  for (const auto& t : list) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
  return offset;
}

// Raw bytes of a tensor of any dtype and strides, appended to `out`.
void appendBytes(std::vector<uint8_t>& out, const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  out.insert(out.end(), p, p + c.nbytes());
}

}  // namespace

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                          std::vector<at::Tensor>& inputs,
                                                          const c10d::AllgatherOptions& opts) {
  static constexpr const char* kOp = "allgather";
  TORCH_CHECK(!inputs.empty(), "zeroplus allgather: requires non-empty input tensor list");
  TORCH_CHECK(outputs.size() == inputs.size(), "zeroplus allgather: requires input/output tensor lists to have ",
              "the same length, got ", inputs.size(), " inputs and ", outputs.size(), " output lists");
  // Several tensors per process (as Gloo): output list i gets every rank's inputs, rank-major.
  const int perRank = static_cast<int>(inputs.size());
  for (const auto& t : inputs) checkCpuStrided(kOp, "input tensor", t);
  checkSameTypeAndSizes(kOp, inputs);
  toDataType(kOp, "input tensor", inputs[0].scalar_type());
  for (const auto& list : outputs) checkPerRankList(kOp, "output tensor list", list, inputs[0], size_ * perRank);
  std::vector<at::Tensor> ins = inputs;
  std::vector<std::vector<at::Tensor>> outLists = outputs;
  return collectiveNested(c10d::OpType::ALLGATHER, kOp, outLists, opts.timeout, [this, ins, outLists](Deadline deadline) {
    const at::Tensor packed = ins.size() == 1 ? ins[0].contiguous() : packList(ins);
    at::Tensor flat = at::empty({packed.numel() * size_}, packed.options());
    comm_->allgather(packed.data_ptr(), packed.nbytes(), flat.data_ptr(), deadline);
    for (const auto& list : outLists) unpackList(flat, list);
  });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputLists,
                                                                    std::vector<at::Tensor>& inputs,
                                                                    const c10d::AllgatherOptions& opts) {
  static constexpr const char* kOp = "allgather_coalesced";
  TORCH_CHECK(static_cast<int>(outputLists.size()) == size_, "zeroplus allgather_coalesced: output lists should be ",
              "equal to world size (", size_, "), got ", outputLists.size());
  for (const auto& t : inputs) checkCpuStrided(kOp, "input tensor", t);
  std::vector<at::Tensor> allOuts;
  for (const auto& list : outputLists) {
    TORCH_CHECK(list.size() == inputs.size(), "zeroplus allgather_coalesced: an output list has ", list.size(),
                " tensors, expected one per input (", inputs.size(), ")");
    for (size_t i = 0; i < list.size(); ++i) {
      checkCpuStrided(kOp, "output tensor", list[i]);
      TORCH_CHECK(list[i].scalar_type() == inputs[i].scalar_type(), "zeroplus allgather_coalesced: invalid tensor ",
                  "type at index ", i, " (expected ", inputs[i].scalar_type(), ", got ", list[i].scalar_type(), ")");
      TORCH_CHECK(list[i].sizes() == inputs[i].sizes(), "zeroplus allgather_coalesced: invalid size of output ",
                  "tensor at index ", i, " (expected ", inputs[i].sizes(), ", got ", list[i].sizes(), ")");
    }
    allOuts.insert(allOuts.end(), list.begin(), list.end());
  }
  std::vector<at::Tensor> ins = inputs;
  std::vector<std::vector<at::Tensor>> outs = outputLists;
  // One byte-level allgather of every input back to back (dtypes may differ between tensors).
  return collective(c10d::OpType::ALLGATHER_COALESCED, kOp, allOuts, opts.timeout, [this, ins, outs](Deadline d) {
    std::vector<uint8_t> packed;
    for (const auto& t : ins) appendBytes(packed, t);
    std::vector<uint8_t> flat(packed.size() * static_cast<size_t>(size_));
    comm_->allgather(packed.data(), packed.size(), flat.data(), d);
    for (int r = 0; r < size_; ++r) {
      size_t offset = static_cast<size_t>(r) * packed.size();
      for (const auto& t : outs[r]) {
        at::Tensor dst = t.is_contiguous() ? t : at::empty(t.sizes(), t.options());
        if (dst.nbytes()) std::memcpy(dst.data_ptr(), flat.data() + offset, dst.nbytes());
        unstage(dst, t);
        offset += dst.nbytes();
      }
    }
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
    const at::Tensor src = in.contiguous();  // contiguous tensors: no copy either way
    at::Tensor dst = contiguousStage(out);
    comm_->allgather(src.data_ptr(), src.nbytes(), dst.data_ptr(), deadline);
    unstage(dst, out);
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
      const at::Tensor src = ins[i].contiguous();
      at::Tensor dst = contiguousStage(outs[i]);
      comm_->allgather(src.data_ptr(), src.nbytes(), dst.data_ptr(), deadline);
      unstage(dst, outs[i]);
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
  checkCpuStrided(kOp, "input tensor", input);
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
    const at::Tensor in = contiguousStage(input);
    at::Tensor flat = rank_ == root ? at::empty({input.numel() * size_}, input.options()) : at::Tensor();
    comm_->gather(in.data_ptr(), in.nbytes(), flat.defined() ? flat.data_ptr() : nullptr, root, deadline);
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
  checkCpuStrided(kOp, "output tensor", output);
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
    at::Tensor out = contiguousStage(output);
    comm_->scatter(flat.defined() ? flat.data_ptr() : nullptr, out.nbytes(), out.data_ptr(), root, deadline);
    unstage(out, output);
  });
}

c10::intrusive_ptr<c10d::Work> ZeroPlusBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                               std::vector<std::vector<at::Tensor>>& inputs,
                                                               const c10d::ReduceScatterOptions& opts) {
  static constexpr const char* kOp = "reduce_scatter";
  checkSingleTensor(kOp, "output_tensors", outputs.size());
  checkSingleTensor(kOp, "input_tensors", inputs.size());
  at::Tensor output = outputs[0];
  checkCpuStrided(kOp, "output tensor", output);  // strided inputs and output are staged (as Gloo)
  const DataType type = toDataType(kOp, "output tensor", output.scalar_type());
  const Reduction reduction = toReduction(kOp, opts.reduceOp, output.scalar_type());
  std::vector<at::Tensor> ins = inputs[0];
  TORCH_CHECK(static_cast<int>(ins.size()) == size_, "zeroplus reduce_scatter: input tensor list has ", ins.size(),
              " tensors, expected one per rank (", size_, ")");
  bool even = true;
  for (const auto& t : ins) {
    checkCpuStrided(kOp, "input tensor list", t);
    TORCH_CHECK(t.scalar_type() == output.scalar_type(), "zeroplus reduce_scatter: input tensor list has dtype ",
                t.scalar_type(), ", expected ", output.scalar_type(), " (the output's dtype)");
    even = even && t.numel() == output.numel();
  }
  if (!even) {
    // Uneven sizes (as Gloo): input i has its own size on every rank, rank r's output matches
    // input r. One allreduce of the concatenation, then each rank keeps its own piece.
    TORCH_CHECK(ins[rank_].numel() == output.numel(), "zeroplus reduce_scatter: output has ", output.numel(),
                " elements, expected ", ins[rank_].numel(), " (input tensor ", rank_, " of the list)");
    int64_t offset = 0;
    for (int r = 0; r < rank_; ++r) offset += ins[r].numel();
    return collective(c10d::OpType::REDUCE_SCATTER, kOp, {output}, opts.timeout,
                      [this, output, ins, type, reduction, offset](Deadline deadline) mutable {
                        at::Tensor flat = packList(ins);
                        applyPremultiply(reduction, flat);
                        comm_->allreduce(flat.data_ptr(), flat.numel(), type, reduction.op, deadline);
                        at::Tensor mine = flat.narrow(0, offset, output.numel());
                        applyAverage(reduction, mine, size_);
                        output.copy_(mine.view(output.sizes()));
                      });
  }
  return collective(c10d::OpType::REDUCE_SCATTER, kOp, {output}, opts.timeout,
                    [this, output, ins, type, reduction](Deadline deadline) mutable {
                      at::Tensor flat = packList(ins);
                      applyPremultiply(reduction, flat);
                      at::Tensor dst = contiguousStage(output);
                      comm_->reduceScatter(flat.data_ptr(), dst.data_ptr(), dst.numel(), type, reduction.op, deadline);
                      applyAverage(reduction, dst, size_);
                      unstage(dst, output);
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
                      at::Tensor src = reduction.premultiply ? in.clone(at::MemoryFormat::Contiguous) : in.contiguous();
                      applyPremultiply(reduction, src);
                      at::Tensor dst = contiguousStage(out);
                      comm_->reduceScatter(src.data_ptr(), dst.data_ptr(), dst.numel(), type, reduction.op, deadline);
                      applyAverage(reduction, dst, size_);
                      unstage(dst, out);
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
                        at::Tensor src = reductions[i].premultiply ? ins[i].clone(at::MemoryFormat::Contiguous)
                                                                   : ins[i].contiguous();
                        applyPremultiply(reductions[i], src);
                        at::Tensor dst = contiguousStage(outs[i]);
                        comm_->reduceScatter(src.data_ptr(), dst.data_ptr(), dst.numel(), types[i],
                                             reductions[i].op, deadline);
                        applyAverage(reductions[i], dst, size_);
                        unstage(dst, outs[i]);
                      }
                    });
}

}  // namespace zeroplus::pg
