#pragma once
// checkpoint() front doors for LibTorch's torch::nn modules (header-only: include it only where
// torch::nn is used). Same thread-safety as checkpoint(): the module must not be changed while a
// checkpointed forward or its backward runs.
#include <memory>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>

#include "torch_ext/checkpoint/checkpoint.h"

namespace torch_ext::checkpoint {

// module->forward(input), checkpointed. M is a module holder (torch::nn::Linear) or a
// std::shared_ptr to a module whose forward takes and returns one tensor.
template <typename M>
at::Tensor checkpoint_module(const M& module, const at::Tensor& input, CheckpointOptions options = {}) {
  if (options.name == "segment") options.name = module->name();
  Segment segment = [held = M(module)](const TensorList& inputs) mutable -> TensorList { return {held->forward(inputs[0])}; };
  return checkpoint(segment, {input}, options)[0];
}

// torch::nn::Sequential in `segments` checkpointed segments of consecutive modules (the last
// segment takes the remainder), like torch.utils.checkpoint.checkpoint_sequential.
inline at::Tensor checkpoint_sequential(const torch::nn::Sequential& sequential, int64_t segments,
                                        const at::Tensor& input, CheckpointOptions options = {}) {
  const int64_t n = static_cast<int64_t>(sequential->size());
  TORCH_CHECK(segments >= 1 && segments <= std::max<int64_t>(n, 1), "checkpoint_sequential: segments=", segments,
              " must be between 1 and the number of modules (", n, ")");
  const int64_t per_segment = n / segments;
  at::Tensor x = input;
  for (int64_t start = 0, index = 0; start < n; ++index) {
    const int64_t end = index == segments - 1 ? n : start + per_segment;
    Segment segment = [impl = sequential.ptr(), start, end](const TensorList& inputs) -> TensorList {
      at::Tensor y = inputs[0];
      for (auto it = impl->begin() + start; it != impl->begin() + end; ++it) y = it->forward(y);
      return {y};
    };
    CheckpointOptions segment_options = options;
    segment_options.name = "Sequential[" + std::to_string(start) + ":" + std::to_string(end) + "]";
    x = checkpoint(segment, {x}, segment_options)[0];
    start = end;
  }
  return x;
}

}  // namespace torch_ext::checkpoint
