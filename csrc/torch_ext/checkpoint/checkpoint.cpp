#include "torch_ext/checkpoint/checkpoint.h"

#include "torch_ext/checkpoint/replay_state.h"

#include <algorithm>
#include <optional>
#include <exception>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <utility>

#include <ATen/ThreadLocalState.h>
#include <ATen/SequenceNumber.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <ATen/ops/empty_strided.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/custom_class.h>

namespace torch_ext::checkpoint {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::string describe(const at::Tensor& t) {
  std::ostringstream out;
  out << t.scalar_type() << t.sizes();
  return out.str();
}

bool is_differentiable(const at::Tensor& t) {
  return t.defined() && (at::isFloatingType(t.scalar_type()) || at::isComplexType(t.scalar_type()));
}

}  // namespace

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

at::Tensor StoredCopy::restore() const {
  at::Tensor t = copy.to(device, dtype, /*non_blocking=*/true).detach();
  if (requires_grad) t.requires_grad_(true);
  return t;
}

namespace {

struct OutputMeta {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
};

std::string describe(const OutputMeta& m) {
  std::ostringstream out;
  out << m.dtype << c10::IntArrayRef(m.sizes);
  return out.str();
}

struct SegmentState : torch::CustomClassHolder {
  Segment segment;
  CheckpointOptions options;
  size_t num_inputs = 0;
  TensorList params;
  std::vector<bool> input_requires_grad;
  std::vector<std::optional<StoredCopy>> stored;  // per input; nullopt: saved in ctx (kept as itself)
  ReplayState state;  // RNG and autocast state of the forward
  std::vector<OutputMeta> output_meta;
  SavedOutputs selective;  // what the `save` policy kept in the forward
};

[[noreturn]] void captured_tensor_error(const SegmentState& state, const torch::autograd::Node& node) {
  if (auto* accumulate = dynamic_cast<const torch::autograd::AccumulateGrad*>(&node)) {
    TORCH_CHECK(false, "checkpoint: ", state.options.name, " reads a tensor requiring grad (",
                describe(accumulate->variable),
                ") that is neither one of its inputs nor one of its params; its gradient would be lost. "
                "Pass it as an input, or checkpoint the module that owns it");
  }
  TORCH_CHECK(false, "checkpoint: ", state.options.name, " reads a tensor requiring grad computed outside the segment "
              "(through ", node.name(), ") that is neither one of its inputs nor one of its params; its gradient "
              "would be lost. Pass it as an input");
}

// Whether the sum of two gradients may be written into t, as the engine's InputBuffer decides: a
// plain dense tensor that nothing else references.
bool can_accumulate_in_place(const at::Tensor& t, const at::Tensor& other) {
  return !at::isTensorSubclassLike(t) && !t._is_zerotensor() && !t.is_nested() && !t.is_sparse() &&
         t.is_non_overlapping_and_dense() && t.use_count() == 1 && t.has_storage() && t.storage().use_count() == 1 &&
         t.sizes() == other.sizes() && t.scalar_type() == other.scalar_type() && t.device() == other.device();
}

void accumulate(at::Tensor& buffer, at::Tensor&& grad) {
  if (!grad.defined()) return;
  if (!buffer.defined()) {
    buffer = std::move(grad);
  } else if (can_accumulate_in_place(buffer, grad)) {
    buffer.add_(grad);
  } else if (can_accumulate_in_place(grad, buffer)) {
    buffer = std::move(grad.add_(buffer));
  } else {
    buffer = buffer + grad;  // the engine's InputBuffer order: the earlier gradient first
  }
}

// Back-propagates root_grads from the root edges through the replayed graph to the target edges and
// returns each target's gradient. This is the engine's algorithm for one graph small enough to
// need none of its machinery: nodes run once all their consumers have run, highest sequence
// number first (the engine's order, so sums of gradients round alike), with their tensor, pre
// and post hooks; each node's saved variables are released after it runs. The targets' own
// nodes (AccumulateGrad of inputs and params) never run: their gradients go to the checkpoint's
// node, whose consumers run them in the caller's backward, hooks included. A replayed node that
// leads to a tensor requiring grad other than the targets raises: its gradient would be lost.
class ReplayBackward {
 public:
  using Edge = torch::autograd::Edge;
  using Node = torch::autograd::Node;

  ReplayBackward(const SegmentState& state, const std::vector<Edge>& targets, uint64_t first_sequence_nr)
      : state_(state), targets_(targets), first_sequence_nr_(first_sequence_nr), target_grads_(targets.size()) {}

