// torch_ext._C: what torch.ops and torch.classes cannot carry. No logic lives here.
#include <pybind11/pybind11.h>

namespace py = pybind11;

void bind_checkpoint(py::module_& m);
void bind_cache(py::module_& m);
void bind_paging(py::module_& m);
void bind_plan(py::module_& m);

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_ext's Python bindings (internal; use the torch_ext package)";

  bind_checkpoint(m);
  bind_cache(m);
  bind_paging(m);
  bind_plan(m);

  py::dict build;
#ifdef TORCH_EXT_WITH_CUDA
  build["cuda"] = true;
#else
  build["cuda"] = false;
#endif
  build["cplusplus"] = __cplusplus;
  build["compiler"] = __VERSION__;
  build["torch_version"] = TORCH_EXT_TORCH_VERSION;
  m.attr("build_info") = build;
}
