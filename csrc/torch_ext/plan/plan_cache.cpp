// The entry points that route a call to its plan (in the PlanTable), to a pad / split route or to
// a build, and the options' checks.
#include "torch_ext/plan/plan.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <filesystem>
#include <future>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/csrc/jit/api/module.h>

#include "torch_ext/plan/build_worker.h"
#include "torch_ext/plan/plan_table.h"
#include "torch_ext/plan/traffic.h"

namespace torch_ext::plan {

namespace {

void atomic_max(std::atomic<int64_t>& target, int64_t value) {
  int64_t current = target.load(std::memory_order_relaxed);
  while (value > current && !target.compare_exchange_weak(current, value, std::memory_order_relaxed)) {
  }
}

}  // namespace

Bucket Bucket::of(const std::vector<int64_t>& sizes) {
  TORCH_CHECK(!sizes.empty() && sizes.size() <= static_cast<size_t>(kMaxDims), "PlanCache: a bucket has 1 to ",
              kMaxDims, " sizes, got ", sizes.size());
  Bucket b;
  b.rank = static_cast<int>(sizes.size());
  std::copy(sizes.begin(), sizes.end(), b.size.begin());
  return b;
}

std::string Bucket::str() const {
  std::ostringstream out;
  for (int k = 0; k < rank; ++k) out << (k ? "x" : "") << size[k];
  return out.str();
}

double Bucket::volume() const {
  double v = 1;
  for (int k = 0; k < rank; ++k) v *= static_cast<double>(size[k]);
  return v;
}

void PlanCacheOptions::validate() const {
  TORCH_CHECK_VALUE(admit_after >= 1, "PlanCache: admit_after must be >= 1, got ", admit_after);
  TORCH_CHECK_VALUE(max_plans >= 0, "PlanCache: max_plans must be >= 0, got ", max_plans);
  TORCH_CHECK_VALUE(max_bytes >= 0, "PlanCache: max_bytes must be >= 0, got ", max_bytes);
  TORCH_CHECK_VALUE(max_batch_size >= 0, "PlanCache: max_batch_size must be >= 0, got ", max_batch_size);
  TORCH_CHECK_VALUE(warmup_calls >= 1, "PlanCache: warmup_calls must be >= 1, got ", warmup_calls);
  TORCH_CHECK_VALUE(timeout_seconds > 0, "PlanCache: timeout_seconds must be > 0, got ", timeout_seconds);
  TORCH_CHECK_VALUE(runners >= 1, "PlanCache: runners must be >= 1, got ", runners);
  for (int64_t d : batch_dims) {
    TORCH_CHECK_VALUE(d >= -1, "PlanCache: batch_dims entries must be >= 0, or -1 for an unbatched input; got ", d);
  }
  for (int64_t d : output_batch_dims) {
    TORCH_CHECK_VALUE(d >= 0, "PlanCache: output_batch_dims entries must be >= 0, got ", d);
  }
  const size_t rank = 1 + dims.size();
  TORCH_CHECK_VALUE(rank <= static_cast<size_t>(kMaxDims), "PlanCache: at most ", kMaxDims - 1,
                    " dynamic dimensions after the batch (dims), got ", dims.size());
  for (const auto& list : dims) {
    TORCH_CHECK_VALUE(!list.empty(), "PlanCache: each entry of dims lists a dimension per input; got an empty one");
    for (int64_t d : list) TORCH_CHECK_VALUE(d >= -1, "PlanCache: dims entries must be >= 0 or -1, got ", d);
  }
  TORCH_CHECK_VALUE(output_dims.size() <= dims.size(), "PlanCache: output_dims has ", output_dims.size(),
                    " entries for ", dims.size(), " dims");
  for (const auto& list : output_dims) {
    for (int64_t d : list) TORCH_CHECK_VALUE(d >= -1, "PlanCache: output_dims entries must be >= 0 or -1, got ", d);
  }
  TORCH_CHECK_VALUE(dim_names.size() <= rank, "PlanCache: dim_names names ", dim_names.size(), " dimensions; there are ",
                    rank);
  for (const auto& name : dim_names) {
    TORCH_CHECK_VALUE(!name.empty() && name.find_first_of(" \t\n[]") == std::string::npos,
                      "PlanCache: dim_names must be non-empty words, got '", name, "'");
  }
  TORCH_CHECK_VALUE(size_ranges.size() <= rank, "PlanCache: size_ranges has ", size_ranges.size(),
                    " entries; there are ", rank, " dynamic dimensions");
  for (const auto& range : size_ranges) {
    TORCH_CHECK_VALUE(range.size() == 2 && range[0] >= 1 && (range[1] == 0 || range[1] >= range[0]),
                      "PlanCache: each size_ranges entry is [min, max] with 1 <= min <= max (max 0: no limit)");
  }
  TORCH_CHECK_VALUE(buckets.size() <= rank, "PlanCache: buckets has ", buckets.size(), " entries; there are ", rank,
                    " dynamic dimensions");
  for (const auto& bounds : buckets) {
    for (size_t i = 0; i < bounds.size(); ++i) {
      TORCH_CHECK_VALUE(bounds[i] >= 1 && (i == 0 || bounds[i] > bounds[i - 1]),
                        "PlanCache: bucket bounds must be positive and ascending, got ", bounds);
    }
  }
  TORCH_CHECK_VALUE(manifest_sha256.empty() || (manifest_sha256.size() == 64 &&
                                                manifest_sha256.find_first_not_of("0123456789abcdef") == std::string::npos),
                    "PlanCache: manifest_sha256 must be 64 lowercase hex digits (a SHA-256), got '", manifest_sha256, "'");
}

PlanCache::PlanCache(torch::jit::Module module, PlanCacheOptions options)
    : options_(std::move(options)),
      table_(std::make_unique<PlanTable>(options_.max_plans, options_.max_bytes)),
      traffic_(std::make_unique<TrafficLog>()) {
  options_.validate();
  source_ = make_script_source(std::move(module), options_);
  start();
}

PlanCache::PlanCache(ExportSource source, PlanCacheOptions options)
    : options_(std::move(options)),
      table_(std::make_unique<PlanTable>(options_.max_plans, options_.max_bytes)),
      traffic_(std::make_unique<TrafficLog>()) {
  options_.validate();
  const bool folder = std::filesystem::is_directory(source.path);
  std::string program = source.path;
  if (folder) {
    program = (std::filesystem::path(source.path) / "program.pt2").string();
    if (!std::filesystem::exists(program)) program.clear();  // a cache saved without its program
  } else {
    TORCH_CHECK(std::filesystem::is_regular_file(source.path), "PlanCache: ", source.path,
                " is neither a saved cache's folder nor an exported program's file");
  }
  source_ = make_export_source(program, options_);
  if (folder) load_folder(source.path, nullptr, /*adopt_layout=*/true);
  start();
}

void PlanCache::start() {
  if (!layout_) layout_ = std::make_unique<Layout>(options_);
  register_fork_participant(this);
  if (options_.background_builds) worker_ = std::make_unique<BuildWorker>();
}

PlanCache::~PlanCache() {
  unregister_fork_participant(this);
  stop_worker();
}

const char* PlanCache::kind() const { return source_->kind(); }

void PlanCache::set_compiler(CompileFn compiler) { set_export_compiler(*source_, std::move(compiler)); }

void PlanCache::set_source(SourceFn source) { set_export_runner(*source_, std::move(source)); }

void PlanCache::set_script_module(torch::jit::Module module) {
  set_export_script(*source_, std::move(module), options_);
}

std::shared_ptr<PlanCache::Plan> PlanCache::wait_for_plan(const Bucket& bucket,
                                                          std::shared_future<std::shared_ptr<Plan>> future) {
  // The builder always fulfils the future (value or error: build_plan's callers catch
  // everything), the worker's stop fails what it never built, and a forked child fails the
  // builds its parent's threads ran; the timeout bounds a build that itself never returns.
  const auto deadline = Clock::now() + std::chrono::duration<double>(options_.timeout_seconds);
  while (future.wait_for(std::chrono::milliseconds(100)) != std::future_status::ready) {
    recover_after_fork();
    TORCH_CHECK(Clock::now() < deadline, "PlanCache: waited timeout_seconds=", options_.timeout_seconds,
                " s for another thread's build of the plan for ", layout_->describe(bucket),
                "; it is still running (raise timeout_seconds for slow builds)");
  }
  return future.get();  // rethrows the builder's error
}

std::shared_ptr<PlanCache::Plan> PlanCache::get_or_build(const Bucket& bucket, const std::vector<c10::IValue>& example) {
  std::promise<std::shared_ptr<Plan>> promise;
  const auto claim = table_->claim(bucket, promise.get_future().share());
  if (claim.plan) return claim.plan;
  if (!claim.owner) return wait_for_plan(bucket, claim.future);  // only callers of this bucket wait
  std::shared_ptr<Plan> plan;
  try {
    plan = build_plan(bucket, example);
  } catch (...) {
    table_->abandon(bucket);
    build_failures_.fetch_add(1, std::memory_order_relaxed);
    promise.set_exception(std::current_exception());
    throw;
  }
  remember_example(example);
  table_->insert(plan);
  promise.set_value(plan);
  if (plan->capture_pending.load(std::memory_order_acquire)) capture_graph(*plan, example);
  return plan;
}

std::vector<c10::IValue> PlanCache::build_example(const Bucket& bucket, const Bucket& sizes,
                                                  const std::vector<c10::IValue>& inputs) const {
  // The request itself where it is at the bucket's sizes; else its rows resized to them.
  if (sizes == bucket) return inputs;
  return layout_->resize(inputs, bucket);
}

c10::IValue PlanCache::serve_miss(const Bucket& bucket, const Bucket& sizes, const std::vector<c10::IValue>& inputs,
                                  SizeRecord& rec) {
  const bool admitted = rec.sightings.fetch_add(1, std::memory_order_relaxed) + 1 >= options_.admit_after;
  std::string why_not;
  const bool buildable = source_->can_build(why_not);
  std::optional<Route> route;
  if (options_.miss_mode != MissMode::exact || !buildable) route = choose_route(sizes);
  if (options_.background_builds && buildable) {
    if (admitted) {
      std::vector<c10::IValue> example;
      for (const auto& v : build_example(bucket, sizes, inputs)) {
        example.push_back(v.isTensor() ? c10::IValue(v.toTensor().clone()) : v);
      }
      enqueue_build(bucket, std::move(example));
    }
  } else if (!route && admitted && buildable) {
    auto plan = get_or_build(bucket, build_example(bucket, sizes, inputs));
    return run_on(*plan, inputs, sizes, rec);
  }
  if (route) return run_route(*route, inputs, sizes);
  TORCH_CHECK(source_->has_source(), "PlanCache: no cached plan serves ", layout_->describe(sizes), " (bucket ",
              bucket.str(), ")",
              !buildable                   ? ", and " + why_not
              : options_.background_builds ? std::string("; its plan builds in the background and there is no source to "
                                                         "run the request meanwhile (preload the buckets you serve)")
                                           : std::string("; it is not admitted yet (admit_after) and there is no "
                                                         "source to run it"));
  rec.fallback_calls.fetch_add(1, std::memory_order_relaxed);
  auto output = run_source(inputs);
  remember_example(inputs);
  return output;
}

c10::IValue PlanCache::run_request(const Bucket& sizes, const std::vector<c10::IValue>& inputs) {
  const auto start = Clock::now();
  const Bucket bucket = layout_->bucket_of(sizes);
  std::shared_ptr<Plan> plan = table_->find(bucket);
  std::shared_ptr<SizeRecord> rec;
  check_no_autograd(inputs);
  check_signature(inputs, sizes);
  c10::IValue output;
  if (plan) {
    rec = plan->record;
    table_->touch(*plan);
    rec->hits.fetch_add(1, std::memory_order_relaxed);
    hit_lookup_ns_.fetch_add(elapsed_ns(start), std::memory_order_relaxed);
    output = run_on(*plan, inputs, sizes, *rec);
  } else {
    rec = table_->record(bucket);
    rec->misses.fetch_add(1, std::memory_order_relaxed);
    output = serve_miss(bucket, sizes, inputs, *rec);
  }
  const int64_t ns = elapsed_ns(start);
  rec->calls.fetch_add(1, std::memory_order_relaxed);
  rec->total_ns.fetch_add(ns, std::memory_order_relaxed);
  atomic_max(rec->max_ns, ns);
  return output;
}

void PlanCache::check_usable(const char* what) const {
  TORCH_CHECK(!(forked_.load(std::memory_order_relaxed) && options_.background_builds), "PlanCache.", what,
              ": this process was forked from the one that made the cache, and background builds need its "
              "worker thread, which a forked child does not have; its plans still serve, but a new one cannot be "
              "built in the background here: make a new PlanCache in the child");
}

c10::IValue PlanCache::infer(const std::vector<c10::IValue>& inputs) {
  recover_after_fork();
  const Bucket sizes = layout_->sizes_of(inputs);
  c10::IValue output = run_request(sizes, inputs);
  traffic_->add(sizes);
  return output;
}

c10::IValue PlanCache::infer_batch(const std::vector<c10::IValue>& inputs) {
  recover_after_fork();
  Bucket sizes = layout_->sizes_of([&] {
    // The batch may exceed max_batch_size here: take the sizes of one row.
    return layout_->slice_batch(inputs, 0, 1);
  }());
  int64_t total = 0;
  for (size_t i = 0; i < inputs.size() && total == 0; ++i) {
    const int64_t d = layout_->input_dim(i, 0);
    if (d >= 0 && inputs[i].isTensor()) total = inputs[i].toTensor().size(d);
  }
  std::vector<c10::IValue> outputs;
  for (int64_t offset = 0; offset < total;) {
    sizes[0] = select_batch_size(total - offset);
    outputs.push_back(run_request(sizes, sizes[0] == total ? inputs : layout_->slice_batch(inputs, offset, sizes[0])));
    offset += sizes[0];
  }
  c10::IValue output = layout_->concat_outputs(outputs);
  // The log holds the batch as it came (in requests of at most max_batch_size), not the pieces the
  // cached plans split it into: a re-plan for it then chooses plans that run it whole.
  const int64_t limit = layout_->max_size(0) > 0 ? std::min(layout_->max_size(0), total) : total;
  if (limit == 0) return output;
  sizes[0] = limit;
  traffic_->add(sizes, total / limit);
  sizes[0] = total % limit;
  if (sizes[0] > 0) traffic_->add(sizes);
  return output;
}

int64_t PlanCache::select_batch_size(int64_t max_count) const {
  TORCH_CHECK(max_count > 0, "PlanCache: select_batch_size needs max_count > 0, got ", max_count);
  const int64_t limit = layout_->max_size(0);
  const int64_t cap = limit > 0 ? std::min(max_count, limit) : max_count;
  int64_t best = 0;
  for (const auto& plan : table_->plans()) {
    if (plan->bucket()[0] <= cap && plan->bucket()[0] > best) best = plan->bucket()[0];
  }
  return best > 0 ? best : cap;
}

}  // namespace torch_ext::plan
