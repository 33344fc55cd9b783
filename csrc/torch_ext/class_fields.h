#pragma once
// Registration of field-described structs (fields.h) as torch.classes, shared by every
// capability's library.cpp (include it nowhere else: it pulls in torch's custom-class headers).
//
//   register_stats<T>(m, "PagerStats")           torch.classes.torch_ext.PagerStats: a typed
//       read-only property per field, __repr__, as_dict() and fields().
//   register_options<T>(m, "CheckpointOptions", doc)   the same, plus a keyword constructor with
//       T's defaults (each value parsed by its codec, then T::validate() where T has one).
//   def_options_init<Options, Prefix...>(cls, {"source"}, make, doc)
//       cls.__init__(source, <every option as a keyword with its default>) -> make(source, options).
//   def_option_properties<Options>(cls, get)    a read-only property per option on the owner.
//   options_schema<Options>() / options_from_stack<Options>(args)   the options as arguments of an
//       operator schema ("str storage=\"keep\", ...") and back from the boxed arguments.
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

namespace detail {

template <Described T>
void def_fields(torch::class_<Boxed<T>>& cls, const char* name) {
  for_each_field<T>([&](const auto& f) {
    using Member = std::remove_cvref_t<decltype(std::declval<T>().*(f.member))>;
    cls.def_property(
        f.name,
        [member = f.member](const c10::intrusive_ptr<Boxed<T>>& self) -> exposed_t<Member> {
          return FieldCodec<Member>::expose(self->value.*member);
        },
        std::string(f.doc));
  });
  for (const char* method : {"__repr__", "__str__"}) {
    cls.def(
        method, [name](const c10::intrusive_ptr<Boxed<T>>& self) { return repr(name, self->value); },
        "The fields and their values");
  }
  cls.def(
      "as_dict", [](const c10::intrusive_ptr<Boxed<T>>& self) { return c10::IValue(as_dict(self->value)); },
      "The fields as a dict (nested structs as dicts)");
  cls.def(
      "fields", [](const c10::intrusive_ptr<Boxed<T>>& /*self*/) { return field_names<T>(); },
      "The field names, in order");
}

}  // namespace detail

// Registers the stats struct T as torch.classes.<ns>.<name> (see the file comment).
template <Described T>
torch::class_<Boxed<T>> register_stats(torch::Library& m, const char* name) {
  auto cls = m.class_<Boxed<T>>(name);
  detail::def_fields(cls, name);
  return cls;
}

// Registers the options struct T as torch.classes.<ns>.<name>, with a keyword constructor (doc:
// its doc string, followed by each option's).
template <Described T>
torch::class_<Boxed<T>> register_options(torch::Library& m, const char* name, const std::string& doc) {
  auto cls = m.class_<Boxed<T>>(name);
  detail::def_options_init<T>(cls, detail::Types<>{}, std::array<const char*, 0>{},
                              [](T options) { return box(std::move(options)); }, doc, std::index_sequence<>{},
                              std::make_index_sequence<field_count<T>()>{});
  detail::def_fields(cls, name);
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

namespace detail {

// A default value as an operator schema writes it.
inline std::string schema_literal(const c10::IValue& v) {
  if (v.isBool()) return v.toBool() ? "True" : "False";
  if (v.isInt()) return std::to_string(v.toInt());
  if (v.isNone()) return "None";
  if (v.isString()) {
    std::string out = "\"";
    for (char c : v.toStringRef()) {
      if (c == '"' || c == '\\') out += '\\';
      out += c;
    }
    return out + "\"";
  }
  if (v.isDouble()) {
    std::ostringstream out;
    out.precision(17);
    out << v.toDouble();
    return out.str();
  }
  TORCH_CHECK(false, "options_schema: no schema literal for a default of type ", v.tagKind());
}

}  // namespace detail

// The options of Options as operator schema arguments, each with its default:
// `str storage="keep", bool preserve_rng_state=True`.
template <Described Options>
std::string options_schema() {
  const Options defaults{};
  std::ostringstream out;
  bool first = true;
  for_each_field<Options>([&](const auto& f) {
    using Member = std::remove_cvref_t<decltype(defaults.*(f.member))>;
    out << (first ? "" : ", ") << c10::getTypePtr<exposed_t<Member>>()->str() << " " << f.name << "="
        << detail::schema_literal(c10::IValue(FieldCodec<Member>::expose(defaults.*(f.member))));
    first = false;
  });
  return out.str();
}

// Options from the boxed arguments an options_schema() produced, starting at `args`.
template <Described Options>
Options options_from_stack(const c10::IValue* args) {
  Options options;
  std::size_t i = 0;
  for_each_field<Options>([&](const auto& f) {
    using Member = std::remove_cvref_t<decltype(options.*(f.member))>;
    options.*(f.member) = FieldCodec<Member>::parse(args[i++].template to<exposed_t<Member>>(), f.name);
  });
  if constexpr (Validated<Options>) options.validate();
  return options;
}

}  // namespace torch_ext
