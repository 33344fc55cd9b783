#include "torch_ext/checkpoint/frame_hooks.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/SavedTensorHooks.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

namespace torch_ext::checkpoint {
namespace {

using torch::autograd::Engine;
using torch::autograd::SavedVariableHooks;

std::atomic<CheckpointErrorTranslator> error_translator{nullptr};

// Forward: the tensor becomes a holder, which recomputes it on unpack.
class PackHooks final : public SavedVariableHooks {
 public:
  explicit PackHooks(std::shared_ptr<Frame> frame) : frame_(std::move(frame)) {}
  void call_pack_hook(const at::Tensor& tensor) override {
    holder_ = frame_->pack(tensor);
    frame_.reset();  // the holder keeps its frame
  }
  at::Tensor call_unpack_hook() override {
    try {
      return holder_->frame->unpack(*holder_);
    } catch (const CheckpointError& error) {
      if (const auto translate = error_translator.load(std::memory_order_acquire)) translate(error);
      throw;
    }
  }

 private:
  std::shared_ptr<Frame> frame_;
  std::shared_ptr<Holder> holder_;
};

// Replay: the tensor goes to its holder; the replay's own graph keeps what repack() returns.
class RepackHooks final : public SavedVariableHooks {
 public:
  RepackHooks(std::shared_ptr<Frame> frame, int64_t graph_task) : frame_(std::move(frame)), graph_task_(graph_task) {}
  void call_pack_hook(const at::Tensor& tensor) override {
    kept_ = frame_->repack(tensor, graph_task_);
    frame_.reset();
  }
  at::Tensor call_unpack_hook() override { return kept_; }

 private:
  std::shared_ptr<Frame> frame_;
  int64_t graph_task_;
  at::Tensor kept_;
};

struct Scope {
  std::shared_ptr<Frame> frame;
  std::optional<int64_t> graph_task;  // a replay's; none in the forward
  size_t python_depth;  // Python hooks pushed when the scope began
};

thread_local std::vector<Scope> scopes;

size_t python_hooks_depth() { return at::SavedTensorDefaultHooks::get_tls_state().stack.size(); }

thread_local std::vector<size_t> transparent_depths;  // Python stack depths of transparent hooks, ascending

// The type of parameter I of an Engine member function: the graph's nodes are held by
// c10::intrusive_ptr in torch 2.13 and by std::shared_ptr before, and the overrides must match.
template <class F>
struct Parameters;
template <class R, class... A>
struct Parameters<R (Engine::*)(A...)> {
  using Types = std::tuple<A...>;
};
template <auto member, size_t I>
using Parameter = std::tuple_element_t<I, typename Parameters<decltype(member)>::Types>;

class HooksEngine final : public Engine {
 public:
  explicit HooksEngine(Engine& wrapped) : wrapped_(wrapped) {}

  std::unique_ptr<SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (!scopes.empty()) {
      const Scope& top = scopes.back();
      const auto& python = at::SavedTensorDefaultHooks::get_tls_state();
      // Dynamo and AOTAutograd defer hooks while they trace (is_tracing), as torch's own do.
      if (python.stack.size() == top.python_depth && !python.is_tracing) {
        if (!top.graph_task) return std::make_unique<PackHooks>(top.frame);
        return std::make_unique<RepackHooks>(top.frame, *top.graph_task);
      }
    }
    return wrapped_.get_default_saved_variable_hooks();
  }

  torch::autograd::variable_list execute(const torch::autograd::edge_list& roots,
                                         const torch::autograd::variable_list& inputs, bool keep_graph,
                                         bool create_graph, bool accumulate_grad,
                                         const torch::autograd::edge_list& outputs) override {
    return wrapped_.execute(roots, inputs, keep_graph, create_graph, accumulate_grad, outputs);
  }
  c10::intrusive_ptr<at::ivalue::Future> execute_with_graph_task(
      const std::shared_ptr<torch::autograd::GraphTask>& graph_task,
      Parameter<&Engine::execute_with_graph_task, 1> root, torch::autograd::InputBuffer&& input_buffer) override {
    return wrapped_.execute_with_graph_task(graph_task, std::move(root), std::move(input_buffer));
  }
  std::unique_ptr<torch::autograd::AnomalyMetadata> make_anomaly_metadata() override {
    return wrapped_.make_anomaly_metadata();
  }
  void thread_on_exception(const std::shared_ptr<torch::autograd::GraphTask>& graph_task,
                           Parameter<&Engine::thread_on_exception, 1> fn, std::exception& e) override {
    wrapped_.thread_on_exception(graph_task, fn, e);
  }
  void thread_init(int device, const std::shared_ptr<torch::autograd::ReadyQueue>& ready_queue,
                   bool should_increment) override {
    wrapped_.thread_init(device, ready_queue, should_increment);
  }

 private:
  Engine& wrapped_;
};

std::atomic<Engine*> installed{nullptr};

Engine& installed_engine() { return *installed.load(std::memory_order_acquire); }

// Puts a HooksEngine in front of the default engine, again if something (torch's Python module,
// imported later into a LibTorch process) has replaced it since.
void install() {
  if (&Engine::get_default_engine() == installed.load(std::memory_order_acquire)) return;
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  Engine& current = Engine::get_default_engine();
  if (&current == installed.load(std::memory_order_acquire)) return;
  // Never deleted: autograd may ask the default engine for hooks until the process ends.
  installed.store(new HooksEngine(current), std::memory_order_release);
  torch::autograd::set_default_engine_stub(&installed_engine);
}

void push(std::shared_ptr<Frame> frame, std::optional<int64_t> graph_task) {
  const auto& disabled = at::SavedTensorDefaultHooks::get_disabled_error_message();
  TORCH_CHECK(!disabled.has_value(), "checkpoint: ", frame->name(), ": ", disabled.value_or(""));
  install();
  scopes.push_back({std::move(frame), graph_task, python_hooks_depth()});
}

}  // namespace

bool saved_tensor_hooks_active() {
  if (!scopes.empty()) return true;
  const size_t depth = python_hooks_depth();
  const auto transparent = std::upper_bound(transparent_depths.begin(), transparent_depths.end(), depth);
  return depth > static_cast<size_t>(transparent - transparent_depths.begin());
}

void mark_python_hooks_transparent() {
  const size_t depth = python_hooks_depth();
  TORCH_CHECK(depth > 0 && (transparent_depths.empty() || transparent_depths.back() < depth),
              "mark_python_hooks_transparent: no Python saved-tensor hooks pushed since the last mark");
  transparent_depths.push_back(depth);
}

void unmark_python_hooks_transparent() {
  TORCH_CHECK(!transparent_depths.empty() && transparent_depths.back() == python_hooks_depth(),
              "unmark_python_hooks_transparent: the hooks on top are not the last ones marked");
  transparent_depths.pop_back();
}

void set_checkpoint_error_translator(CheckpointErrorTranslator translator) {
  error_translator.store(translator, std::memory_order_release);
}

FrameHooks::FrameHooks(std::shared_ptr<Frame> frame) { push(std::move(frame), std::nullopt); }

FrameHooks::FrameHooks(std::shared_ptr<Frame> frame, int64_t graph_task) { push(std::move(frame), graph_task); }

FrameHooks::~FrameHooks() { scopes.pop_back(); }

}  // namespace torch_ext::checkpoint
