// A LibTorch program that runs a TorchScript module calling torch_ext ops.
// Linking libtorch_ext registers torch.ops.torch_ext.*; nothing else is needed.
//
//   python examples/save_scripted_module.py build/libtorch_ext.so module.pt
//   build/torch_ext_example module.pt
#include <iostream>

#include <torch/script.h>

#include "torch_ext/memory/counting_allocator.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: " << argv[0] << " MODULE.pt\n";
    return 2;
  }
  torch::jit::Module module = torch::jit::load(argv[1]);
  module.eval();

  const at::Tensor x = torch::arange(4096, torch::kFloat32);
  const auto outputs = module.forward({x}).toTuple();
  const at::Tensor y = outputs->elements()[0].toTensor();
  const int64_t bytes = outputs->elements()[1].toInt();
  const int64_t allocations = outputs->elements()[2].toInt();

  const bool values_ok = torch::equal(y, x * 2);
  const bool bytes_ok = bytes == static_cast<int64_t>(y.nbytes());
  const bool allocations_ok = allocations >= 1;
  const auto stats = torch_ext::memory::stats();
  const bool stats_ok = stats.current_bytes >= static_cast<int64_t>(x.nbytes() + y.nbytes());

  std::cout << "scripted module doubled " << x.numel() << " floats: " << (values_ok ? "ok" : "WRONG") << "\n"
            << "torch.ops.torch_ext.memory_stats saw " << bytes << " bytes in " << allocations
            << " allocation(s) (expected " << y.nbytes() << " bytes)\n"
            << "C++ API: current " << stats.current_bytes << " bytes, peak " << stats.peak_bytes << " bytes, "
            << stats.allocations << " allocations\n";
  return values_ok && bytes_ok && allocations_ok && stats_ok ? 0 : 1;
}
