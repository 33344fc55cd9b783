#include "torch_ext/plan/plan.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include <ATen/ops/cat.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/sum.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/codegen/fuser/interface.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/tensorexpr_fuser.h>
#include <torch/csrc/jit/runtime/static/impl.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/csrc/jit/serialization/pickle.h>

namespace torch_ext::plan {

namespace {

void atomic_max(std::atomic<int64_t>& target, int64_t value) {
  int64_t current = target.load(std::memory_order_relaxed);
  while (value > current && !target.compare_exchange_weak(current, value, std::memory_order_relaxed)) {
  }
}

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

MissMode miss_mode_from_string(const std::string& name) {
  if (name == "exact") return MissMode::exact;
  if (name == "pad") return MissMode::pad;
  if (name == "split") return MissMode::split;
  if (name == "auto") return MissMode::auto_;
  TORCH_CHECK(false, "PlanCache: unknown miss_mode '", name, "'; expected exact, pad, split or auto");
}

std::string to_string(MissMode mode) {
  switch (mode) {
    case MissMode::exact: return "exact";
    case MissMode::pad: return "pad";
    case MissMode::split: return "split";
    case MissMode::auto_: return "auto";
  }
  return "exact";
}

// Here, where the static runtime's types are complete.
PlanCache::Plan::Plan() = default;
PlanCache::Plan::~Plan() = default;

PlanCache::PlanCache(torch::jit::Module module, PlanCacheOptions options)
    : source_(std::move(module)), options_(std::move(options)) {
  TORCH_CHECK(options_.admit_after >= 1, "PlanCache: admit_after must be >= 1, got ", options_.admit_after);
  TORCH_CHECK(options_.max_plans >= 0, "PlanCache: max_plans must be >= 0, got ", options_.max_plans);
  TORCH_CHECK(options_.max_bytes >= 0, "PlanCache: max_bytes must be >= 0, got ", options_.max_bytes);
  TORCH_CHECK(options_.max_batch_size >= 0, "PlanCache: max_batch_size must be >= 0, got ", options_.max_batch_size);
  TORCH_CHECK(options_.warmup_calls >= 1, "PlanCache: warmup_calls must be >= 1, got ", options_.warmup_calls);
  for (int64_t d : options_.batch_dims) {
    TORCH_CHECK(d >= -1, "PlanCache: batch_dims entries must be >= 0, or -1 for an unbatched input; got ", d);
  }
  for (int64_t d : options_.output_batch_dims) {
    TORCH_CHECK(d >= 0, "PlanCache: output_batch_dims entries must be >= 0, got ", d);
  }
  TORCH_CHECK(source_.find_method(options_.method).has_value(), "PlanCache: the module (",
              source_.type()->name()->qualifiedName(), ") has no method '", options_.method, "'");
  TORCH_CHECK(!source_.is_training(), "PlanCache: the module (", source_.type()->name()->qualifiedName(),
              ") is in training mode and cannot be frozen; call .eval() on it first");
  if (options_.background_builds) {
    worker_ = std::thread([this] { worker_loop(); });
  }
}

PlanCache::~PlanCache() { stop_worker(); }

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

std::shared_ptr<PlanCache::SizeRecord> PlanCache::record(int64_t batch_size) {
  {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    auto it = records_.find(batch_size);
    if (it != records_.end()) return it->second;
  }
  std::unique_lock<std::shared_mutex> lock(mutex_);
  auto& slot = records_[batch_size];
  if (!slot) slot = std::make_shared<SizeRecord>(batch_size);
  return slot;
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

void PlanCache::insert_plan(const std::shared_ptr<Plan>& plan) {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  plan->last_used.store(clock_.fetch_add(1, std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  auto& slot = plans_[plan->batch_size];
  if (slot) release_constants_locked(*slot);
  slot = plan;
  for (const auto& [storage, bytes] : plan->constants) {
    if (constant_plans_[storage]++ == 0) plan_bytes_ += bytes;
  }
  pending_.erase(plan->batch_size);
  evict_locked(plan->batch_size);
}

void PlanCache::release_constants_locked(const Plan& plan) {
  for (const auto& [storage, bytes] : plan.constants) {
    auto it = constant_plans_.find(storage);
    if (--it->second == 0) {
      plan_bytes_ -= bytes;
      constant_plans_.erase(it);
    }
  }
}

void PlanCache::evict_locked(int64_t keep_batch_size) {
  auto over = [this] {
    const auto count = static_cast<int64_t>(plans_.size());
    return (options_.max_plans > 0 && count > options_.max_plans) ||
           (options_.max_bytes > 0 && plan_bytes_ > options_.max_bytes && count > 1);
  };
  while (over()) {
    auto victim = plans_.end();
    for (auto it = plans_.begin(); it != plans_.end(); ++it) {
      if (it->first == keep_batch_size) continue;
      if (victim == plans_.end() ||
          it->second->last_used.load(std::memory_order_relaxed) < victim->second->last_used.load(std::memory_order_relaxed)) {
        victim = it;
      }
    }
    if (victim == plans_.end()) break;
    release_constants_locked(*victim->second);
    victim->second->record->evictions.fetch_add(1, std::memory_order_relaxed);
    plans_.erase(victim);  // calls running it hold their own reference
  }
}

std::shared_ptr<PlanCache::Plan> PlanCache::get_or_build(int64_t batch_size, const std::vector<c10::IValue>& inputs) {
  std::promise<std::shared_ptr<Plan>> promise;
  std::shared_future<std::shared_ptr<Plan>> future;
  bool owner = false;
  {
    std::unique_lock<std::shared_mutex> lock(mutex_);
    if (auto it = plans_.find(batch_size); it != plans_.end()) return it->second;
    if (auto it = pending_.find(batch_size); it != pending_.end()) {
      future = it->second;
    } else {
      future = promise.get_future().share();
      pending_.emplace(batch_size, future);
      owner = true;
    }
  }
  if (!owner) {
    return future.get();  // only callers of this size wait; rethrows the builder's error
  }
  std::shared_ptr<Plan> plan;
  try {
    plan = build_plan(batch_size, inputs);
  } catch (...) {
    {
      std::unique_lock<std::shared_mutex> lock(mutex_);
      pending_.erase(batch_size);
    }
    build_failures_.fetch_add(1, std::memory_order_relaxed);
    promise.set_exception(std::current_exception());
    throw;
  }
  remember_example(inputs, batch_size);
  insert_plan(plan);
  promise.set_value(plan);
  if (plan->capture_pending.load(std::memory_order_acquire)) capture_graph(*plan, inputs);
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

c10::IValue PlanCache::serve_miss(int64_t batch_size, const std::vector<c10::IValue>& inputs, SizeRecord& rec) {
  const bool admitted = rec.sightings.fetch_add(1, std::memory_order_relaxed) + 1 >= options_.admit_after;
  std::optional<Route> route;
  if (options_.miss_mode != MissMode::exact) route = choose_route(batch_size);
  if (options_.background_builds) {
    if (admitted) {
      std::vector<c10::IValue> example;
      for (const auto& v : inputs) example.push_back(v.isTensor() ? c10::IValue(v.toTensor().clone()) : v);
      enqueue_build(batch_size, std::move(example));
    }
  } else if (!route && admitted) {
    auto plan = get_or_build(batch_size, inputs);
    return run_plan(*plan, inputs);
  }
  if (route) return run_route(*route, inputs, batch_size);
  rec.fallback_calls.fetch_add(1, std::memory_order_relaxed);
  auto output = run_source(inputs);
  remember_example(inputs, batch_size);
  return output;
}

c10::IValue PlanCache::run_size(int64_t batch_size, const std::vector<c10::IValue>& inputs, bool count_call) {
  const auto start = Clock::now();
  std::shared_ptr<Plan> plan;
  std::shared_ptr<SizeRecord> rec;
  std::shared_ptr<const Signature> signature;
  {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    if (auto it = plans_.find(batch_size); it != plans_.end()) plan = it->second;
    signature = signature_;
  }
  check_signature(signature.get(), inputs, batch_size);
  c10::IValue output;
  if (plan) {
    rec = plan->record;
    plan->last_used.store(clock_.fetch_add(1, std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    rec->hits.fetch_add(1, std::memory_order_relaxed);
    hit_lookup_ns_.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
    output = run_plan(*plan, inputs);
  } else {
    rec = record(batch_size);
    rec->misses.fetch_add(1, std::memory_order_relaxed);
    output = serve_miss(batch_size, inputs, *rec);
  }
  if (count_call) {
    const int64_t ns = elapsed_ns(start);
    rec->calls.fetch_add(1, std::memory_order_relaxed);
    rec->total_ns.fetch_add(ns, std::memory_order_relaxed);
    atomic_max(rec->max_ns, ns);
  }
  return output;
}

c10::IValue PlanCache::infer(const std::vector<c10::IValue>& inputs) {
  const int64_t batch_size = batch_size_of(inputs);
  TORCH_CHECK(options_.max_batch_size == 0 || batch_size <= options_.max_batch_size, "PlanCache: batch size ",
              batch_size, " is above max_batch_size ", options_.max_batch_size, "; use infer_batch to split it");
  return run_size(batch_size, inputs, /*count_call=*/true);
}

c10::IValue PlanCache::infer_batch(const std::vector<c10::IValue>& inputs) {
  const int64_t total = batch_size_of(inputs);
  std::vector<c10::IValue> outputs;
  for (int64_t offset = 0; offset < total;) {
    const int64_t size = select_batch_size(total - offset);
    outputs.push_back(infer(size == total ? inputs : slice_inputs(inputs, offset, size)));
    offset += size;
  }
  return concat_outputs(outputs);
}

int64_t PlanCache::select_batch_size(int64_t max_count) const {
  TORCH_CHECK(max_count > 0, "PlanCache: select_batch_size needs max_count > 0, got ", max_count);
  const int64_t cap = options_.max_batch_size > 0 ? std::min(max_count, options_.max_batch_size) : max_count;
  int64_t best = 0;
  std::shared_lock<std::shared_mutex> lock(mutex_);
  for (const auto& entry : plans_) {
    if (entry.first <= cap && entry.first > best) best = entry.first;
  }
  return best > 0 ? best : cap;
}

void PlanCache::preload(const std::vector<int64_t>& sizes, const std::vector<c10::IValue>& example_inputs,
                        const ProgressFn& progress) {
  for (int64_t n : sizes) {
    TORCH_CHECK(n > 0, "PlanCache.preload: batch sizes must be > 0, got ", n);
    TORCH_CHECK(options_.max_batch_size == 0 || n <= options_.max_batch_size, "PlanCache.preload: batch size ", n,
                " is above max_batch_size ", options_.max_batch_size);
  }
  std::shared_ptr<const Signature> tentative;  // set from example_inputs until a plan builds
  if (!example_inputs.empty()) {
    const int64_t n = batch_size_of(example_inputs);
    check_signature(example_inputs, n);
    std::shared_ptr<const Signature> before;
    {
      std::shared_lock<std::shared_mutex> lock(mutex_);
      before = signature_;
    }
    if (!before) {
      remember_example(example_inputs, n);
      std::shared_lock<std::shared_mutex> lock(mutex_);
      tentative = signature_;
    }
  }
  const auto total = static_cast<int64_t>(sizes.size());
  int64_t done = 0;
  for (int64_t n : sizes) {
    if (!contains(n)) {
      try {
        get_or_build(n, example_at(n));
      } catch (...) {
        if (tentative && done == 0) {
          // The example never produced a plan: it must not define the cache's inputs.
          std::unique_lock<std::shared_mutex> lock(mutex_);
          if (signature_ == tentative && plans_.empty()) {
            signature_.reset();
            example_.clear();
          }
        }
        throw;
      }
    }
    ++done;
    if (progress) progress(done, total, n);
  }
}

std::vector<int64_t> PlanCache::cached_sizes() const {
  std::vector<int64_t> sizes;
  {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    for (const auto& entry : plans_) sizes.push_back(entry.first);
  }
  std::sort(sizes.begin(), sizes.end());
  return sizes;
}

bool PlanCache::contains(int64_t batch_size) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  return plans_.count(batch_size) > 0;
}

std::optional<torch::jit::Module> PlanCache::plan_module(int64_t batch_size) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  auto it = plans_.find(batch_size);
  if (it == plans_.end()) return std::nullopt;
  return it->second->module;
}

PlanCacheStats PlanCache::stats() const {
  PlanCacheStats out;
  std::shared_lock<std::shared_mutex> lock(mutex_);
  out.plans = static_cast<int64_t>(plans_.size());
  out.plan_bytes = plan_bytes_;
  for (const auto& entry : pending_) {
    if (!plans_.count(entry.first)) ++out.pending_builds;
  }
  out.build_failures = build_failures_.load();
  out.graph_capture_failures = graph_capture_failures_.load();
  out.hit_lookup_seconds = seconds(hit_lookup_ns_.load());
  for (const auto& [n, rec] : records_) {
    SizeStats s;
    s.batch_size = n;
    s.calls = rec->calls.load();
    s.hits = rec->hits.load();
    s.misses = rec->misses.load();
    s.padded_calls = rec->padded_calls.load();
    s.split_calls = rec->split_calls.load();
    s.fallback_calls = rec->fallback_calls.load();
    s.builds = rec->builds.load();
    s.evictions = rec->evictions.load();
    s.plan_runs = rec->plan_runs.load();
    s.graph_replays = rec->graph_replays.load();
    s.build_seconds = seconds(rec->build_ns.load());
    s.total_seconds = seconds(rec->total_ns.load());
    s.max_seconds = seconds(rec->max_ns.load());
    s.plan_seconds = seconds(rec->plan_ns.load());
    s.padded_elements = rec->padded_elements.load();
    if (auto it = plans_.find(n); it != plans_.end()) {
      s.cached = true;
      s.plan_bytes = it->second->bytes;
      if (const auto& graph = it->second->graph) {
        s.cuda_graph = true;
        s.graph_bytes = graph->bytes();
        ++out.cuda_graphs;
      }
    }
    out.calls += s.calls;
    out.hits += s.hits;
    out.misses += s.misses;
    out.builds += s.builds;
    out.evictions += s.evictions;
    out.padded_calls += s.padded_calls;
    out.split_calls += s.split_calls;
    out.fallback_calls += s.fallback_calls;
    out.padded_elements += s.padded_elements;
    out.build_seconds += s.build_seconds;
    out.sizes.push_back(s);
  }
  std::sort(out.sizes.begin(), out.sizes.end(), [](const auto& a, const auto& b) { return a.batch_size < b.batch_size; });
  return out;
}

void PlanCache::reset_stats() {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  for (const auto& entry : records_) {
    auto& r = *entry.second;
    for (auto* counter : {&r.calls, &r.hits, &r.misses, &r.padded_calls, &r.split_calls, &r.fallback_calls, &r.builds,
                          &r.evictions, &r.plan_runs, &r.graph_replays, &r.padded_elements, &r.build_ns, &r.total_ns, &r.max_ns, &r.plan_ns}) {
      counter->store(0);
    }
  }
  build_failures_.store(0);
  graph_capture_failures_.store(0);
  hit_lookup_ns_.store(0);
}

void PlanCache::clear() {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  plans_.clear();
  constant_plans_.clear();
  plan_bytes_ = 0;
}

}  // namespace torch_ext::plan