  variable_list run(const std::vector<Edge>& root_edges, variable_list root_grads) {
    discover(root_edges);
    for (size_t i = 0; i < root_edges.size(); ++i) {
      if (root_edges[i].function != nullptr) send(root_edges[i], std::move(root_grads[i]), /*count=*/false);
    }
    for (auto& [node, p] : pending_) {
      if (p.dependencies == 0) ready_.push_back(node);
    }
    std::make_heap(ready_.begin(), ready_.end(), by_sequence_nr);
    while (!ready_.empty()) {
      std::pop_heap(ready_.begin(), ready_.end(), by_sequence_nr);
      Node* node = ready_.back();
      ready_.pop_back();
      run_node(*node);
    }
    return std::move(target_grads_);
  }

 private:
  struct Pending {
    size_t dependencies = 0;
    variable_list buffer;
  };

  static bool by_sequence_nr(Node* a, Node* b) { return a->sequence_nr() < b->sequence_nr(); }

  std::ptrdiff_t target_slot(const Edge& edge) const {
    for (size_t k = 0; k < targets_.size(); ++k) {
      if (targets_[k].function.get() == edge.function.get() && targets_[k].input_nr == edge.input_nr) {
        return static_cast<std::ptrdiff_t>(k);
      }
    }
    return -1;
  }

  bool is_target_node(const Node* node) const {
    for (const auto& t : targets_) {
      if (t.function.get() == node) return true;
    }
    return false;
  }

  // Finds the replayed graph below the roots and counts each node's consumers.
  void discover(const std::vector<Edge>& root_edges) {
    std::vector<Node*> stack;
    for (const auto& edge : root_edges) {
      Node* node = edge.function.get();
      if (node != nullptr && !is_target_node(node) && pending_.try_emplace(node).second) stack.push_back(node);
    }
    while (!stack.empty()) {
      Node* node = stack.back();
      stack.pop_back();
      if (dynamic_cast<torch::autograd::AccumulateGrad*>(node) != nullptr || node->sequence_nr() < first_sequence_nr_) {
        captured_tensor_error(state_, *node);
      }
      for (const auto& edge : node->next_edges()) {
        Node* next = edge.function.get();
        if (next == nullptr || is_target_node(next)) continue;
        auto [it, inserted] = pending_.try_emplace(next);
        it->second.dependencies += 1;
        if (inserted) stack.push_back(next);
      }
    }
    for (auto& [node, p] : pending_) p.buffer.resize(node->num_inputs());
  }

  // Adds grad to what edge's node (or target) receives; with count, the node may become ready.
  void send(const Edge& edge, at::Tensor&& grad, bool count) {
    const auto slot = target_slot(edge);
    if (slot >= 0) {
      accumulate(target_grads_[static_cast<size_t>(slot)], std::move(grad));
      return;
    }
    auto& p = pending_[edge.function.get()];
    accumulate(p.buffer[edge.input_nr], std::move(grad));
    if (count && --p.dependencies == 0) {
      ready_.push_back(edge.function.get());
      std::push_heap(ready_.begin(), ready_.end(), by_sequence_nr);
    }
  }

  void run_node(Node& node) {
    variable_list inputs = std::move(pending_[&node].buffer);
    for (const auto& hook : node.tensor_pre_hooks()) inputs = (*hook)(inputs);
    for (const auto& [_, hook] : node.retains_grad_hooks()) inputs = (*hook)(inputs);
    for (const auto& hook : node.pre_hooks()) inputs = (*hook)(inputs);
    const bool has_post_hooks = !node.post_hooks().empty();
    variable_list hook_inputs = has_post_hooks ? inputs : variable_list();
    node.will_release_variables();
    variable_list outputs = node(std::move(inputs));
    node.release_variables();
    torch::autograd::validate_outputs(node.next_edges(), outputs, [&](const std::string& message) {
      return "checkpoint: replay of " + state_.options.name + ", node " + node.name() + ": " + message;
    });
    for (const auto& hook : node.post_hooks()) outputs = (*hook)(outputs, hook_inputs);
    const auto& edges = node.next_edges();
    for (size_t i = 0; i < edges.size() && i < outputs.size(); ++i) {
      if (edges[i].function != nullptr) send(edges[i], std::move(outputs[i]), /*count=*/true);
    }
  }

