#pragma once
// Named fields of the plain structs that cross into TorchScript and Python: each capability's
// Options (what a user may set, with its default in the member initializer) and Stats (what it
// reports). A struct lists its fields once, in a static fields() function, and everything else
// (keyword constructors, properties, reprs, dicts) is generated from that list, so a name or a
// default is never written twice. Header-only and free of torch's registration headers: the
// generators live in class_fields.h, which only library.cpp files include.
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

namespace torch_ext {

template <class Struct, class T>
struct Field {
  const char* name;
  T Struct::*member;
  const char* doc;
};

template <class Struct, class T>
constexpr Field<Struct, T> field(const char* name, T Struct::*member, const char* doc) {
  return {name, member, doc};
}

// How a field's C++ type crosses into TorchScript and Python: as `Exposed`, converted by expose()
// and parse(). parse() validates and throws naming the field; an enum is exposed as its name, from
// its EnumNames table (common/enum_names.h).
template <class T>
struct FieldCodec {
  using Exposed = T;
  static const T& expose(const T& value) { return value; }
  static T parse(T value, const char* /*name*/) { return value; }
};

// Calls f(field) for each field of Struct, in declaration order.
template <class Struct, class F>
constexpr void for_each_field(F&& f) {
  std::apply([&](const auto&... fields) { (f(fields), ...); }, Struct::fields());
}

template <class Struct>
constexpr std::size_t field_count() {
  return std::tuple_size_v<decltype(Struct::fields())>;
}

}  // namespace torch_ext
