#include "process_group/adapter/tensor_checks.hpp"

namespace zeroplus::pg {

DataType toDataType(const char* op, const char* arg, at::ScalarType type) {
  switch (type) {
    case at::kFloat: return DataType::kFloat32;
    case at::kDouble: return DataType::kFloat64;
    case at::kHalf: return DataType::kFloat16;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kChar: return DataType::kInt8;
    case at::kByte: return DataType::kUInt8;
    case at::kShort: return DataType::kInt16;
    case at::kInt: return DataType::kInt32;
    case at::kLong: return DataType::kInt64;
    case at::kBool: return DataType::kBool;
    default:
      TORCH_CHECK(false, "zeroplus ", op, ": ", arg, " has unsupported dtype ", type,
                  "; supported: float32, float64, float16, bfloat16, int8, uint8, int16, int32, int64, bool");
  }
}

Reduction toReduction(const char* op, const c10d::ReduceOp& reduceOp, at::ScalarType type) {
  const bool floating = at::isFloatingType(type);
  Reduction r;
  switch (reduceOp.op_) {
    case c10d::ReduceOp::SUM: r.op = ReduceOp::kSum; break;
    case c10d::ReduceOp::PRODUCT: r.op = ReduceOp::kProduct; break;
    case c10d::ReduceOp::MIN: r.op = ReduceOp::kMin; break;
    case c10d::ReduceOp::MAX: r.op = ReduceOp::kMax; break;
    case c10d::ReduceOp::AVG:
      TORCH_CHECK(floating, "zeroplus ", op, ": ReduceOp.AVG needs a floating-point tensor, got ", type);
      r.average = true;
      break;
    case c10d::ReduceOp::PREMUL_SUM: {
      TORCH_CHECK(floating, "zeroplus ", op, ": ReduceOp.PREMUL_SUM needs a floating-point tensor, got ", type);
      auto* supplement = dynamic_cast<c10d::NCCLPreMulSumSupplement*>(reduceOp.supplement_.get());
      TORCH_CHECK(supplement != nullptr, "zeroplus ", op, ": ReduceOp.PREMUL_SUM carries no factor");
      r.premultiply = true;
      if (supplement->tensor_factor.defined()) {
        TORCH_CHECK(supplement->tensor_factor.numel() == 1, "zeroplus ", op,
                    ": PREMUL_SUM tensor factor must have one element, got ", supplement->tensor_factor.numel());
        r.factorTensor = supplement->tensor_factor.to(at::kCPU);
      } else {
        r.factor = supplement->double_factor;
      }
      break;
    }
    case c10d::ReduceOp::BAND:
    case c10d::ReduceOp::BOR:
    case c10d::ReduceOp::BXOR:
      TORCH_CHECK(!floating, "zeroplus ", op, ": bitwise reduce op ", reduceOp.op_,
                  " is not defined for floating-point dtype ", type);
      r.op = reduceOp.op_ == c10d::ReduceOp::BAND ? ReduceOp::kBand
             : reduceOp.op_ == c10d::ReduceOp::BOR ? ReduceOp::kBor
                                                    : ReduceOp::kBxor;
      break;
    default:
      TORCH_CHECK(false, "zeroplus ", op, ": does not support reduce op ", reduceOp.op_);
  }
  return r;
}

void applyPremultiply(const Reduction& reduction, at::Tensor& tensor) {
  if (!reduction.premultiply) return;
  if (reduction.factorTensor.defined()) {
    tensor.mul_(reduction.factorTensor.to(tensor.scalar_type()));
  } else {
    tensor.mul_(reduction.factor);
  }
}

void applyAverage(const Reduction& reduction, at::Tensor& tensor, int groupSize) {
  if (reduction.average) tensor.div_(groupSize);
}

void checkSameDtype(const char* op, const char* arg, const std::vector<at::Tensor>& tensors, at::ScalarType reference) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].scalar_type() == reference, "zeroplus ", op, ": ", arg, "[", i, "] has dtype ",
                tensors[i].scalar_type(), ", expected ", reference);
  }
}

void checkCpuDense(const char* op, const char* arg, const at::Tensor& tensor) {
  TORCH_CHECK(tensor.defined(), "zeroplus ", op, ": ", arg, " is an undefined tensor");
  TORCH_CHECK(tensor.device().is_cpu(), "zeroplus ", op, ": ", arg, " is on ", tensor.device(),
              "; this build of zeroplus moves CPU tensors only");
  TORCH_CHECK(tensor.layout() == at::kStrided, "zeroplus ", op, ": ", arg, " has layout ", tensor.layout(),
              ", expected a dense (strided) tensor");
  TORCH_CHECK(tensor.is_contiguous(), "zeroplus ", op, ": ", arg, " is not contiguous (sizes ", tensor.sizes(),
              ", strides ", tensor.strides(), "); call .contiguous() first");
}

void checkCpuStrided(const char* op, const char* arg, const at::Tensor& tensor) {
  TORCH_CHECK(tensor.defined(), "zeroplus ", op, ": ", arg, " is an undefined tensor");
  TORCH_CHECK(tensor.device().is_cpu(), "zeroplus ", op, ": ", arg, " is on ", tensor.device(),
              "; this build of zeroplus moves CPU tensors only");
  TORCH_CHECK(tensor.layout() == at::kStrided, "zeroplus ", op, ": ", arg, " has layout ", tensor.layout(),
              ", expected a dense (strided) tensor");
}

void checkContiguousValue(const char* op, const char* arg, const at::Tensor& tensor) {
  TORCH_CHECK_VALUE(tensor.is_contiguous(), "zeroplus ", op, ": Tensors must be contiguous; ", arg, " has sizes ",
                    tensor.sizes(), " and strides ", tensor.strides());
}

void checkSameTypeAndSizes(const char* op, const std::vector<at::Tensor>& list) {
  for (size_t i = 1; i < list.size(); ++i) {
    TORCH_CHECK(list[i].scalar_type() == list[0].scalar_type(), "zeroplus ", op, ": invalid tensor type at index ",
                i, " (expected ", list[0].scalar_type(), ", got ", list[i].scalar_type(), ")");
    TORCH_CHECK(list[i].sizes() == list[0].sizes(), "zeroplus ", op, ": invalid tensor size at index ", i,
                " (expected ", list[0].sizes(), ", got ", list[i].sizes(), ")");
  }
}

void checkSingleTensor(const char* op, const char* arg, size_t count) {
  TORCH_CHECK(count == 1, "zeroplus ", op, ": ", arg, " must hold exactly one tensor per process, got ", count);
}

void checkRank(const char* op, const char* arg, int64_t rank, int size) {
  TORCH_CHECK(rank >= 0 && rank < size, "zeroplus ", op, ": invalid ", arg, " ", rank, " for a group of size ", size);
}

void checkSameTypeAndNumel(const char* op, const char* arg, const at::Tensor& tensor, const at::Tensor& reference) {
  TORCH_CHECK(tensor.scalar_type() == reference.scalar_type(), "zeroplus ", op, ": ", arg, " has dtype ",
              tensor.scalar_type(), ", expected ", reference.scalar_type(), " (the input's dtype)");
  TORCH_CHECK(tensor.numel() == reference.numel(), "zeroplus ", op, ": ", arg, " has ", tensor.numel(),
              " elements, expected ", reference.numel(), " (the input's size)");
}

}  // namespace zeroplus::pg
