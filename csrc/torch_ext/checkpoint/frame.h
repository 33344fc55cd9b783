#pragma once
// Frame: one checkpointed call of a segment, checkpointed with saved-tensor hooks (the
// non-reentrant algorithm torch.utils.checkpoint uses, here in C++).
//
// While the segment's forward runs, the front door installs pack() as autograd's saved-tensor
// pack hook: every tensor autograd would save becomes a Holder that records only its metadata, and
// the forward builds the ordinary autograd graph around the holders. So every output has its own
// grad_fn, double backward works, a tensor requiring grad reached through a closure gets its
// gradient, and a segment that saves nothing is never replayed. The first unpack() of a holder in
// a backward pass (a graph task) replays the segment once through the front door's Recompute, whose
// pack hook is repack(): it hands each recomputed tensor to its holder, checks it against the
// forward's metadata (shape, dtype, device; a mismatch raises CheckpointError naming the segment
// and the first differing tensor) and, with early stop, ends the replay once every tensor the
// forward saved has been recomputed. Whether a replay stops early is decided once, at the end of
// the forward, from the recorded graph: the ops from the last saved tensor on (the tail) are
// weighed by the elements they produce, matrix products and convolutions 64 times (kProductWeight),
// and only a tail of at least kEarlyStopWork is worth stopping before (the stop is an exception
// through the segment's Python frames, which costs about what that much elementwise work does).
// The same program takes the same path on any machine: no timing decides.
//
// A tensor that costs nothing to keep is kept as autograd keeps it, not recomputed, where the front
// door says the segment runs under no other saved-tensor hooks (keep_free_tensors()): one sharing
// storage with an input the front door keeps as it is, or a leaf requiring grad (a parameter) or a
// view of one. A segment whose backward needs only such tensors (a Linear) is never replayed, and
// early stop ends a replay at the last tensor it must recompute. A kept tensor written in place
// after the forward raises CheckpointError, as autograd raises for what it saves. Under other hooks
// (an enclosing checkpoint, paged weights, a user's) those decide where a tensor lives, so every
// tensor is recomputed. Nested checkpoints follow
// from the front door saving a segment's inputs through the enclosing frame's hooks; a tail that
// holds a nested checkpoint's forward is always stopped before (as torch's early stop does), so the
// nested segment is recomputed once, by its own frame, not once more inside the enclosing replay.
//
// A replay may reach its front door as another exception than the one repack() threw: TorchScript's
// interpreter, between the hook and the segment's call, re-raises whatever an op throws as its own
// RuntimeError. So the frame notes what repack() threw (a stop, a CheckpointError) and unpack()
// judges the replay by that, not by what came back.
//
// Thread safety: a frame's forward runs on one thread. unpack() and repack() take the frame's
// (recursive) mutex, so backward passes on several threads recompute a frame once per graph task.
// The front door must not hold a lock the Recompute needs while calling unpack() (the Python one
// releases the GIL).
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/SmallVector.h>

namespace torch_ext::checkpoint {

// A replay that does not match its forward: raised by repack() and unpack().
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Thrown by repack() to end a replay early; the Recompute catches it.
struct StopRecomputation : std::exception {
  const char* what() const noexcept override { return "torch_ext checkpoint: recomputation stopped early"; }
};

class Frame;

// Stands in the autograd graph for one tensor a checkpointed forward saved.
struct Holder {
  explicit Holder(std::shared_ptr<Frame> owner) : frame(std::move(owner)) {}
  std::shared_ptr<Frame> frame;  // the holders keep their frame (and its inputs) alive
  // Recomputed tensors by graph task (one, unless backward passes run concurrently), each dropped
  // once unpacked: a second unpack of the same tensor in one pass is an error, as it is for torch's
  // checkpoint.
  c10::SmallVector<std::pair<int64_t, at::Tensor>, 1> recomputed;
  c10::SmallVector<int64_t, 1> unpacked;
  size_t index = 0;  // among the tensors the forward saved
  at::Tensor kept;   // a tensor kept as autograd keeps it (Frame::keep_free_tensors), never recomputed
  int64_t kept_version = 0;
};

class Frame : public std::enable_shared_from_this<Frame> {
 public:
  // Runs the segment once more from its saved inputs, with grad enabled and repack(·, graph_task)
  // as the saved-tensor pack hook, catching StopRecomputation.
  using Recompute = std::function<void(Frame& frame, int64_t graph_task)>;

