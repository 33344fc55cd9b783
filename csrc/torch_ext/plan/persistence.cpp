// Saving and loading a cache, whatever its plans: the example rows, the source's files and
// identity, each plan's bucket (and an exported program's package), all listed with their
// SHA-256 in a manifest that load() checks line by line against this cache's layout.
#include "torch_ext/plan/persistence.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <vector>

#include <c10/core/GradMode.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "torch_ext/plan/plan.h"
#include "torch_ext/common/sha256.h"
#include "torch_ext/plan/plan_table.h"
#include "torch_ext/plan/traffic.h"

namespace torch_ext::plan {

namespace {

namespace fs = std::filesystem;

// Sizes a saved cache may ask for when the dimension has no limit: a manifest is checked before
// anything is allocated for it (set max_batch_size or size_ranges to load larger ones).
constexpr int64_t kUnboundedLoadLimit = 1 << 16;

bool default_layout(const PlanCacheOptions& o) {
  return o.batch_dims.empty() && o.output_batch_dims.empty() && o.dims.empty() && o.output_dims.empty() &&
         o.dim_names.empty() && o.size_ranges.empty() && o.buckets.empty() && o.pad_values.empty();
}

std::vector<c10::IValue> read_rows(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  try {
    return torch::jit::pickle_load(bytes).toList().vec();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "PlanCache.load: ", path, " holds no example rows: ", message_of(e));
  }
}

// Every plan line against the layout and the kinds of plan the source has, before anything is
// allocated for one.
void check_plans(const Layout& layout, const Manifest& manifest, bool builds_dynamic) {
  std::set<std::vector<int64_t>> seen;
  for (const auto& entry : manifest.plans) {
    const std::string where = "PlanCache.load: " + manifest.path + " line " + std::to_string(entry.line);
    layout.check_bucket(entry.upper, where);
    for (int k = 0; k < entry.upper.rank; ++k) {
      TORCH_CHECK(layout.max_size(k) > 0 || entry.upper[k] <= kUnboundedLoadLimit, where, ": ", layout.name(k), " ",
                  entry.upper[k], " is above ", kUnboundedLoadLimit, ", the most a cache without a limit on ",
                  layout.name(k), " loads (set max_batch_size or size_ranges)");
    }
    TORCH_CHECK(layout.bucket_of(entry.upper) == entry.upper, where, ": ", entry.upper.str(),
                " is not a bucket of this cache's layout (buckets)");
    TORCH_CHECK(!entry.dynamic || builds_dynamic, where, ": a TorchScript module's cache holds static plans only; this "
                "line has a ", entry.script ? "script" : "dynamic", " one");
    TORCH_CHECK(!entry.dynamic || layout.lower_of(entry.upper) == entry.lower, where, ": the plan's range starts at ",
                entry.lower.str(), "; this layout's bucket starts at ", layout.lower_of(entry.upper).str());
    TORCH_CHECK(seen.insert(entry.upper.vec()).second, where, ": bucket ", entry.upper.str(), " is listed twice");
  }
}

}  // namespace

