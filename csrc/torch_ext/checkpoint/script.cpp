#include "torch_ext/checkpoint/script.h"

#include <torch/csrc/jit/api/module.h>

namespace torch_ext::checkpoint {
namespace {

TensorList flatten_outputs(const c10::IValue& value, const std::string& name) {
  if (value.isTensor()) return {value.toTensor()};
  TensorList outputs;
  auto add = [&](const c10::IValue& element) {
    TORCH_CHECK(element.isTensor(), "checkpoint: ", name, " returned a ", element.tagKind(),
                " inside its result; a checkpointed TorchScript method must return a tensor or a tuple / "
                "list of tensors");
    outputs.push_back(element.toTensor());
  };
  if (value.isTuple()) {
    for (const auto& element : value.toTupleRef().elements()) add(element);
  } else if (value.isList()) {
    for (const auto& element : value.toListRef()) add(element);
  } else {
    add(value);
  }
  return outputs;
}

}  // namespace

TensorList checkpoint_script_module(const torch::jit::Module& module, const TensorList& inputs,
                                    CheckpointOptions options, const std::string& method) {
  const std::string name = module.type()->name() ? module.type()->name()->qualifiedName() : "ScriptModule";
  TORCH_CHECK(module.find_method(method).has_value(), "checkpoint_script_module: ", name, " has no method '",
              method, "'");
  if (options.name == "segment") options.name = name + "." + method;
  Segment segment = [module, method, name = options.name](const TensorList& args) -> TensorList {
    std::vector<c10::IValue> stack(args.begin(), args.end());
    return flatten_outputs(module.get_method(method)(std::move(stack)), name);
  };
  return checkpoint(segment, inputs, options);
}

TensorList checkpoint_script_module(const c10::IValue& module, const TensorList& inputs,
                                    CheckpointOptions options, const std::string& method) {
  TORCH_CHECK(module.isObject() && module.toObjectRef().type()->is_module(),
              "checkpoint_module: expected a TorchScript module (a scripted nn.Module) but got a ",
              module.tagKind());
  return checkpoint_script_module(torch::jit::Module(module.toObject()), inputs, std::move(options), method);
}

}  // namespace torch_ext::checkpoint
