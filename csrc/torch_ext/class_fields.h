#pragma once
// Registration of field-described structs (fields.h) as torch.classes, shared by every
// capability's library.cpp (include it nowhere else: it pulls in torch's custom-class headers).
//
//   register_struct<T>(m, "PagerStats", doc)      torch.classes.torch_ext.PagerStats: a typed
//       read-only property per field, __repr__, as_dict() and fields(); a T with validate() (an
//       Options struct) also gets a keyword constructor with T's defaults, validated.
//   def_options_init<Options, Prefix...>(cls, {"source"}, make, doc)
//       cls.__init__(source, <every option as a keyword with its default>) -> make(source, options).
//   def_option_properties<Options>(cls, get)    a read-only property per option on the owner.
//
// The same names therefore reach C++, TorchScript and Python, from one list per struct.
#include <array>
#include <cstddef>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <torch/custom_class.h>

#include "torch_ext/fields.h"

namespace torch_ext {

// A plain struct held by a torch.classes object.
template <class T>
struct Boxed : torch::CustomClassHolder {
  explicit Boxed(T v) : value(std::move(v)) {}
  T value;
};

template <class T>
c10::intrusive_ptr<Boxed<T>> box(T value) {
  return c10::make_intrusive<Boxed<T>>(std::move(value));
}

template <class T>
concept Described = requires { T::fields(); };

template <class T>
concept Validated = requires(const T& t) { t.validate(); };

template <class T>
concept DescribedList = requires { typename T::value_type; } && Described<typename T::value_type>;

template <class T>
using exposed_t = typename FieldCodec<std::remove_cvref_t<T>>::Exposed;

// Field structs nested in a field (a list of per-size stats) are exposed as their torch.classes.
template <Described T>
struct FieldCodec<std::vector<T>> {
  using Exposed = std::vector<c10::intrusive_ptr<Boxed<T>>>;
  static Exposed expose(const std::vector<T>& values) {
    Exposed out;
    out.reserve(values.size());
    for (const auto& v : values) out.push_back(box(v));
    return out;
  }
};

namespace detail {

template <class T>
c10::IValue plain(const T& value);

template <Described T>
c10::impl::GenericDict as_dict(const T& s) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  for_each_field<T>([&](const auto& f) { d.insert(f.name, plain(s.*(f.member))); });
  return d;
}

// A field's value as TorchScript sees it, with nested field structs as dicts (for as_dict()).
template <class T>
c10::IValue plain(const T& value) {
  if constexpr (Described<T>) {
    return as_dict(value);
  } else if constexpr (DescribedList<T>) {
    c10::impl::GenericList list(c10::DictType::create(c10::StringType::get(), c10::AnyType::get()));
    for (const auto& v : value) list.push_back(as_dict(v));
    return list;
  } else {
    return c10::IValue(FieldCodec<T>::expose(value));
  }
}

inline void print(std::ostream& out, const c10::IValue& v) {
  if (v.isBool()) {
    out << (v.toBool() ? "True" : "False");
  } else if (v.isString()) {
    out << "'" << v.toStringRef() << "'";
  } else if (v.isNone()) {
    out << "None";
  } else if (v.isDevice()) {
    out << "'" << v.toDevice() << "'";
  } else if (v.isList()) {
    out << "[";
    bool first = true;
    for (const auto& e : v.toListRef()) {
      out << (first ? "" : ", ");
      print(out, e);
      first = false;
    }
    out << "]";
  } else if (v.isGenericDict()) {
    out << "{";
    bool first = true;
    for (const auto& e : v.toGenericDict()) {
      out << (first ? "" : ", ") << e.key().toStringRef() << "=";
      print(out, e.value());
      first = false;
    }
    out << "}";
  } else {
    out << v;
  }
}

template <Described T>
std::string repr(const char* name, const T& s) {
  std::ostringstream out;
  out << name << "(";
  bool first = true;
  for_each_field<T>([&](const auto& f) {
    out << (first ? "" : ", ") << f.name << "=";
    print(out, plain(s.*(f.member)));
    first = false;
  });
  out << ")";
  return out.str();
}

template <Described T>
std::vector<std::string> field_names() {
  std::vector<std::string> names;
  for_each_field<T>([&](const auto& f) { names.emplace_back(f.name); });
  return names;
}

template <class Options, class... Prefix, class Make, std::size_t... I>
auto options_init(Make make, std::index_sequence<I...>) {
  static constexpr auto fields = Options::fields();
  return [make = std::move(make)](Prefix... prefix,
                                  exposed_t<decltype(Options{}.*(std::get<I>(fields).member))>... values) {
    Options options;
    ((options.*(std::get<I>(fields).member) =
          FieldCodec<std::remove_cvref_t<decltype(options.*(std::get<I>(fields).member))>>::parse(
              std::move(values), std::get<I>(fields).name)),
     ...);
    if constexpr (Validated<Options>) options.validate();
    return make(std::move(prefix)..., std::move(options));
  };
}

template <class Options>
std::string options_doc(const std::string& doc) {
  std::ostringstream out;
  out << doc << "\nOptions (keyword arguments):";
  for_each_field<Options>([&](const auto& f) { out << "\n  " << f.name << ": " << f.doc; });
  return out.str();
}

template <class... T>
struct Types {};

template <class Options, class... Prefix, class Class, class Make, std::size_t N, std::size_t... P, std::size_t... I>
void def_options_init(torch::class_<Class>& cls, Types<Prefix...>, const std::array<const char*, N>& prefix_names,
                      Make make, const std::string& doc, std::index_sequence<P...>, std::index_sequence<I...> indices) {
  static constexpr auto fields = Options::fields();
  const Options defaults{};
  // The positional arguments first (no default), then one keyword per option with its default.
  cls.def(torch::init(options_init<Options, Prefix...>(std::move(make), indices)), options_doc<Options>(doc),
          {torch::arg(prefix_names[P])...,
           (torch::arg(std::get<I>(fields).name) = c10::IValue(FieldCodec<std::remove_cvref_t<decltype(
                defaults.*(std::get<I>(fields).member))>>::expose(defaults.*(std::get<I>(fields).member))))...});
}

}  // namespace detail

