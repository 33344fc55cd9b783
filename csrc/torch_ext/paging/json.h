#pragma once
// A small, strict JSON reader for safetensors headers: objects, arrays, strings (all escapes,
// \u surrogate pairs), integers, true/false/null. Floats, trailing commas, duplicate keys,
// nesting deeper than 64 and trailing garbage are rejected. Every read is bounds-checked;
// errors are c10::Error naming `what` (the file) and the byte offset. Stateless, thread-safe.
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace torch_ext::paging {

struct JsonValue {
  enum class Kind { Null, Bool, Int, String, Array, Object };
  Kind kind = Kind::Null;
  bool boolean = false;
  int64_t integer = 0;
  std::string string;
  std::vector<JsonValue> array;
  std::vector<std::pair<std::string, JsonValue>> object;  // in file order, keys unique

  const JsonValue* find(std::string_view key) const;
  static const char* kind_name(Kind kind);
};

// Parses `text` (surrounding whitespace allowed). `what` names the source in errors.
JsonValue parse_json(std::string_view text, const std::string& what);

}  // namespace torch_ext::paging
