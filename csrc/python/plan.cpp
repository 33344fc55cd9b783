// torch_ext._C.plan: Python callables for a torch.classes.torch_ext.PlanCache of an exported
// program (the compiler that builds its AOTInductor packages, the source that runs a request no
// plan serves), the module it was exported from, scripted, and the blocking section that
// releases the GIL while a thread waits for one that may be running Python. No logic lives here.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include "script_object.h"
#include "torch_ext/common/wait.h"
#include "torch_ext/plan/batcher.h"
#include "torch_ext/plan/plan_cache.h"

namespace py = pybind11;
namespace plan = torch_ext::plan;

namespace {

c10::intrusive_ptr<plan::PlanCache> cache_of(const py::handle& script_object) {
  return custom_class_of<plan::PlanCache>(script_object);
}

// Called from threads that do not hold the GIL, released on any thread.
std::shared_ptr<py::object> hold(py::object fn) {
  return std::shared_ptr<py::object>(new py::object(std::move(fn)), [](py::object* object) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete object;
    } else {
      object->release();  // the interpreter is gone: leak rather than touch it
      delete object;
    }
  });
}

py::list to_python(const std::vector<c10::IValue>& values) {
  py::list out;
  for (const auto& v : values) out.append(torch::jit::toPyObject(v));
  return out;
}

// Runs fn under the GIL; a Python exception becomes a C++ error carrying its message.
template <class Fn>
auto call_python(const char* what, Fn&& fn) {
  std::string failure;
  {
    py::gil_scoped_acquire gil;
    try {
      return fn();
    } catch (py::error_already_set& e) {
      failure = e.what();
    }
  }
  TORCH_CHECK(false, "PlanCache: ", what, " raised: ", failure);
}

void set_compiler(const py::object& script_object, py::object fn) {
  auto held = hold(std::move(fn));
  cache_of(script_object)->set_compiler([held](const plan::CompileRequest& request) {
    call_python("the compiler", [&] {
      py::cpp_function cancelled([cancelled = request.cancelled] { return cancelled && cancelled(); });
      (*held)(request.upper, request.lower, request.dynamic, to_python(request.example), request.package_path,
              request.background, cancelled);
    });
  });
}

// A tensor, or a tuple of tensors, as the plans return.
c10::IValue from_python(const py::object& output) {
  if (THPVariable_Check(output.ptr())) return THPVariable_Unpack(output.ptr());
  TORCH_CHECK(py::isinstance<py::tuple>(output), "PlanCache: the source returned a ", Py_TYPE(output.ptr())->tp_name,
              "; expected a tensor or a tuple of tensors");
  std::vector<c10::IValue> parts;
  for (const auto& item : output) {
    TORCH_CHECK(THPVariable_Check(item.ptr()), "PlanCache: the source returned a tuple holding a ",
                Py_TYPE(item.ptr())->tp_name, "; expected tensors");
    parts.emplace_back(THPVariable_Unpack(item.ptr()));
  }
  return c10::ivalue::Tuple::create(std::move(parts));
}

void set_source(const py::object& script_object, py::object fn) {
  auto held = hold(std::move(fn));
  cache_of(script_object)->set_source([held](const std::vector<c10::IValue>& inputs) {
    return call_python("the source", [&] { return from_python((*held)(*to_python(inputs))); });
  });
}

void set_script_module(const py::object& script_object, const py::object& module) {
  const std::optional<torch::jit::Module> scripted = torch::jit::as_module(module);
  TORCH_CHECK_TYPE(scripted.has_value(), "PlanCache: the script module must be a torch.jit.ScriptModule, got ",
                   py::str(py::type::of(module)).cast<std::string>());
  cache_of(script_object)->set_script_module(*scripted);
}

// Calls from Python without TorchScript's method dispatch, which builds a schema-checked stack and
// looks up the compilation unit on every call: about 15 us with the GIL held, per request (a
// batcher's clients serialize on it). The GIL is released while `run` runs, unless `run` only
// takes a lock held briefly by threads that never take the GIL (releasing it there hands the
// interpreter to another thread per call).
template <class Run>
py::object call_released(Run&& run, bool release_gil = true) {
  c10::IValue output;
  {
    // The call's C++ warnings (TORCH_WARN: a plan that runs without its CUDA graph, a TorchScript
    // warnings.warn) reach Python's warnings module, as from torch's own bindings, not stderr.
    torch::PyWarningHandler warnings;
    try {
      std::optional<py::gil_scoped_release> release;
      if (release_gil) release.emplace();
      output = run();
    } catch (...) {  // as torch's own bindings raise them: ValueError, IndexError, ..., no C++ backtrace
      warnings.set_in_exception();
      torch::translate_exception_to_python(std::current_exception());
      throw py::error_already_set();
    }
  }
  return torch::jit::toPyObject(std::move(output));
}

