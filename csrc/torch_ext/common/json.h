#pragma once
// A small, strict JSON reader (safetensors headers and index files): objects, arrays, strings
// (all escapes, \u surrogate pairs; raw bytes must be valid, shortest-form UTF-8), integers,
// true/false/null. Floats, trailing commas, duplicate keys (found with a hash set: linear time),
// objects of more than kMaxJsonMembers members, nesting deeper than 64 and trailing garbage are
// rejected. Every read is bounds-checked; errors are c10::Error naming `what` (the file) and the
// byte offset. A parsed document is flat (16 bytes per value plus the decoded strings), so its
// memory is proportional to the text. Stateless functions; a JsonDocument is immutable and thread-safe.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace torch_ext {

constexpr int64_t kMaxJsonMembers = int64_t{1} << 24;
constexpr int kMaxJsonDepth = 64;

class JsonDocument;

// A value inside a JsonDocument (a cheap handle; valid while the document lives).
class JsonValue {
 public:
  enum class Kind : uint8_t { Null, Bool, Int, String, Array, Object };

  Kind kind() const;
  bool boolean() const;
  int64_t integer() const;
  std::string_view string() const;  // decoded, UTF-8 (may hold NUL from a \u0000 escape)
  // Arrays: their elements; objects: their members (key, value), in file order.
  std::vector<JsonValue> elements() const;
  std::vector<std::pair<std::string_view, JsonValue>> members() const;
  int64_t size() const;  // elements or members; 0 for scalars
  std::optional<JsonValue> find(std::string_view key) const;  // objects only
  static const char* kind_name(Kind kind);

 private:
  friend class JsonDocument;
  friend class JsonParser;
  JsonValue(const JsonDocument* doc, uint32_t index) : doc_(doc), index_(index) {}
  const JsonDocument* doc_;
  uint32_t index_;
};

class JsonDocument {
 public:
  // 16 bytes: Int and Bool keep their value in `payload`; strings their offset in strings_ (low
  // 32 bits) and length (high 32); containers their first child (low; 0: none) and count (high).
  struct Node {
    JsonValue::Kind kind = JsonValue::Kind::Null;
    uint32_t next = 0;  // the next sibling (object: key -> value -> next key); 0: none
    int64_t payload = 0;
    uint32_t low() const { return static_cast<uint32_t>(static_cast<uint64_t>(payload)); }
    uint32_t high() const { return static_cast<uint32_t>(static_cast<uint64_t>(payload) >> 32); }
    void set(uint32_t low, uint32_t high) {
      payload = static_cast<int64_t>((static_cast<uint64_t>(high) << 32) | low);
    }
  };
  JsonValue root() const { return JsonValue(this, 0); }

 private:
  friend class JsonValue;
  friend class JsonParser;
  std::vector<Node> nodes_;
  std::string strings_;
};

// Parses `text` (surrounding whitespace allowed). `what` names the source in errors.
JsonDocument parse_json(std::string_view text, const std::string& what);

// Throws naming `what` unless `text` is valid, shortest-form UTF-8 (no surrogates, <= U+10FFFF).
void check_utf8(std::string_view text, const std::string& what);

}  // namespace torch_ext
