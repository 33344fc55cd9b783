// torch.classes.torch_ext.SafetensorsSource / LayerPager / PagerStats: weight paging for
// TorchScript, Python and C++ programs that reach it through the dispatcher. Constructors take
// the options of SourceOptions / PagerOptions as keywords, with those structs' defaults.
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "torch_ext/class_fields.h"
#include "torch_ext/paging/layer_pager.h"
#include "torch_ext/paging/source.h"

namespace {

using torch_ext::paging::LayerPager;
using torch_ext::paging::PagerOptions;
using torch_ext::paging::PagerStats;
using torch_ext::paging::SafetensorsSource;
using torch_ext::paging::SourceOptions;
using Source = c10::intrusive_ptr<SafetensorsSource>;
using Pager = c10::intrusive_ptr<LayerPager>;

// A SafetensorsSource object, or the path of one to open.
Source as_source(const c10::IValue& source) {
  if (source.isString()) return c10::make_intrusive<SafetensorsSource>(source.toStringRef());
  TORCH_CHECK(source.isCustomClass() && *source.type() == *c10::getCustomClassType<Source>(),
              "LayerPager: source must be a torch_ext SafetensorsSource or the path of a .safetensors file, "
              "index or folder; got ", source.type()->str());
  return source.toCustomClass<SafetensorsSource>();
}

std::string source_repr(const Source& self) {
  std::ostringstream out;
  out << "SafetensorsSource('" << self->path() << "', " << self->names().size() << " tensors, "
      << self->total_bytes() << " bytes)";
  return out.str();
}

std::string pager_repr(const Pager& self) {
  std::ostringstream out;
  out << "LayerPager('" << self->source()->describe() << "', budget_bytes=" << self->options().budget_bytes
      << ", policy='" << torch_ext::enum_name(self->options().policy) << "', prefetch="
      << self->options().prefetch << ", device='" << self->options().device << "', resident_bytes="
      << self->resident_bytes() << ")";
  return out.str();
}

void register_source(torch::Library& m) {
  auto cls = m.class_<SafetensorsSource>("SafetensorsSource");
  torch_ext::def_options_init<SourceOptions, std::string>(
      cls, {"path"}, [](std::string path, SourceOptions options) {
        return c10::make_intrusive<SafetensorsSource>(path, options);
      },
      "Open a .safetensors file, a model.safetensors.index.json, or a folder holding either; validated "
      "completely when opened");
  torch_ext::def_option_properties<SourceOptions>(cls, [](const Source& self) { return self->options(); });
  cls.def("names", &SafetensorsSource::names, "Tensor names, in file order")
      .def("contains", &SafetensorsSource::contains)
      .def("__contains__", &SafetensorsSource::contains)
      .def("__len__", [](const Source& self) { return static_cast<int64_t>(self->names().size()); })
      .def(
          "meta",
          [](const Source& self, const std::string& name) {
            const auto& info = self->info(name);
            return at::empty(info.shape, at::TensorOptions().dtype(info.dtype).device(c10::kMeta));
          },
          "A meta tensor with the stored tensor's dtype and shape (no data)")
      .def("nbytes", [](const Source& self, const std::string& name) { return self->info(name).nbytes; })
      .def("view", &SafetensorsSource::view, "Zero-copy view of the mapped file (writes stay private to this process)")
      .def("has_view", &SafetensorsSource::has_view, "Whether view(name) is zero-copy (a composition has none)")
      .def(
          "composed",
          [](const Source& self, const c10::Dict<std::string, std::vector<std::string>>& programs) {
            std::map<std::string, std::vector<std::string>> by_name;
            for (const auto& item : programs) by_name.emplace(item.key(), item.value());
            return self->composed(by_name);
          },
          "This source also serving compositions {name: program}: tensors made from its tensors by layout ops "
          "and dequantization (source.h: the program ops); the tensors they read leave names()")
      .def(
          "load", [](const Source& self, const std::string& name) { return self->load(name, /*pin_memory=*/false); },
          "A copy in memory the caller owns")
      .def("files", &SafetensorsSource::files)
      .def("metadata",
           [](const Source& self) {
             c10::Dict<std::string, std::string> d;
             for (const auto& [k, v] : self->metadata()) d.insert(k, v);
             return d;
           })
      .def("total_bytes", &SafetensorsSource::total_bytes)
      .def("path", [](const Source& self) { return self->path(); })
      .def("__repr__", &source_repr);
}

void register_pager(torch::Library& m) {
  auto cls = m.class_<LayerPager>("LayerPager");
  torch_ext::def_options_init<PagerOptions, c10::IValue>(
      cls, {"source"}, [](const c10::IValue& source, PagerOptions options) {
        return c10::make_intrusive<LayerPager>(as_source(source), std::move(options));
      },
      "Keeps a SafetensorsSource's tensors resident within budget_bytes (source: the source or the path of one)");
  torch_ext::def_option_properties<PagerOptions>(cls, [](const Pager& self) { return self->options(); });
  cls.def("acquire", &LayerPager::acquire, "The tensor, loaded if needed; valid while the caller holds it")
      .def("acquire_many", &LayerPager::acquire_many, "acquire() of each id in turn, in one call")
      .def("gather_rows", &LayerPager::gather_rows,
           "Rows of a 2-D tensor (an embedding lookup) in the served dtype, without loading the tensor")
      .def("gathers_rows", &LayerPager::gathers_rows)
      .def("matmul", &LayerPager::matmul,
           "input @ weight.T + bias (transposed: input @ weight + bias, transformers' Conv1D), streamed from the "
           "file where the weight converts and has no room (equal to the whole weight's product in every bit)")
      .def("streams", &LayerPager::streams)
      .def("begin_pass", &LayerPager::begin_pass)
      .def("set_order", &LayerPager::set_order)
      .def("order", &LayerPager::order)
      .def("resident_bytes", &LayerPager::resident_bytes)
      .def("resident_count", &LayerPager::resident_count)
      .def("is_resident", &LayerPager::is_resident)
      .def("is_pinned", &LayerPager::is_pinned)
      .def("evict_all", &LayerPager::evict_all)
      .def("reset_stats", &LayerPager::reset_stats)
      .def("stats", [](const Pager& self) { return torch_ext::box(self->stats()); })
      .def(
          "source",
          [](const Pager& self) -> c10::IValue {
            auto source = c10::dynamic_intrusive_pointer_cast<SafetensorsSource>(self->source());
            return source ? c10::IValue(source) : c10::IValue();
          },
          "The SafetensorsSource it pages from (None for other C++ sources)")
      .def("__repr__", &pager_repr);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  torch_ext::register_stats<PagerStats>(m, "PagerStats");
  register_source(m);
  register_pager(m);
}
