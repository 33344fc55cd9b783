// torch_ext._C.cache.PythonValues: Python values on a torch.classes.torch_ext.NodeCache, for the
// LazyExecutor. Inputs convert to IValues without type inference (tensors, numbers, strings,
// devices, tuples and lists; any other object is keyed by identity); outputs are held as the
// Python objects they are, with their tensors handed to the cache for accounting.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <torch/csrc/Device.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include "script_object.h"
#include "torch_ext/cache/node_cache.h"

namespace py = pybind11;

namespace {

using torch_ext::cache::NodeCache;

// A Python object held in an IValue; its reference is dropped under the GIL.
struct PyValue final : c10::ivalue::PyObjectHolder {
  PyValue(py::object object, std::vector<at::Tensor> tensors) : object_(std::move(object)), tensors_(std::move(tensors)) {}
  ~PyValue() override {
    if (!Py_IsInitialized()) {
      object_.release();  // interpreter gone: leak rather than touch it
      return;
    }
    py::gil_scoped_acquire gil;
    object_ = py::object();
  }
  PyObject* getPyObject() override { return object_.ptr(); }
  c10::InferredType tryToInferType() override {
    return c10::InferredType("torch_ext.NodeCache holds a Python object of no TorchScript type");
  }
  c10::IValue toIValue(const c10::TypePtr& type, std::optional<int32_t> N) override {
    TORCH_CHECK(false, "torch_ext.NodeCache: a cached Python object cannot be converted to ", type->repr_str());
  }
  std::string toStr() override {
    py::gil_scoped_acquire gil;
    return py::str(object_);
  }
  std::vector<at::Tensor> extractTensors() override { return tensors_; }

 private:
  py::object object_;
  std::vector<at::Tensor> tensors_;
};

c10::IValue held(py::object object, std::vector<at::Tensor> tensors) {
  c10::intrusive_ptr<c10::ivalue::PyObjectHolder> holder =
      c10::make_intrusive<PyValue>(std::move(object), std::move(tensors));
  return c10::IValue(std::move(holder));
}

c10::IValue object_value(py::handle h) {
  return held(py::reinterpret_borrow<py::object>(h), {});
}

c10::IValue to_ivalue(py::handle h) {
  PyObject* o = h.ptr();
  if (THPVariable_Check(o)) {
    return THPVariable_Unpack(o);
  }
  if (o == Py_None) {
    return {};
  }
  if (PyBool_Check(o)) {
    return o == Py_True;
  }
  if (PyLong_Check(o)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    return overflow ? object_value(h) : c10::IValue(static_cast<int64_t>(v));
  }
  if (PyFloat_Check(o)) {
    return PyFloat_AS_DOUBLE(o);
  }
  if (PyTuple_Check(o)) {  // torch.Size too
    const Py_ssize_t n = PyTuple_GET_SIZE(o);
    std::vector<c10::IValue> elements;
    elements.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      elements.push_back(to_ivalue(PyTuple_GET_ITEM(o, i)));
    }
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  if (PyList_Check(o)) {
    const Py_ssize_t n = PyList_GET_SIZE(o);
    c10::impl::GenericList list(c10::AnyType::get());
    list.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      list.push_back(to_ivalue(PyList_GET_ITEM(o, i)));
    }
    return list;
  }
  if (PyUnicode_Check(o)) {
    return std::string(py::str(h));
  }
  if (THPDevice_Check(o)) {
    return reinterpret_cast<THPDevice*>(o)->device;
  }
  // dtypes, layouts and memory formats are singletons, so identity is equality.
  return object_value(h);
}

std::vector<c10::IValue> to_inputs(const py::handle& inputs) {
  std::vector<c10::IValue> out;
  PyObject* o = inputs.ptr();
  if (PyList_Check(o)) {
    const Py_ssize_t n = PyList_GET_SIZE(o);
    out.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      out.push_back(to_ivalue(PyList_GET_ITEM(o, i)));
    }
  } else if (PyTuple_Check(o)) {
    const Py_ssize_t n = PyTuple_GET_SIZE(o);
    out.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      out.push_back(to_ivalue(PyTuple_GET_ITEM(o, i)));
    }
  } else {
    throw py::type_error(std::string("torch_ext.NodeCache: inputs must be a list or tuple, got ") +
                         Py_TYPE(o)->tp_name);
  }
  return out;
}

