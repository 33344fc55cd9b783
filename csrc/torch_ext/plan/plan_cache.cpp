// The cache's bookkeeping: its plans by batch size, one build per size however many calls miss
// it, eviction (least recently used, by max_plans / max_bytes), per-size records and stats, and
// the entry points that route a call to its plan, to a pad / split route or to a build.
#include "torch_ext/plan/plan.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace torch_ext::plan {

namespace {

void atomic_max(std::atomic<int64_t>& target, int64_t value) {
  int64_t current = target.load(std::memory_order_relaxed);
  while (value > current && !target.compare_exchange_weak(current, value, std::memory_order_relaxed)) {
  }
}

}  // namespace

MissMode miss_mode_from_string(const std::string& name) {
  if (name == "exact") return MissMode::exact;
  if (name == "pad") return MissMode::pad;
  if (name == "split") return MissMode::split;
  if (name == "auto") return MissMode::auto_;
  TORCH_CHECK_VALUE(false, "PlanCache: unknown miss_mode '", name, "'; expected exact, pad, split or auto");
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

void PlanCacheOptions::validate() const {
  TORCH_CHECK_VALUE(admit_after >= 1, "PlanCache: admit_after must be >= 1, got ", admit_after);
  TORCH_CHECK_VALUE(max_plans >= 0, "PlanCache: max_plans must be >= 0, got ", max_plans);
  TORCH_CHECK_VALUE(max_bytes >= 0, "PlanCache: max_bytes must be >= 0, got ", max_bytes);
  TORCH_CHECK_VALUE(max_batch_size >= 0, "PlanCache: max_batch_size must be >= 0, got ", max_batch_size);
  TORCH_CHECK_VALUE(warmup_calls >= 1, "PlanCache: warmup_calls must be >= 1, got ", warmup_calls);
  for (int64_t d : batch_dims) {
    TORCH_CHECK_VALUE(d >= -1, "PlanCache: batch_dims entries must be >= 0, or -1 for an unbatched input; got ", d);
  }
  for (int64_t d : output_batch_dims) {
    TORCH_CHECK_VALUE(d >= 0, "PlanCache: output_batch_dims entries must be >= 0, got ", d);
  }
}

PlanCache::PlanCache(torch::jit::Module module, PlanCacheOptions options)
    : source_(std::move(module)), options_(std::move(options)) {
  options_.validate();
  TORCH_CHECK(source_.find_method(options_.method).has_value(), "PlanCache: the module (",
              source_.type()->name()->qualifiedName(), ") has no method '", options_.method, "'");
  TORCH_CHECK(!source_.is_training(), "PlanCache: the module (", source_.type()->name()->qualifiedName(),
              ") is in training mode and cannot be frozen; call .eval() on it first");
  if (options_.background_builds) {
    worker_ = std::thread([this] { worker_loop(); });
  }
}

PlanCache::~PlanCache() { stop_worker(); }

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
