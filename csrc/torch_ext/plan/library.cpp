// torch.classes.torch_ext.PlanCache / PlanCacheStats / SizeStats: the plan cache for TorchScript
// code, Python and C++ servers. The constructor takes PlanCacheOptions' options as keywords.
#include <string>
#include <vector>

#include <torch/custom_class.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/library.h>

#include "torch_ext/class_fields.h"
#include "torch_ext/plan/plan_cache.h"

namespace {

using torch_ext::plan::PlanCache;
using torch_ext::plan::PlanCacheOptions;
using torch_ext::plan::PlanCacheStats;
using torch_ext::plan::SizeStats;

// Inputs arrive as one tensor, a tuple or a list; the cache takes the positional arguments.
std::vector<c10::IValue> as_inputs(const c10::IValue& inputs) {
  if (inputs.isTuple()) return inputs.toTupleRef().elements().vec();
  if (inputs.isList()) return inputs.toList().vec();
  TORCH_CHECK(inputs.isTensor(), "PlanCache: inputs must be a tensor, a tuple or a list of the module's arguments; got ",
              inputs.tagKind());
  return {inputs};
}

torch::jit::Module as_module(const c10::IValue& module) {
  if (module.isString()) {
    const std::string path(module.toStringRef());
    try {
      return torch::jit::load(path);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "PlanCache: cannot load a scripted module from '", path, "': ", e.what_without_backtrace());
    }
  }
  TORCH_CHECK(module.isObject() && module.toObjectRef().type()->is_module(),
              "PlanCache: expected a scripted module or the path of a saved one; got ", module.tagKind());
  return torch::jit::Module(module.toObject());
}

struct ScriptPlanCache : torch::CustomClassHolder {
  explicit ScriptPlanCache(torch::jit::Module module, PlanCacheOptions options)
      : cache(std::move(module), std::move(options)) {}
  PlanCache cache;
};

using Self = c10::intrusive_ptr<ScriptPlanCache>;

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  torch_ext::register_stats<SizeStats>(m, "SizeStats");
  torch_ext::register_stats<PlanCacheStats>(m, "PlanCacheStats");
  auto cls = m.class_<ScriptPlanCache>("PlanCache");
  torch_ext::def_options_init<PlanCacheOptions, c10::IValue>(
      cls, {"module"}, [](const c10::IValue& module, PlanCacheOptions options) {
        return c10::make_intrusive<ScriptPlanCache>(as_module(module), std::move(options));
      },
      "Per-batch-size plans of a scripted module (module: the module or the path of a saved one)");
  torch_ext::def_option_properties<PlanCacheOptions>(cls, [](const Self& self) { return self->cache.options(); });
  cls.def("infer", [](const Self& self, c10::IValue inputs) { return self->cache.infer(as_inputs(inputs)); })
      // Typed fast path for tensor-only inputs: an Any argument makes Python infer the type of
      // a tuple or list on every call (~20 us), a Tensor[] does not.
      .def("infer_tensors",
           [](const Self& self, std::vector<at::Tensor> inputs) {
             return self->cache.infer(std::vector<c10::IValue>(inputs.begin(), inputs.end()));
           })
      .def("infer_batch", [](const Self& self, c10::IValue inputs) { return self->cache.infer_batch(as_inputs(inputs)); })
      .def("preload",
           [](const Self& self, std::vector<int64_t> sizes, c10::IValue example_inputs) {
             self->cache.preload(sizes, example_inputs.isNone() ? std::vector<c10::IValue>{} : as_inputs(example_inputs));
           })
      .def("select_batch_size", [](const Self& self, int64_t max_count) { return self->cache.select_batch_size(max_count); })
      .def("cached_sizes", [](const Self& self) { return self->cache.cached_sizes(); })
      .def("contains", [](const Self& self, int64_t n) { return self->cache.contains(n); })
      .def("__contains__", [](const Self& self, int64_t n) { return self->cache.contains(n); })
      .def("plan_module",
           [](const Self& self, int64_t n) -> c10::IValue {
             auto module = self->cache.plan_module(n);
             return module ? c10::IValue(module->_ivalue()) : c10::IValue();
           })
      .def("stats", [](const Self& self) { return torch_ext::box(self->cache.stats()); })
      .def("reset_stats", [](const Self& self) { self->cache.reset_stats(); })
      .def("clear", [](const Self& self) { self->cache.clear(); })
      .def("wait_for_builds", [](const Self& self) { self->cache.wait_for_builds(); })
      .def("save", [](const Self& self, std::string dir) { self->cache.save(dir); })
      .def("load", [](const Self& self, std::string dir) { return self->cache.load(dir); });
}