// Registers T as torch.classes.<ns>.<name> (see the file comment).
template <Described T>
torch::class_<Boxed<T>> register_struct(torch::Library& m, const char* name, const std::string& doc) {
  auto cls = m.class_<Boxed<T>>(name);
  if constexpr (Validated<T>) {
    detail::def_options_init<T>(cls, detail::Types<>{}, std::array<const char*, 0>{},
                                [](T options) { return box(std::move(options)); }, doc, std::index_sequence<>{},
                                std::make_index_sequence<field_count<T>()>{});
  }
  for_each_field<T>([&](const auto& f) {
    using Member = std::remove_cvref_t<decltype(std::declval<T>().*(f.member))>;
    cls.def_property(
        f.name,
        [member = f.member](const c10::intrusive_ptr<Boxed<T>>& self) -> exposed_t<Member> {
          return FieldCodec<Member>::expose(self->value.*member);
        },
        std::string(f.doc));
  });
  cls.def(
      "__repr__", [name](const c10::intrusive_ptr<Boxed<T>>& self) { return detail::repr(name, self->value); },
      "The fields and their values");
  cls.def(
      "as_dict", [](const c10::intrusive_ptr<Boxed<T>>& self) { return c10::IValue(detail::as_dict(self->value)); },
      "The fields as a dict (nested structs as dicts)");
  cls.def(
      "fields", [](const c10::intrusive_ptr<Boxed<T>>& /*self*/) { return detail::field_names<T>(); },
      "The field names, in order");
  return cls;
}

// cls.__init__(<prefix arguments>, <each option of Options as a keyword with its default>), which
// builds the options (each parsed by its codec, then Options::validate()) and returns
// make(prefix..., options).
template <class Options, class... Prefix, class Class, class Make>
void def_options_init(torch::class_<Class>& cls, const std::array<const char*, sizeof...(Prefix)>& prefix_names,
                      Make make, const std::string& doc) {
  detail::def_options_init<Options>(cls, detail::Types<Prefix...>{}, prefix_names, std::move(make), doc,
                                    std::index_sequence_for<Prefix...>{},
                                    std::make_index_sequence<field_count<Options>()>{});
}

// A read-only property on the owner class for each option, read through get(self).
template <class Options, class Class, class Get>
void def_option_properties(torch::class_<Class>& cls, Get get) {
  for_each_field<Options>([&](const auto& f) {
    using Member = std::remove_cvref_t<decltype(std::declval<Options>().*(f.member))>;
    cls.def_property(
        f.name,
        [get, member = f.member](const c10::intrusive_ptr<Class>& self) -> exposed_t<Member> {
          return FieldCodec<Member>::expose(get(self).*member);
        },
        std::string(f.doc));
  });
}

}  // namespace torch_ext
