// Runtime CPU instruction-set selection for the fused optimizer kernels.
//
// Contract
//  * The kernels are compiled once per ISA in separate translation units (scalar with the
//    baseline flags, AVX2+FMA+F16C, AVX-512F/BW/VL) and chosen at run time, never with
//    -march=native, so one libzeroplus.so runs on every x86-64 machine.
//  * activeIsa() is the best ISA the CPU supports, lowered by the environment variable
//    ZEROPLUS_CPU_ISA=scalar|avx2|avx512 (read once, on first use; asking for an ISA the CPU
//    lacks falls back to the best supported one below it; an unknown value is ignored).
//  * Thread-safe: the detection result is a function-local static.
#pragma once

#include <optional>
#include <string_view>

namespace zeroplus::optim {

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Name as accepted by ZEROPLUS_CPU_ISA ("scalar", "avx2", "avx512").
const char* isaName(Isa isa);
std::optional<Isa> parseIsa(std::string_view name);

// True when this CPU (and this build) can execute kernels compiled for `isa`.
bool cpuSupports(Isa isa);

// Best supported ISA, after applying ZEROPLUS_CPU_ISA.
Isa activeIsa();

// The ISA actually used for a request: `requested` clamped to what the CPU supports.
Isa resolveIsa(Isa requested);

}  // namespace zeroplus::optim
