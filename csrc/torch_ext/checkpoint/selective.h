#pragma once
// Native selective checkpointing: the `save` option. A checkpointed call keeps the outputs of the
// ops its policy names and its replay takes them instead of running those ops again, as torch's
// selective checkpointing does, but decided in C++: no Python dispatch mode per op.
//
// How: each op a policy names gets a kernel at the ADInplaceOrView dispatch key (below autograd,
// as torch's policy dispatch modes sit), registered once, the first time a policy names it. With
// no policy active on the thread the kernel only passes the call on. Inside a checkpointed call's
// forward (SelectiveScope::kRecord) it counts the op's occurrences and keeps the outputs of the
// ones to save (detached); inside the replay (kServe) it counts again and returns those outputs in
// place of running the op. Autograd above it records the op as usual (its inputs are saved for
// its backward), so the replay saves what the forward saved, in the same order.
//
// Spelling (each item of `save`):
//   "matmul"      aten::mm, addmm, bmm, baddbmm, counted together
//   "attention"   the fused scaled-dot-product attention ops (flash, efficient, cudnn, CPU flash)
//   "aten::mul.Tensor", "aten.mul.Tensor", "mul.Tensor", "aten::mul"  one op, or every overload
//   ITEM/N        every N-th occurrence of ITEM's ops in a call (the N-th, 2N-th, ...)
//   ITEM#i,j      only occurrences i, j (0-based) in a call
//   "dropout"     aten::bernoulli_ (float and Tensor p): the draw of the CPU's dropout mask
//   "torchtitan"  the preset torchtitan uses: "attention" and "matmul/2"
// A saved bernoulli_ (on the CPU, default generator) keeps its mask as bool, one byte an element,
// and the CPU generator's state after the draw; the replay copies the mask in and moves the
// generator to that state, so the random ops after it draw the forward's numbers. That needs a
// replay that restores the forward's RNG state (preserve_rng_state, the default): without it the
// mask is drawn again. An op called with dropout_p > 0 is never saved (its replay must draw the
// forward's random numbers again, in order); other random ops, views, other in-place ops and ops
// that decompose before autograd cannot be named. An output changed in place after the forward
// saved it is recomputed instead of served (its copy dropped as the forward ends), and so is every
// saved op in a second replay (a retained graph): the first replay takes the outputs. A change made
// through aten::_unsafe_view (how at::matmul returns a batched product) counts too: while a forward
// keeps outputs, that op's output shares its input's version counter.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/core/DispatchKeySet.h>

#include "torch_ext/checkpoint/replay_state.h"
#include "torch_ext/fields.h"

namespace c10 {
class OperatorHandle;
}

namespace torch_ext::checkpoint {

class SavePolicy;

// The `save` option: the items as spelled, and the policy they resolve to (null when empty).
class SaveSpec {
 public:
  SaveSpec() = default;
  // Resolves and validates the items; raises ValueError naming an item that names nothing savable.
  explicit SaveSpec(std::vector<std::string> items);
  const std::vector<std::string>& items() const { return items_; }
  const std::shared_ptr<const SavePolicy>& policy() const { return policy_; }
  bool operator==(const SaveSpec& other) const { return items_ == other.items_; }

