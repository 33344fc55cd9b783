#pragma once
// PlanCache: per-batch-size specialised TorchScript plans for dynamic-batch serving.
//
// A plan is the source module frozen (torch::jit::freeze), optimised for inference
// (torch::jit::optimize_for_inference) or run by TorchScript's static runtime, and warmed
// at one batch size; nothing re-profiles when the size changes. Where TorchScript fuses on the
// device, each plan is a clone whose profiling executor specialises to its size once; elsewhere
// the plans share the optimised module, compiled once for every size.
// infer() picks the plan for the batch's size; a miss is served by building the exact plan,
// by padding to a larger cached size, by splitting into cached sizes, or by the source module
// while the plan builds in the background.
//
// Thread safety: every public method may be called from many threads at once. Hits take a
// shared (reader) lock only and never wait for a build. A build's warm-up runs outside every
// lock; only its clone step (milliseconds, if any) is serialised with other builds, since
// TorchScript's CompilationUnit is not thread-safe. Concurrent misses of one size build once
// and wait for that build; other sizes do not. Evicted plans stay alive until the calls
// running them finish.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/csrc/jit/api/module.h>

#include "torch_ext/fields.h"

namespace torch_ext::plan {

class CapturedGraph;

enum class MissMode {
  exact,  // build the plan for the exact size
  pad,    // pad up to the smallest cached size >= n, slice the outputs; build if none
  split,  // run as a sum of cached sizes, largest first; build if they cannot cover n
  auto_,  // pad or split, whichever the measured latencies say is cheaper; build if neither
};

MissMode miss_mode_from_string(const std::string& name);
std::string to_string(MissMode mode);

}  // namespace torch_ext::plan

namespace torch_ext {
template <>
struct FieldCodec<plan::MissMode> {
  using Exposed = std::string;
  static std::string expose(plan::MissMode mode) { return plan::to_string(mode); }
  static plan::MissMode parse(const std::string& name, const char* /*field*/) {
    return plan::miss_mode_from_string(name);
  }
};
}  // namespace torch_ext

namespace torch_ext::plan {

struct PlanCacheOptions {
  std::vector<int64_t> batch_dims;
  std::vector<int64_t> output_batch_dims;
  MissMode miss_mode = MissMode::exact;
  bool background_builds = false;
  int64_t admit_after = 1;
  int64_t max_plans = 0;
  int64_t max_bytes = 0;
  int64_t max_batch_size = 0;
  int64_t warmup_calls = 3;
  bool optimize_for_inference = true;
  std::optional<bool> specialize_shapes;
  bool static_runtime = false;
  bool cuda_graphs = false;
  std::string method = "forward";

  static constexpr auto fields() {
    return std::make_tuple(
        field("batch_dims", &PlanCacheOptions::batch_dims,
              "batch dimension of each input, by position; inputs past the end use the last entry, an empty "
              "list means 0 for every input, and -1 marks an input that is not batched"),
        field("output_batch_dims", &PlanCacheOptions::output_batch_dims,
              "batch dimension of each output tensor (same rules), to slice padded outputs and concatenate "
              "split ones"),
        field("miss_mode", &PlanCacheOptions::miss_mode,
              "'exact' builds the plan for a new size; 'pad' pads up to the smallest cached size >= n and "
              "slices the outputs; 'split' runs a sum of cached sizes, largest first; 'auto' picks pad or "
              "split by measured latency; pad, split and auto build the exact plan when no cached size can "
              "serve"),
        field("background_builds", &PlanCacheOptions::background_builds,
              "serve misses by pad / split / the source module while the exact plan builds on a background "
              "thread, then swap the plan in"),
        field("admit_after", &PlanCacheOptions::admit_after,
              "build a size only once it has been seen this many times (1: at the first miss)"),
        field("max_plans", &PlanCacheOptions::max_plans, "most plans kept, least recently used evicted; 0: unbounded"),
        field("max_bytes", &PlanCacheOptions::max_bytes,
              "byte budget over the plans' distinct constants (shared weights once) and their CUDA graphs; "
              "0: unbounded"),
        field("max_batch_size", &PlanCacheOptions::max_batch_size,
              "largest batch infer() accepts (infer_batch splits larger ones); 0: unbounded"),
        field("warmup_calls", &PlanCacheOptions::warmup_calls,
              "runs at the plan's size before it serves: a profiling executor profiles the 1st and optimises "
              "on the 2nd; the 3rd gives a clean latency estimate for auto mode"),
        field("optimize_for_inference", &PlanCacheOptions::optimize_for_inference,
              "pass the frozen module through torch::jit::optimize_for_inference"),
        field("specialize_shapes", &PlanCacheOptions::specialize_shapes,
              "give each plan a clone whose profiling executor compiles a graph specialised to its warm-up "
              "shapes (True), or let the plans share the optimised module, compiled once for every size, so "
              "a build is its warm-ups (False); None: True where TorchScript fuses on the inputs' device "
              "(its fusion groups are what the shapes feed), else False"),
        field("static_runtime", &PlanCacheOptions::static_runtime,
              "run plans with TorchScript's static runtime (memory planning for the size); CPU modules only"),
        field("cuda_graphs", &PlanCacheOptions::cuda_graphs,
              "on CUDA inputs, capture each plan as a CUDA graph at its size (static buffers, one launch per "
              "call, outputs copied out); a plan that cannot be captured runs without one and stats count "
              "it; a plan built in the background is captured by its first run, on the request's thread; "
              "ignored on CPU"),
        field("method", &PlanCacheOptions::method, "the module's method to serve"));
  }
  void validate() const;
};

struct SizeStats {
  int64_t batch_size = 0;
  int64_t calls = 0;
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t padded_calls = 0;
  int64_t split_calls = 0;
  int64_t fallback_calls = 0;
  int64_t builds = 0;
  int64_t evictions = 0;
  int64_t plan_runs = 0;
  int64_t graph_replays = 0;
  double build_seconds = 0;
  double total_seconds = 0;
  double max_seconds = 0;
  double plan_seconds = 0;
  int64_t padded_elements = 0;
  bool cached = false;
  bool cuda_graph = false;
  int64_t plan_bytes = 0;
  int64_t graph_bytes = 0;

