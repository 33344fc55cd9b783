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

struct PlanCacheOptions {
  // Batch dimension of each input (by position); inputs past the end use the last entry,
  // an empty list means 0 for every input, and -1 marks an input that is not batched.
  std::vector<int64_t> batch_dims;
  // Batch dimension of each output tensor (same rules), used to slice padded outputs and
  // to concatenate split ones.
  std::vector<int64_t> output_batch_dims;
  MissMode miss_mode = MissMode::exact;
  // Serve misses by pad / split / the source module while the exact plan builds on a
  // background thread, then swap the plan in.
  bool background_builds = false;
  // Build a size only once it has been seen this many times (1: at the first miss).
  int64_t admit_after = 1;
  int64_t max_plans = 0;       // 0: unbounded
  int64_t max_bytes = 0;       // byte budget over the plans' distinct constants; 0: unbounded
  int64_t max_batch_size = 0;  // largest batch infer() accepts; 0: unbounded
  // Runs at the plan's size before it serves: a profiling executor profiles the 1st and
  // optimises on the 2nd; the 3rd gives a clean latency estimate for auto mode.
  int64_t warmup_calls = 3;
  bool optimize_for_inference = true;
  // Give each plan a clone of its own, run by TorchScript's profiling executor, which profiles
  // the first warm-up call and compiles a graph specialised to the shapes it saw on the second.
  // Off: the plans share the optimised module, compiled once for every size (by the profiling
  // executor where TorchScript does not fuse, since nothing is then guarded by shape; else by
  // the simple executor), and a build is its warm-ups. Unset: on where TorchScript fuses on the
  // inputs' device (its fusion groups are what the profiled shapes feed), off elsewhere, where
  // a clone per size bought no speed in bench_plan and cost most of each build.
  std::optional<bool> specialize_shapes;
  // Run plans with TorchScript's static runtime (memory planning for the size) instead of
  // the graph executor; the frozen graph is then not passed through optimize_for_inference.
  // CPU modules only.
  bool static_runtime = false;
  // On CUDA inputs, capture each plan as a CUDA graph at its size (static input and output
  // buffers, one launch per call). A plan whose run cannot be captured (host syncs, CPU
  // tensors) keeps running without one; stats count those failures. Ignored on CPU.
  // The capture runs where the plan is built, except that a plan built in the background is
  // captured by its first run, on the request's thread. While a capture runs, a device-wide
  // synchronisation (torch.cuda.synchronize) in another thread fails (a CUDA rule): other
  // threads should synchronise their streams instead.
  bool cuda_graphs = false;
  std::string method = "forward";
};

struct SizeStats {
  int64_t batch_size = 0;
  int64_t calls = 0;            // infer() calls at this size
  int64_t hits = 0;             // calls served by this size's plan
  int64_t misses = 0;           // calls at this size without a plan
  int64_t padded_calls = 0;     // misses served by padding
  int64_t split_calls = 0;      // misses served by splitting
  int64_t fallback_calls = 0;   // misses served by the source module
  int64_t builds = 0;           // plans built (or loaded) for this size
  int64_t evictions = 0;
  int64_t plan_runs = 0;        // runs of this size's plan, also as part of pad / split
  int64_t graph_replays = 0;    // plan_runs served by its CUDA graph
  double build_seconds = 0;     // total over builds
  double total_seconds = 0;     // latency of infer() calls at this size, summed
  double max_seconds = 0;
  double plan_seconds = 0;      // time in this size's plan, summed over plan_runs
  int64_t padded_elements = 0;  // rows of padding added to calls at this size
  bool cached = false;
  bool cuda_graph = false;  // the cached plan runs as a CUDA graph
  int64_t plan_bytes = 0;   // constants this size's plan references, shared ones included, and its graph
  int64_t graph_bytes = 0;  // device memory of its CUDA graph (pool and static inputs)
};

struct PlanCacheStats {
  int64_t calls = 0;
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t builds = 0;
  int64_t build_failures = 0;
  int64_t graph_capture_failures = 0;  // plans built without the CUDA graph asked for
  int64_t evictions = 0;
  int64_t padded_calls = 0;
  int64_t split_calls = 0;
  int64_t fallback_calls = 0;
  int64_t padded_elements = 0;  // padding waste: rows computed and thrown away
  int64_t plans = 0;
  int64_t cuda_graphs = 0;  // cached plans that run as CUDA graphs
  int64_t plan_bytes = 0;  // distinct constants of all cached plans (shared weights once) and their graphs
  int64_t pending_builds = 0;
  double build_seconds = 0;
  double hit_lookup_seconds = 0;  // total time hits spent finding their plan
  std::vector<SizeStats> sizes;   // by batch size
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
