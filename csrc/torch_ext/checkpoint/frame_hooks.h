#pragma once
// A Frame's pack() and repack() as autograd's saved-tensor hooks, in C++: how the C++ and
// TorchScript front doors checkpoint through the same Frame as Python's.
//
// Autograd asks its default engine for the hooks of every tensor it saves. In a Python process that
// engine hands out the Python hooks of torch.autograd.graph.saved_tensors_hooks; in a LibTorch
// process it has none. The first FrameHooks puts an engine in front of the default one that answers
// with the innermost FrameHooks of the calling thread, unless Python hooks pushed after it are on
// top, and passes everything else (running a backward pass, anomaly metadata, the Python hooks) to
// the engine it wraps. So the two kinds of hooks nest in the order they were entered, and a process
// that never checkpoints from C++ keeps torch's engine untouched.
#include <cstdint>
#include <memory>

#include "torch_ext/checkpoint/frame.h"

namespace torch_ext::checkpoint {

// Whether saved-tensor hooks that may decide where a tensor lives are active on this thread: a
// FrameHooks scope, or hooks pushed from Python (torch.autograd.graph.saved_tensors_hooks, torch's
// and torch_ext's checkpoints, paging) other than those marked transparent.
bool saved_tensor_hooks_active();

// Mark (and unmark, innermost first) the Python saved-tensor hooks on top of this thread's stack
// as transparent: they return every tensor as it is (torch_ext.memory.track only counts them), so
// a step measured under them keeps and recomputes what it would without them.
void mark_python_hooks_transparent();
void unmark_python_hooks_transparent();

// How a CheckpointError raised while autograd unpacks a C++ frame's tensor reaches the caller of
// backward: thrown as it is by default. The Python bindings install a translator that raises
// Python's torch_ext CheckpointError instead (torch's engine turns any other C++ exception into a
// plain RuntimeError). A translator must throw.
using CheckpointErrorTranslator = void (*)(const CheckpointError&);
void set_checkpoint_error_translator(CheckpointErrorTranslator translator);

// While alive, on this thread: each tensor autograd saves becomes a holder of `frame` (forward) or
// is handed to frame.repack(·, graph_task) (a replay). Raises where saved-tensor hooks are disabled
// (torch.autograd.graph.disable_saved_tensors_hooks), with torch's message.
class FrameHooks {
 public:
  explicit FrameHooks(std::shared_ptr<Frame> frame);
  FrameHooks(std::shared_ptr<Frame> frame, int64_t graph_task);
  ~FrameHooks();
  FrameHooks(const FrameHooks&) = delete;
  FrameHooks& operator=(const FrameHooks&) = delete;
};

}  // namespace torch_ext::checkpoint
