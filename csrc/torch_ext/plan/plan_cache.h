#pragma once
// PlanCache: plans per bucket of input sizes, for serving a model at varying shapes.
//
// Two kinds of plan, one cache machinery (routing, eviction, background builds, statistics,
// persistence):
//  - TorchScript: the module frozen (torch::jit::freeze), optimised for inference or run by the
//    static runtime, and warmed at one size; where TorchScript fuses on the device each plan is a
//    clone specialised to its size, elsewhere the plans share the optimised module.
//  - torch.export: an AOTInductor package per bucket, compiled with the bucket's sizes static or
//    with a dynamic range over it (plan_shapes), loaded and run here with no Python. Compiling
//    needs Python (Inductor): a compiler callback (set_compiler) builds packages; a process
//    without one serves the plans it loaded and pads or splits onto them.
// A bucket is a box of sizes, one range per dynamic dimension: the batch, then any others the
// options declare (dims, e.g. sequence length). infer() runs a request on its bucket's plan; a
// miss builds that plan, pads to a larger cached bucket, splits the batch into cached ones, or runs
// the source while the plan builds in the background.
//
// Made of parts, each a unit of its own: the plan table (plan_table.h: plans by bucket, builds in
// progress, records, eviction), the build worker (build_worker.h), the router (router.h: pad,
// split), persistence (persistence.h: manifest, packages), the layout (layout.h) and the plan
// kinds (plan.h); this class routes each call through them.
//
// Thread safety: every public method may be called from many threads at once. Hits take shared
// locks only and never wait for a build. Concurrent misses of one bucket build once; waits for
// another thread's build are bounded by timeout_seconds. Evicted plans stay alive until the calls
// running them finish. A forked child may destroy an inherited cache; it cannot use background
// builds (their thread is not in the child) and gets an error saying so.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

// Declares torch::jit::Module. torch/csrc/jit/api/module.h, which defines it, adds about 20 s to
// each file that includes it (g++ 12): only the files that build, copy or run a Module do.
#include <ATen/core/ivalue.h>

#include "torch_ext/common/enum_names.h"
#include "torch_ext/common/fork.h"
#include "torch_ext/fields.h"

namespace torch_ext::plan {

class CapturedGraph;

enum class MissMode {
  exact,  // build the plan for the request's bucket
  pad,    // pad up to the smallest cached bucket that holds the request; build if none
  split,  // run the batch as a sum of cached batch sizes, largest first; build if they cannot cover it
  auto_,  // pad or split, whichever the measured latencies say is cheaper; build if neither
};


enum class PlanShapes {
  static_,  // each plan compiled for its bucket's largest sizes; smaller requests are padded
  dynamic,  // each plan compiled for a range of sizes covering its bucket; requests run as they are
  script,   // each plan the frozen TorchScript module of the program's eager module (set_script_module);
            // requests run as they are, nothing compiles
  auto_,    // build each kind the bucket can have, measure them on it, keep the fastest (stats say which
            // and why)
};

}  // namespace torch_ext::plan

namespace torch_ext {
template <>
struct EnumNames<plan::MissMode> {
  static constexpr std::string_view owner = "PlanCache", what = "miss_mode";
  static constexpr std::array<std::pair<plan::MissMode, std::string_view>, 4> names{
      {{plan::MissMode::exact, "exact"}, {plan::MissMode::pad, "pad"}, {plan::MissMode::split, "split"},
       {plan::MissMode::auto_, "auto"}}};
};
template <>
struct EnumNames<plan::PlanShapes> {
  static constexpr std::string_view owner = "PlanCache", what = "plan_shapes";
  static constexpr std::array<std::pair<plan::PlanShapes, std::string_view>, 4> names{
      {{plan::PlanShapes::static_, "static"}, {plan::PlanShapes::dynamic, "dynamic"},
       {plan::PlanShapes::script, "script"}, {plan::PlanShapes::auto_, "auto"}}};
};
}  // namespace torch_ext

