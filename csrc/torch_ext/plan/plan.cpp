// Plans, whatever runs them: building one (its executor from script_plan.cpp, then its warm-ups
// at its size, timed), running it (by its CUDA graph where it has one), and capturing that graph
// once the plan is cached.
#include "torch_ext/plan/plan.h"

#include <exception>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <vector>

#include <c10/core/GradMode.h>

namespace torch_ext::plan {

std::shared_ptr<PlanCache::Plan> PlanCache::build_plan(int64_t batch_size, const std::vector<c10::IValue>& example) {
  const auto start = Clock::now();
  auto plan = std::make_shared<Plan>();
  plan->batch_size = batch_size;
  plan->record = record(batch_size);
  try {
    make_script_plan(*plan, example);
    for (const auto& [storage, bytes] : plan->constants) plan->bytes += bytes;
    c10::AutoGradMode no_grad(false);
    for (int64_t i = 0; i < options_.warmup_calls; ++i) {
      const auto call_start = Clock::now();
      plan->run_single(example);
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
    } else {
      output = plan.run(inputs);
    }
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "PlanCache: the plan for batch size ", plan.batch_size, " failed: ", message_of(e));
  }
  plan.record->plan_runs.fetch_add(1, std::memory_order_relaxed);
  plan.record->plan_ns.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
  return output;
}

void PlanCache::capture_graph(Plan& plan, const std::vector<c10::IValue>& inputs) {
  std::unique_lock<std::mutex> capturing(plan.capture_mutex, std::try_to_lock);
  // Another thread is capturing it: this call runs the plan's executor meanwhile.
  if (!capturing.owns_lock() || !plan.capture_pending.load(std::memory_order_acquire)) return;
  const auto start = Clock::now();
  std::unique_ptr<CapturedGraph> graph;
  try {
    graph = capture_cuda_graph([&plan](const std::vector<c10::IValue>& in) { return plan.run_single(in); }, inputs);
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

}  // namespace torch_ext::plan