  const SegmentState& state_;
  const std::vector<Edge>& targets_;
  const uint64_t first_sequence_nr_;
  variable_list target_grads_;
  std::unordered_map<Node*, Pending> pending_;
  std::vector<Node*> ready_;  // a max-heap on sequence_nr
};

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<SegmentState> state,
                               at::TensorList tensors) {
    auto& s = *state;
    TensorList inputs(tensors.begin(), tensors.begin() + static_cast<std::ptrdiff_t>(s.num_inputs));
    std::vector<c10::Device> devices;
    bool any_requires_grad = false;
    for (const auto& t : tensors) {
      any_requires_grad = any_requires_grad || t.requires_grad();
      devices.push_back(t.device());
    }
    s.state = ReplayState::capture(devices, s.options.preserve_rng_state);
    s.selective.rng_replayed = s.options.preserve_rng_state;

    TensorList outputs;
    {
      SelectiveScope selective(s.options.save.policy().get(), &s.selective, SelectiveScope::Mode::kRecord,
                               s.options.name);
      outputs = s.segment(inputs);
    }
    // A forward that drew no random numbers replays without them: the replay can leave the RNG
    // alone (restoring it costs about as much as a tiny segment's bookkeeping).
    s.state.forget_rng_if_untouched();

    bool any_differentiable = false;
    s.output_meta.reserve(outputs.size());
    for (size_t i = 0; i < outputs.size(); ++i) {
      TORCH_CHECK(outputs[i].defined(), "checkpoint: ", s.options.name, " returned an undefined tensor as output ", i);
      any_differentiable = any_differentiable || is_differentiable(outputs[i]);
      s.output_meta.push_back({outputs[i].sizes().vec(), outputs[i].scalar_type()});
    }
    TORCH_CHECK(!any_requires_grad || any_differentiable, "checkpoint: ", s.options.name,
                " has inputs or params that require grad but none of its ", outputs.size(),
                " outputs can carry a gradient (no floating-point tensor output); do not checkpoint it, or "
                "return the differentiable result");

    s.input_requires_grad.reserve(inputs.size());
    s.stored.resize(inputs.size());
    TensorList kept;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto& input = inputs[i];
      s.input_requires_grad.push_back(input.requires_grad());
      s.stored[i] = store_copy(input, s.options.storage);
      kept.push_back(s.stored[i] ? at::Tensor() : input);
    }
    ctx->save_for_backward(std::move(kept));
    s.params.assign(tensors.begin() + static_cast<std::ptrdiff_t>(s.num_inputs), tensors.end());
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto state = c10::static_intrusive_pointer_cast<SegmentState>(ctx->saved_data["state"].toCapsule());
    auto& s = *state;
    TORCH_CHECK(!torch::autograd::GradMode::is_enabled(), "checkpoint: ", s.options.name,
                ": double backward (create_graph=True) through a checkpointed segment is not supported");
    const TensorList inputs = restore_inputs(s, ctx->get_saved_variables());
    const uint64_t first_sequence_nr = at::sequence_number::peek();
    TensorList outputs;
    {
      ReplayState::Guard replay_state(s.state);
      torch::autograd::AutoGradMode grad_mode(true);
      SelectiveScope selective(s.options.save.policy().get(), &s.selective, SelectiveScope::Mode::kServe,
                               s.options.name);
      outputs = s.segment(inputs);
    }
    check_replayed_outputs(s, outputs);
    std::vector<torch::autograd::Edge> root_edges;
    variable_list root_grads;
    bool any_grad = false;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!grad_outputs[i].defined()) continue;
      any_grad = true;
      if (outputs[i].requires_grad()) {
        root_edges.push_back(torch::autograd::impl::gradient_edge(outputs[i]));
        root_grads.push_back(grad_outputs[i]);
      }
    }
    // Backward needs the outputs' nodes, not their values: an output that no node saved is freed
    // here rather than living through the segment's backward (torch's early stop never
    // materialises it at all).
    outputs.clear();

    variable_list result(1 + s.num_inputs + s.params.size());
    if (!any_grad) return result;
    TORCH_CHECK(!root_edges.empty(), "checkpoint: none of the outputs of ", s.options.name,
                " requires grad in the replay although its inputs do: the segment detaches its result "
                "from its inputs and params, so no gradient can flow through it");
    std::vector<torch::autograd::Edge> targets;
    std::vector<size_t> target_slots;
    auto add_target = [&](const at::Tensor& t, size_t slot) {
      if (!t.requires_grad()) return;
      targets.push_back(torch::autograd::impl::gradient_edge(t));
      target_slots.push_back(slot);
    };
    for (size_t i = 0; i < inputs.size(); ++i) add_target(inputs[i], 1 + i);
    for (size_t i = 0; i < s.params.size(); ++i) add_target(s.params[i], 1 + s.num_inputs + i);
    variable_list grads = back_propagate(s, root_edges, std::move(root_grads), targets, first_sequence_nr);
    for (size_t k = 0; k < grads.size(); ++k) result[target_slots[k]] = std::move(grads[k]);
    return result;
  }

 private:
  // The boundary inputs as the forward saw them, detached, requiring grad where they did.
  static TensorList restore_inputs(const SegmentState& s, const variable_list& kept) {
    TensorList inputs;
    inputs.reserve(s.num_inputs);
    for (size_t i = 0; i < s.num_inputs; ++i) {
      const at::Tensor restored = s.stored[i] ? s.stored[i]->restore() : kept[i];
      at::Tensor detached = restored.detach();
      if (s.input_requires_grad[i]) detached.requires_grad_(true);
      inputs.push_back(std::move(detached));
    }
    return inputs;
  }

  static void check_replayed_outputs(const SegmentState& s, const TensorList& outputs) {
    TORCH_CHECK(outputs.size() == s.output_meta.size(), "checkpoint: the replay of ", s.options.name, " returned ",
                outputs.size(), " tensors but its forward returned ", s.output_meta.size());
    for (size_t i = 0; i < outputs.size(); ++i) {
      const auto& meta = s.output_meta[i];
      TORCH_CHECK(outputs[i].defined() && outputs[i].sizes() == c10::IntArrayRef(meta.sizes) &&
                      outputs[i].scalar_type() == meta.dtype,
                  "checkpoint: the replay of ", s.options.name, " produced output ", i, " as ",
                  outputs[i].defined() ? describe(outputs[i]) : std::string("undefined"),
                  " but the forward produced ", describe(meta),
                  "; the segment must compute the same shapes from the same inputs");
    }
  }

  static variable_list back_propagate(const SegmentState& s, const std::vector<torch::autograd::Edge>& root_edges,
                                      variable_list root_grads, const std::vector<torch::autograd::Edge>& targets,
                                      uint64_t first_sequence_nr) {
    const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
    if (exec_info == nullptr || exec_info->empty()) {
      return ReplayBackward(s, targets, first_sequence_nr).run(root_edges, std::move(root_grads));
    }
    // The running backward only needs some gradients (autograd.grad, backward(inputs=...)), and
    // nodes consult its plan to skip the others, which would skip the replay's. The replay is
    // not part of that plan: it runs on a thread where no backward is current.
    const at::ThreadLocalState thread_locals;
    variable_list grads;
    std::exception_ptr error;
    std::thread worker([&] {
      try {
        at::ThreadLocalStateGuard guard(thread_locals);
        grads = ReplayBackward(s, targets, first_sequence_nr).run(root_edges, std::move(root_grads));
      } catch (...) {
        error = std::current_exception();
      }
    });
    worker.join();
    if (error) std::rethrow_exception(error);
    return grads;
  }
};

}  // namespace

