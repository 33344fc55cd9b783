// What a caller asks of the cache besides inference: preloading buckets, what is cached,
// statistics, and resetting.
#include "torch_ext/plan/plan.h"

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include <torch/csrc/jit/api/module.h>

#include "torch_ext/plan/plan_table.h"
#include "torch_ext/plan/traffic.h"

namespace torch_ext::plan {

void PlanCache::preload(const std::vector<int64_t>& batch_sizes, const std::vector<c10::IValue>& example_inputs,
                        const ProgressFn& progress) {
  std::vector<Bucket> buckets;
  Bucket other;  // the other dimensions: the example's, else the remembered example's
  if (layout_->rank() > 1) {
    std::vector<c10::IValue> example = example_inputs;
    if (example.empty()) example = example_at(Bucket::of(std::vector<int64_t>(layout_->rank(), 1)));
    other = layout_->sizes_of(layout_->slice_batch(example, 0, 1));
  } else {
    other.rank = 1;
  }
  for (int64_t n : batch_sizes) {
    TORCH_CHECK(n > 0, "PlanCache.preload: batch sizes must be > 0, got ", n);
    other[0] = n;
    buckets.push_back(layout_->bucket_of(other));
  }
  preload_bucket_list(buckets, example_inputs, progress);
}

void PlanCache::preload_buckets(const std::vector<std::vector<int64_t>>& buckets,
                                const std::vector<c10::IValue>& example_inputs, const ProgressFn& progress) {
  std::vector<Bucket> list;
  for (const auto& sizes : buckets) {
    const Bucket b = Bucket::of(sizes);
    layout_->check_bucket(b, "PlanCache.preload");
    list.push_back(layout_->bucket_of(b));
  }
  preload_bucket_list(list, example_inputs, progress);
}

void PlanCache::preload_bucket_list(const std::vector<Bucket>& buckets, const std::vector<c10::IValue>& example_inputs,
                                    const ProgressFn& progress) {
  recover_after_fork();
  for (const Bucket& b : buckets) layout_->check_bucket(b, "PlanCache.preload");
  std::shared_ptr<const Signature> tentative;  // set from example_inputs until a plan builds
  if (!example_inputs.empty()) {
    check_signature(example_inputs, layout_->sizes_of(example_inputs));
    std::shared_ptr<const Signature> before;
    {
      std::shared_lock<std::shared_mutex> lock(example_mutex_);
      before = signature_;
    }
    if (!before) {
      remember_example(example_inputs);
      std::shared_lock<std::shared_mutex> lock(example_mutex_);
      tentative = signature_;
    }
  }
  const auto total = static_cast<int64_t>(buckets.size());
  int64_t done = 0;
  for (const Bucket& b : buckets) {
    if (!table_->contains(b)) {
      try {
        std::string why;
        TORCH_CHECK(source_->can_build(why), "PlanCache.preload: cannot build the plan for ", layout_->describe(b),
                    ": ", why);
        get_or_build(b, example_at(b));
      } catch (...) {
        if (tentative && done == 0) {
          // The example never produced a plan: it must not define the cache's inputs.
          std::unique_lock<std::shared_mutex> lock(example_mutex_);
          if (signature_ == tentative && table_->empty()) {
            signature_.reset();
            example_.clear();
          }
        }
        throw;
      }
    }
    ++done;
    if (progress) progress(done, total, b[0]);
  }
}

std::vector<std::vector<int64_t>> PlanCache::cached_buckets() const {
  std::vector<std::vector<int64_t>> out;
  for (const auto& plan : table_->plans()) out.push_back(plan->bucket().vec());
  return out;
}

std::vector<int64_t> PlanCache::cached_sizes() const {
  std::vector<int64_t> sizes;
  for (const auto& b : cached_buckets()) sizes.push_back(b[0]);
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  return sizes;
}

bool PlanCache::contains(int64_t batch_size) const {
  for (const auto& plan : table_->plans()) {
    if (plan->bucket()[0] == batch_size) return true;
  }
  return false;
}

bool PlanCache::contains_bucket(const std::vector<int64_t>& bucket) const {
  return table_->contains(Bucket::of(bucket));
}

std::optional<torch::jit::Module> PlanCache::plan_module(int64_t batch_size) const {
  for (const auto& plan : table_->plans()) {
    if (plan->bucket()[0] == batch_size) return plan->exec->module();
  }
  return std::nullopt;
}

std::vector<std::string> PlanCache::call_spec() const {
  for (const auto& plan : table_->plans()) return plan->exec->call_spec();
  return {};
}

namespace {

SizeStats size_stats(const PlanCache::SizeRecord& rec) {
  SizeStats s;
  s.batch_size = rec.bucket[0];
  s.bucket = rec.bucket.vec();
  s.calls = rec.calls.load();
  s.hits = rec.hits.load();
  s.misses = rec.misses.load();
  s.padded_calls = rec.padded_calls.load();
  s.split_calls = rec.split_calls.load();
  s.fallback_calls = rec.fallback_calls.load();
  s.builds = rec.builds.load();
  s.compiles = rec.compiles.load();
  s.evictions = rec.evictions.load();
  s.plan_runs = rec.plan_runs.load();
  s.graph_replays = rec.graph_replays.load();
  s.build_seconds = seconds(rec.build_ns.load());
  s.total_seconds = seconds(rec.total_ns.load());
  s.max_seconds = seconds(rec.max_ns.load());
  s.plan_seconds = seconds(rec.plan_ns.load());
  s.padded_elements = rec.padded_elements.load();
  return s;
}

}  // namespace

PlanCacheStats PlanCache::stats() const {
  PlanCacheStats out;
  out.kind = source_->kind();
  const auto totals = table_->totals();
  out.plans = totals.plans;
  out.plan_bytes = totals.plan_bytes;
  out.pending_builds = totals.pending_builds;
  out.build_failures = build_failures_.load();
  out.graph_capture_failures = graph_capture_failures_.load();
  out.hit_lookup_seconds = seconds(hit_lookup_ns_.load());
  out.traffic_requests = traffic_->requests();
  out.traffic_sizes = static_cast<int64_t>(traffic_->distinct());
  out.traffic_dropped = traffic_->dropped();
  table_->visit([&](SizeRecord& rec, const Plan* cached) {
    SizeStats s = size_stats(rec);
    if (cached) {
      const Plan& plan = *cached;
      s.cached = true;
      s.plan_bytes = plan.bytes;
      if (source_->builds_dynamic()) s.shapes = plan.spec.script ? "script" : plan.spec.dynamic ? "dynamic" : "static";
      s.static_seconds = seconds(plan.static_ns);
      s.dynamic_seconds = seconds(plan.dynamic_ns);
      s.script_seconds = seconds(plan.script_ns);
      s.probe_sizes = plan.probe_sizes;
      if (const auto& graph = plan.graph) {
        s.cuda_graph = true;
        s.graph_bytes = graph->bytes();
        ++out.cuda_graphs;
      }
    }
    out.calls += s.calls;
    out.hits += s.hits;
    out.misses += s.misses;
    out.builds += s.builds;
    out.compiles += s.compiles;
    out.evictions += s.evictions;
    out.padded_calls += s.padded_calls;
    out.split_calls += s.split_calls;
    out.fallback_calls += s.fallback_calls;
    out.padded_elements += s.padded_elements;
    out.build_seconds += s.build_seconds;
    out.sizes.push_back(std::move(s));
  });
  std::sort(out.sizes.begin(), out.sizes.end(), [](const auto& a, const auto& b) { return a.bucket < b.bucket; });
  return out;
}

void PlanCache::reset_stats() {
  table_->visit([](SizeRecord& r, const Plan*) {
    for (auto* counter : {&r.calls, &r.hits, &r.misses, &r.padded_calls, &r.split_calls, &r.fallback_calls, &r.builds,
                          &r.compiles, &r.evictions, &r.plan_runs, &r.graph_replays, &r.padded_elements, &r.build_ns,
                          &r.total_ns, &r.max_ns, &r.plan_ns}) {
      counter->store(0);
    }
  });
  build_failures_.store(0);
  graph_capture_failures_.store(0);
  hit_lookup_ns_.store(0);
}

void PlanCache::clear() { table_->clear(); }

std::vector<std::vector<int64_t>> PlanCache::traffic() const {
  std::vector<std::vector<int64_t>> rows;
  for (const auto& [sizes, count] : traffic_->sizes()) {
    rows.push_back(sizes.vec());
    rows.back().push_back(count);
  }
  return rows;
}

std::vector<std::pair<Bucket, int64_t>> PlanCache::checked_traffic(
    const std::vector<std::vector<int64_t>>& rows, const std::string& owner,
    const std::function<std::string(size_t)>& where) const {
  const int rank = layout_->rank();
  std::string dims;
  for (int d = 0; d < rank; ++d) dims += (d ? ", " : "") + layout_->name(d);
  std::vector<std::pair<Bucket, int64_t>> checked;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& row = rows[i];
    TORCH_CHECK_VALUE(row.size() == static_cast<size_t>(rank) + 1, owner, where(i), ": each row is a size per dynamic "
                      "dimension (", dims, ") then a count; got ", row.size(), " numbers");
    const Bucket sizes = Bucket::of({row.begin(), row.end() - 1});
    for (int d = 0; d < rank; ++d) {
      TORCH_CHECK_VALUE(sizes[d] > 0, owner, where(i), ": sizes must be > 0, got ", sizes.str());
    }
    TORCH_CHECK_VALUE(row.back() > 0, owner, where(i), ": the count of ", sizes.str(), " must be > 0, got ",
                      row.back());
    checked.emplace_back(sizes, row.back());
  }
  return checked;
}

void PlanCache::observe_traffic(const std::vector<std::vector<int64_t>>& rows) {
  const auto checked = checked_traffic(rows, "PlanCache.observe_traffic", [](size_t) { return std::string(); });
  for (const auto& [sizes, count] : checked) traffic_->add(sizes, count);
}

void PlanCache::clear_traffic() { traffic_->clear(); }

std::vector<c10::IValue> PlanCache::example_inputs(const std::vector<int64_t>& sizes) const {
  TORCH_CHECK_VALUE(sizes.size() == static_cast<size_t>(layout_->rank()), "PlanCache.example_inputs: expected a size "
                    "per dynamic dimension (", layout_->rank(), "), got ", sizes.size());
  const Bucket bucket = Bucket::of(sizes);
  layout_->check_bucket(bucket, "PlanCache.example_inputs");
  return example_at(bucket);
}

}  // namespace torch_ext::plan
