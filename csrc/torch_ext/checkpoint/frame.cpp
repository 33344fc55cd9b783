#include "torch_ext/checkpoint/frame.h"

#include <algorithm>
#include <sstream>

#include <ATen/SequenceNumber.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/jit/python/update_graph_executor_opt.h>

namespace torch_ext::checkpoint {

namespace {
// Frames begun on this thread (a frame's forward runs on one thread): a nested checkpoint's forward
// in a frame's tail shows as a count that moved after the frame's last pack.
thread_local uint64_t frames_begun = 0;
}  // namespace

Frame::Frame(std::string name, bool early_stop) : name_(std::move(name)), early_stop_(early_stop) {
  ++frames_begun;
}

// The setting is thread-local; setting it costs more than reading it (a logging check), so only a
// change is written.
Frame::SteadyScriptPlans::SteadyScriptPlans() : previous_(torch::jit::getGraphExecutorOptimize()) {
  if (previous_) torch::jit::setGraphExecutorOptimize(false);
}

Frame::SteadyScriptPlans::~SteadyScriptPlans() {
  if (previous_) torch::jit::setGraphExecutorOptimize(true);
}

int64_t Frame::fresh_graph_task() {
  static std::atomic<int64_t> next{-2};  // -1 is get_current_graph_task_id()'s "none"
  return next.fetch_sub(1, std::memory_order_relaxed);
}

Frame::Meta Frame::meta_of(const at::Tensor& tensor) {
  Meta meta{tensor.sizes().vec(), tensor.scalar_type(), tensor.device(), {}};
  if (const auto& fn = torch::autograd::impl::grad_fn_unsafe(tensor)) meta.producer = fn->name();
  return meta;
}

std::string Frame::describe(size_t index, const Meta& meta) const {
  std::ostringstream out;
  out << "saved tensor " << index << " (";
  if (!meta.producer.empty()) out << "made by " << meta.producer << ", ";
  out << meta.dtype << c10::IntArrayRef(meta.sizes) << " on " << meta.device << ")";
  return out.str();
}

void Frame::keep_free_tensors(const std::vector<at::Tensor>& inputs) {
  keep_free_ = true;
  for (const auto& t : inputs) {
    if (t.defined() && t.has_storage()) input_storages_.push_back(t.storage().unsafeGetStorageImpl());
  }
}

bool Frame::is_free(const at::Tensor& tensor) const {
  const at::TensorBase& root = tensor.is_view() ? tensor._base() : static_cast<const at::TensorBase&>(tensor);
  if (root.requires_grad() && root.is_leaf()) return true;
  if (!tensor.has_storage()) return false;
  const c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
  return std::find(input_storages_.begin(), input_storages_.end(), storage) != input_storages_.end();
}

std::shared_ptr<Holder> Frame::pack(const at::Tensor& tensor) {
  auto holder = std::make_shared<Holder>(shared_from_this());
  holder->index = holders_.size();
  holders_.push_back(holder);
  metas_.push_back(meta_of(tensor));
  if (keep_free_ && is_free(tensor)) {
    holder->kept = tensor.detach();  // an alias, not the tensor: a saved output would make a cycle
    holder->kept_version = tensor._version();
    return holder;
  }
  recomputed_ = holders_.size();
  // The node saving this tensor is the one autograd numbered last. A tensor it saves as its own
  // output was computed already; an input is saved before the op computes, so a replay that
  // stops here skips that op too: the tail starts at it.
  const uint64_t next = at::sequence_number::peek();
  const auto* producer = torch::autograd::impl::grad_fn_unsafe(tensor);
  tail_start_ = producer != nullptr && producer->sequence_nr() + 1 == next ? next : next - 1;
  frames_at_pack_ = frames_begun;
  return holder;
}

namespace {

// Matrix products and convolutions cost about this many elementwise ops per output element.
constexpr int64_t kProductWeight = 64;

bool is_product(const torch::autograd::Node& node) {
  const std::string name = node.name();
  for (const char* kind : {"Mm", "Addmm", "Bmm", "Baddbmm", "Matmul", "Linear", "Convolution", "ScaledDotProduct"}) {
    if (name.find(kind) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

void Frame::finish_forward(const std::vector<at::Tensor>& outputs) {
  forward_done_ = true;
  input_storages_.clear();
  if (!early_stop_ || recomputed_ == 0) return;
  if (frames_begun != frames_at_pack_) {  // a nested checkpoint's forward is in the tail
    stop_early_ = true;
    return;
  }
  // The tail: the nodes the forward created after its last saved tensor, found from the outputs.
  std::vector<torch::autograd::Node*> stack;
  std::unordered_map<torch::autograd::Node*, bool> seen;
  for (const auto& t : outputs) {
    if (auto* fn = torch::autograd::impl::grad_fn_unsafe(t)) stack.push_back(fn);
  }
  int64_t work = 0;
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (node->sequence_nr() < tail_start_ || seen[node]) continue;
    seen[node] = true;
    int64_t elements = 0;
    for (uint32_t i = 0; i < node->num_inputs(); ++i) {
      const auto& meta = node->input_metadata(i);
      if (meta.is_tensor_subclass() || meta.is_nested_tensor()) continue;
      int64_t numel = 1;
      for (const auto& d : meta.shape_as_dim_vector()) numel *= d.maybe_as_int().value_or(1);
      elements += numel;
    }
    work += is_product(*node) ? elements * kProductWeight : elements;
    for (const auto& edge : node->next_edges()) {
      if (edge.function) stack.push_back(edge.function.get());
    }
  }
  stop_early_ = work >= kEarlyStopWork;
}

at::Tensor Frame::unpack_kept(const Holder& holder) const {
  if (holder.kept._version() != holder.kept_version) {
    throw CheckpointError("checkpoint: " + name_ + ": " + describe(holder.index, metas_[holder.index]) +
                          ", an input or parameter kept as it is, was modified by an inplace operation after the "
                          "forward (now at version " + std::to_string(holder.kept._version()) + "; expected version " +
                          std::to_string(holder.kept_version) + "), so the backward would use other values than the "
                          "forward's. Modify it after the backward");
  }
  return holder.kept;
}

at::Tensor Frame::unpack(Holder& holder) {
  if (holder.kept.defined()) return unpack_kept(holder);
  int64_t graph_task = torch::autograd::get_current_graph_task_id();
  if (graph_task == -1) graph_task = fresh_graph_task();
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  Replay& replay = replays_[graph_task];
  if (!replay.done) {
    TORCH_CHECK(recompute_, "checkpoint: ", name_, " has no recompute function");
    try {
      recompute_(*this, graph_task);
    } catch (...) {
      if (!replay.stopped) {
        if (replay.error.empty()) throw;
        throw CheckpointError(replay.error);
      }
    }
    replay.done = true;
    check_recomputed(replay);
  }
  if (std::find(holder.unpacked.begin(), holder.unpacked.end(), graph_task) != holder.unpacked.end()) {
    throw CheckpointError("checkpoint: " + name_ + ": a saved tensor was unpacked twice in one backward pass; "
                          "call ctx.saved_tensors once per backward");
  }
  auto it = std::find_if(holder.recomputed.begin(), holder.recomputed.end(),
                         [&](const auto& entry) { return entry.first == graph_task; });
  TORCH_INTERNAL_ASSERT(it != holder.recomputed.end(), "checkpoint: ", name_,
                        ": a saved tensor was not recomputed although its holder is alive");
  at::Tensor tensor = std::move(it->second);
  holder.recomputed.erase(it);
  holder.unpacked.push_back(graph_task);
  return tensor;
}

at::Tensor Frame::repack(const at::Tensor& tensor, int64_t graph_task) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  Replay& replay = replays_[graph_task];
  if (replay.stopped) throw StopRecomputation();  // the segment caught the stop and went on
  at::Tensor kept = tensor.requires_grad() ? tensor.detach() : tensor;
  const size_t index = replay.count++;
  auto fail = [&](std::string message) {
    replay.error = message;
    return CheckpointError(message);
  };
  if (index >= holders_.size()) {
    if (!forward_done_) {
      // A backward inside the segment, during its own forward, replays before the forward has
      // saved all it will: the extra tensors belong to that inner backward.
      ignore_count_ = true;
      return kept;
    }
    throw fail("checkpoint: the replay of " + name_ + " saved more tensors for backward than its forward did (" +
               std::to_string(holders_.size()) + "): the segment must compute the same ops from the same inputs");
  }
  const Meta& expected = metas_[index];
  const Meta got = meta_of(tensor);
  if (got.sizes != expected.sizes || got.dtype != expected.dtype || got.device != expected.device) {
    throw fail("checkpoint: the replay of " + name_ + " produced " + describe(index, got) +
               " where its forward produced " + describe(index, expected) +
               "; the segment must compute the same shapes from the same inputs (a cache or other state it changes "
               "in its forward would make its replay differ)");
  }
  auto holder = holders_[index].lock();
  if (holder && !holder->kept.defined()) holder->recomputed.emplace_back(graph_task, kept);
  if (stop_early_ && replay.count == recomputed_) {
    replay.stopped = true;
    throw StopRecomputation();
  }
  return kept;
}

void Frame::check_recomputed(const Replay& replay) const {
  if (ignore_count_ || replay.stopped) return;  // a stop comes at the last tensor to recompute
  if (replay.count != holders_.size()) {
    throw CheckpointError("checkpoint: the replay of " + name_ + " saved " + std::to_string(replay.count) +
                          " tensors for backward but its forward saved " + std::to_string(holders_.size()) +
                          "; the segment must compute the same ops from the same inputs");
  }
}

}  // namespace torch_ext::checkpoint
