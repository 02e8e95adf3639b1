// Fuzzes the checkpoint manifest's validator, the one both readers use
// (optimizers/core/checkpoint/manifest.hpp parseManifest; Python's format.parse_manifest calls
// it through zeroplus::check_manifest), and the strict JSON parser under it (json.hpp).
// tests/fuzz/checkpoint_manifest_fuzz.py drives the same code from Python, but atheris sees no
// coverage inside the library: this target is where the validator's branches guide the fuzzer.
//
// Input: a manifest's bytes. Contract checked:
//   * json::parse returns 0 or -EINVAL with an error; what it accepts dumps to text that parses
//     back to the same text (a fixed point).
//   * parseManifest returns 0, -EIO, -ENOTSUP or -EINVAL, with an error unless 0; what it accepts
//     obeys every documented bound (names, CRC counts, shapes below 2^62 elements, chunk ranges
//     inside their tensor and file, no overlap, aliases), and encodes to a manifest that parses
//     and encodes again to the same bytes.
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "optimizers/core/checkpoint/manifest.hpp"

namespace ckpt = zeroplus::ckpt;
using u128 = unsigned __int128;

namespace {

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "manifest_parse_fuzz: contract violated: %s\n", what);
    std::abort();
  }
}

void checkJson(std::string_view text) {
  ckpt::json::Value v;
  std::string err;
  const int rc = ckpt::json::parse(text, &v, &err);
  check(rc == 0 || rc == -EINVAL, "json::parse returned another code than 0 or -EINVAL");
  if (rc != 0) {
    check(!err.empty(), "json::parse refused without saying why");
    return;
  }
  const std::string once = ckpt::json::dump(v);
  ckpt::json::Value back;
  check(ckpt::json::parse(once, &back, &err) == 0, "json::dump wrote text json::parse refuses");
  check(ckpt::json::dump(back) == once, "json::dump of a parsed dump differs");
}

bool isShardName(const std::string& n) {
  return n.size() == 13 && n.compare(0, 4, "rank") == 0 && n.compare(9, 4, ".bin") == 0 &&
         std::all_of(n.begin() + 4, n.begin() + 9, [](char c) { return c >= '0' && c <= '9'; });
}

void checkBounds(const ckpt::Manifest& m) {
  check(m.version >= 1 && m.version <= ckpt::kVersion, "version out of range");
  check(m.blockBytes >= 1 && m.blockBytes <= ckpt::kMaxBlockBytes, "block_bytes out of range");
  for (const ckpt::FileRecord& f : m.files) {
    check(isShardName(f.name), "a file name that is not rankNNNNN.bin");
    check(f.bytes >= 0, "negative file size");
    check(static_cast<int64_t>(f.blockCrc32.size()) == (f.bytes + m.blockBytes - 1) / m.blockBytes,
          "CRC count does not match the file's blocks");
  }
  for (const ckpt::TensorRecord& t : m.tensors) {
    u128 bound = 1, numel = 1;
    for (int64_t d : t.shape) {
      check(d >= 0, "negative dimension");
      bound *= static_cast<u128>(std::max<int64_t>(d, 1));
      numel *= static_cast<u128>(d);
      check(bound < (u128{1} << 62), "shape of 2^62 elements or more");
    }
    check(numel == static_cast<u128>(t.numel), "numel is not the product of the shape");
    check(ckpt::dtypeBytes(t.dtype) > 0, "unknown dtype");
    check(t.kind == "param" || t.kind == "buffer", "unknown kind");
    for (const auto& [key, dtype] : t.state) check(ckpt::dtypeBytes(dtype) > 0, "unknown state dtype");
  }
  for (const auto& [alias, target] : m.aliases) {
    check(m.tensor(target) != nullptr && m.tensor(alias) == nullptr, "alias to nothing, or shadowing a tensor");
  }
  std::map<std::pair<std::string, std::string>, std::vector<std::pair<int64_t, int64_t>>> spans;
  for (const ckpt::Chunk& c : m.chunks) {
    const ckpt::TensorRecord* t = m.tensor(c.tensor);
    check(t != nullptr, "chunk of an unknown tensor");
    check(0 <= c.lo && c.lo < c.hi && c.hi <= t->numel, "chunk range outside its tensor");
    check(0 <= c.file && c.file < static_cast<int64_t>(m.files.size()), "chunk in an unknown file");
    const __int128 end =
        static_cast<__int128>(c.offset) + static_cast<__int128>(c.hi - c.lo) * ckpt::dtypeBytes(c.dtype);
    check(c.offset >= 0 && end <= m.files[static_cast<size_t>(c.file)].bytes, "chunk bytes outside its file");
    spans[{c.tensor, c.key}].emplace_back(c.lo, c.hi);
  }
  for (auto& [which, ranges] : spans) {
    std::sort(ranges.begin(), ranges.end());
    for (size_t k = 1; k < ranges.size(); ++k) check(ranges[k].first >= ranges[k - 1].second, "overlapping chunks");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  checkJson(text);
  ckpt::Manifest m;
  std::string err;
  const int rc = ckpt::parseManifest(text, &m, &err);
  check(rc == 0 || rc == -EIO || rc == -ENOTSUP || rc == -EINVAL, "parseManifest returned an undocumented code");
  if (rc != 0) {
    check(!err.empty(), "parseManifest refused without saying why");
    return 0;
  }
  checkBounds(m);
  const std::string once = ckpt::encodeManifest(m);
  ckpt::Manifest back;
  check(ckpt::parseManifest(once, &back, &err) == 0, "encodeManifest wrote a manifest parseManifest refuses");
  check(ckpt::encodeManifest(back) == once, "encodeManifest of a parsed encoding differs");
  return 0;
}
