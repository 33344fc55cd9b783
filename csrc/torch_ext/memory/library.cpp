// torch.ops.torch_ext.memory_stats / reset_peak_memory / (un)install_counting_allocator /
// counting_allocator_installed: CPU memory accounting.
#include <tuple>

#include <torch/library.h>

#include "torch_ext/memory/counting_allocator.h"

namespace {

std::tuple<int64_t, int64_t, int64_t> memory_stats() {
  const auto s = torch_ext::memory::stats();
  return {s.current_bytes, s.peak_bytes, s.allocations};
}

}  // namespace

// Every op reads or changes global state: CONSERVATIVE alias analysis keeps TorchScript from
// merging two memory_stats() calls or dropping reset_peak_memory() as dead code.
TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  m.def(torch::schema("install_counting_allocator() -> bool", c10::AliasAnalysisKind::CONSERVATIVE),
        &torch_ext::memory::install_counting_allocator);
  m.def(torch::schema("uninstall_counting_allocator() -> ()", c10::AliasAnalysisKind::CONSERVATIVE),
        &torch_ext::memory::uninstall_counting_allocator);
  m.def(torch::schema("counting_allocator_installed() -> bool", c10::AliasAnalysisKind::CONSERVATIVE),
        &torch_ext::memory::counting_allocator_installed);
  m.def(torch::schema("memory_stats() -> (int current_bytes, int peak_bytes, int allocations)",
                      c10::AliasAnalysisKind::CONSERVATIVE),
        &memory_stats);
  m.def(torch::schema("reset_peak_memory() -> ()", c10::AliasAnalysisKind::CONSERVATIVE),
        &torch_ext::memory::reset_peak);
}