  static constexpr auto fields() {
    return std::make_tuple(
        field("batch_size", &SizeStats::batch_size, "the size these figures are for"),
        field("calls", &SizeStats::calls, "infer() calls at this size"),
        field("hits", &SizeStats::hits, "calls served by this size's plan"),
        field("misses", &SizeStats::misses, "calls at this size without a plan"),
        field("padded_calls", &SizeStats::padded_calls, "misses served by padding"),
        field("split_calls", &SizeStats::split_calls, "misses served by splitting"),
        field("fallback_calls", &SizeStats::fallback_calls, "misses served by the source module"),
        field("builds", &SizeStats::builds, "plans built (or loaded) for this size"),
        field("evictions", &SizeStats::evictions, "times this size's plan was evicted"),
        field("plan_runs", &SizeStats::plan_runs, "runs of this size's plan, also as part of pad / split"),
        field("graph_replays", &SizeStats::graph_replays, "plan_runs served by its CUDA graph"),
        field("build_seconds", &SizeStats::build_seconds, "total over builds"),
        field("total_seconds", &SizeStats::total_seconds, "latency of infer() calls at this size, summed"),
        field("max_seconds", &SizeStats::max_seconds, "the slowest infer() call at this size"),
        field("plan_seconds", &SizeStats::plan_seconds, "time in this size's plan, summed over plan_runs"),
        field("padded_elements", &SizeStats::padded_elements, "rows of padding added to calls at this size"),
        field("cached", &SizeStats::cached, "a plan for this size is cached"),
        field("cuda_graph", &SizeStats::cuda_graph, "the cached plan runs as a CUDA graph"),
        field("plan_bytes", &SizeStats::plan_bytes,
              "constants this size's plan references, shared ones included, and its graph"),
        field("graph_bytes", &SizeStats::graph_bytes, "device memory of its CUDA graph (pool and static inputs)"));
  }
};

struct PlanCacheStats {
  int64_t calls = 0;
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t builds = 0;
  int64_t build_failures = 0;
  int64_t graph_capture_failures = 0;
  int64_t evictions = 0;
  int64_t padded_calls = 0;
  int64_t split_calls = 0;
  int64_t fallback_calls = 0;
  int64_t padded_elements = 0;
  int64_t plans = 0;
  int64_t cuda_graphs = 0;
  int64_t plan_bytes = 0;
  int64_t pending_builds = 0;
  double build_seconds = 0;
  double hit_lookup_seconds = 0;
  std::vector<SizeStats> sizes;

