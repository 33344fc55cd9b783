#pragma once
// Internal to the plan cache's sources: a cached plan and what runs it (an Executable of one
// plan kind), the source plans are made from (PlanSource: TorchScript or an exported program),
// the record of one bucket, a pad / split route, and helpers they share. A cached Plan changes
// only in its atomics and, once, its CUDA graph and that graph's bytes (the cache's unique lock).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include "torch_ext/plan/cuda_graph.h"
#include "torch_ext/plan/layout.h"
#include "torch_ext/plan/plan_cache.h"
#include "torch_ext/plan/router.h"

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

// What runs one plan: a TorchScript module's executor, or a loaded AOTInductor package.
class Executable {
 public:
  virtual ~Executable() = default;
  // Any number of threads at once.
  virtual c10::IValue run(const std::vector<c10::IValue>& inputs) = 0;
  // One thread at a time (a build's warm-ups, then its capture).
  virtual c10::IValue run_single(const std::vector<c10::IValue>& inputs) { return run(inputs); }
  // The memory the plan references (weights shared between plans count once in the cache).
  virtual Constants constants() const = 0;
  virtual std::optional<torch::jit::Module> module() const;  // a TorchScript plan's (script_plan.cpp)
  virtual std::string file() const { return {}; }  // an exported program's package
  // An exported program's package: its inputs' and outputs' pytree specs, serialised.
  virtual std::vector<std::string> call_spec() const { return {}; }
};

// What one build makes: a plan for `upper`, static or over the range [lower, upper].
struct PlanSpec {
  Bucket upper, lower;
  bool dynamic = false;
  bool background = false;  // built by the worker: a compile must not hold up request threads
  bool script = false;      // a TorchScript plan of an exported program's cache (dynamic too: any size runs)
};

// The fastest of `calls` runs after the first (the first may profile, compile or fill caches).
int64_t fastest_run(Executable& exec, const std::vector<c10::IValue>& inputs, int64_t calls);

struct ManifestPlan;  // persistence.h
struct Manifest;

// What plans are made from. Thread safety: build(), load_plan() and run_source() may be called
// from many threads at once.
class PlanSource {
 public:
  virtual ~PlanSource() = default;
  virtual const char* kind() const = 0;  // "torchscript", "export"
  virtual std::string name() const = 0;  // for messages
  // Whether this process can build a plan; else why not (for the error a miss raises).
  virtual bool can_build(std::string& why) const = 0;
  // Whether plans over a range of sizes exist for this kind (plan_shapes applies).
  virtual bool builds_dynamic() const = 0;
  // Whether TorchScript plans exist beside the compiled ones (an exported program's script module).
  virtual bool builds_script() const { return false; }
  // The executable for spec from example (inputs at spec.upper); counts its compiles.
  virtual std::unique_ptr<Executable> build(const PlanSpec& spec, const std::vector<c10::IValue>& example,
                                            int64_t& compiles) = 0;
  // Asks builds in progress to give up (the cache is being destroyed).
  virtual void cancel_builds() {}
  // Runs the source on a request no plan serves; whether there is one.
  virtual bool has_source() const = 0;
  virtual c10::IValue run_source(const std::vector<c10::IValue>& inputs) = 0;
  // Persistence: the source's files and identity in a manifest, checked against this source
  // (not for a cache opened from the folder: adopt), and a saved plan loaded.
  virtual void save(const std::string& dir, Manifest& manifest) const = 0;
  virtual void check_saved(const std::string& dir, const Manifest& manifest, bool adopt) = 0;
  virtual std::unique_ptr<Executable> load_plan(const std::string& dir, const ManifestPlan& plan,
                                                const std::vector<c10::IValue>& example) = 0;
};

// frozen: a saved cache's frozen module, served as it is (check_saved with adopt takes its hashes).
std::unique_ptr<PlanSource> make_script_source(torch::jit::Module module, const PlanCacheOptions& options,
                                               bool frozen = false);
std::unique_ptr<PlanSource> make_export_source(const std::string& program_path, const PlanCacheOptions& options);
void set_export_compiler(PlanSource& source, CompileFn compiler);
void set_export_runner(PlanSource& source, SourceFn runner);
void set_export_script(PlanSource& source, torch::jit::Module module, const PlanCacheOptions& options);

struct PlanCache::SizeRecord {
  explicit SizeRecord(const Bucket& b) : bucket(b) {}
  const Bucket bucket;
  std::atomic<int64_t> sightings{0};
  std::atomic<int64_t> calls{0}, hits{0}, misses{0}, padded_calls{0}, split_calls{0}, fallback_calls{0};
  std::atomic<int64_t> builds{0}, compiles{0}, evictions{0}, plan_runs{0}, graph_replays{0}, padded_elements{0};
  std::atomic<int64_t> build_ns{0}, total_ns{0}, max_ns{0}, plan_ns{0};
};

struct PlanCache::Plan {
  PlanSpec spec;
  std::unique_ptr<Executable> exec;
  // plan_shapes="auto": each candidate's latency over the bucket's probe sizes (ns), and how many
  // of them came from the traffic log (0: its smallest, middle and largest sizes).
  int64_t static_ns = 0, dynamic_ns = 0, script_ns = 0;
  int64_t probe_sizes = 0;

  // With cuda_graphs on CUDA inputs that could be captured; written under the cache's unique
  // lock before capture_pending turns false.
  std::unique_ptr<CapturedGraph> graph;
  std::atomic<bool> capture_pending{false};
  std::mutex capture_mutex;
  Constants constants;  // its graph is one entry of its own
  int64_t bytes = 0;  // all of its constants, shared ones included
  int64_t build_ns = 0;
  int64_t warm_ns = 0;  // fastest warm-up at its largest sizes: the estimate before real runs
  std::shared_ptr<SizeRecord> record;
  std::atomic<uint64_t> last_used{0};

  const Bucket& bucket() const { return spec.upper; }
  // The sizes a request is run at: its own inside a dynamic plan's range, else the bucket's.
  Bucket target(const Bucket& sizes) const { return run_target(spec.upper, spec.lower, spec.dynamic, sizes); }
  double estimated_seconds() const {
    const int64_t runs = record->plan_runs.load(std::memory_order_relaxed);
    return runs > 0 ? seconds(record->plan_ns.load(std::memory_order_relaxed)) / static_cast<double>(runs)
                    : seconds(warm_ns);
  }
};

struct PlanCache::Route {
  bool pad = false;
  std::vector<std::shared_ptr<Plan>> plans;  // pad: one plan; split: the pieces, largest first
  std::vector<int64_t> pieces;               // split: each piece's batch size
  Bucket target;                             // pad: the sizes run; split: the other dimensions' sizes
};

}  // namespace torch_ext::plan
