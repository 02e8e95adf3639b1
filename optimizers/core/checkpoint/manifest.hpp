// The zeroplus checkpoint manifest (manifest.json) as typed C++ values. Torch-free.
//
// parseManifest() is the definition of a valid manifest, for both front-ends: the LibTorch
// engine's CheckpointFiles calls it, and the Python package's format.py parse_manifest calls it
// through the op zeroplus::check_manifest (registration/files_registration.cpp) before it builds
// its dict with json.loads (json.hpp says why what this parser accepts reads the same there).
// format.py is the writer (encode_manifest) and the dict front-end; docs/checkpoints.md the prose.
//
// encodeManifest() writes compact JSON whose last member is "manifest_sha256", the SHA-256 of the
// bytes without that member (as format.py encode_manifest does): one flipped bit anywhere is
// refused.
//
// parseManifest() checks, before anything else, the version and the seal, then every field a
// reader will trust: shard file names (rankNNNNN.bin only: nothing can name a path outside the
// checkpoint directory), sizes and per-block CRC counts and values (32-bit), tensor shapes (the
// product of max(dim, 1) below 2^62), dtypes and kinds, aliases, every chunk's tensor, element
// range, file and byte range (inside the file's recorded size), no two chunks of one value
// overlapping, param groups naming known tensors. Return codes: 0; -EIO the bytes are corrupt
// (not JSON, seal missing or mismatching); -ENOTSUP a newer format version; -EINVAL anything else
// malformed. *error says which field, worded to follow "<path of the manifest>: " (both
// front-ends prefix it so; Python tests match on these words).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "optimizers/core/checkpoint/json.hpp"

namespace zeroplus::ckpt {

constexpr const char* kFormat = "zeroplus-checkpoint";
constexpr int64_t kVersion = 2;
constexpr int64_t kChecksummedSince = 2;
constexpr const char* kManifestName = "manifest.json";
constexpr const char* kLatestName = "latest";
constexpr int64_t kBlockBytes = int64_t{4} << 20;
constexpr int64_t kMaxBlockBytes = int64_t{64} << 20;

// Bytes per element of a dtype name the format allows ("float32", "bfloat16", ...); 0 if unknown.
int64_t dtypeBytes(std::string_view dtype);
// "rank00003.bin".
std::string shardFileName(int rank);
// One path component a `latest` pointer may name (format.py check_dir_name).
bool isPlainDirName(std::string_view name);

struct FileRecord {
  std::string name;
  int64_t bytes = 0;
  std::vector<uint32_t> blockCrc32;
};

struct TensorRecord {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;          // the model's dtype of the tensor
  std::string kind;           // "param" or "buffer"
  bool hasTrainable = false;  // params carry "trainable"
  bool trainable = false;
  std::vector<std::pair<std::string, std::string>> state;  // elementwise state key -> dtype
  json::Value scalars = json::Value::object();             // per-tensor optimizer scalars (tagged values)
  int64_t numel = 1;          // product of shape (parse fills it; encode ignores it)
};

struct Chunk {
  std::string tensor, key;  // key: "param", "value" or an optimizer state name
  int64_t lo = 0, hi = 0;   // flat element range of the tensor
  std::string dtype;
  int64_t file = 0, offset = 0;  // index into files; byte offset in it
};

struct Manifest {
  int64_t version = kVersion;
  json::Value source = json::Value::object();
  int64_t blockBytes = kBlockBytes;
  std::vector<FileRecord> files;
  std::vector<TensorRecord> tensors;                     // in the writer's order
  std::vector<std::pair<std::string, std::string>> aliases;  // alias -> stored tensor
  std::vector<Chunk> chunks;
  json::Value paramGroups = json::Value::array();  // objects: hyperparameters (tagged) and "params" (names)
  json::Value optimizer = json::Value::object();
  json::Value extra;
  std::string saveId;

  // tensor name -> index in `tensors` (parse fills it; call indexTensors() after building one).
  std::unordered_map<std::string, size_t> tensorIndex;
  void indexTensors();
  const TensorRecord* tensor(const std::string& name) const;
};

std::string encodeManifest(const Manifest& m);
int parseManifest(std::string_view bytes, Manifest* out, std::string* error);

}  // namespace zeroplus::ckpt