namespace torch_ext::plan {

// Most dynamic dimensions a cache buckets: the batch and three more.
constexpr int kMaxDims = 4;

// Sizes per dynamic dimension, batch first: a request's sizes, or a bucket's largest ones (its key).
struct Bucket {
  std::array<int64_t, kMaxDims> size{};
  int rank = 0;
  int64_t operator[](int d) const { return size[d]; }
  int64_t& operator[](int d) { return size[d]; }
  bool operator==(const Bucket& other) const { return rank == other.rank && size == other.size; }
  bool operator<(const Bucket& other) const {
    return std::lexicographical_compare(size.begin(), size.begin() + rank, other.size.begin(),
                                        other.size.begin() + other.rank);
  }
  std::vector<int64_t> vec() const { return {size.begin(), size.begin() + rank}; }
  static Bucket of(const std::vector<int64_t>& sizes);
  std::string str() const;  // "8", "8x64"
  double volume() const;    // elements per unit of the other dimensions
};

struct BucketHash {
  std::size_t operator()(const Bucket& b) const noexcept {
    std::size_t h = static_cast<std::size_t>(b.rank);
    for (int d = 0; d < b.rank; ++d) h = h * 1000003u ^ static_cast<std::size_t>(b.size[d]);
    return h;
  }
};

class Layout;  // layout.h

struct PlanCacheOptions {
  // How inputs and outputs are laid out: what a saved export cache records and restores.
  std::vector<int64_t> batch_dims;
  std::vector<int64_t> output_batch_dims;
  std::vector<std::vector<int64_t>> dims;
  std::vector<std::vector<int64_t>> output_dims;
  std::vector<std::string> dim_names;
  std::vector<std::vector<int64_t>> size_ranges;
  std::vector<std::vector<int64_t>> buckets;
  std::vector<double> pad_values;
  // How the cache serves.
  MissMode miss_mode = MissMode::exact;
  bool background_builds = false;
  int64_t admit_after = 1;
  int64_t max_plans = 0;
  int64_t max_bytes = 0;
  int64_t max_batch_size = 0;
  int64_t warmup_calls = 3;
  double timeout_seconds = 600;
  // TorchScript plans.
  bool optimize_for_inference = true;
  std::optional<bool> specialize_shapes;
  bool static_runtime = false;
  bool cuda_graphs = false;
  std::string method = "forward";
  // Exported programs' plans.
  PlanShapes plan_shapes = PlanShapes::auto_;
  int64_t runners = 1;
  std::string package_dir;
  std::string fingerprint;
  // Saved caches.
  std::string manifest_sha256;

