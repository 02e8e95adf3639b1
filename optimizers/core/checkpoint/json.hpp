// A small JSON value, a compact writer and a strict parser: what the checkpoint manifest needs
// (format.py writes it with json.dumps(separators=(",", ":"), allow_nan=True)). Torch-free.
//
// Value is a plain tree: null, bool, int (int64), float (double), string (UTF-8), array, object
// (members in insertion order; keys unique). dump() writes compact JSON as Python's json.dumps
// does: floats always with a '.' or an exponent (2.0, 1e-08), so Python reads a float back,
// non-finite floats as NaN / Infinity / -Infinity (allow_nan), strings with \" \\ and control
// characters escaped and other bytes as they are.
//
// parse() is strict where a lenient parser would guess: one value and only whitespace (space,
// tab, LF, CR) around it, no byte-order mark, no duplicate keys, no trailing commas, no leading
// zeros, integers that do not fit int64 refused (never rounded to a double), nesting at most
// kMaxDepth, strings well-formed UTF-8 (RFC 3629: no overlong forms, no encoded surrogates),
// \u escapes (surrogate pairs joined) decoded to UTF-8, unpaired surrogates refused. NaN,
// Infinity and -Infinity are accepted (Python writes them). Errors: -EINVAL and *error says what
// and at which byte.
//
// The contract the Python reader relies on (format.py parse_manifest validates with this parser,
// then builds its dict with json.loads): every text parse() accepts, Python's json.loads reads to
// the same values: same members (no duplicate for Python to resolve), same strings (json.loads
// decodes bytes as UTF-8, with surrogatepass: refused here), same integers and floats (both
// round correctly), and no nesting deep enough for Python's RecursionError. Where the two
// grammars differ (duplicates, big integers, lone surrogates, a BOM, UTF-16/32 input, deep
// nesting) this parser is the stricter one; tests/python/test_checkpoint_format.py pins each.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace zeroplus::ckpt::json {

constexpr int kMaxDepth = 64;

struct Value {
  enum class Kind { Null, Bool, Int, Float, String, Array, Object };
  Kind kind = Kind::Null;
  bool b = false;
  int64_t i = 0;
  double d = 0.0;
  std::string s;
  std::vector<Value> items;       // array elements, or object member values
  std::vector<std::string> keys;  // object member names (parallel to items)

  Value() = default;
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value number(double v);
  static Value string(std::string v);
  static Value array();
  static Value object();

  bool isNull() const { return kind == Kind::Null; }
  bool isInt() const { return kind == Kind::Int; }
  bool isNumber() const { return kind == Kind::Int || kind == Kind::Float; }
  bool isString() const { return kind == Kind::String; }
  bool isArray() const { return kind == Kind::Array; }
  bool isObject() const { return kind == Kind::Object; }
  double asDouble() const { return kind == Kind::Int ? static_cast<double>(i) : d; }

  // Object members: the value under `key`, or nullptr (also for a non-object).
  const Value* find(std::string_view key) const;
  Value* find(std::string_view key);
  // Sets (replaces or appends) member `key` of an object; returns it.
  Value& set(std::string key, Value v);
  // Appends to an array; returns the new element.
  Value& push(Value v);
};

// Compact JSON text of v (see the file comment).
std::string dump(const Value& v);
void dumpTo(const Value& v, std::string* out);

// Parses `text` (module doc). 0, or -EINVAL with *error set.
int parse(std::string_view text, Value* out, std::string* error);

}  // namespace zeroplus::ckpt::json
