#include "torch_ext/common/json.h"

#include <algorithm>
#include <unordered_set>

#include <c10/util/Exception.h>

namespace torch_ext {

namespace {

// Length of the UTF-8 sequence starting at text[pos] (1-4), or 0 when it is invalid: a stray
// continuation byte, a truncated sequence, an overlong form, a surrogate or a code point above
// U+10FFFF (the Unicode standard's table 3-7 of well-formed byte sequences).
size_t utf8_sequence(std::string_view text, size_t pos) {
  const auto byte = [&](size_t i) { return pos + i < text.size() ? static_cast<unsigned char>(text[pos + i]) : 0; };
  const unsigned char b0 = byte(0);
  if (b0 < 0x80) return 1;
  const auto cont = [&](size_t i, unsigned char lo = 0x80, unsigned char hi = 0xBF) {
    return byte(i) >= lo && byte(i) <= hi;
  };
  if (b0 >= 0xC2 && b0 <= 0xDF) return cont(1) ? 2 : 0;
  if (b0 == 0xE0) return cont(1, 0xA0) && cont(2) ? 3 : 0;
  if ((b0 >= 0xE1 && b0 <= 0xEC) || b0 == 0xEE || b0 == 0xEF) return cont(1) && cont(2) ? 3 : 0;
  if (b0 == 0xED) return cont(1, 0x80, 0x9F) && cont(2) ? 3 : 0;
  if (b0 == 0xF0) return cont(1, 0x90) && cont(2) && cont(3) ? 4 : 0;
  if (b0 >= 0xF1 && b0 <= 0xF3) return cont(1) && cont(2) && cont(3) ? 4 : 0;
  if (b0 == 0xF4) return cont(1, 0x80, 0x8F) && cont(2) && cont(3) ? 4 : 0;
  return 0;
}

}  // namespace

void check_utf8(std::string_view text, const std::string& what) {
  for (size_t pos = 0; pos < text.size();) {
    const size_t n = utf8_sequence(text, pos);
    TORCH_CHECK(n != 0, what, ": invalid UTF-8 at byte ", pos);
    pos += n;
  }
}

JsonValue::Kind JsonValue::kind() const { return doc_->nodes_[index_].kind; }
bool JsonValue::boolean() const { return doc_->nodes_[index_].payload != 0; }
int64_t JsonValue::integer() const { return doc_->nodes_[index_].payload; }

std::string_view JsonValue::string() const {
  const auto& node = doc_->nodes_[index_];
  if (node.kind != Kind::String) return {};
  return std::string_view(doc_->strings_).substr(node.low(), node.high());
}

int64_t JsonValue::size() const {
  const auto& node = doc_->nodes_[index_];
  return node.kind == Kind::Array || node.kind == Kind::Object ? node.high() : 0;
}

std::vector<JsonValue> JsonValue::elements() const {
  std::vector<JsonValue> out;
  const auto& node = doc_->nodes_[index_];
  if (node.kind != Kind::Array) return out;
  out.reserve(node.high());
  for (uint32_t i = node.low(); i != 0; i = doc_->nodes_[i].next) out.push_back(JsonValue(doc_, i));
  return out;
}

std::vector<std::pair<std::string_view, JsonValue>> JsonValue::members() const {
  std::vector<std::pair<std::string_view, JsonValue>> out;
  const auto& node = doc_->nodes_[index_];
  if (node.kind != Kind::Object) return out;
  out.reserve(node.high());
  for (uint32_t key = node.low(); key != 0; key = doc_->nodes_[doc_->nodes_[key].next].next) {
    out.emplace_back(JsonValue(doc_, key).string(), JsonValue(doc_, doc_->nodes_[key].next));
  }
  return out;
}

std::optional<JsonValue> JsonValue::find(std::string_view key) const {
  const auto& node = doc_->nodes_[index_];
  if (node.kind != Kind::Object) return std::nullopt;
  for (uint32_t k = node.low(); k != 0; k = doc_->nodes_[doc_->nodes_[k].next].next) {
    if (JsonValue(doc_, k).string() == key) return JsonValue(doc_, doc_->nodes_[k].next);
  }
  return std::nullopt;
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

class JsonParser {
 public:
  JsonParser(std::string_view text, const std::string& what) : text_(text), what_(what) {}

  JsonDocument parse_document() {
    // Every value takes at least one byte and all but the last a separator too, so this bounds
    // the nodes; decoded strings are never longer than their text. Reserving (untouched) memory
    // keeps the arena's string_views valid and costs no copies.
    doc_.nodes_.reserve(text_.size() / 2 + 2);
    doc_.strings_.reserve(text_.size());
    skip_whitespace();
    parse_value(0);
    skip_whitespace();
    if (pos_ != text_.size()) fail("unexpected trailing characters after the JSON value");
    return std::move(doc_);
  }

 private:
  using Kind = JsonValue::Kind;
  using Node = JsonDocument::Node;

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

  uint32_t add(Node node) {
    if (doc_.nodes_.size() >= UINT32_MAX) fail("too many values");
    doc_.nodes_.push_back(node);
    return static_cast<uint32_t>(doc_.nodes_.size() - 1);
  }

  // Appends the value at pos_ and returns its node's index.
  uint32_t parse_value(int depth) {
    if (depth > kMaxJsonDepth) fail("nesting deeper than 64 levels");
    if (at_end()) fail("unexpected end of input");
    const char c = peek();
    Node node;
    switch (c) {
      case '{': return parse_object(depth);
      case '[': return parse_array(depth);
      case '"': return parse_string();
      case 't': literal("true"); node.kind = Kind::Bool; node.payload = 1; break;
      case 'f': literal("false"); node.kind = Kind::Bool; break;
      case 'n': literal("null"); break;
      default:
        if (c != '-' && (c < '0' || c > '9')) fail(std::string("unexpected character '") + c + "'");
        node.kind = Kind::Int;
        node.payload = parse_integer();
    }
    return add(node);
  }

  void literal(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) fail("invalid literal");
    pos_ += word.size();
  }

  // Links child after *last (or as the container's first child) and counts it.
  void link(uint32_t container, uint32_t& last, uint32_t child) {
    if (last == 0) {
      doc_.nodes_[container].set(child, 0);
    } else {
      doc_.nodes_[last].next = child;
    }
    last = child;
  }

  uint32_t parse_object(int depth) {
    expect('{');
    const uint32_t self = add(Node{Kind::Object});
    uint32_t last = 0;
    uint32_t count = 0;
    // Keys seen: a linear scan while the object is small, then a hash set (linear time overall).
    constexpr uint32_t kLinear = 8;
    std::vector<std::string_view> small;
    std::unordered_set<std::string_view> seen;
    skip_whitespace();
    if (peek() == '}') { ++pos_; return self; }
    while (true) {
      skip_whitespace();
      if (peek() != '"') fail("expected a string key");
      const size_t key_pos = pos_;
      const uint32_t key = parse_string();
      const std::string_view name = JsonValue(&doc_, key).string();
      if (count + 1 > kMaxJsonMembers) fail("object with more than " + std::to_string(kMaxJsonMembers) + " members");
      bool duplicate;
      if (count < kLinear) {
        duplicate = std::find(small.begin(), small.end(), name) != small.end();
        small.push_back(name);
        if (count + 1 == kLinear) seen.insert(small.begin(), small.end());
      } else {
        duplicate = !seen.insert(name).second;
      }
      if (duplicate) {
        pos_ = key_pos;
        fail("duplicate key \"" + std::string(name) + "\"");
      }
      link(self, last, key);
      skip_whitespace();
      expect(':');
      skip_whitespace();
      const uint32_t value = parse_value(depth + 1);
      doc_.nodes_[key].next = value;
      last = value;
      ++count;
      doc_.nodes_[self].set(doc_.nodes_[self].low(), count);
      skip_whitespace();
      if (peek() == ',') { ++pos_; continue; }
      if (peek() == '}') { ++pos_; return self; }
      fail("expected ',' or '}' in object");
    }
  }

  uint32_t parse_array(int depth) {
    expect('[');
    const uint32_t self = add(Node{Kind::Array});
    uint32_t last = 0;
    uint32_t count = 0;
    skip_whitespace();
    if (peek() == ']') { ++pos_; return self; }
    while (true) {
      skip_whitespace();
      link(self, last, parse_value(depth + 1));
      ++count;
      doc_.nodes_[self].set(doc_.nodes_[self].low(), count);
      skip_whitespace();
      if (peek() == ',') { ++pos_; continue; }
      if (peek() == ']') { ++pos_; return self; }
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

  void append_utf8(uint32_t cp) {
    std::string& out = doc_.strings_;
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

  void parse_escape() {
    if (at_end()) fail("unterminated escape");
    const char e = text_[pos_++];
    std::string& out = doc_.strings_;
    switch (e) {
      case '"': out.push_back('"'); return;
      case '\\': out.push_back('\\'); return;
      case '/': out.push_back('/'); return;
      case 'b': out.push_back('\b'); return;
      case 'f': out.push_back('\f'); return;
      case 'n': out.push_back('\n'); return;
      case 'r': out.push_back('\r'); return;
      case 't': out.push_back('\t'); return;
      case 'u': break;
      default: fail(std::string("invalid escape '\\") + e + "'");
    }
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
    append_utf8(cp);
  }

  // Decodes the string at pos_ into the arena and appends its node.
  uint32_t parse_string() {
    expect('"');
    const size_t begin = doc_.strings_.size();
    while (true) {
      // Copy the run of plain bytes up to the next quote, backslash, control or non-ASCII byte.
      size_t run = pos_;
      while (run < text_.size()) {
        const auto c = static_cast<unsigned char>(text_[run]);
        if (c == '"' || c == '\\' || c < 0x20 || c >= 0x80) break;
        ++run;
      }
      doc_.strings_.append(text_.data() + pos_, run - pos_);
      pos_ = run;
      if (at_end()) fail("unterminated string");
      const auto c = static_cast<unsigned char>(text_[pos_]);
      if (c == '"') {
        ++pos_;
        break;
      }
      if (c < 0x20) fail("control character in string");
      if (c == '\\') {
        ++pos_;
        parse_escape();
        continue;
      }
      const size_t n = utf8_sequence(text_, pos_);
      if (n == 0) fail("invalid UTF-8 in string");
      doc_.strings_.append(text_.data() + pos_, n);
      pos_ += n;
    }
    Node node{Kind::String};
    node.set(static_cast<uint32_t>(begin), static_cast<uint32_t>(doc_.strings_.size() - begin));
    return add(node);
  }

  std::string_view text_;
  const std::string& what_;
  size_t pos_ = 0;
  JsonDocument doc_;
};

JsonDocument parse_json(std::string_view text, const std::string& what) {
  TORCH_CHECK(text.size() < UINT32_MAX, what, ": JSON text of ", text.size(), " bytes is too large");
  return JsonParser(text, what).parse_document();
}

}  // namespace torch_ext
