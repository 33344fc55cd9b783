// torch.ops.torch_ext.checkpoint_module / checkpoint_boundary_bytes and
// torch.classes.torch_ext.CheckpointOptions: segment checkpointing for TorchScript (checkpoint a
// scripted submodule from scripted code) and the options every front door passes.
#include <string>
#include <vector>

#include <ATen/core/stack.h>
#include <torch/library.h>

#include "torch_ext/checkpoint/script.h"
#include "torch_ext/class_fields.h"

namespace {

using torch_ext::checkpoint::CheckpointOptions;

// checkpoint_module(Any module, Tensor[] inputs, <CheckpointOptions as keywords>) -> Tensor[]
void checkpoint_module(const c10::OperatorHandle& /*op*/, torch::jit::Stack* stack_pointer) {
  auto& stack = *stack_pointer;
  const size_t n = 2 + torch_ext::field_count<CheckpointOptions>();
  const c10::IValue* args = &stack[stack.size() - n];
  const CheckpointOptions options = torch_ext::options_from_stack<CheckpointOptions>(args + 2);
  auto inputs = args[1].toTensorVector();
  auto outputs = torch_ext::checkpoint::checkpoint_script_module(args[0], inputs, options);
  torch::jit::drop(stack, n);
  torch::jit::push(stack, std::move(outputs));
}

c10::SymInt checkpoint_boundary_bytes(std::vector<at::Tensor> inputs, c10::string_view storage) {
  return torch_ext::checkpoint::boundary_bytes(inputs, torch_ext::enum_from_name<torch_ext::checkpoint::StoragePolicy>(storage));
}

}  // namespace

// checkpoint_module runs arbitrary module code (RNG, in-place updates of buffers): CONSERVATIVE
// keeps TorchScript from reordering, merging or dropping it. It is registered as a composite
// kernel: its autograd node is built by the implementation itself, and fake tensors flow through
// the module like any other composite op. checkpoint_boundary_bytes reads only metadata.
TORCH_LIBRARY_FRAGMENT(torch_ext, m) {
  torch_ext::register_options<CheckpointOptions>(m, "CheckpointOptions",
                                                 "Options of a checkpointed segment (checkpoint.h)");
  const std::string schema =
      "checkpoint_module(Any module, Tensor[] inputs, " + torch_ext::options_schema<CheckpointOptions>() + ") -> Tensor[]";
  m.def(torch::schema(schema.c_str(), c10::AliasAnalysisKind::CONSERVATIVE));
  m.impl("checkpoint_module", c10::DispatchKey::CompositeImplicitAutograd,
         torch::CppFunction::makeFromBoxedFunction<&checkpoint_module>());
  m.def("checkpoint_boundary_bytes(Tensor[] inputs, str storage) -> SymInt", &checkpoint_boundary_bytes);
}