  static constexpr auto fields() {
    return std::make_tuple(
        field("batch_dims", &PlanCacheOptions::batch_dims,
              "batch dimension of each input, by position; inputs past the end use the last entry, an empty "
              "list means 0 for every input, and -1 marks an input that is not batched"),
        field("output_batch_dims", &PlanCacheOptions::output_batch_dims,
              "batch dimension of each output tensor (same rules), to slice padded outputs and concatenate "
              "split ones"),
        field("dims", &PlanCacheOptions::dims,
              "the dynamic dimensions after the batch (e.g. sequence length): for each, the dimension of each "
              "input that has its size, by position (same rules as batch_dims; -1: not in that input)"),
        field("output_dims", &PlanCacheOptions::output_dims,
              "for each dynamic dimension after the batch, the dimension of each output that has its size "
              "(-1: none), to slice padded outputs"),
        field("dim_names", &PlanCacheOptions::dim_names,
              "names of the dynamic dimensions, batch first, for messages and stats; default batch, dim1, ..."),
        field("size_ranges", &PlanCacheOptions::size_ranges,
              "[min, max] size of each dynamic dimension, batch first, that the module accepts (max 0: no "
              "limit); a request above max is refused, one below min is padded up to it; default [1, 0]"),
        field("buckets", &PlanCacheOptions::buckets,
              "for each dynamic dimension, batch first, the ascending upper bounds of its buckets: a request's "
              "bucket takes, in each dimension, the smallest bound >= its size, and spans the sizes above the "
              "bound below; empty (or a dimension past the end): every size is a bucket of its own"),
        field("pad_values", &PlanCacheOptions::pad_values,
              "value of each input's padded positions along the dynamic dimensions after the batch, by position "
              "(e.g. 0 for token ids and for an attention mask whose 0 masks a position out); empty: those "
              "dimensions are never padded. Padding along the batch repeats the last row"),
        field("miss_mode", &PlanCacheOptions::miss_mode,
              "'exact' builds the plan for a new bucket; 'pad' pads up to the smallest cached bucket that "
              "holds the request and slices the outputs; 'split' runs the batch as a sum of cached batch "
              "sizes, largest first; 'auto' picks pad or split by measured latency; pad, split and auto build "
              "the request's plan when no cached bucket can serve"),
        field("background_builds", &PlanCacheOptions::background_builds,
              "serve misses by pad / split / the source while the plan builds on a background thread (an "
              "exported program's compiles run in a separate process), then swap the plan in"),
        field("admit_after", &PlanCacheOptions::admit_after,
              "build a bucket only once it has been seen this many times (1: at the first miss)"),
        field("max_plans", &PlanCacheOptions::max_plans, "most plans kept, least recently used evicted; 0: unbounded"),
        field("max_bytes", &PlanCacheOptions::max_bytes,
              "byte budget over the plans' distinct constants (shared weights once; an AOTInductor package "
              "holds its own) and their CUDA graphs; 0: unbounded"),
        field("max_batch_size", &PlanCacheOptions::max_batch_size,
              "largest batch infer() accepts (infer_batch splits larger ones); 0: unbounded"),
        field("warmup_calls", &PlanCacheOptions::warmup_calls,
              "runs at the plan's sizes before it serves: a profiling executor profiles the 1st and optimises "
              "on the 2nd; the fastest after the 1st is the latency estimate pad / split / auto use"),
        field("timeout_seconds", &PlanCacheOptions::timeout_seconds,
              "longest a call waits for work on another thread (a build of the plan it needs, "
              "wait_for_builds) before raising an error that says what it waited for"),
        field("optimize_for_inference", &PlanCacheOptions::optimize_for_inference,
              "TorchScript: pass the frozen module through torch::jit::optimize_for_inference"),
        field("specialize_shapes", &PlanCacheOptions::specialize_shapes,
              "TorchScript: give each plan a clone whose profiling executor compiles a graph specialised to its "
              "warm-up shapes (True), or let the plans share the optimised module, compiled once for every "
              "size, so a build is its warm-ups (False); None: True where TorchScript fuses on the inputs' "
              "device (its fusion groups are what the shapes feed), else False"),
        field("static_runtime", &PlanCacheOptions::static_runtime,
              "TorchScript: run plans with the static runtime (memory planning for the size); CPU modules only"),
        field("cuda_graphs", &PlanCacheOptions::cuda_graphs,
              "on CUDA inputs, capture each plan as a CUDA graph at its bucket's sizes (static buffers, one "
              "launch per call, outputs copied out); a plan that cannot be captured runs without one and stats "
              "count it; a plan built in the background is captured by its first run, on the request's "
              "thread; ignored on CPU"),
        field("method", &PlanCacheOptions::method, "TorchScript: the module's method to serve"),
        field("plan_shapes", &PlanCacheOptions::plan_shapes,
              "exported programs: each bucket's plan 'static' (requests padded), 'dynamic' (a range), 'script' "
              "(set_script_module's module, frozen; no compile) or 'auto': each kind, the fastest kept (SizeStats)"),
        field("runners", &PlanCacheOptions::runners,
              "exported programs: model instances per plan, the most calls one plan runs at once (more wait)"),
        field("package_dir", &PlanCacheOptions::package_dir,
              "exported programs: folder for compiled packages; empty: a temporary folder removed with the cache"),
        field("fingerprint", &PlanCacheOptions::fingerprint,
              "exported programs: what identifies the program (the Python face hashes its code and weights); "
              "save() records it and load() refuses a folder saved from another"),
        field("manifest_sha256", &PlanCacheOptions::manifest_sha256,
              "the SHA-256 (64 lowercase hex digits) of the manifest.txt a deployment trusts: a saved folder "
              "(PlanCache(folder), load()) whose manifest has another digest is refused before any of its code "
              "loads; the manifest holds every file's SHA-256, so this pins every byte loaded; empty: no pin"));
  }
  void validate() const;
};

struct SizeStats {
  int64_t batch_size = 0;
  std::vector<int64_t> bucket;
  int64_t calls = 0;
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t padded_calls = 0;
  int64_t split_calls = 0;
  int64_t fallback_calls = 0;
  int64_t builds = 0;
  int64_t compiles = 0;
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
  std::string shapes;
  double static_seconds = 0;
  double dynamic_seconds = 0;
  double script_seconds = 0;
  int64_t probe_sizes = 0;
  int64_t plan_bytes = 0;
  int64_t graph_bytes = 0;

