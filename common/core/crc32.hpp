// CRC-32 (the IEEE / zlib / gzip polynomial, reflected, 0xEDB88320) of byte ranges, at memory
// speed: the checkpoint format records one per 4 MiB block, and every save and load computes
// them over all the bytes it moves, so zlib's ~1.6 GB/s byte-table loop was a large part of a
// checkpoint load (issue 41). Torch-free.
//
// crc32(crc, data, n) has zlib's crc32() contract: start from 0, feed the result of one call
// as `crc` of the next to continue a running checksum; crc32(0, p, n) == zlib.crc32(bytes).
// On x86-64 CPUs with PCLMULQDQ and SSE4.1 the body is folded 64 bytes at a time with carry-
// less multiplication (Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ",
// the constants of its reflected CRC-32 case); elsewhere, and for the tail, slicing-by-8 tables.
// Both are checked against a bit-at-a-time reference in tests/cpp/common/crc32_test.cpp.
// Thread-safe (no state; the tables are built once, thread-safely).
#pragma once

#include <cstddef>
#include <cstdint>

namespace zeroplus::checksum {

uint32_t crc32(uint32_t crc, const void* data, size_t n);

// The portable path alone (tests compare the two; a CPU without PCLMULQDQ runs only this).
uint32_t crc32Portable(uint32_t crc, const void* data, size_t n);

// Whether crc32() takes the carry-less multiplication path on this CPU.
bool crc32Accelerated();

}  // namespace zeroplus::checksum
