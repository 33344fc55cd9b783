#pragma once
// Segment checkpointing: run a segment without keeping its intermediate activations, store
// only its inputs (the boundary), and recompute it with grad enabled during backward.
//
// checkpoint() is the C++ front door to the Frame (frame.h) that Python's checkpoints use too, its
// hooks in C++ (frame_hooks.h). It is reentrant and thread-safe: each call has its own frame. A
// Segment may be called from the autograd engine's thread during backward, so it must not rely on
// thread-local state of the thread that ran the forward.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/GradMode.h>
#include <c10/core/SymInt.h>

#include "torch_ext/checkpoint/frame.h"
#include "torch_ext/checkpoint/replay_state.h"
#include "torch_ext/checkpoint/selective.h"
#include "torch_ext/common/enum_names.h"
#include "torch_ext/fields.h"

namespace torch::autograd {
class SavedVariable;
}

namespace torch_ext::checkpoint {

using TensorList = std::vector<at::Tensor>;

// A segment maps its boundary inputs to its outputs; it may read other tensors (parameters,
// captured tensors), whose gradients flow through the graph as without checkpointing.
using Segment = std::function<TensorList(const TensorList&)>;

// How the boundary inputs are kept between forward and backward.
//   keep:    as they are (exact gradients).
//   offload: accelerator inputs are copied to pinned CPU memory asynchronously and copied back
//            in backward; CPU inputs are kept as they are (exact).
//   bf16 / fp16: float32 / float64 inputs are stored rounded to bfloat16 / float16 (lossy: the
//            replay sees the rounded inputs, so gradients are approximate; opt-in only).
enum class StoragePolicy { kKeep, kOffload, kBFloat16, kFloat16 };

}  // namespace torch_ext::checkpoint

namespace torch_ext {
template <>
struct EnumNames<checkpoint::StoragePolicy> {
  static constexpr std::string_view owner = "checkpoint", what = "storage policy";
  static constexpr std::array<std::pair<checkpoint::StoragePolicy, std::string_view>, 4> names{
      {{checkpoint::StoragePolicy::kKeep, "keep"}, {checkpoint::StoragePolicy::kOffload, "offload"},
       {checkpoint::StoragePolicy::kBFloat16, "bf16"}, {checkpoint::StoragePolicy::kFloat16, "fp16"}}};
};
}  // namespace torch_ext

namespace torch_ext::checkpoint {

struct CheckpointOptions {
  StoragePolicy storage = StoragePolicy::kKeep;
  bool preserve_rng_state = true;
  bool early_stop = true;
  SaveSpec save;
  std::string name = "segment";  // names the segment in error messages (not an option: its identity)

  static constexpr auto fields() {
    return std::make_tuple(
        field("storage", &CheckpointOptions::storage,
              "how the boundary inputs are kept between forward and backward: 'keep' (exact), 'offload' "
              "(accelerator inputs to pinned CPU memory), 'bf16' / 'fp16' (lossy, opt-in)"),
        field("preserve_rng_state", &CheckpointOptions::preserve_rng_state,
              "save and restore the RNG state of the CPU and of every device the inputs and params live on, "
              "so that the replay draws the same random numbers (dropout masks) as the forward"),
        field("early_stop", &CheckpointOptions::early_stop,
              "end a replay once every tensor its backward needs has been recomputed, when the recorded "
              "graph's ops after the last of them are worth skipping (by their sizes, never a timing); off, "
              "the replay runs the whole segment"),
        field("save", &CheckpointOptions::save,
              "ops whose outputs the forward keeps and the replay does not run again (native selective "
              "checkpointing, decided in C++): 'matmul', 'attention', 'torchtitan' (attention and every second "
              "matmul) or ops such as 'aten::mm', each optionally '/N' (every N-th) or '#i,j' (those occurrences); "
              "empty: none"));
  }
};

// segment(inputs), checkpointed: its forward keeps only its inputs (under the storage policy) and
// builds the ordinary autograd graph around placeholders for what it would have saved; the first
// backward that needs one replays the segment (frame.h). So every output has its own grad_fn, double
// backward and nested checkpoints work, and a tensor requiring grad that the segment captures gets
// its gradient. Under no_grad / inference mode the segment runs plainly. Raises CheckpointError
// naming the segment when a replay saves other tensors than its forward did, or when the forward
// wrote one of its inputs in place.
TensorList checkpoint(const Segment& segment, const TensorList& inputs, const CheckpointOptions& options = {});

// The error for a segment that wrote its input `index` in place during its forward, from which its
// replay would start.
CheckpointError input_written_in_place(const std::string& segment, size_t index);

// The dtype `t` is stored in under `policy` (bf16 / fp16 round float32 and float64 only).
at::ScalarType boundary_dtype(const at::Tensor& t, StoragePolicy policy);

// A boundary input a storage policy keeps as a copy (offloaded to pinned CPU memory, or rounded):
// a snapshot of the input at the forward, so a later in-place change of the input does not reach it.
struct StoredCopy {
  at::Tensor copy;
  c10::Device device{c10::kCPU};
  at::ScalarType dtype = at::kFloat;
  bool requires_grad = false;

