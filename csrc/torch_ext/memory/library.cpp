// torch.ops.torch_ext.memory_stats / reset_peak_memory / (un)install_counting_allocator /
// counting_allocator_installed: CPU memory accounting.
#include <string>
#include <tuple>
#include <vector>

#include <torch/library.h>

#include "torch_ext/memory/counting_allocator.h"

namespace {

std::tuple<int64_t, int64_t, int64_t> memory_stats() {
  const auto s = torch_ext::memory::stats();
  return {s.current_bytes, s.peak_bytes, s.allocations};
}

}  // namespace

// Every op reads or changes global state: CONSERVATIVE alias analysis keeps TorchScript from
// merging two memory_stats() calls or dropping reset_peak_memory() as dead code. The
// data_dependent_output tag does the same for torch.compile: fake tensors refuse to evaluate the
// ops, so Dynamo graph-breaks and runs each in place. Traced, memory_stats() would return the
// numbers seen while tracing and Inductor would drop reset_peak_memory().
TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  const std::vector<at::Tag> measured{at::Tag::data_dependent_output};
  const auto def = [&](const char* name, const char* signature, auto* function) {
    m.def(torch::schema((std::string(name) + signature).c_str(), c10::AliasAnalysisKind::CONSERVATIVE), measured);
    m.impl(name, torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd, function));
  };
  def("install_counting_allocator", "() -> bool", &torch_ext::memory::install_counting_allocator);
  def("uninstall_counting_allocator", "() -> ()", &torch_ext::memory::uninstall_counting_allocator);
  def("counting_allocator_installed", "() -> bool", &torch_ext::memory::counting_allocator_installed);
  def("memory_stats", "() -> (int current_bytes, int peak_bytes, int allocations)", &memory_stats);
  def("reset_peak_memory", "() -> ()", &torch_ext::memory::reset_peak);
}
