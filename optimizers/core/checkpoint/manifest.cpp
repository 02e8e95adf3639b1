#include "optimizers/core/checkpoint/manifest.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <map>

#include "common/core/sha256.hpp"

namespace zeroplus::ckpt {
namespace {

constexpr std::string_view kSealKey = "manifest_sha256";
constexpr int64_t kMaxElements = int64_t{1} << 62;

using json::Value;

Value str(const std::string& s) { return Value::string(s); }

}  // namespace

int64_t dtypeBytes(std::string_view d) {
  if (d == "float32" || d == "int32") return 4;
  if (d == "float64" || d == "int64") return 8;
  if (d == "float16" || d == "bfloat16" || d == "int16") return 2;
  if (d == "int8" || d == "uint8" || d == "bool") return 1;
  return 0;
}

std::string shardFileName(int rank) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "rank%05d.bin", rank);
  return buf;
}

bool isPlainDirName(std::string_view n) {
  if (n.empty() || n.size() > 255 || n == "." || n == ".." || n.find("..") != std::string_view::npos) return false;
  for (size_t k = 0; k < n.size(); ++k) {
    const char c = n[k];
    const bool alnum = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
    if (!alnum && (k == 0 || (c != '.' && c != '+' && c != '=' && c != '-'))) return false;
  }
  return true;
}

void Manifest::indexTensors() {
  tensorIndex.clear();
  for (size_t k = 0; k < tensors.size(); ++k) tensorIndex.emplace(tensors[k].name, k);
}

const TensorRecord* Manifest::tensor(const std::string& name) const {
  const auto it = tensorIndex.find(name);
  return it == tensorIndex.end() ? nullptr : &tensors[it->second];
}

std::string encodeManifest(const Manifest& m) {
  Value root = Value::object();
  root.set("format", str(kFormat));
  root.set("version", Value::integer(kVersion));
  root.set("source", m.source);
  root.set("block_bytes", Value::integer(m.blockBytes));
  Value& files = root.set("files", Value::array());
  for (const FileRecord& f : m.files) {
    Value rec = Value::object();
    rec.set("name", str(f.name));
    rec.set("bytes", Value::integer(f.bytes));
    Value& crcs = rec.set("block_crc32", Value::array());
    for (uint32_t c : f.blockCrc32) crcs.push(Value::integer(c));
    files.push(std::move(rec));
  }
  Value& tensors = root.set("tensors", Value::object());
  for (const TensorRecord& t : m.tensors) {
    Value rec = Value::object();
    Value& shape = rec.set("shape", Value::array());
    for (int64_t d : t.shape) shape.push(Value::integer(d));
    rec.set("dtype", str(t.dtype));
    rec.set("kind", str(t.kind));
    if (t.hasTrainable) rec.set("trainable", Value::boolean(t.trainable));
    if (t.kind == "param") {
      Value& state = rec.set("state", Value::object());
      for (const auto& [k, d] : t.state) state.set(k, str(d));
      rec.set("scalars", t.scalars);
    }
    tensors.set(t.name, std::move(rec));
  }
  Value& aliases = root.set("aliases", Value::object());
  for (const auto& [a, target] : m.aliases) aliases.set(a, str(target));
  Value& chunks = root.set("chunks", Value::array());
  for (const Chunk& c : m.chunks) {
    Value rec = Value::array();
    rec.push(str(c.tensor));
    rec.push(str(c.key));
    rec.push(Value::integer(c.lo));
    rec.push(Value::integer(c.hi));
    rec.push(str(c.dtype));
    rec.push(Value::integer(c.file));
    rec.push(Value::integer(c.offset));
    chunks.push(std::move(rec));
  }
  root.set("param_groups", m.paramGroups);
  root.set("optimizer", m.optimizer);
  root.set("extra", m.extra);
  root.set("save_id", str(m.saveId));
  std::string body = json::dump(root);
  const std::string digest = checksum::sha256Hex(body);
  body.pop_back();  // the closing '}': the seal is the last member
  body += ",\"";
  body += kSealKey;
  body += "\":\"" + digest + "\"}";
  return body;
}