  // Construct when the segment's forward begins, after its inputs are saved (through the enclosing
  // frame's hooks, if any): a frame begun after the enclosing frame's last pack is in its tail.
  Frame(std::string name, bool early_stop);
  void set_recompute(Recompute recompute) { recompute_ = std::move(recompute); }
  const std::string& name() const { return name_; }

  // Before the forward, where the segment runs under no other saved-tensor hooks: keep the tensors
  // that cost nothing to keep (see above); `inputs` are the segment's inputs the front door keeps as
  // they are.
  void keep_free_tensors(const std::vector<at::Tensor>& inputs);

  // Forward: the holder that replaces `tensor` in the graph.
  std::shared_ptr<Holder> pack(const at::Tensor& tensor);
  // The forward returned `outputs`: decides whether replays stop early (see above).
  void finish_forward(const std::vector<at::Tensor>& outputs);
  bool stops_early() const { return stop_early_; }
  std::recursive_mutex& mutex() { return mutex_; }

  // Backward: the tensor `holder` stands for, recomputed on the first unpack in this graph task.
  at::Tensor unpack(Holder& holder);

  // Replay: what the replay's graph keeps for `tensor` (the recomputation graph is backwarded
  // only by a backward inside the segment). Throws StopRecomputation when early stop is reached,
  // CheckpointError when the replay departs from the forward.
  at::Tensor repack(const at::Tensor& tensor, int64_t graph_task);

  // While a segment's forward or a replay of it runs on this thread: TorchScript functions it calls
  // keep the plan they have instead of switching to an optimized one. TorchScript's profiling
  // executor runs a function's first calls (and those of each new shape) on one plan and later calls
  // on another, which saves other tensors for backward; a replay must save what its forward saved.
  class SteadyScriptPlans {
   public:
    SteadyScriptPlans();
    ~SteadyScriptPlans();
    SteadyScriptPlans(const SteadyScriptPlans&) = delete;
    SteadyScriptPlans& operator=(const SteadyScriptPlans&) = delete;

   private:
    bool previous_;
  };

  // An id for unpacks outside any backward pass (a graph task id is >= 0).
  static int64_t fresh_graph_task();

  // Tails of at least this much work (elements, products weighted) are worth stopping before.
  static constexpr int64_t kEarlyStopWork = int64_t{1} << 16;

 private:
  struct Meta {
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
    c10::Device device;
    std::string producer;  // the grad_fn that made the tensor, if any, for error messages
  };
  static Meta meta_of(const at::Tensor& tensor);
  std::string describe(size_t index, const Meta& meta) const;
  // One replay (a graph task's).
  struct Replay {
    size_t count = 0;      // tensors repacked
    bool done = false;     // the replay ran
    bool stopped = false;  // repack() stopped it early
    std::string error;     // the CheckpointError repack() threw, if any
  };
  void check_recomputed(const Replay& replay) const;
  bool is_free(const at::Tensor& tensor) const;
  at::Tensor unpack_kept(const Holder& holder) const;

  const std::string name_;
  const bool early_stop_;
  bool stop_early_ = false;     // decided by finish_forward()
  uint64_t tail_start_ = 0;     // the first node of the tail: the last saved tensor's or the next
  uint64_t frames_at_pack_ = 0; // frames begun on this thread when the forward last packed
  Recompute recompute_;
  std::recursive_mutex mutex_;
  std::vector<std::weak_ptr<Holder>> holders_;  // in the order the forward saved them
  size_t recomputed_ = 0;  // holders up to the last one a replay refills (not kept)
  bool keep_free_ = false;
  std::vector<const c10::StorageImpl*> input_storages_;  // during the forward, where keep_free_
  std::vector<Meta> metas_;
  bool forward_done_ = false;
  bool ignore_count_ = false;  // a backward inside the forward saved more than the forward kept
  std::unordered_map<int64_t, Replay> replays_;  // by graph task
};

}  // namespace torch_ext::checkpoint