void PlanCache::save(const std::string& dir) const {
  const auto plans = table_->plans();
  std::vector<c10::IValue> example;
  {
    std::shared_lock<std::shared_mutex> lock(example_mutex_);
    example = example_;
  }
  TORCH_CHECK(!example.empty(), "PlanCache.save: nothing to save to ", dir, "; no plan was built yet");
  fs::create_directories(fs::path(dir) / "plans");
  Manifest manifest;
  manifest.kind = source_->kind();
  copy_layout(options_, manifest.layout);
  c10::impl::GenericList rows(c10::AnyType::get());
  for (const auto& v : example) rows.push_back(v);
  const auto bytes = torch::jit::pickle_save(rows);
  const auto example_path = (fs::path(dir) / "example.pkl").string();
  std::ofstream(example_path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  manifest.add_file(dir, "example.pkl");
  source_->save(dir, manifest);
  for (const auto& plan : plans) {
    ManifestPlan entry{plan->spec.upper, plan->spec.lower, plan->spec.dynamic, plan->spec.script, "", "", 0};
    if (const std::string file = plan->exec->file(); !file.empty()) {
      entry.file = "plans/" + plan->bucket().str() + (plan->spec.dynamic ? "-dynamic.pt2" : "-static.pt2");
      const fs::path target = fs::path(dir) / entry.file;
      if (!fs::exists(target) || !fs::equivalent(file, target)) {
        fs::copy_file(file, target, fs::copy_options::overwrite_existing);
      }
      entry.sha256 = sha256_file(target.string());
    }
    manifest.plans.push_back(entry);
  }
  manifest.traffic = traffic();
  write_manifest(dir, manifest);
}

int64_t PlanCache::load(const std::string& dir, const ProgressFn& progress) {
  recover_after_fork();
  TORCH_CHECK(fs::is_directory(dir), "PlanCache.load: ", dir, " is not a directory");
  return load_folder(dir, progress, /*adopt_layout=*/false);
}

int64_t PlanCache::load_folder(const std::string& dir, const ProgressFn& progress, bool adopt_layout) {
  const Manifest manifest = read_manifest(dir, options_.manifest_sha256);
  TORCH_CHECK(manifest.kind == source_->kind(), "PlanCache.load: ", manifest.path, " holds ", manifest.kind,
              " plans; this cache's plans are ", source_->kind());
  if (adopt_layout && default_layout(options_)) {
    copy_layout(manifest.layout, options_);
    options_.validate();
  } else {
    std::string mine, saved;
    const std::string field = layout_difference(options_, manifest.layout, mine, saved);
    TORCH_CHECK(field.empty(), "PlanCache.load: ", manifest.path, " was saved with ", field, " =", saved,
                "; this cache has ", field, " =", mine);
  }
  if (!layout_) layout_ = std::make_unique<Layout>(options_);
  source_->check_saved(dir, manifest, adopt_layout);
  const std::string example_path = manifest.checked_file(dir, "example.pkl");
  const std::vector<c10::IValue> rows = read_rows(example_path);
  const Bucket row_sizes = layout_->sizes_of(rows);
  TORCH_CHECK(row_sizes[0] == 1, "PlanCache.load: ", example_path, " holds ", row_sizes[0], " rows, not 1");
  check_signature(rows, row_sizes);
  remember_example(rows);
  check_plans(*layout_, manifest, source_->builds_dynamic());
  const auto traffic = checked_traffic(manifest.traffic, "PlanCache.load: " + manifest.path, [&](size_t i) {
    return " line " + std::to_string(manifest.traffic_lines[i]);
  });
  int64_t loaded = 0;
  const auto total = static_cast<int64_t>(manifest.plans.size());
  for (int64_t i = 0; i < total; ++i) {
    const ManifestPlan& entry = manifest.plans[i];
    if (!table_->contains(entry.upper)) {
      load_plan(dir, entry);
      ++loaded;
    }
    if (progress) progress(i + 1, total, entry.upper[0]);
  }
  for (const auto& [sizes, count] : traffic) traffic_->add(sizes, count);
  return loaded;
}

void PlanCache::load_plan(const std::string& dir, const ManifestPlan& entry) {
  const auto start = Clock::now();
  auto plan = std::make_shared<Plan>();
  plan->spec = PlanSpec{entry.upper, entry.lower, entry.dynamic, false, entry.script};
  plan->record = table_->record(entry.upper);
  const auto example = example_at(entry.upper);
  try {
    plan->exec = source_->load_plan(dir, entry, example);
    plan->constants = plan->exec->constants();
    for (const auto& [storage, size] : plan->constants) plan->bytes += size;
    c10::AutoGradMode no_grad(false);
    plan->warm_ns = fastest_run(*plan->exec, example, options_.warmup_calls);
  } catch (const std::exception& e) {
    build_failures_.fetch_add(1, std::memory_order_relaxed);
    TORCH_CHECK(false, "PlanCache.load: loading the plan for ", layout_->describe(entry.upper), " from ", dir,
                " failed: ", message_of(e));
  }
  if (options_.cuda_graphs && on_cuda(example)) plan->capture_pending.store(true, std::memory_order_relaxed);
  plan->build_ns = elapsed_ns(start);
  plan->record->builds.fetch_add(1, std::memory_order_relaxed);
  plan->record->build_ns.fetch_add(plan->build_ns, std::memory_order_relaxed);
  table_->insert(plan);
}

}  // namespace torch_ext::plan
