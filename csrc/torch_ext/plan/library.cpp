// torch.classes.torch_ext.PlanCache / PlanCacheStats / SizeStats: the plan cache for TorchScript
// code, Python and C++ servers. The constructor takes PlanCacheOptions' options as keywords.
#include <filesystem>
#include <string>
#include <vector>

#include <torch/custom_class.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/library.h>

#include "torch_ext/class_fields.h"
#include "torch_ext/plan/batcher.h"
#include "torch_ext/plan/plan_cache.h"

namespace {

using torch_ext::plan::Batcher;
using torch_ext::plan::BatcherOptions;
using torch_ext::plan::BatcherStats;
using torch_ext::plan::PlanCache;
using torch_ext::plan::PlanCacheOptions;
using torch_ext::plan::PlanCacheStats;
using torch_ext::plan::SizeStats;

using Self = c10::intrusive_ptr<PlanCache>;

// Inputs arrive as one tensor, a tuple or a list; the cache takes the positional arguments.
std::vector<c10::IValue> as_inputs(const c10::IValue& inputs) {
  if (inputs.isTuple()) return inputs.toTupleRef().elements().vec();
  if (inputs.isList()) return inputs.toList().vec();
  TORCH_CHECK(inputs.isTensor(), "PlanCache: inputs must be a tensor, a tuple or a list of the module's arguments; got ",
              inputs.tagKind());
  return {inputs};
}

// A scripted module, the path of a saved one, or an exported program: the folder a saved cache
// is in, or a .pt2 file torch.export.save wrote.
Self make_cache(const c10::IValue& module, PlanCacheOptions options) {
  if (module.isString()) {
    const std::string path(module.toStringRef());
    if (std::filesystem::is_directory(path) || path.ends_with(".pt2")) {
      return c10::make_intrusive<PlanCache>(torch_ext::plan::ExportSource{path}, std::move(options));
    }
    torch::jit::Module loaded;
    try {
      loaded = torch::jit::load(path);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "PlanCache: cannot load a scripted module from '", path, "': ", e.what_without_backtrace());
    }
    return c10::make_intrusive<PlanCache>(std::move(loaded), std::move(options));
  }
  TORCH_CHECK(module.isObject() && module.toObjectRef().type()->is_module(),
              "PlanCache: expected a scripted module, the path of a saved one, a saved cache's folder or an exported "
              "program's .pt2 file; got ", module.tagKind());
  return c10::make_intrusive<PlanCache>(torch::jit::Module(module.toObject()), std::move(options));
}