namespace {

struct Checker {
  std::string* error;
  int fail(int code, const std::string& what) {
    if (error) *error = what;
    return code;
  }
};

// The seal (format.py _check_seal): the bytes end with ,"manifest_sha256":"<64 hex>"} and the
// hex is the SHA-256 of everything before that member followed by '}'.
bool sealMatches(std::string_view data, std::string* why) {
  const std::string head = std::string(",\"") + std::string(kSealKey) + "\":\"";
  const size_t need = head.size() + 64 + 2;
  if (data.size() < need || data.substr(data.size() - 2) != "\"}" ||
      data.substr(data.size() - need, head.size()) != head) {
    *why = "the manifest's checksum (manifest_sha256, the last member of a manifest of version >= 2) is missing or "
           "damaged; the manifest is corrupt";
    return false;
  }
  const std::string_view recorded = data.substr(data.size() - 66, 64);
  for (char c : recorded) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) {  // not 64 lowercase hex digits
      *why = "the manifest's checksum (manifest_sha256, the last member of a manifest of version >= 2) is missing "
             "or damaged; the manifest is corrupt";
      return false;
    }
  }
  std::string body(data.substr(0, data.size() - need));
  body.push_back('}');
  const std::string actual = checksum::sha256Hex(body);
  if (actual != recorded) {
    *why = "checksum mismatch in the manifest (sha256 of its bytes " + actual.substr(0, 16) + "..., recorded " +
           std::string(recorded.substr(0, 16)) + "...); the manifest is corrupt";
    return false;
  }
  return true;
}

