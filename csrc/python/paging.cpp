// torch_ext._C.paging.ModuleWeights: one module's paged tensors acquired in one call, for the
// forward pre-hook that runs before every paged module. Through torch.classes that call costs more
// than the acquire itself: the boxed call converts the list of names on every forward. No logic
// lives here.
#include <string>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include "torch_ext/paging/layer_pager.h"

namespace py = pybind11;

namespace {

using torch_ext::paging::LayerPager;

c10::intrusive_ptr<LayerPager> pager_of(const py::handle& script_object) {
  static const auto type = c10::getCustomClassType<c10::intrusive_ptr<LayerPager>>();
  return torch::jit::toIValue(script_object, type).toCustomClass<LayerPager>();
}

struct ModuleWeights {
  c10::intrusive_ptr<LayerPager> pager;
  std::vector<std::string> keys;
};

}  // namespace

void bind_paging(py::module_& m) {
  auto paging = m.def_submodule("paging", "Weight paging");
  py::class_<ModuleWeights>(paging, "ModuleWeights",
                            "acquire() of a fixed list of names on a torch.classes.torch_ext.LayerPager")
      .def(py::init([](const py::object& script_object, std::vector<std::string> keys) {
             return ModuleWeights{pager_of(script_object), std::move(keys)};
           }),
           py::arg("pager"), py::arg("keys"))
      .def(
          "acquire",
          [](const ModuleWeights& self) {
            std::vector<at::Tensor> tensors;
            {
              py::gil_scoped_release no_gil;  // a miss reads the file
              tensors = self.pager->acquire_many(self.keys);
            }
            py::tuple out(tensors.size());
            for (size_t i = 0; i < tensors.size(); ++i) {
              out[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(tensors[i])));
            }
            return out;
          },
          "The pager's acquire_many(keys), as a tuple");
}
