// Element sizes, names and the reduction kernels.
//
// The kernels are plain element loops over restrict-qualified typed pointers with no calls or
// branches the compiler cannot if-convert, so they vectorise at the project's -O2 (checked with
// -fopt-info-vec: every type/op except int64 product and half min/max). Half types are widened
// to float, combined, and rounded once to nearest-even, as c10d's Gloo backend does for fp16.
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

// dst may alias a or b exactly. Each aliasing case gets its own function with restrict-qualified
// parameters (GCC honours restrict reliably only there): the compiler then vectorises without
// runtime overlap checks, which GCC's default -O2 cost model ("very cheap") refuses to emit,
// leaving a scalar loop otherwise. Load/Store widen half types to float and round back.
#if defined(__GNUC__) && !defined(__clang__)
// GCC's -O2 "very cheap" vectoriser cost model rejects loops that need a scalar epilogue, i.e.
// every loop with a run-time trip count; ask for the normal model on the kernels only.
#define ZEROPLUS_VECTORIZE __attribute__((optimize("tree-vectorize", "vect-cost-model=dynamic")))
#else
#define ZEROPLUS_VECTORIZE
#endif

template <typename S, typename Op, typename Load, typename Store>
ZEROPLUS_VECTORIZE void inPlaceLeft(S* __restrict io, const S* __restrict y, size_t count, Load load, Store store) {
  for (size_t i = 0; i < count; ++i) io[i] = store(Op::apply(load(io[i]), load(y[i])));
}
template <typename S, typename Op, typename Load, typename Store>
ZEROPLUS_VECTORIZE void inPlaceRight(S* __restrict io, const S* __restrict x, size_t count, Load load, Store store) {
  for (size_t i = 0; i < count; ++i) io[i] = store(Op::apply(load(x[i]), load(io[i])));
}
template <typename S, typename Op, typename Load, typename Store>
ZEROPLUS_VECTORIZE void outOfPlace(S* __restrict o, const S* __restrict x, const S* __restrict y, size_t count, Load load,
                Store store) {
  for (size_t i = 0; i < count; ++i) o[i] = store(Op::apply(load(x[i]), load(y[i])));
}

template <typename S, typename Op, typename Load, typename Store>
void loopWith(void* dst, const void* a, const void* b, size_t count, Load load, Store store) {
  S* d = static_cast<S*>(dst);
  const S* x = static_cast<const S*>(a);
  const S* y = static_cast<const S*>(b);
  if (dst == a) {
    inPlaceLeft<S, Op>(d, y, count, load, store);
  } else if (dst == b) {
    inPlaceRight<S, Op>(d, x, count, load, store);
  } else {
    outOfPlace<S, Op>(d, x, y, count, load, store);
  }
}

template <typename T, typename Op>
void loop(void* dst, const void* a, const void* b, size_t count) {
  auto same = [](T v) { return v; };
  loopWith<T, Op>(dst, a, b, count, same, same);
}

template <typename Op, float (*Load)(uint16_t), uint16_t (*Store)(float)>
void halfLoop(void* dst, const void* a, const void* b, size_t count) {
  loopWith<uint16_t, Op>(dst, a, b, count, [](uint16_t v) { return Load(v); }, [](float v) { return Store(v); });
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

bool divideInPlace(void* data, size_t count, DataType type, double divisor) {
  switch (type) {
    case DataType::kFloat32: {
      auto* p = static_cast<float*>(data);
      const float d = static_cast<float>(divisor);
      for (size_t i = 0; i < count; ++i) p[i] /= d;
      return true;
    }
    case DataType::kFloat64: {
      auto* p = static_cast<double*>(data);
      for (size_t i = 0; i < count; ++i) p[i] /= divisor;
      return true;
    }
    case DataType::kFloat16: {
      auto* p = static_cast<uint16_t*>(data);
      const float d = static_cast<float>(divisor);
      for (size_t i = 0; i < count; ++i) p[i] = detail::floatToHalf(detail::halfToFloat(p[i]) / d);
      return true;
    }
    case DataType::kBFloat16: {
      auto* p = static_cast<uint16_t*>(data);
      const float d = static_cast<float>(divisor);
      for (size_t i = 0; i < count; ++i) p[i] = detail::floatToBf16(detail::bf16ToFloat(p[i]) / d);
      return true;
    }
    default:
      return false;
  }
}

}  // namespace zeroplus::pg