bool isShardName(const std::string& n) {
  if (n.size() != 13 || n.compare(0, 4, "rank") != 0 || n.compare(9, 4, ".bin") != 0) return false;
  return std::all_of(n.begin() + 4, n.begin() + 9, [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

int parseManifest(std::string_view bytes, Manifest* out, std::string* error) {
  Checker ck{error};
  Value root;
  std::string why;
  if (json::parse(bytes, &root, &why) != 0) return ck.fail(-EIO, "not valid JSON (" + why + "); the manifest is corrupt");
  const Value* format = root.find("format");
  if (!root.isObject() || format == nullptr || !format->isString() || format->s != kFormat) {
    return ck.fail(-EINVAL, "not a zeroplus checkpoint manifest (no \"format\": \"zeroplus-checkpoint\")");
  }
  const Value* version = root.find("version");
  if (version == nullptr || !version->isInt() || version->i < 1) {
    return ck.fail(-EINVAL, "version is not a positive integer");
  }
  if (version->i > kVersion) {
    return ck.fail(-ENOTSUP, "format version " + std::to_string(version->i) + ", newer than this zeroplus reads (" +
                                 std::to_string(kVersion) + "); upgrade zeroplus");
  }
  if (version->i >= kChecksummedSince || root.find(kSealKey) != nullptr) {
    if (!sealMatches(bytes, &why)) return ck.fail(-EIO, why);
  }
  Manifest m;
  m.version = version->i;
  auto need = [&](const char* key, Value::Kind kind, const char* what) -> const Value* {
    const Value* v = root.find(key);
    return v != nullptr && v->kind == kind ? v : (ck.fail(-EINVAL, std::string("field '") + key + "' missing or not " + what), nullptr);
  };
  const Value* source = need("source", Value::Kind::Object, "an object");
  const Value* files = source ? need("files", Value::Kind::Array, "a list") : nullptr;
  const Value* tensors = files ? need("tensors", Value::Kind::Object, "an object") : nullptr;
  const Value* aliases = tensors ? need("aliases", Value::Kind::Object, "an object") : nullptr;
  const Value* chunks = aliases ? need("chunks", Value::Kind::Array, "a list") : nullptr;
  const Value* groups = chunks ? need("param_groups", Value::Kind::Array, "a list") : nullptr;
  const Value* optimizer = groups ? need("optimizer", Value::Kind::Object, "an object") : nullptr;
  const Value* block = optimizer ? need("block_bytes", Value::Kind::Int, "an int") : nullptr;
  if (block == nullptr) return -EINVAL;
  if (block->i <= 0 || block->i > kMaxBlockBytes) {
    return ck.fail(-EINVAL, "block_bytes " + std::to_string(block->i) + " is outside [1, " +
                                std::to_string(kMaxBlockBytes) + "]");
  }
  m.source = *source;
  m.blockBytes = block->i;
  m.optimizer = *optimizer;
  if (const Value* extra = root.find("extra")) m.extra = *extra;
  if (const Value* id = root.find("save_id"); id != nullptr && id->isString()) m.saveId = id->s;

  for (size_t k = 0; k < files->items.size(); ++k) {
    const Value& f = files->items[k];
    const std::string at = "files[" + std::to_string(k) + "]";
    const Value* name = f.find("name");
    if (name == nullptr || !name->isString() || !isShardName(name->s)) {
      const std::string shown = name != nullptr && name->isString() ? "name '" + name->s + "'" : "no name";
      return ck.fail(-EINVAL, at + " has " + shown + ", expected rankNNNNN.bin (refusing a name that could escape the "
                                   "checkpoint directory)");
    }
    const Value* size = f.find("bytes");
    if (size == nullptr || !size->isInt() || size->i < 0) return ck.fail(-EINVAL, at + ".bytes is invalid");
    const Value* crcs = f.find("block_crc32");
    const int64_t blocks = (size->i + m.blockBytes - 1) / m.blockBytes;
    const std::string crcRule = at + ".block_crc32 must list " + std::to_string(blocks) +
                                " checksums, each a 32-bit unsigned integer";
    if (crcs == nullptr || !crcs->isArray() || static_cast<int64_t>(crcs->items.size()) != blocks) {
      return ck.fail(-EINVAL, crcRule);
    }
    FileRecord rec{name->s, size->i, {}};
    for (const Value& c : crcs->items) {
      if (!c.isInt() || c.i < 0 || c.i > 0xFFFFFFFFLL) return ck.fail(-EINVAL, crcRule);
      rec.blockCrc32.push_back(static_cast<uint32_t>(c.i));
    }
    m.files.push_back(std::move(rec));
  }

  for (size_t k = 0; k < tensors->items.size(); ++k) {
    const Value& t = tensors->items[k];
    TensorRecord rec;
    rec.name = tensors->keys[k];
    const std::string at = "tensor '" + rec.name + "'";
    const Value* shape = t.find("shape");
    bool ok = shape != nullptr && shape->isArray();
    int64_t bound = 1;
    for (size_t d = 0; ok && d < shape->items.size(); ++d) {
      const Value& dim = shape->items[d];
      // the product of max(dim, 1) stays below 2^62: bound * dim < kMaxElements, without overflow
      ok = dim.isInt() && dim.i >= 0 && (dim.i <= 1 || bound <= (kMaxElements - 1) / dim.i);
      if (ok) {
        rec.shape.push_back(dim.i);
        bound *= std::max<int64_t>(dim.i, 1);
      }
    }
    if (!ok) return ck.fail(-EINVAL, at + " has an invalid shape");
    rec.numel = 1;
    for (int64_t d : rec.shape) rec.numel *= d;
    const Value* dtype = t.find("dtype");
    if (dtype == nullptr || !dtype->isString() || dtypeBytes(dtype->s) == 0) {
      return ck.fail(-EINVAL, at + " has an unknown dtype");
    }
    rec.dtype = dtype->s;
    const Value* kind = t.find("kind");
    if (kind == nullptr || !kind->isString() || (kind->s != "param" && kind->s != "buffer")) {
      return ck.fail(-EINVAL, at + " has an unknown kind");
    }
    rec.kind = kind->s;
    if (const Value* tr = t.find("trainable"); tr != nullptr) {
      if (tr->kind != Value::Kind::Bool) return ck.fail(-EINVAL, at + " has a \"trainable\" that is not a bool");
      rec.hasTrainable = true;
      rec.trainable = tr->b;
    }
    const Value* state = t.find("state");
    const Value* scalars = t.find("scalars");
    if ((state != nullptr && !state->isObject()) || (scalars != nullptr && !scalars->isObject())) {
      return ck.fail(-EINVAL, at + " has invalid optimizer state fields");
    }
    if (state != nullptr) {
      for (size_t s = 0; s < state->items.size(); ++s) {
        if (!state->items[s].isString() || dtypeBytes(state->items[s].s) == 0) {
          return ck.fail(-EINVAL, at + " has invalid optimizer state fields");
        }
        rec.state.emplace_back(state->keys[s], state->items[s].s);
      }
    }
    if (scalars != nullptr) rec.scalars = *scalars;
    m.tensorIndex.emplace(rec.name, m.tensors.size());
    m.tensors.push_back(std::move(rec));
  }

  for (size_t k = 0; k < aliases->items.size(); ++k) {
    const std::string& alias = aliases->keys[k];
    const Value& target = aliases->items[k];
    if (!target.isString() || m.tensor(target.s) == nullptr) {
      return ck.fail(-EINVAL, "alias '" + alias + "' names an unknown tensor");
    }
    if (m.tensor(alias) != nullptr) {
      return ck.fail(-EINVAL, "alias '" + alias + "' is also the name of a stored tensor (one state_dict key, two values)");
    }
    m.aliases.emplace_back(alias, target.s);
  }

  std::map<std::pair<std::string, std::string>, std::vector<std::pair<int64_t, int64_t>>> spans;
  for (size_t k = 0; k < chunks->items.size(); ++k) {
    const Value& c = chunks->items[k];
    const std::string at = "chunks[" + std::to_string(k) + "]";
    bool ok = c.isArray() && c.items.size() == 7 && c.items[0].isString() && c.items[1].isString() &&
              c.items[2].isInt() && c.items[3].isInt() && c.items[4].isString() && c.items[5].isInt() &&
              c.items[6].isInt();
    const TensorRecord* t = ok ? m.tensor(c.items[0].s) : nullptr;
    ok = ok && t != nullptr;
    Chunk ch;
    if (ok) {
      ch = {c.items[0].s, c.items[1].s, c.items[2].i, c.items[3].i, c.items[4].s, c.items[5].i, c.items[6].i};
      const int64_t es = dtypeBytes(ch.dtype);
      ok = 0 <= ch.lo && ch.lo < ch.hi && ch.hi <= t->numel && es > 0 && 0 <= ch.file &&
           ch.file < static_cast<int64_t>(m.files.size()) && ch.offset >= 0;
      // offset + (hi - lo) * es <= file size, without overflow (hi - lo < 2^62, es <= 8)
      ok = ok && ch.offset <= m.files[ch.file].bytes && (ch.hi - ch.lo) <= (m.files[ch.file].bytes - ch.offset) / es;
    }
    if (!ok) return ck.fail(-EINVAL, at + " is out of range (tensor, element range, file or byte offset)");
    spans[{ch.tensor, ch.key}].emplace_back(ch.lo, ch.hi);
    m.chunks.push_back(std::move(ch));
  }
  for (auto& [which, ranges] : spans) {
    std::sort(ranges.begin(), ranges.end());
    for (size_t k = 1; k < ranges.size(); ++k) {
      if (ranges[k].first < ranges[k - 1].second) {
        return ck.fail(-EINVAL, "chunks of '" + which.first + "' (" + which.second + ") overlap at element " +
                                    std::to_string(ranges[k].first));
      }
    }
  }

  for (size_t k = 0; k < groups->items.size(); ++k) {
    const Value& g = groups->items[k];
    const Value* params = g.find("params");
    bool ok = params != nullptr && params->isArray();
    for (size_t p = 0; ok && p < params->items.size(); ++p) {
      ok = params->items[p].isString() && m.tensor(params->items[p].s) != nullptr;
    }
    if (!ok) return ck.fail(-EINVAL, "param_groups[" + std::to_string(k) + "] is invalid");
  }
  m.paramGroups = *groups;
  *out = std::move(m);
  return 0;
}

}  // namespace zeroplus::ckpt
