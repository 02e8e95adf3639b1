// Argument validation and dtype mapping shared by the collective wrappers. Every check runs on
// the caller's thread and raises a c10::Error whose text starts "zeroplus <op>: " and names the
// offending argument, so bad input fails before any byte moves.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <vector>

#include "process_group/core/datatype.hpp"

namespace zeroplus::pg {

// at::ScalarType -> core DataType; raises for dtypes the backend does not move.
DataType toDataType(const char* op, const char* arg, at::ScalarType type);

// A c10d reduce op as the core performs it: AVG is SUM then a division by the group size,
// PREMUL_SUM is a multiplication by the factor then SUM (as in NCCL).
struct Reduction {
  ReduceOp op = ReduceOp::kSum;
  bool average = false;
  bool premultiply = false;
  double factor = 1.0;       // PREMUL_SUM with a scalar factor
  at::Tensor factorTensor;   // PREMUL_SUM with a one-element tensor factor
};

// Validates `reduceOp` for `type` (bitwise ops need integers, AVG/PREMUL_SUM need floats).
Reduction toReduction(const char* op, const c10d::ReduceOp& reduceOp, at::ScalarType type);

// Applies the pre-scale of PREMUL_SUM in place (no-op for other ops). Worker thread.
void applyPremultiply(const Reduction& reduction, at::Tensor& tensor);

// Applies the post-division of AVG in place (no-op for other ops). Worker thread.
void applyAverage(const Reduction& reduction, at::Tensor& tensor, int groupSize);

// Every tensor in `tensors` has `reference`'s dtype (named `arg` in the error).
void checkSameDtype(const char* op, const char* arg, const std::vector<at::Tensor>& tensors, at::ScalarType reference);

// A dense CPU tensor in row-major order.
void checkCpuDense(const char* op, const char* arg, const at::Tensor& tensor);

// A strided (not sparse) CPU tensor, any strides: for arguments the op stages through a
// contiguous copy when needed, as Gloo accepts them.
void checkCpuStrided(const char* op, const char* arg, const at::Tensor& tensor);

// Contiguity of a flat-buffer argument whose layout the caller chose (alltoall_base): a
// ValueError ("Tensors must be contiguous"), the type torch and Gloo raise for it.
void checkContiguousValue(const char* op, const char* arg, const at::Tensor& tensor);

// Every tensor of a several-tensors-per-process list has `list[0]`'s dtype and sizes
// (messages as Gloo's: "invalid tensor type" / "invalid tensor size").
void checkSameTypeAndSizes(const char* op, const std::vector<at::Tensor>& list);

// A contiguous copy of `tensor` when it is not contiguous (else `tensor` itself).
inline at::Tensor contiguousStage(const at::Tensor& tensor) { return tensor.contiguous(); }

// Copies `staged` back into `tensor` when contiguousStage made a copy. Worker thread.
inline void unstage(const at::Tensor& staged, const at::Tensor& tensor) {
  if (!staged.is_same(tensor)) tensor.copy_(staged);
}

// Exactly one tensor in a list argument (zeroplus, like NCCL, serves one device per process).
void checkSingleTensor(const char* op, const char* arg, size_t count);

void checkRank(const char* op, const char* arg, int64_t rank, int size);

void checkSameTypeAndNumel(const char* op, const char* arg, const at::Tensor& tensor, const at::Tensor& reference);

}  // namespace zeroplus::pg
