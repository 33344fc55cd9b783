#pragma once
// Enum options that cross to Python and TorchScript as names: the one table per enum, and the
// one parse and name functions and FieldCodec (class_fields.h) that every such enum uses.
//
// A capability declares its enum's names once, beside the enum:
//   template <> struct EnumNames<paging::EvictionPolicy> {
//     static constexpr std::string_view owner = "LayerPager", what = "policy";
//     static constexpr std::array<std::pair<paging::EvictionPolicy, std::string_view>, 3> names{{...}};
//   };
// Pure functions of constant tables: thread-safe.
#include <array>
#include <string>
#include <string_view>
#include <utility>

#include <c10/util/Exception.h>

#include "torch_ext/fields.h"

namespace torch_ext {

template <class E>
struct EnumNames;  // specialised per enum: owner, what, names

template <class E>
std::string_view enum_name(E value) {
  for (const auto& [v, name] : EnumNames<E>::names) {
    if (v == value) return name;
  }
  TORCH_CHECK(false, EnumNames<E>::owner, ": ", EnumNames<E>::what, " has no name for value ", static_cast<int>(value));
}

// The value named `name`; anything else is a ValueError: "<owner>: unknown <what> 'x'; expected 'a', 'b' or 'c'".
template <class E>
E enum_from_name(std::string_view name) {
  std::string expected;
  const auto& names = EnumNames<E>::names;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i].second == name) return names[i].first;
    expected.append(i == 0 ? "" : i + 1 == names.size() ? " or " : ", ").append("'").append(names[i].second).append("'");
  }
  TORCH_CHECK_VALUE(false, EnumNames<E>::owner, ": unknown ", EnumNames<E>::what, " '", std::string(name),
                    "'; expected ", expected);
}

template <class E>
  requires requires { EnumNames<E>::names; }
struct FieldCodec<E> {
  using Exposed = std::string;
  static std::string expose(E value) { return std::string(enum_name(value)); }
  static E parse(const std::string& name, const char* /*field*/) { return enum_from_name<E>(name); }
};

}  // namespace torch_ext
