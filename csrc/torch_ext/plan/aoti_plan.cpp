// Exported programs' plans: AOTInductor packages, one per bucket, loaded and run with
// torch::inductor::AOTIModelPackageLoader (no Python). Packages are compiled by a compiler
// callback (Python's torch._inductor); a process without one serves what it loaded. Where the
// module the program was exported from scripts, a bucket's plan may be its frozen TorchScript
// module instead (a TorchScript source inside this one, saved and loaded with it).
#include "torch_ext/plan/plan.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/csrc/jit/serialization/import.h>

#include "torch_ext/plan/persistence.h"
#include "torch_ext/common/sha256.h"

namespace torch_ext::plan {

namespace {

namespace fs = std::filesystem;

class AotiExecutable final : public Executable {
 public:
  AotiExecutable(std::string file, int64_t runners) : file_(std::move(file)), pid_(getpid()) {
    try {
      loader_ = std::make_unique<torch::inductor::AOTIModelPackageLoader>(file_, "model", /*run_single_threaded=*/false,
                                                                          static_cast<size_t>(runners));
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "PlanCache: cannot load the AOTInductor package ", file_, ": ", message_of(e));
    }
  }

  ~AotiExecutable() override {
    // A forked child must not remove the folder the parent's loader extracted the package to.
    if (getpid() != pid_) (void)loader_.release();
  }

  c10::IValue run(const std::vector<c10::IValue>& inputs) override {
    std::vector<at::Tensor> tensors;
    tensors.reserve(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      TORCH_CHECK(inputs[i].isTensor(), "PlanCache: an exported program's plan takes tensors; input ", i, " is a ",
                  inputs[i].tagKind());
      tensors.push_back(inputs[i].toTensor());
    }
    std::vector<at::Tensor> outputs = loader_->run(tensors);
    if (outputs.size() == 1) return outputs[0];
    return c10::ivalue::Tuple::create(std::vector<c10::IValue>(outputs.begin(), outputs.end()));
  }

  // A package holds its own copy of the weights (AOTInductor embeds them): nothing is shared.
  Constants constants() const override {
    Constants out;
    try {
      for (const auto& [name, t] : loader_->get_runner()->extract_constants_map(/*use_inactive=*/false)) {
        if (!t.defined()) continue;
        if (t.has_storage()) {
          out.emplace(t.storage().unsafeGetStorageImpl(), static_cast<int64_t>(t.storage().nbytes()));
        } else {
          out.emplace(t.unsafeGetTensorImpl(), static_cast<int64_t>(t.nbytes()));
        }
      }
    } catch (const std::exception&) {
      out.clear();
    }
    if (out.empty()) out.emplace(this, static_cast<int64_t>(fs::file_size(file_)));
    return out;
  }

  std::string file() const override { return file_; }
  std::vector<std::string> call_spec() const override { return loader_->get_call_spec(); }

 private:
  std::string file_;
  pid_t pid_;
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader_;
};

class ExportSourceImpl final : public PlanSource {
 public:
  ExportSourceImpl(std::string program, const PlanCacheOptions& options)
      : program_(std::move(program)), options_(options), fingerprint_(options.fingerprint), pid_(getpid()) {
    if (!options_.package_dir.empty()) {
      fs::create_directories(options_.package_dir);
      package_dir_ = options_.package_dir;
    }
  }

  ~ExportSourceImpl() override {
    std::error_code ignored;
    if (owns_package_dir_ && getpid() == pid_) fs::remove_all(package_dir_, ignored);
  }

  const char* kind() const override { return "export"; }
  std::string name() const override { return program_.empty() ? "an exported program" : program_; }
  bool builds_dynamic() const override { return true; }

  bool builds_script() const override { return script() != nullptr; }

  bool can_build(std::string& why) const override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (compiler_) return true;
    why = "this process has no compiler for exported programs (AOTInductor compiles in Python: build or preload "
          "the buckets in Python and save() them; a C++ process loads them with no compile)";
    return false;
  }

