#include "optimizers/core/swap_record.hpp"

#include <cerrno>
#include <cstring>

#include "common/core/crc32.hpp"

namespace zeroplus::swap {
namespace {

constexpr int kWords = 8;

void load(const void* record, uint64_t* w) { std::memcpy(w, record, kWords * sizeof(uint64_t)); }

int refuse(std::string* why, std::string text) {
  if (why != nullptr) *why = std::move(text);
  return -EBADMSG;
}

}  // namespace

void sealRecord(void* record, const RecordKey& key) {
  auto* bytes = static_cast<unsigned char*>(record);
  uint64_t w[kWords] = {kMagic, kVersion, key.id, key.generation, key.payloadBytes, key.layoutTag, 0, 0};
  w[6] = checksum::crc32(0, bytes + kHeaderBytes, key.payloadBytes);
  w[7] = checksum::crc32(0, w, 7 * sizeof(uint64_t));
  std::memset(bytes, 0, kHeaderBytes);
  std::memcpy(bytes, w, sizeof(w));
}

int checkRecord(const void* record, const RecordKey& key, std::string* why) {
  uint64_t w[kWords];
  load(record, w);
  if (w[0] != kMagic) return refuse(why, "not a zeroplus swap record (bad magic)");
  if (w[7] != checksum::crc32(0, w, 7 * sizeof(uint64_t))) return refuse(why, "header checksum mismatch");
  if (w[1] != kVersion) return refuse(why, "format version " + std::to_string(w[1]) + ", expected " +
                                               std::to_string(kVersion));
  if (w[2] != key.id) return refuse(why, "record of id " + std::to_string(w[2]) + ", expected " +
                                             std::to_string(key.id));
  if (w[3] != key.generation) {
    return refuse(why, "stale record: generation " + std::to_string(w[3]) + ", expected " +
                           std::to_string(key.generation));
  }
  if (w[4] != key.payloadBytes) return refuse(why, "payload of " + std::to_string(w[4]) + " bytes, expected " +
                                                       std::to_string(key.payloadBytes));
  if (w[5] != key.layoutTag) return refuse(why, "layout tag mismatch");
  const auto* bytes = static_cast<const unsigned char*>(record);
  if (w[6] != checksum::crc32(0, bytes + kHeaderBytes, key.payloadBytes)) {
    return refuse(why, "payload checksum mismatch (CRC-32)");
  }
  return 0;
}

}  // namespace zeroplus::swap
