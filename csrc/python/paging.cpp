// torch_ext._C.paging.Pager: a torch.classes.torch_ext.LayerPager's acquire and acquire_many, for
// the hooks that run around every paged module's forward and in its backward. Through
// torch.classes each call costs more than the acquire itself (the boxed call, its schema and its
// arguments' conversion). No logic lives here.
#include <string>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>

#include "script_object.h"
#include "torch_ext/paging/layer_pager.h"

namespace py = pybind11;

namespace {

using torch_ext::paging::LayerPager;

struct Pager {
  c10::intrusive_ptr<LayerPager> pager;
};

}  // namespace

void bind_paging(py::module_& m) {
  auto paging = m.def_submodule("paging", "Weight paging");
  py::class_<Pager>(paging, "Pager", "acquire / acquire_many of a torch.classes.torch_ext.LayerPager")
      .def(py::init([](const py::object& script_object) { return Pager{custom_class_of<LayerPager>(script_object)}; }),
           py::arg("pager"))
      .def(
          "acquire",
          [](const Pager& self, const std::string& key) {
            py::gil_scoped_release no_gil;  // a miss reads the file
            return self.pager->acquire(key);
          },
          py::arg("key"), "The pager's acquire(key)")
      .def(
          "acquire_many",
          [](const Pager& self, const std::vector<std::string>& keys) {
            std::vector<at::Tensor> tensors;
            {
              py::gil_scoped_release no_gil;
              tensors = self.pager->acquire_many(keys);
            }
            py::tuple out(tensors.size());
            for (size_t i = 0; i < tensors.size(); ++i) {
              out[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(tensors[i])));
            }
            return out;
          },
          py::arg("keys"), "The pager's acquire_many(keys), as a tuple");
}