void collect_tensors(py::handle h, std::vector<at::Tensor>& out) {
  PyObject* o = h.ptr();
  if (THPVariable_Check(o)) {
    out.push_back(THPVariable_Unpack(o));
  } else if (PyTuple_Check(o) || PyList_Check(o)) {
    for (auto item : h) {
      collect_tensors(item, out);
    }
  } else if (PyDict_Check(o)) {
    for (auto item : py::reinterpret_borrow<py::dict>(h)) {
      collect_tensors(item.second, out);
    }
  }
}

py::object to_python(const c10::IValue& value) {
  if (value.isPyObject()) {
    return py::reinterpret_borrow<py::object>(value.toPyObject());
  }
  if (value.isTensor()) {
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(value.toTensor()));
  }
  TORCH_CHECK(value.isNone(), "torch_ext.NodeCache: an entry put from C++ holds a ", value.tagKind(),
              "; read it through torch.classes.torch_ext.NodeCache");
  return py::none();
}

// Python values on a NodeCache: what torch.classes cannot carry (any Python object as a value or
// an input, converted without TorchScript's type inference), for the LazyExecutor's hot path.
struct PythonValues {
  c10::intrusive_ptr<NodeCache> cache;
};

}  // namespace

void bind_cache(py::module_& m) {
  auto cache = m.def_submodule("cache", "Lazy node cache");
  cache.def(
      "digest",
      [](const at::Tensor& tensor) {
        TORCH_CHECK_VALUE(torch_ext::cache::TensorKey::content_eligible(tensor),
                          "torch_ext._C.cache.digest: expected a contiguous CPU tensor that does not require grad, got ",
                          tensor.toString(), " of sizes ", tensor.sizes());
        const auto digest = torch_ext::cache::digest_of(tensor);
        return py::bytes(reinterpret_cast<const char*>(digest.data()), sizeof(digest));
      },
      py::arg("tensor"), "The NodeCache's content digest (XXH3 128-bit) of a tensor's bytes, as 16 bytes");
  py::class_<PythonValues>(cache, "PythonValues",
                           "get / put / observe of Python values on a torch.classes.torch_ext.NodeCache")
      .def(py::init([](const py::object& script_object) {
             return PythonValues{custom_class_of<NodeCache>(script_object)};
           }),
           py::arg("cache"))
      .def(
          "get",
          [](PythonValues& self, int64_t node_id, const py::object& inputs, py::object default_value) -> py::object {
            auto value = self.cache->get(node_id, to_inputs(inputs));
            return value ? to_python(*value) : default_value;
          },
          py::arg("node_id"), py::arg("inputs"), py::arg("default") = py::none(),
          "The cached output for these inputs, or default")
      .def(
          "put",
          [](PythonValues& self, int64_t node_id, const py::object& inputs, py::object value, double cost_seconds,
             size_t content_inputs) {
            std::vector<at::Tensor> tensors;
            collect_tensors(value, tensors);
            return self.cache->put(node_id, to_inputs(inputs), held(std::move(value), tensors), cost_seconds, tensors,
                                   content_inputs);
          },
          py::arg("node_id"), py::arg("inputs"), py::arg("value"), py::arg("cost_seconds") = 0.0,
          py::arg("content_inputs") = 0,
          "Cache value for these inputs (the first content_inputs keyed by content where that pays); False when "
          "not stored")
      .def(
          "observe",
          [](PythonValues& self, int64_t source_id, const py::object& inputs, int64_t work_bytes) {
            return static_cast<int>(self.cache->observe(source_id, to_inputs(inputs), work_bytes));
          },
          py::arg("source_id"), py::arg("inputs"), py::arg("work_bytes") = 0,
          "0: inputs equal the last observed under source_id; 1: earlier ones among the recent; 2: new")
      .def(
          "record_call",
          [](PythonValues& self, int64_t nodes_computed, int64_t nodes_reused) {
            self.cache->record_call(nodes_computed, nodes_reused);
          },
          py::arg("nodes_computed"), py::arg("nodes_reused"));
}
