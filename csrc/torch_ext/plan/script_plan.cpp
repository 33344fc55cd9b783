// TorchScript plans: the source module frozen and optimised once, each plan's module (that base
// or a clone of it) and executor (graph executor or static runtime), the constants it
// references, runs of the source module for misses no plan serves, and what save() / load()
// keep of it (the frozen module, and hashes of the served code and of the weights).
#include "torch_ext/plan/plan.h"

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/codegen/fuser/interface.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/passes/tensorexpr_fuser.h>
#include <torch/csrc/jit/runtime/static/impl.h>
#include <torch/csrc/jit/serialization/import.h>

#include "torch_ext/common/fork.h"
#include "torch_ext/common/sha256.h"
#include "torch_ext/plan/persistence.h"

namespace torch_ext::plan {

std::optional<torch::jit::Module> Executable::module() const { return std::nullopt; }

namespace {

void add_tensor(const at::Tensor& t, Constants& out) {
  if (!t.defined()) return;
  if (t.is_mkldnn() || !t.has_storage()) {
    out.emplace(t.unsafeGetTensorImpl(), static_cast<int64_t>(t.numel() * t.element_size()));
    return;
  }
  out.emplace(t.storage().unsafeGetStorageImpl(), static_cast<int64_t>(t.storage().nbytes()));
}

void add_block_constants(torch::jit::Block* block, Constants& out) {
  for (torch::jit::Node* node : block->nodes()) {
    if (node->kind() == c10::prim::Constant || node->kind().toQualString() == std::string("prim::ConstantMKLDNNTensor")) {
      if (node->hasAttribute(c10::attr::value)) {
        const auto kind = node->kindOf(c10::attr::value);
        if (kind == torch::jit::AttributeKind::t) {
          add_tensor(node->t(c10::attr::value), out);
        } else if (kind == torch::jit::AttributeKind::ival && node->ival(c10::attr::value).isTensor()) {
          add_tensor(node->ival(c10::attr::value).toTensor(), out);
        }
      }
    }
    for (torch::jit::Block* inner : node->blocks()) add_block_constants(inner, out);
  }
}

// TorchScript's executors take locks of their own on every run (a GraphFunction's executor lock,
// the profiling executor's plan lock; the static runtimes' free list here). A process forked while
// another thread runs a module would inherit those locks held by a thread it does not have, and
// its first run of that module would hang. So every run of a TorchScript module here passes this
// gate, and fork() closes it: runs that have not started wait, fork() waits for those in flight to
// end (a run nested in a run goes on: its thread is mid-run). The gate registers when the library
// loads, before any object can, so its fork_prepare runs first: a run in flight may still need
// another participant's lock (a torch_ext op in the scripted model), never the reverse, since no
// participant holds its locks while it runs a plan.
class ScriptRunGate final : public ForkParticipant {
 public:
  class Running {
   public:
    explicit Running(ScriptRunGate& gate) : gate_(gate) { gate_.enter(); }
    ~Running() { gate_.leave(); }
    Running(const Running&) = delete;
    Running& operator=(const Running&) = delete;

   private:
    ScriptRunGate& gate_;
  };

  ScriptRunGate() { register_fork_participant(this); }

  void fork_prepare() override {
    std::unique_lock<std::mutex> lock(mutex_);
    forking_ = true;
    changed_.wait(lock, [this] { return running_ == 0; });
    lock.release();  // held across fork(): no run starts meanwhile
  }

  void fork_parent() override {
    forking_ = false;
    mutex_.unlock();
    changed_.notify_all();
  }

  void fork_child() override {  // only the forking thread is here, and it runs nothing
    new (&mutex_) std::mutex();
    new (&changed_) std::condition_variable();
    forking_ = false;
  }

 private:
  void enter() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (depth_ == 0) changed_.wait(lock, [this] { return !forking_; });
    ++running_;
    ++depth_;
  }

