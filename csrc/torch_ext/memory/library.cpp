// torch.ops.torch_ext.memory_stats / reset_peak_memory: CPU memory accounting.
#include <tuple>

#include <torch/library.h>

#include "torch_ext/memory/counting_allocator.h"

namespace {

std::tuple<int64_t, int64_t, int64_t> memory_stats() {
  const auto s = torch_ext::memory::stats();
  return {s.current_bytes, s.peak_bytes, s.allocations};
}

}  // namespace

// Both ops read or change global state: CONSERVATIVE alias analysis keeps TorchScript
// from merging two memory_stats() calls or dropping reset_peak_memory() as dead code.
TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  m.def(torch::schema("memory_stats() -> (int current_bytes, int peak_bytes, int allocations)",
                      c10::AliasAnalysisKind::CONSERVATIVE),
        &memory_stats);
  m.def(torch::schema("reset_peak_memory() -> ()", c10::AliasAnalysisKind::CONSERVATIVE),
        &torch_ext::memory::reset_peak);
}