TensorList checkpoint(const Segment& segment, const TensorList& inputs, const TensorList& params,
                      const CheckpointOptions& options) {
  TORCH_CHECK(static_cast<bool>(segment), "checkpoint: ", options.name, " is an empty callable");
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK(inputs[i].defined(), "checkpoint: input ", i, " of ", options.name, " is an undefined tensor");
  }
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].defined(), "checkpoint: param ", i, " of ", options.name, " is an undefined tensor");
  }
  bool needs_graph = false;
  if (torch::autograd::GradMode::is_enabled()) {
    for (const auto& t : inputs) needs_graph = needs_graph || t.requires_grad();
    for (const auto& t : params) needs_graph = needs_graph || t.requires_grad();
  }
  if (!needs_graph) return segment(inputs);

  auto state = c10::make_intrusive<SegmentState>();
  state->segment = segment;
  state->options = options;
  state->num_inputs = inputs.size();
  if (params.empty()) return CheckpointFunction::apply(std::move(state), at::TensorList(inputs));
  TensorList all;
  all.reserve(inputs.size() + params.size());
  all.insert(all.end(), inputs.begin(), inputs.end());
  all.insert(all.end(), params.begin(), params.end());
  return CheckpointFunction::apply(std::move(state), at::TensorList(all));
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