  static constexpr auto fields() {
    return std::make_tuple(
        field("batch_size", &SizeStats::batch_size, "the bucket's batch size (its largest)"),
        field("bucket", &SizeStats::bucket, "the bucket's largest size in each dynamic dimension, batch first"),
        field("calls", &SizeStats::calls, "infer() calls in this bucket"),
        field("hits", &SizeStats::hits, "calls served by this bucket's plan"),
        field("misses", &SizeStats::misses, "calls in this bucket without a plan"),
        field("padded_calls", &SizeStats::padded_calls, "misses served by padding to another bucket's plan"),
        field("split_calls", &SizeStats::split_calls, "misses served by splitting"),
        field("fallback_calls", &SizeStats::fallback_calls, "misses served by the source"),
        field("builds", &SizeStats::builds, "plans built (or loaded) for this bucket"),
        field("compiles", &SizeStats::compiles, "AOTInductor packages compiled for this bucket (auto: two a build)"),
        field("evictions", &SizeStats::evictions, "times this bucket's plan was evicted"),
        field("plan_runs", &SizeStats::plan_runs, "runs of this bucket's plan, also as part of pad / split"),
        field("graph_replays", &SizeStats::graph_replays, "plan_runs served by its CUDA graph"),
        field("build_seconds", &SizeStats::build_seconds, "total over builds, compiles included"),
        field("total_seconds", &SizeStats::total_seconds, "latency of infer() calls in this bucket, summed"),
        field("max_seconds", &SizeStats::max_seconds, "the slowest infer() call in this bucket"),
        field("plan_seconds", &SizeStats::plan_seconds, "time in this bucket's plan, summed over plan_runs"),
        field("padded_elements", &SizeStats::padded_elements,
              "elements of padding computed and thrown away for calls in this bucket"),
        field("cached", &SizeStats::cached, "a plan for this bucket is cached"),
        field("cuda_graph", &SizeStats::cuda_graph, "the cached plan runs as a CUDA graph"),
        field("shapes", &SizeStats::shapes,
              "an exported program's plan: 'static' or 'dynamic' (an AOTInductor package), 'script' (its module's "
              "frozen TorchScript); '' in a TorchScript module's cache"),
        field("static_seconds", &SizeStats::static_seconds,
              "plan_shapes='auto': the static plan's latency over the bucket's probe sizes (padded), measured at "
              "build"),
        field("dynamic_seconds", &SizeStats::dynamic_seconds,
              "plan_shapes='auto': the dynamic plan's latency over the same probe sizes, each weighted by its "
              "requests"),
        field("script_seconds", &SizeStats::script_seconds,
              "plan_shapes='auto', a script module set: the TorchScript plan's latency over them, weighted alike"),
        field("probe_sizes", &SizeStats::probe_sizes,
              "plan_shapes='auto': how many sizes of the traffic the cache had logged in the bucket were the probe "
              "sizes (its most requested, at most 8); 0: there were none, and the probes were the bucket's "
              "smallest, middle and largest sizes"),
        field("plan_bytes", &SizeStats::plan_bytes,
              "constants this bucket's plan references, shared ones included, and its graph"),
        field("graph_bytes", &SizeStats::graph_bytes, "device memory of its CUDA graph (pool and static inputs)"));
  }
};

struct PlanCacheStats {
  std::string kind;
  int64_t calls = 0;
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t builds = 0;
  int64_t compiles = 0;
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
  int64_t traffic_requests = 0;
  int64_t traffic_sizes = 0;
  int64_t traffic_dropped = 0;
  double build_seconds = 0;
  double hit_lookup_seconds = 0;
  std::vector<SizeStats> sizes;