std::vector<c10::IValue> values_of(const std::vector<at::Tensor>& inputs) { return {inputs.begin(), inputs.end()}; }

py::cpp_function cache_infer(const py::object& script_object) {
  return py::cpp_function(
      [cache = cache_of(script_object)](const std::vector<at::Tensor>& inputs) {
        return call_released([&] { return cache->infer(values_of(inputs)); });
      },
      py::arg("inputs"));
}

// PlanCache.preload / preload_buckets with tensor example inputs, the GIL released while the plan
// builds (a TorchScript plan is frozen and optimised in this thread; other threads keep serving).
py::cpp_function cache_preload(const py::object& script_object) {
  return py::cpp_function(
      [cache = cache_of(script_object)](const std::vector<int64_t>& sizes, const std::vector<at::Tensor>& example,
                                        bool bucket) {
        return call_released([&] {
          if (bucket) {
            cache->preload_buckets({sizes}, values_of(example));
          } else {
            cache->preload(sizes, values_of(example));
          }
          return c10::IValue();
        });
      },
      py::arg("sizes"), py::arg("example_inputs"), py::arg("bucket"));
}

// A batcher request's inputs from a tuple or list of exactly torch.Tensor (nullopt: another value
// is among them). The batcher's thread may drop them after their batch: a tensor Python made would
// take the GIL there to release its Python object (once per request, waiting for whichever thread
// holds it), so the request holds detached aliases, which have none.
std::optional<std::vector<c10::IValue>> request_of(const py::handle& inputs) {
  const bool is_tuple = PyTuple_Check(inputs.ptr());
  TORCH_CHECK_TYPE(is_tuple || PyList_Check(inputs.ptr()), "Batcher: a request's inputs come as a tuple or list, got ",
                   Py_TYPE(inputs.ptr())->tp_name);
  const Py_ssize_t n = is_tuple ? PyTuple_GET_SIZE(inputs.ptr()) : PyList_GET_SIZE(inputs.ptr());
  std::vector<c10::IValue> values;
  values.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = is_tuple ? PyTuple_GET_ITEM(inputs.ptr(), i) : PyList_GET_ITEM(inputs.ptr(), i);
    if (!THPVariable_CheckExact(item)) return std::nullopt;
    values.emplace_back(THPVariable_Unpack(item));
  }
  plan::PlanCache::check_no_autograd(values);  // before detaching hides what it checks
  for (auto& value : values) value = value.toTensor().detach();
  return values;
}

c10::intrusive_ptr<plan::Batcher> batcher_of(const py::object& script_object) {
  static const auto type = c10::getCustomClassType<c10::intrusive_ptr<plan::Batcher>>();
  return torch::jit::toIValue(script_object, type).toCustomClass<plan::Batcher>();
}

py::cpp_function batcher_infer(const py::object& script_object) {
  return py::cpp_function(
      [batcher = batcher_of(script_object)](const py::handle& inputs, double timeout_seconds, double deadline_ms) {
        auto request = request_of(inputs);
        TORCH_CHECK_TYPE(request, "Batcher: infer_tensors takes only tensors (exactly torch.Tensor)");
        return call_released([&] { return batcher->infer(std::move(*request), timeout_seconds, deadline_ms); });
      },
      py::arg("inputs"), py::arg("timeout_seconds") = -1.0, py::arg("deadline_ms") = -1.0);
}

// A request's result as torch_ext's BatchFuture holds it: the BatchResult itself rather than a
// TorchScript object around it, which costs more to make and to read (one per request, the GIL held).
struct BatchHandle {
  c10::intrusive_ptr<plan::BatchResult> result;
};

py::cpp_function batcher_submit(const py::object& script_object) {
  return py::cpp_function(
      [batcher = batcher_of(script_object)](const py::handle& inputs, double deadline_ms) -> py::object {
        auto request = request_of(inputs);
        if (!request) return py::none();  // the caller takes TorchScript's path
        BatchHandle handle;
        call_released(
            [&] {
              handle.result = batcher->submit(std::move(*request), deadline_ms);
              return c10::IValue();
            },
            /*release_gil=*/false);
        return py::cast(std::move(handle));
      },
      py::arg("inputs"), py::arg("deadline_ms") = -1.0);
}

// Batcher.cancel(handle) of a torch.classes.torch_ext.Batcher, holding it weakly: a future that
// outlives its batcher must not keep the batcher's thread alive.
py::cpp_function batcher_cancel(const py::object& script_object) {
  return py::cpp_function(
      [batcher = c10::weak_intrusive_ptr<plan::Batcher>(batcher_of(script_object))](const BatchHandle& handle) {
        const auto alive = batcher.lock();
        return alive && alive->cancel(handle.result);
      },
      py::arg("handle"));
}

