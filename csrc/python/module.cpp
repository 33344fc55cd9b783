// torch_ext._C: what torch.ops and torch.classes cannot carry. No logic lives here.
#include <pybind11/pybind11.h>

#include "torch_ext/memory/counting_allocator.h"

namespace py = pybind11;

void bind_checkpoint(py::module_& m);
void bind_cache(py::module_& m);

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_ext's Python bindings (internal; use the torch_ext package)";

  auto memory = m.def_submodule("memory", "CPU memory accounting");
  memory.def("install_counting_allocator", &torch_ext::memory::install_counting_allocator,
             "Make the counting wrapper c10's CPU allocator; False if a higher-priority allocator is in place.");
  memory.def("uninstall_counting_allocator", &torch_ext::memory::uninstall_counting_allocator,
             "Restore the CPU allocator the counting wrapper replaced.");
  memory.def("counting_allocator_installed", &torch_ext::memory::counting_allocator_installed);

  bind_checkpoint(m);
  bind_cache(m);

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
