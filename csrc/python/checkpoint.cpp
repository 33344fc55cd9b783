// torch_ext._C.checkpoint: Python callables as checkpoint segments. No logic lives here.
#include <memory>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include "torch_ext/checkpoint/checkpoint.h"

namespace py = pybind11;
namespace ck = torch_ext::checkpoint;

namespace {

// The segment may be released by the autograd engine on a thread that does not hold the GIL.
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

ck::TensorList apply(py::object fn, const ck::TensorList& inputs, const ck::TensorList& params,
                     const std::string& storage, bool preserve_rng_state, std::string name) {
  ck::CheckpointOptions options;
  options.storage = ck::parse_storage_policy(storage);
  options.preserve_rng_state = preserve_rng_state;
  options.name = std::move(name);
  auto held = hold(std::move(fn));
  ck::Segment segment = [held](const ck::TensorList& args) -> ck::TensorList {
    py::gil_scoped_acquire gil;
    py::object result = (*held)(args);
    if (THPVariable_Check(result.ptr())) return {THPVariable_Unpack(result.ptr())};
    return result.cast<ck::TensorList>();
  };
  return ck::checkpoint(segment, inputs, params, options);
}

}  // namespace

void bind_checkpoint(py::module_& m) {
  auto sub = m.def_submodule("checkpoint", "segment checkpointing (internal; use torch_ext.checkpoint)");
  sub.def("apply", &apply, py::arg("fn"), py::arg("inputs"), py::arg("params"), py::arg("storage") = "keep",
          py::arg("preserve_rng_state") = true, py::arg("name") = "segment",
          "Run fn(inputs) -> tensor or list of tensors as a checkpointed segment; params are the other tensors it reads.");
  sub.def(
      "validate_storage",
      [](const std::string& storage) { return std::string(ck::storage_policy_name(ck::parse_storage_policy(storage))); },
      "The canonical name of a storage policy; raises for an unknown one.");
  sub.def(
      "boundary_bytes",
      [](const ck::TensorList& inputs, const std::string& storage) {
        return ck::boundary_bytes(inputs, ck::parse_storage_policy(storage)).expect_int();
      },
      "Bytes the boundary of these inputs keeps under a storage policy.");
}
