// Plans: building one (freezing and optimising the source module once, then a plan's module,
// executor and warm-ups at its size), running it, capturing it as a CUDA graph, and the
// constants it references.
#include "torch_ext/plan/plan.h"

#include <exception>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <vector>

#include <c10/core/GradMode.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/codegen/fuser/interface.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/tensorexpr_fuser.h>
#include <torch/csrc/jit/runtime/static/impl.h>

namespace torch_ext::plan {

namespace {

void add_tensor(const at::Tensor& t, Constants& out) {
  if (!t.defined()) {
    return;
  }
  if (t.is_mkldnn() || !t.has_storage()) {
    out.emplace(t.unsafeGetTensorImpl(), static_cast<int64_t>(t.numel() * t.element_size()));
    return;
  }
  out.emplace(t.storage().unsafeGetStorageImpl(), static_cast<int64_t>(t.storage().nbytes()));
}

void add_block_constants(torch::jit::Block* block, Constants& out) {
  for (torch::jit::Node* node : block->nodes()) {
    if (node->kind() == c10::prim::Constant || node->kind().toQualString() == std::string("prim::ConstantMKLDNNTensor")) {
      if (node->hasAttribute(c10::attr::value)) {
        const auto kind = node->kindOf(c10::attr::value);
        if (kind == torch::jit::AttributeKind::t) {
          add_tensor(node->t(c10::attr::value), out);
        } else if (kind == torch::jit::AttributeKind::ival && node->ival(c10::attr::value).isTensor()) {
          add_tensor(node->ival(c10::attr::value).toTensor(), out);
        }
      }
    }
    for (torch::jit::Block* inner : node->blocks()) {
      add_block_constants(inner, out);
    }
  }
}

// The memory a plan references: its graphs' tensor constants (frozen weights) and tensor
// attributes, each storage once. Plans are clones of one base module and share most of them.
Constants module_constants(const torch::jit::Module& module) {
  Constants out;
  for (const auto& method : module.get_methods()) {
    add_block_constants(method.graph()->block(), out);
  }
  for (const auto& attribute : module.named_attributes(/*recurse=*/true)) {
    if (attribute.value.isTensor()) {
      add_tensor(attribute.value.toTensor(), out);
    }
  }
  return out;
}

}  // namespace

// Here, where the static runtime's types are complete.
PlanCache::Plan::Plan() = default;
PlanCache::Plan::~Plan() = default;

torch::jit::Module PlanCache::frozen_locked() const {
  if (!frozen_ready_) {
    frozen_ = torch::jit::freeze(source_.clone(), std::nullopt, /*optimize_numerics=*/true);
    frozen_ready_ = true;
  }
  return frozen_;
}

torch::jit::Module PlanCache::optimized_locked() const {
  if (!optimized_ready_) {
    torch::jit::Module base = frozen_locked().clone();
    optimized_ = torch::jit::optimize_for_inference(base);
    optimized_ready_ = true;
  }
  return optimized_;
}

void PlanCache::capture_graph(Plan& plan, const std::vector<c10::IValue>& inputs) {
  std::unique_lock<std::mutex> capturing(plan.capture_mutex, std::try_to_lock);
  // Another thread is capturing it: this call runs the plan's executor meanwhile.
  if (!capturing.owns_lock() || !plan.capture_pending.load(std::memory_order_acquire)) return;
  const auto start = Clock::now();
  std::unique_ptr<CapturedGraph> graph;
  try {
    graph = capture_cuda_graph(
        [&plan](const std::vector<c10::IValue>& in) {
          return plan.static_module ? (*plan.static_module)(in) : (*plan.method)(in);
        },
        inputs);
  } catch (const std::exception& e) {
    graph_capture_failures_.fetch_add(1, std::memory_order_relaxed);
    TORCH_WARN("PlanCache: the plan for batch size ", plan.batch_size, " runs without a CUDA graph: ", message_of(e));
  }
  plan.record->build_ns.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  std::unique_lock<std::shared_mutex> lock(mutex_);
  if (graph) {
    const int64_t bytes = graph->bytes();
    plan.graph = std::move(graph);
    auto it = plans_.find(plan.batch_size);
    if (it != plans_.end() && it->second.get() == &plan) {  // an evicted plan's bytes are no longer counted
      plan.constants.emplace(plan.graph.get(), bytes);
      plan.bytes += bytes;
      constant_plans_[plan.graph.get()] = 1;
      plan_bytes_ += bytes;
      evict_locked(plan.batch_size);
    }
  }
  plan.capture_pending.store(false, std::memory_order_release);
}

bool PlanCache::fuses(const std::vector<c10::IValue>& example) const {
  return torch::jit::tensorExprFuserEnabled() &&
         (on_cuda(example) ? torch::jit::canFuseOnGPU() : torch::jit::canFuseOnCPU());
}

std::shared_ptr<PlanCache::Plan> PlanCache::build_plan(int64_t batch_size, const std::vector<c10::IValue>& example) {
  const auto start = Clock::now();
  auto plan = std::make_shared<Plan>();
  plan->batch_size = batch_size;
  plan->record = record(batch_size);
  try {
    {
      std::lock_guard<std::mutex> lock(source_mutex_);
      torch::jit::Module frozen;
      try {
        frozen = frozen_locked();
      } catch (const std::exception& e) {
        TORCH_CHECK(false, "PlanCache: freezing the module (", source_.type()->name()->qualifiedName(),
                    ") failed while building the plan for batch size ", batch_size, ": ", message_of(e));
      }
      const bool optimize = options_.optimize_for_inference && !options_.static_runtime;
      torch::jit::Module base = optimize ? optimized_locked() : frozen;
      const bool fusing = fuses(example);
      if (options_.static_runtime || options_.specialize_shapes.value_or(fusing)) {
        // A clone has its own graph executor, which specialises at this size (or a graph of its
        // own for the static runtime to rewrite); it shares the base's constants and (inplace)
        // its attributes: every plan references the same weights.
        plan->module = base.clone(/*inplace=*/true);
      } else {
        // Without specialisation a plan's graph would be the base's, compiled again: the plans
        // share the base, compiled once for every size, and a build is its warm-ups. Where
        // TorchScript does not fuse, its profiling executor guards nothing by shape and never
        // re-profiles; where it fuses, it would guard its fusion groups with the first size's
        // shapes and re-profile at the others, so the simple executor runs the base there. The
        // mode is chosen before the base's first run (its executor is created then), once.
        if (!base_executor_chosen_) {
          if (fusing) {
            torch::jit::toGraphFunction(base.get_method(options_.method).function())
                ._set_initial_executor_execution_mode(torch::jit::ExecutorExecutionMode::SIMPLE);
          }
          base_executor_chosen_ = true;
        }
        plan->module = base;
      }
      if (options_.static_runtime) {
        TORCH_CHECK(!on_cuda(example), "the static runtime runs CPU modules only; these inputs are on CUDA");
        plan->static_module = std::make_unique<torch::jit::StaticModule>(plan->module, /*is_frozen=*/true);
      }
    }
    plan->method = plan->module.get_method(options_.method);
    plan->constants = module_constants(plan->module);
    for (const auto& [storage, bytes] : plan->constants) plan->bytes += bytes;
    c10::AutoGradMode no_grad(false);
    for (int64_t i = 0; i < options_.warmup_calls; ++i) {
      const auto call_start = Clock::now();
      if (plan->static_module) {
        (*plan->static_module)(example);
      } else {
        (*plan->method)(example);
      }
      // The fastest warm-up after the profiling run: robust to a descheduled call.
      const int64_t ns = elapsed_ns(call_start);
      if (i == 1 || options_.warmup_calls == 1 || (i > 1 && ns < plan->warm_ns)) plan->warm_ns = ns;
    }
    // Captured once the plan is cached: by get_or_build on the building thread, or by the plan's
    // first run when the background worker built it.
    if (options_.cuda_graphs && on_cuda(example)) plan->capture_pending.store(true, std::memory_order_relaxed);
  } catch (const std::exception& e) {
    std::ostringstream shapes;
    for (size_t i = 0; i < example.size(); ++i) {
      shapes << (i ? ", " : "");
      if (example[i].isTensor()) shapes << example[i].toTensor().sizes(); else shapes << example[i].tagKind();
    }
    TORCH_CHECK(false, "PlanCache: building the plan for batch size ", batch_size, " failed on inputs of shape (",
                shapes.str(), "): ", message_of(e));
  }
  plan->build_ns = elapsed_ns(start);
  plan->record->builds.fetch_add(1, std::memory_order_relaxed);
  plan->record->build_ns.fetch_add(plan->build_ns, std::memory_order_relaxed);
  return plan;
}

c10::IValue PlanCache::run_plan(Plan& plan, const std::vector<c10::IValue>& inputs) {
  const auto start = Clock::now();
  c10::AutoGradMode no_grad(false);
  c10::IValue output;
  if (plan.capture_pending.load(std::memory_order_acquire)) capture_graph(plan, inputs);
  try {
    if (!plan.capture_pending.load(std::memory_order_acquire) && plan.graph && plan.graph->serves(inputs)) {
      output = plan.graph->replay(inputs);
      plan.record->graph_replays.fetch_add(1, std::memory_order_relaxed);
    } else if (plan.static_module) {
      std::unique_ptr<torch::jit::StaticRuntime> runtime;
      {
        std::lock_guard<std::mutex> lock(plan.runtimes_mutex);
        if (!plan.free_runtimes.empty()) {
          runtime = std::move(plan.free_runtimes.back());
          plan.free_runtimes.pop_back();
        }
      }
      if (!runtime) runtime = std::make_unique<torch::jit::StaticRuntime>(*plan.static_module);
      output = (*runtime)(inputs);
      std::lock_guard<std::mutex> lock(plan.runtimes_mutex);
      plan.free_runtimes.push_back(std::move(runtime));
    } else {
      output = (*plan.method)(inputs);
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "PlanCache: the plan for batch size ", plan.batch_size, " failed: ", message_of(e));
  }
  plan.record->plan_runs.fetch_add(1, std::memory_order_relaxed);
  plan.record->plan_ns.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  return output;
}

c10::IValue PlanCache::run_source(const std::vector<c10::IValue>& inputs) {
  c10::AutoGradMode no_grad(false);
  try {
    return source_.get_method(options_.method)(inputs);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "PlanCache: the module (", source_.type()->name()->qualifiedName(), ") rejected the inputs: ",
                message_of(e));
  }
}

}  // namespace torch_ext::plan
