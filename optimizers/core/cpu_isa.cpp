#include "optimizers/core/cpu_isa.hpp"

#include <cstdlib>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace zeroplus::optim {

const char* isaName(Isa isa) {
  switch (isa) {
    case Isa::kScalar: return "scalar";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "unknown";
}

std::optional<Isa> parseIsa(std::string_view name) {
  if (name == "scalar") return Isa::kScalar;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "avx512") return Isa::kAvx512;
  return std::nullopt;
}

#if defined(__x86_64__) || defined(__i386__)
namespace {
// F16C from cpuid directly: clang before 16 rejects __builtin_cpu_supports("f16c") (the fuzz
// and sanitizer builds use clang 14).
bool hasF16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
}
}  // namespace
#endif

bool cpuSupports(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  switch (isa) {
    case Isa::kScalar: return true;
    // The AVX2 translation unit also uses FMA (fused multiply-add) and F16C (fp16 loads).
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && hasF16c();
    case Isa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && cpuSupports(Isa::kAvx2);
  }
  return false;
#else
  return isa == Isa::kScalar;
#endif
}

Isa resolveIsa(Isa requested) {
  for (int i = static_cast<int>(requested); i > 0; --i) {
    if (cpuSupports(static_cast<Isa>(i))) return static_cast<Isa>(i);
  }
  return Isa::kScalar;
}

Isa activeIsa() {
  // ZEROPLUS_CPU_ISA is the only environment variable this component reads; it is listed in
  // docs/optimizers.md. Reading it once keeps the choice stable for the life of the process.
  static const Isa isa = [] {
    Isa wanted = Isa::kAvx512;
    if (const char* env = std::getenv("ZEROPLUS_CPU_ISA")) {
      if (auto parsed = parseIsa(env)) wanted = *parsed;
    }
    return resolveIsa(wanted);
  }();
  return isa;
}

}  // namespace zeroplus::optim
