// libFuzzer target: the safetensors JSON header parser on arbitrary bytes. Any input must parse
// or raise c10::Error; a crash, a sanitizer report, a leak or a hang is a bug.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include <c10/util/Exception.h>

#include "torch_ext/common/json.h"

namespace {

using torch_ext::JsonValue;

// Reads every value, so each accessor runs on every shape the parser accepts.
int64_t walk(const JsonValue& value) {
  int64_t sum = static_cast<int64_t>(value.kind()) + value.size();
  switch (value.kind()) {
    case JsonValue::Kind::Object:
      for (const auto& [key, member] : value.members()) sum += static_cast<int64_t>(key.size()) + walk(member);
      if (value.size() > 0) sum += value.find(value.members().back().first).has_value();
      break;
    case JsonValue::Kind::Array:
      for (const auto& element : value.elements()) sum += walk(element);
      break;
    case JsonValue::Kind::String: sum += static_cast<int64_t>(value.string().size()); break;
    case JsonValue::Kind::Int: sum += value.integer() & 1; break;
    case JsonValue::Kind::Bool: sum += value.boolean(); break;
    case JsonValue::Kind::Null: break;
  }
  return sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const auto doc = torch_ext::parse_json(text, "fuzz.json");
    volatile int64_t sink = walk(doc.root());
    (void)sink;
  } catch (const c10::Error&) {
  }
  try {
    torch_ext::check_utf8(text, "fuzz.txt");
  } catch (const c10::Error&) {
  }
  return 0;
}