  void leave() {
    std::lock_guard<std::mutex> lock(mutex_);
    --depth_;
    if (--running_ == 0 && forking_) changed_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  bool forking_ = false;
  int64_t running_ = 0;            // runs in flight, all threads
  static thread_local int depth_;  // runs in flight on this thread
};

thread_local int ScriptRunGate::depth_ = 0;

ScriptRunGate& run_gate() {
  static ScriptRunGate* gate = new ScriptRunGate();  // leaked: runs may outlive static destruction
  return *gate;
}

[[maybe_unused]] ScriptRunGate& registered_at_load = run_gate();

// A plan's module and executor. Plans are clones of one base module and share most constants.
class ScriptExecutable final : public Executable {
 public:
  explicit ScriptExecutable(torch::jit::Module module, const std::string& method)
      : module_(std::move(module)), method_(module_.get_method(method)) {}

  void use_static_runtime() { static_module_ = std::make_unique<torch::jit::StaticModule>(module_, /*is_frozen=*/true); }

  c10::IValue run(const std::vector<c10::IValue>& inputs) override {
    ScriptRunGate::Running running(run_gate());
    if (!static_module_) return method_(inputs);
    std::unique_ptr<torch::jit::StaticRuntime> runtime;
    {
      std::lock_guard<std::mutex> lock(runtimes_mutex_);
      if (!free_runtimes_.empty()) {
        runtime = std::move(free_runtimes_.back());
        free_runtimes_.pop_back();
      }
    }
    if (!runtime) runtime = std::make_unique<torch::jit::StaticRuntime>(*static_module_);
    c10::IValue output = (*runtime)(inputs);
    std::lock_guard<std::mutex> lock(runtimes_mutex_);
    free_runtimes_.push_back(std::move(runtime));
    return output;
  }

  c10::IValue run_single(const std::vector<c10::IValue>& inputs) override {
    ScriptRunGate::Running running(run_gate());
    return static_module_ ? (*static_module_)(inputs) : method_(inputs);
  }

  // The plan's graphs' tensor constants (frozen weights) and tensor attributes, each storage once.
  Constants constants() const override {
    Constants out;
    for (const auto& method : module_.get_methods()) add_block_constants(method.graph()->block(), out);
    for (const auto& attribute : module_.named_attributes(/*recurse=*/true)) {
      if (attribute.value.isTensor()) add_tensor(attribute.value.toTensor(), out);
    }
    return out;
  }

  std::optional<torch::jit::Module> module() const override { return module_; }

 private:
  torch::jit::Module module_;
  torch::jit::Method method_;
  std::unique_ptr<torch::jit::StaticModule> static_module_;
  std::mutex runtimes_mutex_;  // guards the free list only, never held while running
  std::vector<std::unique_ptr<torch::jit::StaticRuntime>> free_runtimes_;
};

// TorchScript names classes it compiled again with ___torch_mangle_<n>, n counting per process.
std::string demangled(const std::string& text) {
  static const std::regex mangle("___torch_mangle_[0-9]+\\.");
  return std::regex_replace(text, mangle, "");
}

// The code of every method of the module and its submodules, as TorchScript prints it.
std::string code_hash(const torch::jit::Module& module) {
  Sha256 h;
  for (const auto& m : module.modules()) {
    h.update(demangled(m.type()->name() ? m.type()->name()->qualifiedName() : "") + "\n");
    for (const auto& method : m.get_methods()) {
      h.update(method.name() + "\n" + demangled(method.graph()->toString(/*print_source_locations=*/false)) + "\n");
    }
  }
  return h.hex_digest();
}

// Every attribute's name and value: tensors by dtype, shape and bytes, the rest as printed.
std::string weights_hash(const torch::jit::Module& module) {
  Sha256 h;
  for (const auto& attribute : module.named_attributes(/*recurse=*/true)) {
    h.update(attribute.name + "\n");
    if (attribute.value.isTensor()) {
      const at::Tensor t = attribute.value.toTensor().detach().to(at::kCPU).contiguous();
      std::ostringstream meta;
      meta << t.scalar_type() << " " << t.sizes() << "\n";
      h.update(meta.str());
      h.update(t.const_data_ptr(), t.nbytes());
    } else if (attribute.value.isInt() || attribute.value.isDouble() || attribute.value.isBool() ||
               attribute.value.isString()) {
      std::ostringstream value;
      value << attribute.value << "\n";
      h.update(value.str());
    }
  }
  return h.hex_digest();
}

class ScriptSource final : public PlanSource {
 public:
  // frozen: a module a saved cache holds, frozen already (it has no training flag left).
  ScriptSource(torch::jit::Module module, const PlanCacheOptions& options, bool frozen)
      : source_(std::move(module)), options_(options) {
    TORCH_CHECK(source_.find_method(options_.method).has_value(), "PlanCache: the module (", name(),
                ") has no method '", options_.method, "'");
    if (frozen) {
      frozen_ = source_;
      frozen_ready_ = true;
      return;
    }
    TORCH_CHECK(!source_.is_training(), "PlanCache: the module (", name(),
                ") is in training mode and cannot be frozen; call .eval() on it first");
  }

