// Saving and loading a cache: the frozen module, one example row of each input, and a manifest
// of the cached sizes with a fingerprint of the source module, which load() checks.
#include "torch_ext/plan/plan.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/ops/sum.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/csrc/jit/serialization/pickle.h>

namespace torch_ext::plan {

namespace {

constexpr const char* kManifestHeader = "torch_ext.PlanCache 1";

uint64_t fingerprint(const torch::jit::Module& module, const std::string& method) {
  // The method's schema and every parameter and buffer (name, shape, dtype, sum of values).
  std::ostringstream text;
  text << module.get_method(method).function().getSchema() << "\n";
  for (const auto& p : module.named_parameters(true)) {
    text << p.name << " " << p.value.sizes() << " " << p.value.scalar_type() << " "
         << at::sum(p.value.detach().to(at::kDouble)).item<double>() << "\n";
  }
  for (const auto& b : module.named_buffers(true)) {
    text << b.name << " " << b.value.sizes() << " " << b.value.scalar_type() << " "
         << (b.value.is_complex() ? 0.0 : at::sum(b.value.detach().to(at::kDouble)).item<double>()) << "\n";
  }
  return std::hash<std::string>{}(text.str());
}

struct Manifest {
  uint64_t fingerprint = 0;
  std::string method;
  std::vector<int64_t> sizes;
};

// Parses the manifest save() writes; errors name the file and the line expected.
Manifest read_manifest(const std::string& manifest_path) {
  std::ifstream manifest(manifest_path);
  TORCH_CHECK(manifest.good(), "PlanCache.load: ", manifest_path, " does not exist or cannot be read");
  std::string header;
  std::getline(manifest, header);
  TORCH_CHECK(header == kManifestHeader, "PlanCache.load: ", manifest_path, " is not a PlanCache manifest (first line '",
              header, "', expected '", kManifestHeader, "')");
  Manifest out;
  std::string key;
  manifest >> key >> out.fingerprint;
  TORCH_CHECK(key == "fingerprint", "PlanCache.load: ", manifest_path, " is malformed (expected fingerprint)");
  manifest >> key >> out.method;
  TORCH_CHECK(key == "method", "PlanCache.load: ", manifest_path, " is malformed (expected method)");
  manifest >> key;
  TORCH_CHECK(key == "sizes", "PlanCache.load: ", manifest_path, " is malformed (expected sizes)");
  for (int64_t n; manifest >> n;) out.sizes.push_back(n);
  return out;
}

}  // namespace

void PlanCache::save(const std::string& dir) const {
  std::vector<int64_t> sizes = cached_sizes();
  std::vector<c10::IValue> example;
  {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    example = example_;
  }
  TORCH_CHECK(!example.empty(), "PlanCache.save: nothing to save to ", dir, "; no plan was built yet");
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  // optimize_for_inference's MKLDNN constants cannot be loaded back, so the frozen module is
  // what is saved; load() runs optimize_for_inference again.
  {
    std::lock_guard<std::mutex> lock(source_mutex_);
    frozen_locked().save((fs::path(dir) / "module.pt").string());
  }
  c10::impl::GenericList rows(c10::AnyType::get());
  for (const auto& v : example) rows.push_back(v);
  const auto bytes = torch::jit::pickle_save(rows);
  std::ofstream((fs::path(dir) / "example.pkl").string(), std::ios::binary).write(bytes.data(), bytes.size());
  std::ofstream manifest((fs::path(dir) / "manifest.txt").string());
  manifest << kManifestHeader << "\n";
  manifest << "fingerprint " << fingerprint(source_, options_.method) << "\n";
  manifest << "method " << options_.method << "\n";
  manifest << "sizes";
  for (int64_t n : sizes) manifest << " " << n;
  manifest << "\n";
  TORCH_CHECK(manifest.good(), "PlanCache.save: writing ", (fs::path(dir) / "manifest.txt").string(), " failed");
}

int64_t PlanCache::load(const std::string& dir, const ProgressFn& progress) {
  namespace fs = std::filesystem;
  const auto manifest_path = (fs::path(dir) / "manifest.txt").string();
  const Manifest manifest = read_manifest(manifest_path);
  TORCH_CHECK(manifest.method == options_.method, "PlanCache.load: ", manifest_path, " holds plans of method '",
              manifest.method, "'; this cache serves '", options_.method, "'");
  const uint64_t mine = fingerprint(source_, options_.method);
  TORCH_CHECK(manifest.fingerprint == mine, "PlanCache.load: ", manifest_path, " was saved from a different module ",
              "(fingerprint ", manifest.fingerprint, ", this cache's module ", mine, ")");
  const auto example_path = (fs::path(dir) / "example.pkl").string();
  std::ifstream example_file(example_path, std::ios::binary);
  TORCH_CHECK(example_file.good(), "PlanCache.load: ", example_path, " does not exist or cannot be read");
  std::vector<char> bytes((std::istreambuf_iterator<char>(example_file)), std::istreambuf_iterator<char>());
  const auto rows = torch::jit::pickle_load(bytes).toList().vec();
  check_signature(rows, 1);
  remember_example(rows, 1);
  const auto module_path = (fs::path(dir) / "module.pt").string();
  TORCH_CHECK(fs::exists(module_path), "PlanCache.load: ", module_path, " does not exist");
  {
    std::lock_guard<std::mutex> lock(source_mutex_);
    if (!frozen_ready_) {
      try {
        frozen_ = torch::jit::load(module_path);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, "PlanCache.load: cannot load ", module_path, ": ", message_of(e));
      }
      frozen_ready_ = true;
    }
  }
  const std::vector<int64_t>& sizes = manifest.sizes;
  int64_t loaded = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t n = sizes[i];
    if (!contains(n)) {
      get_or_build(n, example_at(n));
      ++loaded;
    }
    if (progress) progress(static_cast<int64_t>(i) + 1, static_cast<int64_t>(sizes.size()), n);
  }
  return loaded;
}

}  // namespace torch_ext::plan
