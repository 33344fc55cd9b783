#pragma once
// Internal to the plan cache's sources: a cached plan, the record of one batch size, a pad / split
// route, and helpers they share. A cached Plan changes only in its atomics, its runtime free list
// (runtimes_mutex) and, once, its CUDA graph and that graph's bytes (the cache's unique lock).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/jit/api/module.h>

#include "torch_ext/plan/cuda_graph.h"
#include "torch_ext/plan/plan_cache.h"

namespace torch::jit {
class StaticModule;
class StaticRuntime;
}  // namespace torch::jit

namespace torch_ext::plan {

using Clock = std::chrono::steady_clock;

inline int64_t elapsed_ns(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
}

inline double seconds(int64_t ns) { return static_cast<double>(ns) * 1e-9; }

// The message of a torch error without its C++ backtrace.
inline const char* message_of(const std::exception& e) {
  if (const auto* error = dynamic_cast<const c10::Error*>(&e)) return error->what_without_backtrace();
  return e.what();
}

using Constants = std::unordered_map<const void*, int64_t>;  // storage (or opaque tensor) -> bytes

struct PlanCache::SizeRecord {
  explicit SizeRecord(int64_t n) : batch_size(n) {}
  const int64_t batch_size;
  std::atomic<int64_t> sightings{0};
  std::atomic<int64_t> calls{0}, hits{0}, misses{0}, padded_calls{0}, split_calls{0}, fallback_calls{0};
  std::atomic<int64_t> builds{0}, evictions{0}, plan_runs{0}, graph_replays{0}, padded_elements{0};
  std::atomic<int64_t> build_ns{0}, total_ns{0}, max_ns{0}, plan_ns{0};
};

struct PlanCache::Plan {
  Plan();
  ~Plan();  // both defined where the static runtime's types are complete (script_plan.cpp)

  int64_t batch_size = 0;

  // TorchScript: the plan's module (the shared base or a clone of it) and its executor.
  torch::jit::Module module;
  std::optional<torch::jit::Method> method;
  std::unique_ptr<torch::jit::StaticModule> static_module;
  std::mutex runtimes_mutex;  // guards the free list only, never held while running
  std::vector<std::unique_ptr<torch::jit::StaticRuntime>> free_runtimes;
  // Any number of threads at once: a static runtime call takes one of its own from the free list.
  c10::IValue run(const std::vector<c10::IValue>& inputs);
  // One thread at a time (the build's warm-ups, then its capture): the static module's own runtime.
  c10::IValue run_single(const std::vector<c10::IValue>& inputs);

  // With cuda_graphs on CUDA inputs that could be captured; written under the cache's unique
  // lock before capture_pending turns false.
  std::unique_ptr<CapturedGraph> graph;
  std::atomic<bool> capture_pending{false};
  std::mutex capture_mutex;
  Constants constants;  // its graph is one entry of its own
  int64_t bytes = 0;  // all of its constants, shared ones included
  int64_t build_ns = 0;
  int64_t warm_ns = 0;  // fastest warm-up after profiling: the estimate before real runs
  std::shared_ptr<SizeRecord> record;
  std::atomic<uint64_t> last_used{0};

  double estimated_seconds() const {
    const int64_t runs = record->plan_runs.load(std::memory_order_relaxed);
    return runs > 0 ? seconds(record->plan_ns.load(std::memory_order_relaxed)) / static_cast<double>(runs)
                    : seconds(warm_ns);
  }
};

struct PlanCache::Route {
  bool pad = false;
  std::vector<std::shared_ptr<Plan>> plans;  // pad: one plan; split: the pieces, largest first
};

}  // namespace torch_ext::plan