  static constexpr auto fields() {
    return std::make_tuple(
        field("kind", &PlanCacheStats::kind, "'torchscript' or 'export': what the plans are"),
        field("calls", &PlanCacheStats::calls, "infer() calls"),
        field("hits", &PlanCacheStats::hits, "calls served by their bucket's plan"),
        field("misses", &PlanCacheStats::misses, "calls without a plan for their bucket"),
        field("builds", &PlanCacheStats::builds, "plans built or loaded"),
        field("compiles", &PlanCacheStats::compiles, "AOTInductor packages compiled (0 when every plan was loaded)"),
        field("build_failures", &PlanCacheStats::build_failures, "builds that raised"),
        field("graph_capture_failures", &PlanCacheStats::graph_capture_failures,
              "plans built without the CUDA graph asked for"),
        field("evictions", &PlanCacheStats::evictions, "plans evicted by max_plans / max_bytes"),
        field("padded_calls", &PlanCacheStats::padded_calls, "misses served by padding"),
        field("split_calls", &PlanCacheStats::split_calls, "misses served by splitting"),
        field("fallback_calls", &PlanCacheStats::fallback_calls, "misses served by the source"),
        field("padded_elements", &PlanCacheStats::padded_elements,
              "padding waste: elements computed and thrown away"),
        field("plans", &PlanCacheStats::plans, "plans cached now"),
        field("cuda_graphs", &PlanCacheStats::cuda_graphs, "cached plans that run as CUDA graphs"),
        field("plan_bytes", &PlanCacheStats::plan_bytes,
              "distinct constants of all cached plans (shared weights once) and their graphs"),
        field("pending_builds", &PlanCacheStats::pending_builds, "builds queued or running"),
        field("traffic_requests", &PlanCacheStats::traffic_requests,
              "requests in the traffic log (served, or given to observe_traffic), at its sizes"),
        field("traffic_sizes", &PlanCacheStats::traffic_sizes, "distinct sizes in the traffic log"),
        field("traffic_dropped", &PlanCacheStats::traffic_dropped,
              "requests at sizes the traffic log had no room for (it keeps 4096 sizes)"),
        field("build_seconds", &PlanCacheStats::build_seconds, "time spent building, compiles included, summed"),
        field("hit_lookup_seconds", &PlanCacheStats::hit_lookup_seconds, "total time hits spent finding their plan"),
        field("sizes", &PlanCacheStats::sizes, "per-bucket figures, by bucket"));
  }
};

// Progress of preload() and load(): (plans done, plans requested, batch size just built).
using ProgressFn = std::function<void(int64_t, int64_t, int64_t)>;

// What an exported program's compiler is asked for: the package of one bucket's plan, written to
// package_path. Sizes are per dynamic dimension, batch first; a static plan takes `upper` only, a
// dynamic one every size in [lower, upper]. example: inputs at `upper`.
struct CompileRequest {
  std::vector<int64_t> upper;
  std::vector<int64_t> lower;
  bool dynamic = false;
  std::vector<c10::IValue> example;
  std::string package_path;
  bool background = false;          // for the worker: compile where request threads do not wait for it
  std::function<bool()> cancelled;  // true once the cache is being destroyed: give up
};
// Throws with the reason when the package cannot be built; called from any thread.
using CompileFn = std::function<void(const CompileRequest&)>;
// Runs the source of an exported program (the eager module) on a request no plan serves.
using SourceFn = std::function<c10::IValue(const std::vector<c10::IValue>&)>;

// An exported program's cache: a folder save() wrote (its plans are loaded, no compile, and its
// layout options restored) or the file of an exported program (torch.export.save), whose plans
// need a compiler (set_compiler).
struct ExportSource {
  std::string path;
};

class PlanSource;     // plan.h
class PlanTable;      // plan_table.h
struct ManifestPlan;  // persistence.h
class BuildWorker;    // build_worker.h
class TrafficLog;     // traffic.h

class PlanCache : public torch::CustomClassHolder, private ForkParticipant {
 public:
  PlanCache(torch::jit::Module module, PlanCacheOptions options = {});
  PlanCache(ExportSource source, PlanCacheOptions options = {});
  ~PlanCache() override;
  PlanCache(const PlanCache&) = delete;
  PlanCache& operator=(const PlanCache&) = delete;

  // Runs the model on inputs whose dynamic dimensions have one size each, the batch at most
  // max_batch_size.
  c10::IValue infer(const std::vector<c10::IValue>& inputs);
  // Any number of elements: runs infer() on chunks of select_batch_size(remaining) and
  // concatenates the outputs.
  c10::IValue infer_batch(const std::vector<c10::IValue>& inputs);
  // Builds plans for batch sizes / buckets not yet cached. example_inputs (any sizes) give the
  // other dimensions; empty: the inputs of an earlier successful call. A bucket lists its largest
  // size in each dynamic dimension, batch first; a batch size alone stands for the bucket of
  // that batch at the example's other sizes.
  void preload(const std::vector<int64_t>& batch_sizes, const std::vector<c10::IValue>& example_inputs = {},
               const ProgressFn& progress = nullptr);
  void preload_buckets(const std::vector<std::vector<int64_t>>& buckets,
                       const std::vector<c10::IValue>& example_inputs = {}, const ProgressFn& progress = nullptr);
  // How many elements one call should take when max_count are waiting: the largest cached
  // batch size <= max_count, else max_count capped by max_batch_size.
  int64_t select_batch_size(int64_t max_count) const;