void register_batcher(torch::Library& m) {
  using torch_ext::plan::BatchResult;
  using Result = c10::intrusive_ptr<BatchResult>;
  m.class_<BatchResult>("BatchResult")
      .def("wait", [](const Result& self, double timeout_seconds) { return self->wait(timeout_seconds); },
           "Whether the result is in after waiting at most timeout_seconds")
      .def("result", [](const Result& self, double timeout_seconds) { return self->result(timeout_seconds); },
           "The output (or the batch's error), waiting at most timeout_seconds")
      .def("done", [](const Result& self) { return self->done(); })
      .def("running", [](const Result& self) { return self->running(); },
           "Whether a batch has taken the request and not yet handed its result back (false while queued)")
      .def("cancelled", [](const Result& self) { return self->cancelled(); },
           "Whether Batcher.cancel took the request out of the queue")
      .def("future", [](const Result& self) { return c10::IValue(self->future()); },
           "A torch Future completed with the result (torch.jit.wait, callbacks)");
  torch_ext::register_stats<BatcherStats>(m, "BatcherStats");
  auto cls = m.class_<Batcher>("Batcher");
  torch_ext::def_options_init<BatcherOptions, Self>(
      cls, {"cache"},
      [](const Self& cache, BatcherOptions options) { return c10::make_intrusive<Batcher>(cache, options); },
      "A dynamic batcher in front of a PlanCache: single requests gathered into batches of max_batch_size rows or "
      "max_delay_ms, each caller handed its rows");
  torch_ext::def_option_properties<BatcherOptions>(
      cls, [](const c10::intrusive_ptr<Batcher>& self) { return self->options(); });
  cls.def("submit",
          [](const c10::intrusive_ptr<Batcher>& self, c10::IValue inputs, double deadline_ms) {
            return self->submit(as_inputs(inputs), deadline_ms);
          },
          "Queues a request; returns its BatchResult (raises when the queue is full, or when deadline_ms, if >= 0, "
          "cannot be met); runs the batch it fills unless submit_runs_batch is false",
          {torch::arg("inputs"), torch::arg("deadline_ms") = -1.0})
      .def("infer",
           [](const c10::intrusive_ptr<Batcher>& self, c10::IValue inputs, double timeout_seconds, double deadline_ms) {
             return self->infer(as_inputs(inputs), timeout_seconds, deadline_ms);
           },
           "submit() and wait for the output, at most timeout_seconds (< 0: the option's)",
           {torch::arg("inputs"), torch::arg("timeout_seconds") = -1.0, torch::arg("deadline_ms") = -1.0})
      .def("infer_tensors",
           [](const c10::intrusive_ptr<Batcher>& self, std::vector<at::Tensor> inputs, double timeout_seconds,
              double deadline_ms) {
             return self->infer(std::vector<c10::IValue>(inputs.begin(), inputs.end()), timeout_seconds, deadline_ms);
           },
           "infer() for tensor-only inputs (no type inference of an Any argument)",
           {torch::arg("inputs"), torch::arg("timeout_seconds") = -1.0, torch::arg("deadline_ms") = -1.0})
      .def("cancel", [](const c10::intrusive_ptr<Batcher>& self, const Result& result) { return self->cancel(result); },
           "Takes a queued request (submit's BatchResult) out of the queue before a batch takes it: its result() "
           "then raises; false when it runs, has run, or is not this batcher's")
      .def("stats", [](const c10::intrusive_ptr<Batcher>& self) { return torch_ext::box(self->stats()); })
      .def("follow", [](const c10::intrusive_ptr<Batcher>& self, const Self& cache) { self->follow(cache); },
           "Later batches run on this cache (a re-plan of the one the batcher was made with)")
      .def("close", [](const c10::intrusive_ptr<Batcher>& self) { self->close(); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  torch_ext::register_stats<SizeStats>(m, "SizeStats");
  torch_ext::register_stats<PlanCacheStats>(m, "PlanCacheStats");
  auto cls = m.class_<PlanCache>("PlanCache");
  torch_ext::def_options_init<PlanCacheOptions, c10::IValue>(
      cls, {"module"}, [](const c10::IValue& module, PlanCacheOptions options) { return make_cache(module, std::move(options)); },
      "Plans per bucket of input sizes (module: a scripted module or the path of a saved one; or an exported "
      "program's cache: the folder save() wrote, loaded with no compile, or a torch.export.save .pt2 file)");
  torch_ext::def_option_properties<PlanCacheOptions>(cls, [](const Self& self) { return self->options(); });
  cls.def("infer", [](const Self& self, c10::IValue inputs) { return self->infer(as_inputs(inputs)); })
      // Typed fast path for tensor-only inputs: an Any argument makes Python infer the type of
      // a tuple or list on every call (~20 us), a Tensor[] does not.
      .def("infer_tensors",
           [](const Self& self, std::vector<at::Tensor> inputs) {
             return self->infer(std::vector<c10::IValue>(inputs.begin(), inputs.end()));
           })
      .def("infer_batch", [](const Self& self, c10::IValue inputs) { return self->infer_batch(as_inputs(inputs)); })
      .def("preload",
           [](const Self& self, std::vector<int64_t> sizes, c10::IValue example_inputs) {
             self->preload(sizes, example_inputs.isNone() ? std::vector<c10::IValue>{} : as_inputs(example_inputs));
           })
      .def("preload_buckets",
           [](const Self& self, std::vector<std::vector<int64_t>> buckets, c10::IValue example_inputs) {
             self->preload_buckets(buckets,
                                   example_inputs.isNone() ? std::vector<c10::IValue>{} : as_inputs(example_inputs));
           })
      .def("select_batch_size", [](const Self& self, int64_t max_count) { return self->select_batch_size(max_count); })
      .def("cached_sizes", [](const Self& self) { return self->cached_sizes(); })
      .def("cached_buckets", [](const Self& self) { return self->cached_buckets(); })
      .def("contains", [](const Self& self, int64_t n) { return self->contains(n); })
      .def("__contains__", [](const Self& self, int64_t n) { return self->contains(n); })
      .def("contains_bucket", [](const Self& self, std::vector<int64_t> bucket) { return self->contains_bucket(bucket); })
      .def("plan_module",
           [](const Self& self, int64_t n) -> c10::IValue {
             auto module = self->plan_module(n);
             return module ? c10::IValue(module->_ivalue()) : c10::IValue();
           })
      .def("stats", [](const Self& self) { return torch_ext::box(self->stats()); })
      .def("reset_stats", [](const Self& self) { self->reset_stats(); })
      .def("clear", [](const Self& self) { self->clear(); })
      .def("traffic", [](const Self& self) { return self->traffic(); },
           "The traffic log: a row per size served (a size per dynamic dimension, batch first, then its count)")
      .def("observe_traffic", [](const Self& self, std::vector<std::vector<int64_t>> rows) { self->observe_traffic(rows); },
           "Adds rows in traffic()'s form (another cache's log, a recorded stream) to the traffic log")
      .def("clear_traffic", [](const Self& self) { self->clear_traffic(); })
      .def("example_inputs", [](const Self& self, std::vector<int64_t> sizes) -> c10::IValue {
             return c10::IValue(c10::ivalue::Tuple::create(self->example_inputs(sizes)));
           },
           "Inputs at the given sizes (one per dynamic dimension, batch first), made from the cache's example")
      .def("wait_for_builds", [](const Self& self, double timeout_seconds) { self->wait_for_builds(timeout_seconds); },
           "Blocks until no build is queued or running; timeout_seconds < 0: the option's",
           {torch::arg("timeout_seconds") = -1.0})
      .def("kind", [](const Self& self) { return std::string(self->kind()); })
      .def("call_spec", [](const Self& self) { return self->call_spec(); })
      .def("save", [](const Self& self, std::string dir) { self->save(dir); })
      .def("load", [](const Self& self, std::string dir) { return self->load(dir); });
  register_batcher(m);  // after PlanCache, which its constructor takes
}
