#include "torch_ext/paging/json.h"

#include <c10/util/Exception.h>

namespace torch_ext::paging {

const JsonValue* JsonValue::find(std::string_view key) const {
  for (const auto& [k, v] : object) {
    if (k == key) return &v;
  }
  return nullptr;
}

const char* JsonValue::kind_name(Kind kind) {
  switch (kind) {
    case Kind::Null: return "null";
    case Kind::Bool: return "boolean";
    case Kind::Int: return "integer";
    case Kind::String: return "string";
    case Kind::Array: return "array";
    case Kind::Object: return "object";
  }
  return "?";
}

namespace {

constexpr int kMaxDepth = 64;

class Parser {
 public:
  Parser(std::string_view text, const std::string& what) : text_(text), what_(what) {}

  JsonValue parse_document() {
    skip_whitespace();
    JsonValue value = parse_value(0);
    skip_whitespace();
    if (pos_ != text_.size()) fail("unexpected trailing characters after the JSON value");
    return value;
  }

 private:
  [[noreturn]] void fail(const std::string& message) const {
    TORCH_CHECK(false, what_, ": malformed JSON header at byte ", pos_, ": ", message);
  }

  bool at_end() const { return pos_ >= text_.size(); }
  char peek() const { return at_end() ? '\0' : text_[pos_]; }

  void expect(char c) {
    if (at_end() || text_[pos_] != c) fail(std::string("expected '") + c + "'");
    ++pos_;
  }

  void skip_whitespace() {
    while (!at_end()) {
      const char c = text_[pos_];
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
      ++pos_;
    }
  }

  JsonValue parse_value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than 64 levels");
    if (at_end()) fail("unexpected end of input");
    const char c = peek();
    JsonValue v;
    switch (c) {
      case '{': v.kind = JsonValue::Kind::Object; parse_object(v, depth); break;
      case '[': v.kind = JsonValue::Kind::Array; parse_array(v, depth); break;
      case '"': v.kind = JsonValue::Kind::String; v.string = parse_string(); break;
      case 't': literal("true"); v.kind = JsonValue::Kind::Bool; v.boolean = true; break;
      case 'f': literal("false"); v.kind = JsonValue::Kind::Bool; v.boolean = false; break;
      case 'n': literal("null"); v.kind = JsonValue::Kind::Null; break;
      default:
        if (c == '-' || (c >= '0' && c <= '9')) {
          v.kind = JsonValue::Kind::Int;
          v.integer = parse_integer();
        } else {
          fail(std::string("unexpected character '") + c + "'");
        }
    }
    return v;
  }

  void literal(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) fail("invalid literal");
    pos_ += word.size();
  }

  void parse_object(JsonValue& v, int depth) {
    expect('{');
    skip_whitespace();
    if (peek() == '}') { ++pos_; return; }
    while (true) {
      skip_whitespace();
      if (peek() != '"') fail("expected a string key");
      std::string key = parse_string();
      if (v.find(key) != nullptr) fail("duplicate key \"" + key + "\"");
      skip_whitespace();
      expect(':');
      skip_whitespace();
      JsonValue value = parse_value(depth + 1);
      v.object.emplace_back(std::move(key), std::move(value));
      skip_whitespace();
      if (peek() == ',') { ++pos_; continue; }
      if (peek() == '}') { ++pos_; return; }
      fail("expected ',' or '}' in object");
    }
  }

  void parse_array(JsonValue& v, int depth) {
    expect('[');
    skip_whitespace();
    if (peek() == ']') { ++pos_; return; }
    while (true) {
      skip_whitespace();
      v.array.push_back(parse_value(depth + 1));
      skip_whitespace();
      if (peek() == ',') { ++pos_; continue; }
      if (peek() == ']') { ++pos_; return; }
      fail("expected ',' or ']' in array");
    }
  }

  int64_t parse_integer() {
    const bool negative = peek() == '-';
    if (negative) ++pos_;
    if (at_end() || text_[pos_] < '0' || text_[pos_] > '9') fail("expected a digit");
    if (text_[pos_] == '0' && pos_ + 1 < text_.size() && text_[pos_ + 1] >= '0' && text_[pos_ + 1] <= '9') {
      fail("leading zeros are not allowed");
    }
    // Accumulate as a negative number so INT64_MIN is representable.
    int64_t value = 0;
    while (!at_end() && text_[pos_] >= '0' && text_[pos_] <= '9') {
      const int digit = text_[pos_] - '0';
      if (value < (INT64_MIN + digit) / 10) fail("integer out of the 64-bit range");
      value = value * 10 - digit;
      ++pos_;
    }
    if (!at_end() && (text_[pos_] == '.' || text_[pos_] == 'e' || text_[pos_] == 'E')) {
      fail("only integers are allowed, found a fraction or exponent");
    }
    if (!negative) {
      if (value == INT64_MIN) fail("integer out of the 64-bit range");
      value = -value;
    }
    return value;
  }

  uint32_t parse_hex4() {
    if (pos_ + 4 > text_.size()) fail("truncated \\u escape");
    uint32_t code = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = text_[pos_++];
      code <<= 4;
      if (c >= '0' && c <= '9') code |= c - '0';
      else if (c >= 'a' && c <= 'f') code |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') code |= c - 'A' + 10;
      else fail("invalid hex digit in \\u escape");
    }
    return code;
  }

  static void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  std::string parse_string() {
    expect('"');
    std::string out;
    while (true) {
      if (at_end()) fail("unterminated string");
      const char c = text_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') { out.push_back(c); continue; }
      if (at_end()) fail("unterminated escape");
      const char e = text_[pos_++];
      switch (e) {
        case '"': out.push_back('"'); break;
        case '\\': out.push_back('\\'); break;
        case '/': out.push_back('/'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'u': {
          uint32_t cp = parse_hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (text_.substr(pos_, 2) != "\\u") fail("unpaired high surrogate in \\u escape");
            pos_ += 2;
            const uint32_t low = parse_hex4();
            if (low < 0xDC00 || low > 0xDFFF) fail("invalid low surrogate in \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("unpaired low surrogate in \\u escape");
          }
          append_utf8(out, cp);
          break;
        }
        default: fail(std::string("invalid escape '\\") + e + "'");
      }
    }
  }

  std::string_view text_;
  const std::string& what_;
  size_t pos_ = 0;
};

}  // namespace

JsonValue parse_json(std::string_view text, const std::string& what) {
  return Parser(text, what).parse_document();
}

}  // namespace torch_ext::paging
