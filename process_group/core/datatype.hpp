// Element types and reduction operators understood by the torch-free core. The adapter maps
// at::ScalarType / c10d::ReduceOp onto these; AVG and PREMUL_SUM are SUM plus a scale the
// adapter applies, so they do not appear here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace zeroplus::pg {

enum class DataType : uint8_t {
  kFloat32, kFloat64, kFloat16, kBFloat16,
  kInt8, kUInt8, kInt16, kInt32, kInt64, kBool,
};

enum class ReduceOp : uint8_t { kSum, kProduct, kMin, kMax, kBand, kBor, kBxor };

size_t elementSize(DataType type);
std::string_view toString(DataType type);
std::string_view toString(ReduceOp op);

// Bitwise ops are defined on integer and bool types only (as in c10d's Gloo backend).
bool reduceSupported(DataType type, ReduceOp op);

// dst[i] = dst[i] (op) src[i] for i < count. Half types are computed in float and rounded to
// nearest-even once per element. Precondition: reduceSupported(type, op).
void reduceInto(void* dst, const void* src, size_t count, DataType type, ReduceOp op);

// data[i] = data[i] / divisor for floating types (half types computed in float and rounded
// once, as ATen's div_ does). The AVG post-pass of bucketed allreduces. Returns false for
// non-floating types (nothing is written).
bool divideInPlace(void* data, size_t count, DataType type, double divisor);

}  // namespace zeroplus::pg
