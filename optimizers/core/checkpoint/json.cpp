#include "optimizers/core/checkpoint/json.hpp"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <unordered_set>

namespace zeroplus::ckpt::json {

Value Value::boolean(bool v) {
  Value out;
  out.kind = Kind::Bool;
  out.b = v;
  return out;
}
Value Value::integer(int64_t v) {
  Value out;
  out.kind = Kind::Int;
  out.i = v;
  return out;
}
Value Value::number(double v) {
  Value out;
  out.kind = Kind::Float;
  out.d = v;
  return out;
}
Value Value::string(std::string v) {
  Value out;
  out.kind = Kind::String;
  out.s = std::move(v);
  return out;
}
Value Value::array() {
  Value out;
  out.kind = Kind::Array;
  return out;
}
Value Value::object() {
  Value out;
  out.kind = Kind::Object;
  return out;
}

const Value* Value::find(std::string_view key) const {
  if (kind != Kind::Object) return nullptr;
  for (size_t k = 0; k < keys.size(); ++k) {
    if (keys[k] == key) return &items[k];
  }
  return nullptr;
}
Value* Value::find(std::string_view key) { return const_cast<Value*>(static_cast<const Value*>(this)->find(key)); }

Value& Value::set(std::string key, Value v) {
  if (Value* there = find(key)) return *there = std::move(v);
  keys.push_back(std::move(key));
  items.push_back(std::move(v));
  return items.back();
}

Value& Value::push(Value v) {
  items.push_back(std::move(v));
  return items.back();
}

namespace {

void dumpString(std::string_view s, std::string* out) {
  out->push_back('"');
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out->push_back('\\');
      out->push_back(ch);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out->append(buf);
    } else {
      out->push_back(ch);
    }
  }
  out->push_back('"');
}

void dumpDouble(double d, std::string* out) {
  if (std::isnan(d)) {
    out->append("NaN");
    return;
  }
  if (std::isinf(d)) {
    out->append(d > 0 ? "Infinity" : "-Infinity");
    return;
  }
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, d);  // shortest round-trip form
  std::string_view text(buf, static_cast<size_t>(r.ptr - buf));
  out->append(text);
  if (text.find_first_of(".e") == std::string_view::npos) out->append(".0");  // stays a float in Python
}

}  // namespace

void dumpTo(const Value& v, std::string* out) {
  switch (v.kind) {
    case Value::Kind::Null:
      out->append("null");
      return;
    case Value::Kind::Bool:
      out->append(v.b ? "true" : "false");
      return;
    case Value::Kind::Int:
      out->append(std::to_string(v.i));
      return;
    case Value::Kind::Float:
      dumpDouble(v.d, out);
      return;
    case Value::Kind::String:
      dumpString(v.s, out);
      return;
    case Value::Kind::Array:
      out->push_back('[');
      for (size_t k = 0; k < v.items.size(); ++k) {
        if (k) out->push_back(',');
        dumpTo(v.items[k], out);
      }
      out->push_back(']');
      return;
    case Value::Kind::Object:
      out->push_back('{');
      for (size_t k = 0; k < v.items.size(); ++k) {
        if (k) out->push_back(',');
        dumpString(v.keys[k], out);
        out->push_back(':');
        dumpTo(v.items[k], out);
      }
      out->push_back('}');
      return;
  }
}

std::string dump(const Value& v) {
  std::string out;
  dumpTo(v, &out);
  return out;
}

namespace {

class Parser {
 public:
  Parser(std::string_view text, std::string* error) : t_(text), error_(error) {}

  bool document(Value* out) {
    ws();
    if (!value(out, 0)) return false;
    ws();
    return pos_ == t_.size() || fail("trailing characters after the JSON value");
  }

