// One swap record: a 4 KiB header, then the payload (the bytes a swapper keeps on NVMe for one
// bucket: optimizer state, a master copy). Torch-free: the C++ engine's optimizer swapper
// (optimizers/adapter/zero/optimizer_swapper.hpp) and the Python engine's optimizer, parameter
// and gradient swappers (plugin/python/zeroplus/offload/) all write this one format through
// SwapStore (swap_store.hpp).
//
//   bytes [0, 4096)   header: 8 little-endian 64-bit words, the rest zero
//                       0 magic "ZPCSWP01"  1 format version  2 record id (bucket index)
//                       3 generation (how many times the record was written; the store knows
//                         which one it expects, so a stale file is refused)
//                       4 payload bytes  5 layout tag (the writer's description of the payload:
//                         which slots, in which order)  6 CRC-32 of the payload
//                       7 CRC-32 of words 0-6
//   bytes [4096, ...) payload
//
// A record is accepted only if every header word matches what the reader expects and both
// CRC-32s (common/core/crc32.hpp) match: a torn write, a stale file, a flipped bit or another
// record's file is refused, never read as state. The page-sized header keeps the payload
// page-aligned in the (page-aligned) pool buffer and in the file: one O_DIRECT transfer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace zeroplus::swap {

constexpr size_t kHeaderBytes = 4096;
constexpr uint64_t kMagic = 0x3130505753435A50ull;  // "ZPCSWP01" little-endian
constexpr uint64_t kVersion = 1;

// What a reader expects of a record.
struct RecordKey {
  uint64_t id = 0;
  uint64_t generation = 0;
  uint64_t payloadBytes = 0;
  uint64_t layoutTag = 0;
};

inline size_t recordBytes(uint64_t payloadBytes) { return kHeaderBytes + payloadBytes; }

// Writes the header for `key` into record[0, kHeaderBytes), checksumming the payload that
// follows it (record + kHeaderBytes, key.payloadBytes bytes).
void sealRecord(void* record, const RecordKey& key);

// 0 when the record in `record` is `key`'s; otherwise -EBADMSG and *why says which check failed
// (magic, version, id, generation, length, layout, header or payload checksum).
int checkRecord(const void* record, const RecordKey& key, std::string* why);

}  // namespace zeroplus::swap