  // The input again: on its device, in its dtype (rounded values under bf16 / fp16), detached,
  // requiring grad where the input did.
  at::Tensor restore() const;
};

// The one place a storage policy is applied: the copy `policy` keeps of `t`, or nullopt where it
// keeps `t` itself (keep; CPU tensors under offload; tensors other than float32 / float64 under
// bf16 / fp16).
std::optional<StoredCopy> store_copy(const at::Tensor& t, StoragePolicy policy);

// A boundary input as every front door keeps it for the replay: the storage policy's copy, or the
// input itself saved as autograd saves a tensor (through the enclosing frame's hooks, if any: that
// is what nests checkpoints).
class SavedInput {
 public:
  SavedInput(const at::Tensor& input, StoragePolicy policy);
  SavedInput(SavedInput&&) noexcept;
  ~SavedInput();
  // The input again, requiring grad where it did; an input kept as itself that was changed in place
  // since raises autograd's error.
  at::Tensor restore() const;
  // Whether the input itself is kept (no copy): saved under no hooks, it stays alive until backward.
  bool keeps_input() const { return !copy_; }

 private:
  std::optional<StoredCopy> copy_;
  std::unique_ptr<torch::autograd::SavedVariable> saved_;
};

// What a segment's forward and its replays run under, the same for every front door (each adds its
// segment, its inputs and its saved-tensor hooks): the RNG and autocast state of the forward, and the
// outputs the native policy (`save`) keeps.
struct SegmentRuns {
  ReplayState state;
  std::shared_ptr<const SavePolicy> policy;
  SavedOutputs selective;

  // On the thread about to run the forward; `devices`: those of the segment's inputs.
  static SegmentRuns begin(const std::vector<c10::Device>& devices, const CheckpointOptions& options);

  // The forward, run() calling the segment under the front door's hooks: the policy records what it
  // keeps and TorchScript functions keep their plans (Frame::SteadyScriptPlans).
  template <class Run>
  auto forward(const std::string& segment, Run&& run) {
    auto out = [&] {
      const Frame::SteadyScriptPlans steady;
      SelectiveScope scope(policy.get(), &selective, SelectiveScope::Mode::kRecord, segment);
      return run();
    }();
    state.forget_rng_if_untouched();
    return out;
  }

  // A replay, run() calling the segment under the front door's replay hooks: the forward's RNG and
  // autocast state, grad mode on, the policy serving what it kept, TorchScript plans held.
  template <class Run>
  void replay(const std::string& segment, Run&& run) {
    ReplayState::Guard guard(state);
    c10::AutoGradMode grad(true);
    SelectiveScope scope(policy.get(), &selective, SelectiveScope::Mode::kServe, segment);
    const Frame::SteadyScriptPlans steady;
    run();
  }
};

// Bytes the boundary of `inputs` occupies under `policy` (offloaded bytes count on the CPU);
// symbolic under dynamic shapes.
c10::SymInt boundary_bytes(const TensorList& inputs, StoragePolicy policy);

}  // namespace torch_ext::checkpoint
