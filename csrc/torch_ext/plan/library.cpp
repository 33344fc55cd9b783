// torch.classes.torch_ext.PlanCache: the plan cache for TorchScript code and C++ servers.
#include <torch/custom_class.h>
#include <torch/csrc/jit/serialization/import.h>

#include "torch_ext/plan/plan_cache.h"

namespace {

using torch_ext::plan::PlanCache;
using torch_ext::plan::PlanCacheOptions;

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

c10::Dict<std::string, double> totals(const torch_ext::plan::PlanCacheStats& s) {
  c10::Dict<std::string, double> d;
  d.insert("calls", s.calls);
  d.insert("hits", s.hits);
  d.insert("misses", s.misses);
  d.insert("builds", s.builds);
  d.insert("build_failures", s.build_failures);
  d.insert("graph_capture_failures", s.graph_capture_failures);
  d.insert("evictions", s.evictions);
  d.insert("padded_calls", s.padded_calls);
  d.insert("split_calls", s.split_calls);
  d.insert("fallback_calls", s.fallback_calls);
  d.insert("padded_elements", s.padded_elements);
  d.insert("plans", s.plans);
  d.insert("cuda_graphs", s.cuda_graphs);
  d.insert("plan_bytes", s.plan_bytes);
  d.insert("pending_builds", s.pending_builds);
  d.insert("build_seconds", s.build_seconds);
  d.insert("hit_lookup_seconds", s.hit_lookup_seconds);
  return d;
}

c10::Dict<int64_t, c10::Dict<std::string, double>> per_size(const torch_ext::plan::PlanCacheStats& s) {
  c10::Dict<int64_t, c10::Dict<std::string, double>> out;
  for (const auto& z : s.sizes) {
    c10::Dict<std::string, double> d;
    d.insert("batch_size", z.batch_size);
    d.insert("calls", z.calls);
    d.insert("hits", z.hits);
    d.insert("misses", z.misses);
    d.insert("padded_calls", z.padded_calls);
    d.insert("split_calls", z.split_calls);
    d.insert("fallback_calls", z.fallback_calls);
    d.insert("builds", z.builds);
    d.insert("evictions", z.evictions);
    d.insert("plan_runs", z.plan_runs);
    d.insert("graph_replays", z.graph_replays);
    d.insert("build_seconds", z.build_seconds);
    d.insert("total_seconds", z.total_seconds);
    d.insert("max_seconds", z.max_seconds);
    d.insert("plan_seconds", z.plan_seconds);
    d.insert("padded_elements", z.padded_elements);
    d.insert("cached", z.cached ? 1.0 : 0.0);
    d.insert("cuda_graph", z.cuda_graph ? 1.0 : 0.0);
    d.insert("plan_bytes", z.plan_bytes);
    d.insert("graph_bytes", z.graph_bytes);
    out.insert(z.batch_size, d);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  m.class_<ScriptPlanCache>("PlanCache")
      .def(torch::init([](c10::IValue module, std::vector<int64_t> batch_dims, std::vector<int64_t> output_batch_dims,
                          std::string miss_mode, bool background_builds, int64_t admit_after, int64_t max_plans,
                          int64_t max_bytes, int64_t max_batch_size, int64_t warmup_calls, bool optimize_for_inference,
                          std::optional<bool> specialize_shapes, bool static_runtime, bool cuda_graphs, std::string method) {
        PlanCacheOptions options;
        options.batch_dims = std::move(batch_dims);
        options.output_batch_dims = std::move(output_batch_dims);
        options.miss_mode = torch_ext::plan::miss_mode_from_string(miss_mode);
        options.background_builds = background_builds;
        options.admit_after = admit_after;
        options.max_plans = max_plans;
        options.max_bytes = max_bytes;
        options.max_batch_size = max_batch_size;
        options.warmup_calls = warmup_calls;
        options.optimize_for_inference = optimize_for_inference;
        options.specialize_shapes = specialize_shapes;
        options.static_runtime = static_runtime;
        options.cuda_graphs = cuda_graphs;
        options.method = std::move(method);
        return c10::make_intrusive<ScriptPlanCache>(as_module(module), std::move(options));
      }))
      .def("infer", [](const c10::intrusive_ptr<ScriptPlanCache>& self, c10::IValue inputs) {
        return self->cache.infer(as_inputs(inputs));
      })
      // Typed fast path for tensor-only inputs: an Any argument makes Python infer the type of
      // a tuple or list on every call (~20 us), a Tensor[] does not.
      .def("infer_tensors", [](const c10::intrusive_ptr<ScriptPlanCache>& self, std::vector<at::Tensor> inputs) {
        return self->cache.infer(std::vector<c10::IValue>(inputs.begin(), inputs.end()));
      })
      .def("infer_batch", [](const c10::intrusive_ptr<ScriptPlanCache>& self, c10::IValue inputs) {
        return self->cache.infer_batch(as_inputs(inputs));
      })
      .def("preload", [](const c10::intrusive_ptr<ScriptPlanCache>& self, std::vector<int64_t> sizes,
                         c10::IValue example_inputs) {
        self->cache.preload(sizes, example_inputs.isNone() ? std::vector<c10::IValue>{} : as_inputs(example_inputs));
      })
      .def("select_batch_size", [](const c10::intrusive_ptr<ScriptPlanCache>& self, int64_t max_count) {
        return self->cache.select_batch_size(max_count);
      })
      .def("cached_sizes", [](const c10::intrusive_ptr<ScriptPlanCache>& self) { return self->cache.cached_sizes(); })
      .def("contains", [](const c10::intrusive_ptr<ScriptPlanCache>& self, int64_t n) { return self->cache.contains(n); })
      .def("plan_module", [](const c10::intrusive_ptr<ScriptPlanCache>& self, int64_t n) -> c10::IValue {
        auto module = self->cache.plan_module(n);
        return module ? c10::IValue(module->_ivalue()) : c10::IValue();
      })
      .def("stats", [](const c10::intrusive_ptr<ScriptPlanCache>& self) { return totals(self->cache.stats()); })
      .def("size_stats", [](const c10::intrusive_ptr<ScriptPlanCache>& self) { return per_size(self->cache.stats()); })
      .def("reset_stats", [](const c10::intrusive_ptr<ScriptPlanCache>& self) { self->cache.reset_stats(); })
      .def("clear", [](const c10::intrusive_ptr<ScriptPlanCache>& self) { self->cache.clear(); })
      .def("wait_for_builds", [](const c10::intrusive_ptr<ScriptPlanCache>& self) { self->cache.wait_for_builds(); })
      .def("save", [](const c10::intrusive_ptr<ScriptPlanCache>& self, std::string dir) { self->cache.save(dir); })
      .def("load", [](const c10::intrusive_ptr<ScriptPlanCache>& self, std::string dir) { return self->cache.load(dir); })
      .def("miss_mode", [](const c10::intrusive_ptr<ScriptPlanCache>& self) {
        return torch_ext::plan::to_string(self->cache.options().miss_mode);
      });
}