  std::unique_ptr<Executable> build(const PlanSpec& spec, const std::vector<c10::IValue>& example,
                                    int64_t& compiles) override {
    if (spec.script) {
      PlanSource* scripted = script();
      TORCH_CHECK(scripted, "PlanCache: no script module to build a TorchScript plan from (set_script_module)");
      return scripted->build(spec, example, compiles);
    }
    CompileFn compiler;
    std::string path;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      TORCH_CHECK(compiler_, "PlanCache: no compiler for exported programs in this process");
      compiler = compiler_;
      path = (fs::path(package_dir_locked()) / (spec.upper.str() + (spec.dynamic ? "-dynamic-" : "-static-") +
                                                std::to_string(++packages_) + ".pt2"))
                 .string();
    }
    compiler(CompileRequest{spec.upper.vec(), spec.lower.vec(), spec.dynamic, example, path, spec.background,
                            [this] { return cancelled_.load(std::memory_order_relaxed); }});
    ++compiles;
    TORCH_CHECK(fs::is_regular_file(path), "PlanCache: the compiler returned without writing ", path);
    return std::make_unique<AotiExecutable>(path, options_.runners);
  }

  void cancel_builds() override { cancelled_.store(true, std::memory_order_relaxed); }

  bool has_source() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<bool>(runner_);
  }

  c10::IValue run_source(const std::vector<c10::IValue>& inputs) override {
    SourceFn runner;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      runner = runner_;
    }
    TORCH_CHECK(runner, "PlanCache: no source to run a request no plan serves");
    return runner(inputs);
  }

  void save(const std::string& dir, Manifest& manifest) const override {
    if (!program_.empty()) {
      const fs::path target = fs::path(dir) / "program.pt2";
      if (!fs::exists(target) || !fs::equivalent(program_, target)) {
        fs::copy_file(program_, target, fs::copy_options::overwrite_existing);
      }
      manifest.add_file(dir, "program.pt2");
    }
    manifest.values["fingerprint"] = fingerprint_.empty() ? "none" : fingerprint_;
    if (PlanSource* scripted = script()) scripted->save(dir, manifest);
  }

  void check_saved(const std::string& dir, const Manifest& manifest, bool adopt) override {
    const std::string& saved = manifest.value("fingerprint");
    if (adopt) {
      if (fingerprint_.empty() && saved != "none") fingerprint_ = saved;
    } else {
      TORCH_CHECK(fingerprint_.empty() || saved == "none" || saved == fingerprint_, "PlanCache.load: ", manifest.path,
                  " was saved from a different exported program (fingerprint ", saved, "; this cache's program has ",
                  fingerprint_, ")");
    }
    if (manifest.files.count("program.pt2")) manifest.checked_file(dir, "program.pt2");
    if (!manifest.files.count("module.pt")) return;
    if (PlanSource* scripted = script()) {
      scripted->check_saved(dir, manifest, adopt);
      return;
    }
    // No module given: the saved one is the script module (the manifest lists its SHA-256, and
    // the program's fingerprint was checked above).
    const std::string path = manifest.checked_file(dir, "module.pt");
    torch::jit::Module module;
    try {
      module = torch::jit::load(path);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "PlanCache.load: cannot load ", path, ": ", message_of(e));
    }
    auto scripted = make_script_source(std::move(module), options_, /*frozen=*/true);
    scripted->check_saved(dir, manifest, /*adopt=*/true);
    set_script(std::move(scripted));
  }

  std::unique_ptr<Executable> load_plan(const std::string& dir, const ManifestPlan& plan,
                                        const std::vector<c10::IValue>& example) override {
    if (plan.script) {
      PlanSource* scripted = script();
      TORCH_CHECK(scripted, "PlanCache.load: line ", plan.line, " of the manifest is a TorchScript plan, and ", dir,
                  " holds no module.pt");
      return scripted->load_plan(dir, plan, example);
    }
    const std::string file = (fs::path(dir) / plan.file).string();
    TORCH_CHECK(!plan.file.empty() && plan.file.find("..") == std::string::npos, "PlanCache.load: line ", plan.line,
                " of the manifest names no package inside ", dir);
    TORCH_CHECK(fs::is_regular_file(file), "PlanCache.load: ", file, " does not exist");
    const std::string actual = sha256_file(file);
    TORCH_CHECK(actual == plan.sha256, "PlanCache.load: ", file, " is not the package that was saved (its SHA-256 is ",
                actual, ", the manifest records ", plan.sha256, ")");
    return std::make_unique<AotiExecutable>(file, options_.runners);
  }

  void set_compiler(CompileFn compiler) {
    std::lock_guard<std::mutex> lock(mutex_);
    compiler_ = std::move(compiler);
  }

  void set_runner(SourceFn runner) {
    std::lock_guard<std::mutex> lock(mutex_);
    runner_ = std::move(runner);
  }

  // Once, before plans are built from it: a plan keeps a reference into the script source.
  void set_script(std::unique_ptr<PlanSource> scripted) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(!script_, "PlanCache: the cache has its script module already");
    script_ = std::move(scripted);
  }

 private:
  PlanSource* script() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return script_.get();
  }

  const std::string& package_dir_locked() {
    if (package_dir_.empty()) {
      std::string pattern = (fs::temp_directory_path() / "torch_ext_plans_XXXXXX").string();
      TORCH_CHECK(mkdtemp(pattern.data()) != nullptr, "PlanCache: cannot make a folder for packages in ",
                  fs::temp_directory_path().string());
      package_dir_ = pattern;
      owns_package_dir_ = true;
    }
    return package_dir_;
  }

  const std::string program_;
  const PlanCacheOptions options_;
  std::string fingerprint_;
  const pid_t pid_;
  std::atomic<bool> cancelled_{false};
  mutable std::mutex mutex_;  // guards the members below; never held while compiling or running
  CompileFn compiler_;
  SourceFn runner_;
  std::unique_ptr<PlanSource> script_;  // set once, never replaced
  std::string package_dir_;
  bool owns_package_dir_ = false;
  int64_t packages_ = 0;
};

ExportSourceImpl& export_source(PlanSource& source) {
  auto* impl = dynamic_cast<ExportSourceImpl*>(&source);
  TORCH_CHECK(impl, "PlanCache: compilers and sources are for exported programs' caches; this cache's plans are ",
              source.kind());
  return *impl;
}

}  // namespace

std::unique_ptr<PlanSource> make_export_source(const std::string& program_path, const PlanCacheOptions& options) {
  return std::make_unique<ExportSourceImpl>(program_path, options);
}

void set_export_compiler(PlanSource& source, CompileFn compiler) { export_source(source).set_compiler(std::move(compiler)); }

void set_export_runner(PlanSource& source, SourceFn runner) { export_source(source).set_runner(std::move(runner)); }

void set_export_script(PlanSource& source, torch::jit::Module module, const PlanCacheOptions& options) {
  export_source(source).set_script(make_script_source(std::move(module), options));
}

}  // namespace torch_ext::plan
