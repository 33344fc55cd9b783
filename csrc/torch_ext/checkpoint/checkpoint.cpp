#include "torch_ext/checkpoint/checkpoint.h"

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ops/empty_strided.h>
#include <torch/csrc/autograd/saved_variable.h>

#include "torch_ext/checkpoint/frame_hooks.h"

namespace torch_ext::checkpoint {

at::ScalarType boundary_dtype(const at::Tensor& t, StoragePolicy policy) {
  if (t.scalar_type() != at::kFloat && t.scalar_type() != at::kDouble) return t.scalar_type();
  if (policy == StoragePolicy::kBFloat16) return at::kBFloat16;
  if (policy == StoragePolicy::kFloat16) return at::kHalf;
  return t.scalar_type();
}

std::optional<StoredCopy> store_copy(const at::Tensor& t, StoragePolicy policy) {
  const at::ScalarType dtype = boundary_dtype(t, policy);
  const bool offload = policy == StoragePolicy::kOffload && t.device().type() != c10::kCPU;
  if (dtype == t.scalar_type() && !offload) return std::nullopt;
  StoredCopy stored{{}, t.device(), t.scalar_type(), t.requires_grad()};
  if (offload) {
    stored.copy = at::empty_strided(t.sizes(), t.strides(), t.options().device(c10::kCPU).pinned_memory(true));
    stored.copy.copy_(t.detach(), /*non_blocking=*/true);
  } else {
    stored.copy = t.detach().to(dtype);
  }
  return stored;
}

SavedInput::SavedInput(const at::Tensor& input, StoragePolicy policy) : copy_(store_copy(input, policy)) {
  if (!copy_) saved_ = std::make_unique<torch::autograd::SavedVariable>(input, /*is_output=*/false);
}

SavedInput::SavedInput(SavedInput&&) noexcept = default;
SavedInput::~SavedInput() = default;

at::Tensor SavedInput::restore() const { return copy_ ? copy_->restore() : saved_->unpack(); }

at::Tensor StoredCopy::restore() const {
  at::Tensor t = copy.to(device, dtype, /*non_blocking=*/true).detach();
  if (requires_grad) t.requires_grad_(true);
  return t;
}

CheckpointError input_written_in_place(const std::string& segment, size_t index) {
  return CheckpointError("checkpoint: " + segment + " wrote its input " + std::to_string(index) +
                         " in place during its forward; its replay would start from the written values. Clone the "
                         "input inside the segment, or do not checkpoint it");
}

namespace {

// What a frame's replay needs: the segment, its inputs and what its forward ran under.
struct Call {
  Segment segment;
  std::vector<SavedInput> inputs;
  SegmentRuns runs;
};

void replay(Call& call, Frame& frame, int64_t graph_task) {
  TensorList inputs;
  inputs.reserve(call.inputs.size());
  for (const auto& input : call.inputs) inputs.push_back(input.restore());
  call.runs.replay(frame.name(), [&] {
    const FrameHooks hooks(frame.shared_from_this(), graph_task);
    call.segment(inputs);  // a stop ends it with an exception: Frame::unpack() tells
  });
}

}  // namespace

TensorList checkpoint(const Segment& segment, const TensorList& inputs, const CheckpointOptions& options) {
  TORCH_CHECK(static_cast<bool>(segment), "checkpoint: ", options.name, " is an empty callable");
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(inputs[i].defined(), "checkpoint: input ", i, " of ", options.name, " is an undefined tensor");
  }
  if (!c10::GradMode::is_enabled()) return segment(inputs);

  auto call = std::make_shared<Call>();
  call->segment = segment;
  call->inputs.reserve(inputs.size());
  std::vector<c10::Device> devices;
  std::vector<uint32_t> versions;
  for (const auto& t : inputs) {
    call->inputs.emplace_back(t, options.storage);
    devices.push_back(t.device());
    versions.push_back(t._version());
  }
  // Begun after its inputs are saved (frame.h: how an enclosing frame sees a nested one).
  auto frame = std::make_shared<Frame>(options.name, options.early_stop);
  if (!saved_tensor_hooks_active()) {
    TensorList kept;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (call->inputs[i].keeps_input()) kept.push_back(inputs[i]);
    }
    frame->keep_free_tensors(kept);
  }
  call->runs = SegmentRuns::begin(devices, options);
  frame->set_recompute([call](Frame& f, int64_t graph_task) { replay(*call, f, graph_task); });
  TensorList outputs = call->runs.forward(frame->name(), [&] {
    const FrameHooks hooks(frame);
    return segment(inputs);
  });
  frame->finish_forward(outputs);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i]._version() != versions[i]) throw input_written_in_place(frame->name(), i);
  }
  return outputs;
}

SegmentRuns SegmentRuns::begin(const std::vector<c10::Device>& devices, const CheckpointOptions& options) {
  SegmentRuns runs;
  runs.state = ReplayState::capture(devices, options.preserve_rng_state);
  runs.selective.rng_replayed = options.preserve_rng_state;
  runs.policy = options.save.policy();
  return runs;
}

c10::SymInt boundary_bytes(const TensorList& inputs, StoragePolicy policy) {
  c10::SymInt total = 0;
  for (const auto& t : inputs) {
    if (!t.defined()) continue;
    total = total + t.sym_numel() * static_cast<int64_t>(c10::elementSize(boundary_dtype(t, policy)));
  }
  return total;
}

}  // namespace torch_ext::checkpoint