  const char* kind() const override { return "torchscript"; }
  std::string name() const override { return source_.type()->name()->qualifiedName(); }
  bool can_build(std::string& /*why*/) const override { return true; }
  bool builds_dynamic() const override { return false; }
  bool has_source() const override { return true; }

  std::unique_ptr<Executable> build(const PlanSpec& spec, const std::vector<c10::IValue>& example,
                                    int64_t& /*compiles*/) override;

  c10::IValue run_source(const std::vector<c10::IValue>& inputs) override {
    try {
      ScriptRunGate::Running running(run_gate());
      return source_.get_method(options_.method)(inputs);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "PlanCache: the module (", name(), ") rejected the inputs: ", message_of(e));
    }
  }

  void save(const std::string& dir, Manifest& manifest) const override;
  void check_saved(const std::string& dir, const Manifest& manifest, bool adopt) override;
  std::unique_ptr<Executable> load_plan(const std::string& /*dir*/, const ManifestPlan& plan,
                                        const std::vector<c10::IValue>& example) override {
    int64_t compiles = 0;
    return build(PlanSpec{plan.upper, plan.lower, false}, example, compiles);
  }

 private:
  torch::jit::Module frozen_locked() const;
  torch::jit::Module optimized_locked() const;
  bool fuses(const std::vector<c10::IValue>& example) const {
    return torch::jit::tensorExprFuserEnabled() &&
           (on_cuda(example) ? torch::jit::canFuseOnGPU() : torch::jit::canFuseOnCPU());
  }