BatchHandle batch_handle(const py::object& script_object) {
  static const auto type = c10::getCustomClassType<c10::intrusive_ptr<plan::BatchResult>>();
  return BatchHandle{torch::jit::toIValue(script_object, type).toCustomClass<plan::BatchResult>()};
}

}  // namespace

void bind_plan(py::module_& m) {
  auto sub = m.def_submodule("plan", "plan cache (internal; use torch_ext.PlanCache)");
  sub.def("set_compiler", &set_compiler, py::arg("cache"), py::arg("compiler"),
          "compiler(upper, lower, dynamic, example, package_path, background, cancelled) writes the AOTInductor package "
          "of one bucket's plan to package_path; called from any thread (background: the build worker), "
          "cancelled() turns true when the cache goes away");
  sub.def("set_source", &set_source, py::arg("cache"), py::arg("source"),
          "source(*inputs) runs a request no plan serves: a tensor, or a tuple of tensors as the plans return");
  sub.def("set_script_module", &set_script_module, py::arg("cache"), py::arg("module"),
          "the module an exported program's cache was exported from, scripted and in eval mode: plans of kind "
          "'script' are it, frozen");
  sub.def("cache_infer", &cache_infer, py::arg("cache"),
          "PlanCache.infer_tensors(inputs) of a torch.classes.torch_ext.PlanCache, called directly (no TorchScript "
          "method dispatch), the GIL released while it runs");
  sub.def("cache_preload", &cache_preload, py::arg("cache"),
          "preload(sizes, example_inputs, bucket) of a torch.classes.torch_ext.PlanCache for tensor example inputs "
          "(bucket: sizes is one bucket, else batch sizes), called directly, the GIL released while it builds");
  sub.def("batcher_infer", &batcher_infer, py::arg("batcher"),
          "Batcher.infer_tensors(inputs, timeout_seconds=-1, deadline_ms=-1) of a torch.classes.torch_ext.Batcher, "
          "called directly (no TorchScript method dispatch), the GIL released while it waits");
  sub.def("batcher_submit", &batcher_submit, py::arg("batcher"),
          "Batcher.submit(inputs, deadline_ms=-1) of a torch.classes.torch_ext.Batcher for tensor inputs, called "
          "directly (no TorchScript method dispatch; the GIL held while it queues, released while it runs batches); "
          "inputs: a tuple or list; returns a BatchHandle, or None (nothing queued) when an input is not exactly a "
          "torch.Tensor");
  sub.def("batcher_cancel", &batcher_cancel, py::arg("batcher"),
          "Batcher.cancel(handle) of a torch.classes.torch_ext.Batcher for a BatchHandle, holding the batcher weakly "
          "(false once it is gone)");
  py::class_<BatchHandle>(sub, "BatchHandle", "a batcher request's result (a torch_ext BatchResult)")
      .def(
          "result",
          [](const BatchHandle& handle, double timeout_seconds) {
            // A result already in is taken with the GIL held: releasing it would hand the interpreter
            // to another waiting thread and queue this one behind it, a round trip for nothing.
            const auto& result = handle.result;
            return call_released([&] { return result->result(timeout_seconds); }, /*release_gil=*/!result->done());
          },
          py::arg("timeout_seconds"), "the output, waiting at most timeout_seconds with the GIL released")
      .def("done", [](const BatchHandle& handle) { return handle.result->done(); })
      .def("running", [](const BatchHandle& handle) { return handle.result->running(); })
      .def("cancelled", [](const BatchHandle& handle) { return handle.result->cancelled(); })
      .def(
          "future", [](const BatchHandle& handle) { return torch::jit::toPyObject(c10::IValue(handle.result->future())); },
          "a torch.futures.Future completed with the result");
  py::class_<plan::Completions>(sub, "Completions",
                                "which awaited requests are done, for an event loop woken by a pipe (plan::Completions)")
      .def(py::init<int>(), py::arg("fd"), "fd: the write end of a non-blocking pipe, which the caller closes")
      .def(
          "watch", [](plan::Completions& completions, const BatchHandle& handle,
                      int64_t key) { completions.watch(*handle.result, key); },
          py::arg("handle"), py::arg("key"), "lists key once the request is done (at once if it is)")
      .def("take", &plan::Completions::take, "the keys listed since the last take()")
      .def("close", &plan::Completions::close, "no more writes to fd (then it may be closed)");
  sub.def("batch_handle", &batch_handle, py::arg("result"),
          "the BatchHandle of a torch.classes.torch_ext.BatchResult (what a Batcher's TorchScript submit returns)");
  // Joins and waits on threads that may be inside Python (a compiler, a future's callback) release
  // the GIL, or the waiting thread and the waited-for one would each hold what the other needs.
  torch_ext::set_blocking_section([](const std::function<void()>& wait) {
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release release;
      wait();
    } else {
      wait();
    }
  });
}