  static constexpr auto fields() {
    return std::make_tuple(
        field("calls", &PlanCacheStats::calls, "infer() calls"),
        field("hits", &PlanCacheStats::hits, "calls served by their size's plan"),
        field("misses", &PlanCacheStats::misses, "calls without a plan at their size"),
        field("builds", &PlanCacheStats::builds, "plans built or loaded"),
        field("build_failures", &PlanCacheStats::build_failures, "builds that raised"),
        field("graph_capture_failures", &PlanCacheStats::graph_capture_failures,
              "plans built without the CUDA graph asked for"),
        field("evictions", &PlanCacheStats::evictions, "plans evicted by max_plans / max_bytes"),
        field("padded_calls", &PlanCacheStats::padded_calls, "misses served by padding"),
        field("split_calls", &PlanCacheStats::split_calls, "misses served by splitting"),
        field("fallback_calls", &PlanCacheStats::fallback_calls, "misses served by the source module"),
        field("padded_elements", &PlanCacheStats::padded_elements, "padding waste: rows computed and thrown away"),
        field("plans", &PlanCacheStats::plans, "plans cached now"),
        field("cuda_graphs", &PlanCacheStats::cuda_graphs, "cached plans that run as CUDA graphs"),
        field("plan_bytes", &PlanCacheStats::plan_bytes,
              "distinct constants of all cached plans (shared weights once) and their graphs"),
        field("pending_builds", &PlanCacheStats::pending_builds, "builds queued or running"),
        field("build_seconds", &PlanCacheStats::build_seconds, "time spent building, summed"),
        field("hit_lookup_seconds", &PlanCacheStats::hit_lookup_seconds, "total time hits spent finding their plan"),
        field("sizes", &PlanCacheStats::sizes, "per-size figures, by batch size"));
  }
};

// Progress of preload(): (plans done, plans requested, batch size just built).
using ProgressFn = std::function<void(int64_t, int64_t, int64_t)>;

class PlanCache {
 public:
  PlanCache(torch::jit::Module module, PlanCacheOptions options = {});
  ~PlanCache();
  PlanCache(const PlanCache&) = delete;
  PlanCache& operator=(const PlanCache&) = delete;

  // Runs the module on inputs whose batched dimensions all have one size n.
  c10::IValue infer(const std::vector<c10::IValue>& inputs);
  // Any number of elements: runs infer() on chunks of select_batch_size(remaining) and
  // concatenates the outputs.
  c10::IValue infer_batch(const std::vector<c10::IValue>& inputs);
  // Builds plans for sizes not yet cached. example_inputs (any batch size) give the
  // non-batch shapes; empty: the inputs of an earlier successful call.
  void preload(const std::vector<int64_t>& sizes, const std::vector<c10::IValue>& example_inputs = {},
               const ProgressFn& progress = nullptr);
  // How many elements one call should take when max_count are waiting: the largest cached
  // size <= max_count, else max_count capped by max_batch_size.
  int64_t select_batch_size(int64_t max_count) const;

  std::vector<int64_t> cached_sizes() const;
  bool contains(int64_t batch_size) const;
  // The plan's module (frozen, optimised, warmed at batch_size); nullopt when not cached.
  std::optional<torch::jit::Module> plan_module(int64_t batch_size) const;
  PlanCacheStats stats() const;
  void reset_stats();
  void clear();
  // Blocks until no background build is queued or running.
  void wait_for_builds();

  // Writes the frozen module, one example row of each input and a manifest of the cached
  // sizes to dir; load() rebuilds those plans from it without freezing the source again
  // (each plan is still optimised and warmed: executor state cannot be serialised).
  void save(const std::string& dir) const;
  // Returns the number of plans loaded.
  int64_t load(const std::string& dir, const ProgressFn& progress = nullptr);

  const PlanCacheOptions& options() const { return options_; }

 private:
  struct Plan;        // plan.h
  struct SizeRecord;  // plan.h
  struct Signature;   // inputs.cpp
  struct Route;       // plan.h

  // The cache's bookkeeping and routing (plan_cache.cpp).
  std::shared_ptr<SizeRecord> record(int64_t batch_size);
  std::shared_ptr<Plan> get_or_build(int64_t batch_size, const std::vector<c10::IValue>& inputs);
  void insert_plan(const std::shared_ptr<Plan>& plan);
  void evict_locked(int64_t keep_batch_size);
  void release_constants_locked(const Plan& plan);
  c10::IValue serve_miss(int64_t batch_size, const std::vector<c10::IValue>& inputs, SizeRecord& rec);
  c10::IValue run_size(int64_t batch_size, const std::vector<c10::IValue>& inputs, bool count_call);

  // What a call's inputs must be (inputs.cpp).
  int64_t batch_size_of(const std::vector<c10::IValue>& inputs) const;
  void check_signature(const std::vector<c10::IValue>& inputs, int64_t batch_size) const;
  void check_signature(const Signature* signature, const std::vector<c10::IValue>& inputs, int64_t batch_size) const;
  void remember_example(const std::vector<c10::IValue>& inputs, int64_t batch_size);
  std::vector<c10::IValue> example_at(int64_t batch_size) const;

