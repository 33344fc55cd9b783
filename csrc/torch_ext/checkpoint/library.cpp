// torch.ops.torch_ext.checkpoint_module / checkpoint_boundary_bytes: segment checkpointing for
// TorchScript (checkpoint a scripted submodule from scripted code).
#include <string>
#include <vector>

#include <torch/library.h>

#include "torch_ext/checkpoint/script.h"

namespace {

std::vector<at::Tensor> checkpoint_module(const c10::IValue& module, std::vector<at::Tensor> inputs,
                                          c10::string_view storage, bool preserve_rng_state) {
  torch_ext::checkpoint::CheckpointOptions options;
  options.storage = torch_ext::checkpoint::parse_storage_policy(storage);
  options.preserve_rng_state = preserve_rng_state;
  return torch_ext::checkpoint::checkpoint_script_module(module, inputs, options);
}

c10::SymInt checkpoint_boundary_bytes(std::vector<at::Tensor> inputs, c10::string_view storage) {
  return torch_ext::checkpoint::boundary_bytes(inputs, torch_ext::checkpoint::parse_storage_policy(storage));
}

}  // namespace

// checkpoint_module runs arbitrary module code (RNG, in-place updates of buffers): CONSERVATIVE
// keeps TorchScript from reordering, merging or dropping it. It is registered as a composite
// kernel: its autograd node is built by the implementation itself, and fake tensors flow through
// the module like any other composite op. checkpoint_boundary_bytes reads only metadata.
TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  m.def(torch::schema("checkpoint_module(Any module, Tensor[] inputs, str storage=\"keep\", "
                      "bool preserve_rng_state=True) -> Tensor[]",
                      c10::AliasAnalysisKind::CONSERVATIVE),
        &checkpoint_module);
  m.def("checkpoint_boundary_bytes(Tensor[] inputs, str storage=\"keep\") -> SymInt", &checkpoint_boundary_bytes);
}
