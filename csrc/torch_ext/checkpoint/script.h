#pragma once
// checkpoint() for TorchScript modules: the segment is a method of a torch::jit::Module. Same
// thread-safety as checkpoint(); the module must not be changed while a checkpointed forward or
// its backward runs.
#include <string>

#include <ATen/core/ivalue.h>

#include "torch_ext/checkpoint/checkpoint.h"

namespace torch::jit {
struct Module;
}

namespace torch_ext::checkpoint {

// module.<method>(*inputs), checkpointed. The method must return a tensor or a tuple / list of
// tensors (returned flattened).
TensorList checkpoint_script_module(const torch::jit::Module& module, const TensorList& inputs,
                                    CheckpointOptions options = {}, const std::string& method = "forward");

// The same for a module held in an IValue (what TorchScript passes to torch_ext::checkpoint_module).
TensorList checkpoint_script_module(const c10::IValue& module, const TensorList& inputs,
                                    CheckpointOptions options = {}, const std::string& method = "forward");

}  // namespace torch_ext::checkpoint