  std::vector<int64_t> cached_sizes() const;  // the batch sizes of the cached plans, ascending
  std::vector<std::vector<int64_t>> cached_buckets() const;
  bool contains(int64_t batch_size) const;
  bool contains_bucket(const std::vector<int64_t>& bucket) const;
  // TorchScript: the plan's module (frozen, optimised, warmed at batch_size); nullopt when not
  // cached or not a TorchScript plan.
  std::optional<torch::jit::Module> plan_module(int64_t batch_size) const;
  // An exported program's cached plans: the pytree specs of their inputs and outputs, serialised
  // (torch.utils._pytree.treespec_loads); empty when no plan is cached.
  std::vector<std::string> call_spec() const;
  PlanCacheStats stats() const;
  void reset_stats();  // the traffic log stays: clear_traffic() empties it
  // The traffic log: each request's sizes (a size per dynamic dimension, batch first) as infer()
  // and infer_batch()'s calls brought them (infer_batch's whole batch, in requests of at most
  // max_batch_size, not the pieces the cached plans split it into), with their count. Each row is
  // the sizes then the count, sizes ascending. What buckets are chosen from
  // (torch_ext.plan.choose_buckets), and what plan_shapes='auto' times a bucket's plans at.
  std::vector<std::vector<int64_t>> traffic() const;
  // Adds rows in traffic()'s form (another cache's log, a recorded stream) to the log. save()
  // keeps the log; load() adds the saved one.
  void observe_traffic(const std::vector<std::vector<int64_t>>& rows);
  void clear_traffic();
  // Inputs at `sizes` (a size per dynamic dimension, batch first) made from the example the cache
  // keeps (an earlier call's inputs, or an exported program's example): what a build warms up on,
  // and what torch_ext.plan times the model at when it chooses buckets.
  std::vector<c10::IValue> example_inputs(const std::vector<int64_t>& sizes) const;
  void clear();
  // Blocks until no background build is queued or running, at most timeout_seconds (< 0: the
  // option's); raises if that passes first.
  void wait_for_builds(double timeout_seconds = -1);

  // Exported programs: what builds and what runs a miss in this process (Python sets both).
  void set_compiler(CompileFn compiler);
  void set_source(SourceFn source);
  // Exported programs: the module the program was exported from, scripted (same inputs, flat, and
  // outputs), in eval mode: plans of kind 'script' are it, frozen (plan_shapes 'script', or 'auto''s
  // third candidate). save() keeps it; a cache loaded from the folder serves it with no module given.
  void set_script_module(torch::jit::Module module);

  // Writes what load() needs to dir, with a manifest of the cached buckets and the SHA-256 of
  // every file: TorchScript, the frozen module and the hashes of the served code and weights
  // (each plan is optimised and warmed again at load: executor state cannot be serialised); an
  // exported program, each plan's package (loaded with no compile).
  void save(const std::string& dir) const;
  // Loads the plans of a folder save() wrote, after checking the manifest, every file's hash and
  // that it was saved from this cache's source and layout. Returns the number of plans loaded.
  int64_t load(const std::string& dir, const ProgressFn& progress = nullptr);

  const PlanCacheOptions& options() const { return options_; }
  const char* kind() const;
  // The checks infer() makes before running a request (sizes in range, the inputs' signature),
  // and the request's sizes; where its dynamic dimensions are (layout.h).
  Bucket check_request(const std::vector<c10::IValue>& inputs) const;
  // Plans serve inference and record no autograd: with grad mode on, an input that requires grad
  // would silently get no gradient through the output, so such a request is refused.
  static void check_no_autograd(const std::vector<c10::IValue>& inputs);
  const Layout& layout() const { return *layout_; }

  // Internal to the plan cache's sources (plan.h).
  struct Plan;
  struct SizeRecord;
  struct Route;

 private:
  struct Signature;  // inputs.cpp