  torch::jit::Module source_;
  const PlanCacheOptions options_;
  // Freezing and optimize_for_inference are independent of the batch size: the module is frozen
  // (or loaded frozen by load()) and optimised once, and each plan is that or a clone of it,
  // sharing its constants. clone(), freeze() and optimize_for_inference() register types in the
  // module's CompilationUnit, which is not thread-safe, so they run under mutex_; warm-ups, the
  // bulk of a build, run outside it.
  mutable std::mutex mutex_;
  mutable torch::jit::Module frozen_;  // guarded by mutex_
  mutable bool frozen_ready_ = false;
  mutable torch::jit::Module optimized_;  // frozen_ through optimize_for_inference, once
  mutable bool optimized_ready_ = false;
  bool base_executor_chosen_ = false;  // for plans that share the base
  // A source adopted from a saved folder (its frozen module, check_saved with adopt): the hashes
  // of the module it was frozen from, which save() writes again.
  std::string adopted_code_, adopted_weights_;
};

torch::jit::Module ScriptSource::frozen_locked() const {
  if (!frozen_ready_) {
    frozen_ = torch::jit::freeze(source_.clone(), std::nullopt, /*optimize_numerics=*/true);
    frozen_ready_ = true;
  }
  return frozen_;
}

torch::jit::Module ScriptSource::optimized_locked() const {
  if (!optimized_ready_) {
    torch::jit::Module base = frozen_locked().clone();
    optimized_ = torch::jit::optimize_for_inference(base);
    optimized_ready_ = true;
  }
  return optimized_;
}

std::unique_ptr<Executable> ScriptSource::build(const PlanSpec& spec, const std::vector<c10::IValue>& example,
                                                int64_t& /*compiles*/) {
  std::lock_guard<std::mutex> lock(mutex_);
  torch::jit::Module frozen;
  try {
    frozen = frozen_locked();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "PlanCache: freezing the module (", name(), ") failed while building the plan for bucket ",
                spec.upper.str(), ": ", message_of(e));
  }
  const bool optimize = options_.optimize_for_inference && !options_.static_runtime;
  torch::jit::Module base = optimize ? optimized_locked() : frozen;
  const bool fusing = fuses(example);
  torch::jit::Module module;
  if (options_.static_runtime || options_.specialize_shapes.value_or(fusing)) {
    // A clone has its own graph executor, which specialises at this size (or a graph of its own
    // for the static runtime to rewrite); it shares the base's constants and (inplace) its
    // attributes: every plan references the same weights.
    module = base.clone(/*inplace=*/true);
  } else {
    // Without specialisation a plan's graph would be the base's, compiled again: the plans share
    // the base, compiled once for every size, and a build is its warm-ups. Where TorchScript does
    // not fuse, its profiling executor guards nothing by shape and never re-profiles; where it
    // fuses, it would guard its fusion groups with the first size's shapes and re-profile at the
    // others, so the simple executor runs the base there. The mode is chosen before the base's
    // first run (its executor is created then), once.
    if (!base_executor_chosen_) {
      if (fusing) {
        torch::jit::toGraphFunction(base.get_method(options_.method).function())
            ._set_initial_executor_execution_mode(torch::jit::ExecutorExecutionMode::SIMPLE);
      }
      base_executor_chosen_ = true;
    }
    module = base;
  }
  auto exec = std::make_unique<ScriptExecutable>(module, options_.method);
  if (options_.static_runtime) {
    TORCH_CHECK(!on_cuda(example), "the static runtime runs CPU modules only; these inputs are on CUDA");
    exec->use_static_runtime();
  }
  return exec;
}

void ScriptSource::save(const std::string& dir, Manifest& manifest) const {
  // optimize_for_inference's MKLDNN constants cannot be loaded back, so the frozen module is what
  // is saved; load() runs optimize_for_inference again.
  {
    std::lock_guard<std::mutex> lock(mutex_);
    frozen_locked().save((std::filesystem::path(dir) / "module.pt").string());
  }
  manifest.add_file(dir, "module.pt");
  manifest.values["method"] = options_.method;
  manifest.values["code"] = adopted_code_.empty() ? code_hash(source_) : adopted_code_;
  manifest.values["weights"] = adopted_weights_.empty() ? weights_hash(source_) : adopted_weights_;
}

void ScriptSource::check_saved(const std::string& dir, const Manifest& manifest, bool adopt) {
  TORCH_CHECK(manifest.value("method") == options_.method, "PlanCache.load: ", manifest.path, " holds plans of method '",
              manifest.value("method"), "'; this cache serves '", options_.method, "'");
  if (adopt) {  // the source is the saved frozen module: it serves, and save() keeps its origin's hashes
    adopted_code_ = manifest.value("code");
    adopted_weights_ = manifest.value("weights");
    return;
  }
  TORCH_CHECK(manifest.value("code") == code_hash(source_), "PlanCache.load: ", manifest.path,
              " was saved from a different module: the code of this cache's module (", name(),
              ") differs from the saved one's, so its saved frozen module would serve the old code");
  TORCH_CHECK(manifest.value("weights") == weights_hash(source_), "PlanCache.load: ", manifest.path,
              " was saved from a different module: the weights (or other attributes) of this cache's module (", name(),
              ") differ from the saved one's");
  const std::string module_path = manifest.checked_file(dir, "module.pt");
  std::lock_guard<std::mutex> lock(mutex_);
  if (!frozen_ready_) {
    try {
      frozen_ = torch::jit::load(module_path);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, "PlanCache.load: cannot load ", module_path, ": ", message_of(e));
    }
    frozen_ready_ = true;
  }
}

}  // namespace

std::unique_ptr<PlanSource> make_script_source(torch::jit::Module module, const PlanCacheOptions& options, bool frozen) {
  return std::make_unique<ScriptSource>(std::move(module), options, frozen);
}

}  // namespace torch_ext::plan
