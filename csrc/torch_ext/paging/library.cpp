// torch.classes.torch_ext.SafetensorsSource / LayerPager: weight paging for TorchScript and Python.
#include <c10/core/Device.h>
#include <torch/custom_class.h>

#include "torch_ext/paging/layer_pager.h"
#include "torch_ext/paging/source.h"

namespace {

using torch_ext::paging::LayerPager;
using torch_ext::paging::PagerOptions;
using torch_ext::paging::SafetensorsSource;

c10::Device parse_device(const std::string& device, const std::string& what) {
  try {
    return c10::Device(device);
  } catch (const c10::Error&) {
    TORCH_CHECK(false, what, ": invalid device \"", device, "\"");
  }
}

c10::Dict<std::string, double> stats_dict(const LayerPager& pager) {
  const auto s = pager.stats();
  c10::Dict<std::string, double> d;
  d.insert("hits", static_cast<double>(s.hits));
  d.insert("misses", static_cast<double>(s.misses));
  d.insert("evictions", static_cast<double>(s.evictions));
  d.insert("bytes_loaded", static_cast<double>(s.bytes_loaded));
  d.insert("load_seconds", s.load_seconds);
  d.insert("stall_seconds", s.stall_seconds);
  d.insert("prefetches", static_cast<double>(s.prefetches));
  d.insert("prefetch_hits", static_cast<double>(s.prefetch_hits));
  d.insert("over_budget_loads", static_cast<double>(s.over_budget_loads));
  d.insert("pinned_over_budget", s.pinned_over_budget ? 1.0 : 0.0);
  return d;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  m.class_<SafetensorsSource>("SafetensorsSource")
      .def(torch::init([](const std::string& path, bool direct_io) {
             return c10::make_intrusive<SafetensorsSource>(path, direct_io);
           }),
           "Open a .safetensors file, a model.safetensors.index.json, or a folder holding either",
           {torch::arg("path"), torch::arg("direct_io") = false})
      .def("names", &SafetensorsSource::names)
      .def("contains", &SafetensorsSource::contains)
      .def("dtype", [](const c10::intrusive_ptr<SafetensorsSource>& self, const std::string& name) {
        return torch_ext::paging::safetensors_dtype_name(self->info(name).dtype);
      })
      .def("shape", [](const c10::intrusive_ptr<SafetensorsSource>& self, const std::string& name) {
        return self->info(name).shape;
      })
      .def("nbytes", [](const c10::intrusive_ptr<SafetensorsSource>& self, const std::string& name) {
        return self->info(name).nbytes;
      })
      .def("view", &SafetensorsSource::view)
      .def("load", [](const c10::intrusive_ptr<SafetensorsSource>& self, const std::string& name) {
        return self->load(name, /*pin_memory=*/false);
      })
      .def("files", &SafetensorsSource::files)
      .def("metadata", [](const c10::intrusive_ptr<SafetensorsSource>& self) {
        c10::Dict<std::string, std::string> d;
        for (const auto& [k, v] : self->metadata()) d.insert(k, v);
        return d;
      })
      .def("total_bytes", &SafetensorsSource::total_bytes)
      .def("direct_io", &SafetensorsSource::direct_io)
      .def("path", [](const c10::intrusive_ptr<SafetensorsSource>& self) { return self->path(); });

  m.class_<LayerPager>("LayerPager")
      .def(torch::init([](c10::intrusive_ptr<SafetensorsSource> source, int64_t budget_bytes,
                          std::vector<std::string> pinned, const std::string& policy, int64_t prefetch,
                          const std::string& device, bool zero_copy) {
             TORCH_CHECK(source, "LayerPager: source is None");
             PagerOptions options;
             options.budget_bytes = budget_bytes;
             options.pinned = std::move(pinned);
             options.policy = torch_ext::paging::parse_policy(policy);
             options.prefetch = prefetch;
             options.device = parse_device(device, "LayerPager(" + source->describe() + ")");
             options.zero_copy = zero_copy;
             return c10::make_intrusive<LayerPager>(std::move(source), std::move(options));
           }),
           "A byte-budgeted pager over a SafetensorsSource",
           {torch::arg("source"), torch::arg("budget_bytes"), torch::arg("pinned") = c10::List<std::string>(),
            torch::arg("policy") = std::string("lru"), torch::arg("prefetch") = 0,
            torch::arg("device") = std::string("cpu"), torch::arg("zero_copy") = false})
      .def("acquire", &LayerPager::acquire)
      .def("acquire_many", &LayerPager::acquire_many)
      .def("begin_pass", &LayerPager::begin_pass)
      .def("set_order", &LayerPager::set_order)
      .def("order", &LayerPager::order)
      .def("resident_bytes", &LayerPager::resident_bytes)
      .def("resident_count", &LayerPager::resident_count)
      .def("budget_bytes", &LayerPager::budget_bytes)
      .def("is_resident", &LayerPager::is_resident)
      .def("is_pinned", &LayerPager::is_pinned)
      .def("evict_all", &LayerPager::evict_all)
      .def("reset_stats", &LayerPager::reset_stats)
      .def("stats", [](const c10::intrusive_ptr<LayerPager>& self) { return stats_dict(*self); })
      .def("policy", [](const c10::intrusive_ptr<LayerPager>& self) {
        return torch_ext::paging::policy_name(self->options().policy);
      })
      .def("prefetch", [](const c10::intrusive_ptr<LayerPager>& self) { return self->options().prefetch; })
      .def("device", [](const c10::intrusive_ptr<LayerPager>& self) { return self->options().device.str(); })
      .def("zero_copy", [](const c10::intrusive_ptr<LayerPager>& self) { return self->options().zero_copy; });
}