 private:
  bool fail(const char* what) {
    if (error_) *error_ = std::string(what) + " at byte " + std::to_string(pos_);
    return false;
  }
  void ws() {
    while (pos_ < t_.size() && (t_[pos_] == ' ' || t_[pos_] == '\t' || t_[pos_] == '\n' || t_[pos_] == '\r')) ++pos_;
  }
  bool literal(std::string_view word) {
    if (t_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  bool value(Value* out, int depth) {
    if (depth > kMaxDepth) return fail("nesting deeper than the limit");
    if (pos_ >= t_.size()) return fail("unexpected end of input");
    const char c = t_[pos_];
    if (c == '{') return object(out, depth);
    if (c == '[') return array(out, depth);
    if (c == '"') {
      *out = Value::string({});
      return string(&out->s);
    }
    if (literal("null")) return *out = Value(), true;
    if (literal("true")) return *out = Value::boolean(true), true;
    if (literal("false")) return *out = Value::boolean(false), true;
    if (literal("NaN")) return *out = Value::number(std::nan("")), true;
    if (literal("Infinity")) return *out = Value::number(HUGE_VAL), true;
    if (literal("-Infinity")) return *out = Value::number(-HUGE_VAL), true;
    return number(out);
  }

  bool number(Value* out) {
    const size_t start = pos_;
    bool isFloat = false;
    if (pos_ < t_.size() && t_[pos_] == '-') ++pos_;
    if (pos_ >= t_.size() || t_[pos_] < '0' || t_[pos_] > '9') return fail("invalid value");
    if (t_[pos_] == '0' && pos_ + 1 < t_.size() && t_[pos_ + 1] >= '0' && t_[pos_ + 1] <= '9') {
      return fail("number with a leading zero");
    }
    auto digits = [&] {
      const size_t at = pos_;
      while (pos_ < t_.size() && t_[pos_] >= '0' && t_[pos_] <= '9') ++pos_;
      return pos_ > at;
    };
    digits();
    if (pos_ < t_.size() && t_[pos_] == '.') {
      ++pos_;
      isFloat = true;
      if (!digits()) return fail("number with no digits after '.'");
    }
    if (pos_ < t_.size() && (t_[pos_] == 'e' || t_[pos_] == 'E')) {
      ++pos_;
      isFloat = true;
      if (pos_ < t_.size() && (t_[pos_] == '+' || t_[pos_] == '-')) ++pos_;
      if (!digits()) return fail("number with no exponent digits");
    }
    const char* first = t_.data() + start;
    const char* last = t_.data() + pos_;
    if (isFloat) {
      double d = 0;
      const auto r = std::from_chars(first, last, d);
      if (r.ec == std::errc::result_out_of_range) {
        // from_chars refuses what Python rounds: overflow to +-inf, underflow to 0.
        d = std::strtod(std::string(first, last).c_str(), nullptr);
      } else if (r.ec != std::errc() || r.ptr != last) {
        return fail("invalid number");
      }
      *out = Value::number(d);
      return true;
    }
    int64_t v = 0;
    const auto r = std::from_chars(first, last, v);
    if (r.ec != std::errc() || r.ptr != last) return fail("integer out of the int64 range");
    *out = Value::integer(v);
    return true;
  }

  bool hex4(uint32_t* out) {
    if (pos_ + 4 > t_.size()) return fail("truncated \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = t_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f') v |= static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= static_cast<uint32_t>(c - 'A' + 10);
      else return fail("invalid \\u escape");
    }
    *out = v;
    return true;
  }

  static void utf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  // One multi-byte UTF-8 sequence at pos_, copied to out: well-formed as Unicode defines it
  // (RFC 3629: no overlong forms, no encoded surrogates U+D800..U+DFFF, nothing past U+10FFFF).
  // Python decodes the same bytes to the same characters; a lenient reader would let a name that
  // Python refuses (or decodes with surrogatepass, as json.loads does) pass as valid here.
  bool utf8Sequence(std::string* out) {
    const auto b0 = static_cast<unsigned char>(t_[pos_]);
    size_t n = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      n = 2;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      n = 3;
      if (b0 == 0xE0) lo = 0xA0;  // overlong below U+0800
      if (b0 == 0xED) hi = 0x9F;  // surrogates
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      n = 4;
      if (b0 == 0xF0) lo = 0x90;  // overlong below U+10000
      if (b0 == 0xF4) hi = 0x8F;  // past U+10FFFF
    } else {
      return fail("invalid UTF-8 in a string");
    }
    if (pos_ + n > t_.size()) return fail("invalid UTF-8 in a string");
    for (size_t k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(t_[pos_ + k]);
      if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) return fail("invalid UTF-8 in a string");
    }
    out->append(t_.data() + pos_, n);
    pos_ += n;
    return true;
  }

  bool string(std::string* out) {
    ++pos_;  // the opening quote
    while (true) {
      if (pos_ >= t_.size()) return fail("unterminated string");
      const char c = t_[pos_++];
      if (c == '"') return true;
      if (static_cast<unsigned char>(c) < 0x20) return fail("control character in a string");
      if (static_cast<unsigned char>(c) >= 0x80) {
        --pos_;
        if (!utf8Sequence(out)) return false;
        continue;
      }
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (pos_ >= t_.size()) return fail("unterminated string");
      const char e = t_[pos_++];
      switch (e) {
        case '"': out->push_back('"'); break;
        case '\\': out->push_back('\\'); break;
        case '/': out->push_back('/'); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u': {
          uint32_t cp = 0;
          if (!hex4(&cp)) return false;
          if (cp >= 0xDC00 && cp <= 0xDFFF) return fail("unpaired low surrogate");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            uint32_t lo = 0;
            if (!literal("\\u") || !hex4(&lo) || lo < 0xDC00 || lo > 0xDFFF) return fail("unpaired high surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          utf8(cp, out);
          break;
        }
        default:
          return fail("invalid escape");
      }
    }
  }

  bool array(Value* out, int depth) {
    *out = Value::array();
    ++pos_;
    ws();
    if (pos_ < t_.size() && t_[pos_] == ']') return ++pos_, true;
    while (true) {
      ws();
      if (!value(&out->push(Value()), depth + 1)) return false;
      ws();
      if (pos_ >= t_.size()) return fail("unterminated array");
      if (t_[pos_] == ']') return ++pos_, true;
      if (t_[pos_++] != ',') return fail("expected ',' or ']'");
    }
  }

  bool object(Value* out, int depth) {
    *out = Value::object();
    ++pos_;
    ws();
    if (pos_ < t_.size() && t_[pos_] == '}') return ++pos_, true;
    std::unordered_set<std::string> seen;  // a manifest's "tensors" has one member per tensor
    while (true) {
      ws();
      if (pos_ >= t_.size() || t_[pos_] != '"') return fail("expected a member name");
      std::string key;
      if (!string(&key)) return false;
      if (!seen.insert(key).second) return fail("duplicate member name");
      ws();
      if (pos_ >= t_.size() || t_[pos_++] != ':') return fail("expected ':'");
      ws();
      out->keys.push_back(std::move(key));
      if (!value(&out->items.emplace_back(), depth + 1)) return false;
      ws();
      if (pos_ >= t_.size()) return fail("unterminated object");
      if (t_[pos_] == '}') return ++pos_, true;
      if (t_[pos_++] != ',') return fail("expected ',' or '}'");
    }
  }

  std::string_view t_;
  std::string* error_;
  size_t pos_ = 0;
};

}  // namespace

int parse(std::string_view text, Value* out, std::string* error) {
  Value v;
  if (!Parser(text, error).document(&v)) return -EINVAL;
  *out = std::move(v);
  return 0;
}

}  // namespace zeroplus::ckpt::json
