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

// The reduction actually performed on the wire; AVG and PREMUL_SUM become SUM plus a scale.
ReduceOp toCoreReduceOp(const char* op, const c10d::ReduceOp& reduceOp, at::ScalarType type);

// A dense CPU tensor in row-major order.
void checkCpuDense(const char* op, const char* arg, const at::Tensor& tensor);

// Exactly one tensor in a list argument (zeroplus, like NCCL, serves one device per process).
void checkSingleTensor(const char* op, const char* arg, size_t count);

void checkRank(const char* op, const char* arg, int64_t rank, int size);

void checkSameTypeAndNumel(const char* op, const char* arg, const at::Tensor& tensor, const at::Tensor& reference);

}  // namespace zeroplus::pg