  // Routing a call to its plan, a route or a build (plan_cache.cpp).
  void start();
  std::shared_ptr<Plan> get_or_build(const Bucket& bucket, const std::vector<c10::IValue>& example);
  std::shared_ptr<Plan> wait_for_plan(const Bucket& bucket, std::shared_future<std::shared_ptr<Plan>> future);
  c10::IValue serve_miss(const Bucket& bucket, const Bucket& sizes, const std::vector<c10::IValue>& inputs,
                         SizeRecord& rec);
  c10::IValue run_request(const Bucket& sizes, const std::vector<c10::IValue>& inputs);
  void preload_bucket_list(const std::vector<Bucket>& buckets, const std::vector<c10::IValue>& example_inputs,
                           const ProgressFn& progress);
  std::vector<c10::IValue> build_example(const Bucket& bucket, const Bucket& sizes,
                                         const std::vector<c10::IValue>& inputs) const;
  void check_usable(const char* what) const;

  // What a call's inputs must be (inputs.cpp).
  void check_signature(const std::vector<c10::IValue>& inputs, const Bucket& sizes) const;
  void check_signature(const Signature* signature, const std::vector<c10::IValue>& inputs, const Bucket& sizes) const;
  void remember_example(const std::vector<c10::IValue>& inputs);
  // Rows in traffic()'s form, checked against the layout (`owner` and where(i), the i-th row's
  // place, start the error), before any is added to the log.
  std::vector<std::pair<Bucket, int64_t>> checked_traffic(const std::vector<std::vector<int64_t>>& rows,
                                                          const std::string& owner,
                                                          const std::function<std::string(size_t)>& where) const;
  std::vector<c10::IValue> example_at(const Bucket& sizes) const;

  // Plans, whatever runs them (plan.cpp).
  std::shared_ptr<Plan> build_plan(const Bucket& bucket, const std::vector<c10::IValue>& example,
                                   bool background = false);
  void make_executable(Plan& plan, const std::vector<c10::IValue>& example);
  c10::IValue run_plan(Plan& plan, const std::vector<c10::IValue>& inputs);
  c10::IValue run_on(Plan& plan, const std::vector<c10::IValue>& inputs, const Bucket& sizes, SizeRecord& rec);
  c10::IValue run_source(const std::vector<c10::IValue>& inputs);
  // Captures a plan whose capture is pending (once, on this thread, from inputs at its size).
  void capture_graph(Plan& plan, const std::vector<c10::IValue>& inputs);

  // Background builds on the BuildWorker, and fork safety (worker.cpp).
  void enqueue_build(const Bucket& bucket, std::vector<c10::IValue> example);
  void build_job(const Bucket& bucket, const std::vector<c10::IValue>& example,
                 std::promise<std::shared_ptr<Plan>>& promise);
  // Stops the worker (the destructor): buckets still queued are never built, their waiters fail.
  void stop_worker();
  void fork_prepare() override;
  void fork_parent() override;
  void fork_child() override;
  // In a forked child: fails the builds the parent's threads were running (once).
  void recover_after_fork();

  // Pad / split (batching.cpp).
  std::optional<Route> choose_route(const Bucket& sizes) const;
  c10::IValue run_route(const Route& route, const std::vector<c10::IValue>& inputs, const Bucket& sizes);

  // Persistence (persistence.cpp).
  int64_t load_folder(const std::string& dir, const ProgressFn& progress, bool adopt_layout);
  void load_plan(const std::string& dir, const ManifestPlan& entry);

  std::unique_ptr<PlanSource> source_;
  PlanCacheOptions options_;
  std::unique_ptr<Layout> layout_;

  std::unique_ptr<PlanTable> table_;  // the plans, builds in progress, records; its own lock
  std::unique_ptr<TrafficLog> traffic_;  // its own lock

  mutable std::shared_mutex example_mutex_;  // guards the two below
  std::shared_ptr<const Signature> signature_;
  std::vector<c10::IValue> example_;  // one row of each input, the batch size 1

  std::atomic<int64_t> build_failures_{0};
  std::atomic<int64_t> graph_capture_failures_{0};
  std::atomic<int64_t> hit_lookup_ns_{0};

  std::unique_ptr<BuildWorker> worker_;  // background_builds only; its own lock and thread
  std::atomic<bool> forked_{false};      // set in a forked child, where no thread of the parent runs
  std::atomic<bool> recovered_{false};
};

}  // namespace torch_ext::plan
