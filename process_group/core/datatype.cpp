// Element sizes, names and the reduction kernels.
//
// The kernels are plain element loops over typed pointers with no calls or branches the
// compiler cannot if-convert, so GCC/Clang vectorise them at -O2/-O3 (with a runtime alias
// check, since dst may alias an input). Half types are widened to float, combined, and
// rounded once to nearest-even; that matches what c10d's Gloo backend does for fp16 sums.
#include "process_group/core/datatype.hpp"

#include <cstring>
#include <type_traits>

#include "process_group/core/half.hpp"
#include "process_group/core/reduce.hpp"

namespace zeroplus::pg {

size_t elementSize(DataType type) {
  switch (type) {
    case DataType::kFloat64:
    case DataType::kInt64: return 8;
    case DataType::kFloat32:
    case DataType::kInt32: return 4;
    case DataType::kFloat16:
    case DataType::kBFloat16:
    case DataType::kInt16: return 2;
    case DataType::kInt8:
    case DataType::kUInt8:
    case DataType::kBool: return 1;
  }
  return 0;
}

std::string_view toString(DataType type) {
  switch (type) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kInt8: return "int8";
    case DataType::kUInt8: return "uint8";
    case DataType::kInt16: return "int16";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
    case DataType::kBool: return "bool";
  }
  return "unknown";
}

std::string_view toString(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kProduct: return "product";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kBand: return "band";
    case ReduceOp::kBor: return "bor";
    case ReduceOp::kBxor: return "bxor";
  }
  return "unknown";
}

static bool isFloating(DataType type) {
  return type == DataType::kFloat32 || type == DataType::kFloat64 || type == DataType::kFloat16 ||
         type == DataType::kBFloat16;
}

bool reduceSupported(DataType type, ReduceOp op) {
  if (static_cast<unsigned>(type) > static_cast<unsigned>(DataType::kBool) ||
      static_cast<unsigned>(op) > static_cast<unsigned>(ReduceOp::kBxor)) {
    return false;
  }
  const bool bitwise = op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
  return !(bitwise && isFloating(type));
}

namespace {

// Integer arithmetic is done in an unsigned type at least as wide as int, so overflow wraps
// (as torch's integer tensors do) instead of being undefined behaviour.
template <typename T>
using Wide = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;

struct Sum {
  template <typename T> static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(static_cast<Wide<T>>(a) + static_cast<Wide<T>>(b));
    } else {
      return a + b;
    }
  }
};
struct Product {
  template <typename T> static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      return static_cast<T>(static_cast<Wide<T>>(a) * static_cast<Wide<T>>(b));
    } else {
      return a * b;
    }
  }
};
struct Min { template <typename T> static T apply(T a, T b) { return b < a ? b : a; } };
struct Max { template <typename T> static T apply(T a, T b) { return a < b ? b : a; } };
struct Band { template <typename T> static T apply(T a, T b) { return static_cast<T>(a & b); } };
struct Bor { template <typename T> static T apply(T a, T b) { return static_cast<T>(a | b); } };
struct Bxor { template <typename T> static T apply(T a, T b) { return static_cast<T>(a ^ b); } };

template <typename T, typename Op>
void loop(void* dst, const void* a, const void* b, size_t count) {
  // memcpy-free typed access: buffers come from tensors / our scratch, so they are aligned
  // for T (the adapter passes data_ptr(), which is at least element aligned).
  T* d = static_cast<T*>(dst);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < count; ++i) d[i] = Op::apply(x[i], y[i]);
}

template <typename Op, float (*Load)(uint16_t), uint16_t (*Store)(float)>
void halfLoop(void* dst, const void* a, const void* b, size_t count) {
  uint16_t* d = static_cast<uint16_t*>(dst);
  const uint16_t* x = static_cast<const uint16_t*>(a);
  const uint16_t* y = static_cast<const uint16_t*>(b);
  for (size_t i = 0; i < count; ++i) d[i] = Store(Op::apply(Load(x[i]), Load(y[i])));
}

template <typename Op>
void dispatchType(void* dst, const void* a, const void* b, size_t count, DataType type) {
  switch (type) {
    case DataType::kFloat32:
      if constexpr (!std::is_same_v<Op, Band> && !std::is_same_v<Op, Bor> && !std::is_same_v<Op, Bxor>) {
        loop<float, Op>(dst, a, b, count);
      }
      return;
    case DataType::kFloat64:
      if constexpr (!std::is_same_v<Op, Band> && !std::is_same_v<Op, Bor> && !std::is_same_v<Op, Bxor>) {
        loop<double, Op>(dst, a, b, count);
      }
      return;
    case DataType::kFloat16:
      if constexpr (!std::is_same_v<Op, Band> && !std::is_same_v<Op, Bor> && !std::is_same_v<Op, Bxor>) {
        halfLoop<Op, detail::halfToFloat, detail::floatToHalf>(dst, a, b, count);
      }
      return;
    case DataType::kBFloat16:
      if constexpr (!std::is_same_v<Op, Band> && !std::is_same_v<Op, Bor> && !std::is_same_v<Op, Bxor>) {
        halfLoop<Op, detail::bf16ToFloat, detail::floatToBf16>(dst, a, b, count);
      }
      return;
    case DataType::kInt8: loop<int8_t, Op>(dst, a, b, count); return;
    case DataType::kUInt8: loop<uint8_t, Op>(dst, a, b, count); return;
    case DataType::kInt16: loop<int16_t, Op>(dst, a, b, count); return;
    case DataType::kInt32: loop<int32_t, Op>(dst, a, b, count); return;
    case DataType::kInt64: loop<int64_t, Op>(dst, a, b, count); return;
    case DataType::kBool:
      // Bools are bytes holding 0 or 1: SUM/MAX are "any", PRODUCT/MIN are "all" (torch's
      // semantics), which the bitwise forms compute without leaving {0, 1}.
      if constexpr (std::is_same_v<Op, Sum> || std::is_same_v<Op, Max> || std::is_same_v<Op, Bor>) {
        loop<uint8_t, Bor>(dst, a, b, count);
      } else if constexpr (std::is_same_v<Op, Product> || std::is_same_v<Op, Min> || std::is_same_v<Op, Band>) {
        loop<uint8_t, Band>(dst, a, b, count);
      } else {
        loop<uint8_t, Bxor>(dst, a, b, count);
      }
      return;
  }
}

}  // namespace

namespace detail {

void reduceTo(void* dst, const void* a, const void* b, size_t count, DataType type, ReduceOp op) {
  if (count == 0) return;
  switch (op) {
    case ReduceOp::kSum: dispatchType<Sum>(dst, a, b, count, type); return;
    case ReduceOp::kProduct: dispatchType<Product>(dst, a, b, count, type); return;
    case ReduceOp::kMin: dispatchType<Min>(dst, a, b, count, type); return;
    case ReduceOp::kMax: dispatchType<Max>(dst, a, b, count, type); return;
    case ReduceOp::kBand: dispatchType<Band>(dst, a, b, count, type); return;
    case ReduceOp::kBor: dispatchType<Bor>(dst, a, b, count, type); return;
    case ReduceOp::kBxor: dispatchType<Bxor>(dst, a, b, count, type); return;
  }
}

}  // namespace detail

void reduceInto(void* dst, const void* src, size_t count, DataType type, ReduceOp op) {
  detail::reduceTo(dst, dst, src, count, type, op);
}

}  // namespace zeroplus::pg