 private:
  std::vector<std::string> items_;
  std::shared_ptr<const SavePolicy> policy_;
};

// One rule of a resolved policy, for inspection and for the compiled path (which hands the same
// decisions to torch.utils.checkpoint): the op (`aten::mm.default`), its group (ops counted
// together), the group's period (every N-th) and its chosen occurrences (empty: all).
struct SaveRule {
  std::string op;
  int64_t group;
  int64_t every;
  std::vector<int64_t> occurrences;
};
std::vector<SaveRule> save_rules(const SaveSpec& spec);

// The outputs one checkpointed call's forward saved, in order, for its replays.
class SavedOutputs {
 public:
  struct Entry {
    const void* op;  // the operator's identity (its OperatorHandle's definition)
    std::vector<c10::IValue> outputs;
    std::vector<uint32_t> versions;  // of each tensor output when saved
    bool served = false;             // handed to a replay (outputs then empty)
    std::optional<CpuRng> rng_after;  // a random op's: the generator's state after its draw
  };
  // Set by the caller before the forward: the replay restores the forward's RNG state, so a random
  // op's draw may be kept (without it the replay draws anew and must not be handed old numbers).
  bool rng_replayed = false;
  // A Python dispatch mode changes which ops some kernels call (torch's math attention adds its mask
  // in place unless a mode or a subclass is about); a replay under another setting than its forward
  // serves nothing.
  bool python_modes = false;
  std::vector<Entry> entries;
  // kProbe: each call of the policy's ops, as (op as 'aten::mm.default', occurrence, output bytes);
  // bytes -1: a later op of the forward changed the output in place, so it cannot be served.
  std::vector<std::tuple<std::string, int64_t, int64_t>> probed;

  // Whether a tensor output of `entry` changed in place after it was saved.
  static bool changed(const Entry& entry);
  // Drops the outputs changed in place since they were saved (their ops run in the replay), so that
  // they are not held for nothing: the forward's scope calls it as it ends.
  void release_changed();
};

// While alive, the policy's ops on this thread record into (kRecord) or are served from (kServe)
// `saved`; a null policy pauses any enclosing scope (a replay of a call without a policy). Scopes
// nest; `segment` names the call in errors and must outlive the scope (it is not copied: a scope
// is made twice for every checkpointed call).
class SelectiveScope {
 public:
  // kProbe only lists the calls the policy sees (what an op-level plan's occurrences refer to).
  enum class Mode { kRecord, kServe, kProbe };
  SelectiveScope(const SavePolicy* policy, SavedOutputs* saved, Mode mode, const std::string& segment);
  ~SelectiveScope();
  SelectiveScope(const SelectiveScope&) = delete;
  SelectiveScope& operator=(const SelectiveScope&) = delete;

  // The kernel's work for one call of `op` (arguments on the stack, results left there).
  void handle(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack);

 private:
  void record(const c10::OperatorHandle& op, const torch::jit::Stack& stack);
  // Replaces the arguments on the stack by the forward's outputs; false when they cannot be served
  // (the op must run).
  bool serve(const c10::OperatorHandle& op, int64_t occurrence, torch::jit::Stack& stack);
  // The same for a random in-place op (its mask copied into `self`, the generator moved on).
  void record_random(const c10::OperatorHandle& op, const at::Tensor& self);
  bool serve_random(const c10::OperatorHandle& op, int64_t occurrence, torch::jit::Stack& stack);
  // The forward's entry for this call of `op`; raises CheckpointError when the replay departs.
  SavedOutputs::Entry& next_entry(const c10::OperatorHandle& op, int64_t occurrence);

  const SavePolicy* policy_;
  SavedOutputs* saved_;
  Mode mode_;
  const std::string& segment_;
  std::vector<int64_t> counts_;  // occurrences so far, by group
  size_t cursor_ = 0;            // the next entry a replay serves
  SelectiveScope* enclosing_;
  bool tracks_unsafe_views_ = false;  // a forward or probe that keeps outputs (see unsafe_view_kernel)
};

}  // namespace torch_ext::checkpoint

namespace torch_ext {
// Exposed as an optional list (None: save nothing): operator schemas take no list default but None.
template <>
struct FieldCodec<checkpoint::SaveSpec> {
  using Exposed = std::optional<std::vector<std::string>>;
  static Exposed expose(const checkpoint::SaveSpec& spec) {
    return spec.items().empty() ? std::nullopt : Exposed(spec.items());
  }
  static checkpoint::SaveSpec parse(Exposed items, const char* /*name*/) {
    return checkpoint::SaveSpec(items ? std::move(*items) : std::vector<std::string>());
  }
};
}  // namespace torch_ext