  // Plans, whatever runs them (plan.cpp).
  std::shared_ptr<Plan> build_plan(int64_t batch_size, const std::vector<c10::IValue>& example);
  c10::IValue run_plan(Plan& plan, const std::vector<c10::IValue>& inputs);
  // Captures a plan whose capture is pending (once, on this thread, from inputs at its size).
  void capture_graph(Plan& plan, const std::vector<c10::IValue>& inputs);

  // TorchScript plans (script_plan.cpp), with frozen_locked() and optimized_locked() below.
  // TorchScript's part of a build: the plan's module (the frozen, optimised base or a clone of
  // it), its executor and its constants.
  void make_script_plan(Plan& plan, const std::vector<c10::IValue>& example);
  // Whether TorchScript fuses on the device of these inputs (its fusion groups are guarded by shape).
  bool fuses(const std::vector<c10::IValue>& example) const;
  c10::IValue run_source(const std::vector<c10::IValue>& inputs);

  // The background worker (worker.cpp).
  void enqueue_build(int64_t batch_size, std::vector<c10::IValue> example);
  void worker_loop();
  // Stops the worker (the destructor): sizes still queued are never built, their waiters fail.
  void stop_worker();

  // Pad / split and the batch dimensions they follow (batching.cpp).
  std::optional<Route> choose_route(int64_t batch_size) const;
  c10::IValue run_route(const Route& route, const std::vector<c10::IValue>& inputs, int64_t batch_size);
  int64_t input_batch_dim(size_t index, int64_t dim) const;
  int64_t output_batch_dim(size_t index, int64_t dim) const;
  std::vector<c10::IValue> slice_inputs(const std::vector<c10::IValue>& inputs, int64_t start, int64_t length) const;
  std::vector<c10::IValue> pad_inputs(const std::vector<c10::IValue>& inputs, int64_t batch_size, int64_t target) const;
  c10::IValue slice_output(const c10::IValue& output, int64_t length) const;
  c10::IValue concat_outputs(const std::vector<c10::IValue>& outputs) const;

  torch::jit::Module source_;
  PlanCacheOptions options_;
  // Freezing and optimize_for_inference are independent of the batch size: the module is
  // frozen (or loaded frozen by load()) and optimised once, and each plan is that or a clone of
  // it, sharing its constants, warmed at its size. clone(),
  // freeze() and optimize_for_inference() register types in the module's CompilationUnit,
  // which is not thread-safe, so they run under source_mutex_; warm-ups, the bulk of a
  // build, run outside it.
  mutable std::mutex source_mutex_;
  mutable torch::jit::Module frozen_;  // guarded by source_mutex_
  mutable bool frozen_ready_ = false;  // guarded by source_mutex_
  // frozen_ through optimize_for_inference, once: no pass of it depends on the batch size.
  mutable torch::jit::Module optimized_;  // guarded by source_mutex_
  mutable bool optimized_ready_ = false;  // guarded by source_mutex_
  bool base_executor_chosen_ = false;  // for plans that share the base; guarded by source_mutex_
  torch::jit::Module frozen_locked() const;
  torch::jit::Module optimized_locked() const;

  mutable std::shared_mutex mutex_;  // guards everything below up to the worker state
  std::unordered_map<int64_t, std::shared_ptr<Plan>> plans_;
  std::unordered_map<int64_t, std::shared_future<std::shared_ptr<Plan>>> pending_;
  std::unordered_map<int64_t, std::shared_ptr<SizeRecord>> records_;
  std::shared_ptr<const Signature> signature_;
  std::vector<c10::IValue> example_;  // one row of each input, the batch size 1
  int64_t plan_bytes_ = 0;  // distinct constants of the cached plans
  std::unordered_map<const void*, int64_t> constant_plans_;  // constant -> cached plans referencing it

  std::atomic<uint64_t> clock_{0};  // LRU ticks
  std::atomic<int64_t> build_failures_{0};
  std::atomic<int64_t> graph_capture_failures_{0};
  std::atomic<int64_t> hit_lookup_ns_{0};

  std::mutex worker_mutex_;
  std::condition_variable worker_cv_;
  std::condition_variable idle_cv_;
  struct Job {
    int64_t batch_size;
    std::vector<c10::IValue> example;
    std::shared_ptr<std::promise<std::shared_ptr<Plan>>> promise;
  };
  std::deque<Job> queue_;
  bool worker_busy_ = false;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace torch_ext::plan
