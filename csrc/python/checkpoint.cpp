// torch_ext._C.checkpoint: Python callables as checkpoint segments, with the options of a
// torch.classes.torch_ext.CheckpointOptions object. No logic lives here.
#include <memory>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include "torch_ext/checkpoint/checkpoint.h"
#include "torch_ext/class_fields.h"

namespace py = pybind11;
namespace ck = torch_ext::checkpoint;

namespace {

using OptionsObject = c10::intrusive_ptr<torch_ext::Boxed<ck::CheckpointOptions>>;

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
                     const py::handle& options, std::string name) {
  static const auto options_type = c10::getCustomClassType<OptionsObject>();
  ck::CheckpointOptions resolved = torch::jit::toIValue(options, options_type).toCustomClass<
      torch_ext::Boxed<ck::CheckpointOptions>>()->value;
  resolved.name = std::move(name);
  auto held = hold(std::move(fn));
  ck::Segment segment = [held](const ck::TensorList& args) -> ck::TensorList {
    py::gil_scoped_acquire gil;
    py::object result = (*held)(args);
    if (THPVariable_Check(result.ptr())) return {THPVariable_Unpack(result.ptr())};
    return result.cast<ck::TensorList>();
  };
  return ck::checkpoint(segment, inputs, params, resolved);
}

}  // namespace

void bind_checkpoint(py::module_& m) {
  auto sub = m.def_submodule("checkpoint", "segment checkpointing (internal; use torch_ext.checkpoint)");
  sub.def("apply", &apply, py::arg("fn"), py::arg("inputs"), py::arg("params"), py::arg("options"),
          py::arg("name"),
          "Run fn(inputs) -> tensor or list of tensors as a checkpointed segment; params are the other tensors "
          "it reads; options: a torch.classes.torch_ext.CheckpointOptions.");
}
