// TorchScript plans: the source module frozen and optimised once, each plan's module (that base
// or a clone of it) and executor (graph executor or static runtime), the constants it
// references, and runs of the source module for misses no plan serves.
#include "torch_ext/plan/plan.h"

#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
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

c10::IValue PlanCache::Plan::run(const std::vector<c10::IValue>& inputs) {
  if (!static_module) return (*method)(inputs);
  std::unique_ptr<torch::jit::StaticRuntime> runtime;
  {
    std::lock_guard<std::mutex> lock(runtimes_mutex);
    if (!free_runtimes.empty()) {
      runtime = std::move(free_runtimes.back());
      free_runtimes.pop_back();
    }
  }
  if (!runtime) runtime = std::make_unique<torch::jit::StaticRuntime>(*static_module);
  c10::IValue output = (*runtime)(inputs);
  std::lock_guard<std::mutex> lock(runtimes_mutex);
  free_runtimes.push_back(std::move(runtime));
  return output;
}

c10::IValue PlanCache::Plan::run_single(const std::vector<c10::IValue>& inputs) {
  return static_module ? (*static_module)(inputs) : (*method)(inputs);
}

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

bool PlanCache::fuses(const std::vector<c10::IValue>& example) const {
  return torch::jit::tensorExprFuserEnabled() &&
         (on_cuda(example) ? torch::jit::canFuseOnGPU() : torch::jit::canFuseOnCPU());
}

void PlanCache::make_script_plan(Plan& plan, const std::vector<c10::IValue>& example) {
  {
    std::lock_guard<std::mutex> lock(source_mutex_);
    torch::jit::Module frozen;
    try {
      frozen = frozen_locked();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "PlanCache: freezing the module (", source_.type()->name()->qualifiedName(),
                  ") failed while building the plan for batch size ", plan.batch_size, ": ", message_of(e));
    }
    const bool optimize = options_.optimize_for_inference && !options_.static_runtime;
    torch::jit::Module base = optimize ? optimized_locked() : frozen;
    const bool fusing = fuses(example);
    if (options_.static_runtime || options_.specialize_shapes.value_or(fusing)) {
      // A clone has its own graph executor, which specialises at this size (or a graph of its
      // own for the static runtime to rewrite); it shares the base's constants and (inplace)
      // its attributes: every plan references the same weights.
      plan.module = base.clone(/*inplace=*/true);
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
      plan.module = base;
    }
    if (options_.static_runtime) {
      TORCH_CHECK(!on_cuda(example), "the static runtime runs CPU modules only; these inputs are on CUDA");
      plan.static_module = std::make_unique<torch::jit::StaticModule>(plan.module, /*is_frozen=*/true);
    }
  }
  plan.method = plan.module.get_method(options_.method);
  plan.constants = module_constants(plan.module);
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
