#pragma once
// CapturedGraph: one plan's call at one batch size captured as a CUDA graph. Replaying it
// copies the inputs into the static input buffers, launches the whole graph at once and
// returns clones of the static outputs, so a later replay never overwrites what a caller holds.
//
// Thread safety: replay() may be called from many threads. Replays of one graph share its
// buffers, so they are serialised, and each waits (on the GPU, not the host) for the previous
// replay's output copies, whatever streams the callers use.
// Capture needs a build against a CUDA torch (TORCH_EXT_WITH_CUDA); elsewhere it throws.
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/ivalue.h>

namespace torch_ext::plan {

using RunFn = std::function<c10::IValue(const std::vector<c10::IValue>&)>;

class CapturedGraph {
 public:
  virtual ~CapturedGraph() = default;
  // Inputs as at capture: the same shapes, dtypes and device; equal non-tensor values.
  virtual c10::IValue replay(const std::vector<c10::IValue>& inputs) = 0;
  // Whether replay() can serve these inputs: tensors of the captured shapes, non-tensor inputs
  // equal to the captured ones.
  virtual bool serves(const std::vector<c10::IValue>& inputs) const = 0;
  // Device memory the graph holds: its private memory pool (intermediates and outputs) and
  // its static inputs, measured as the growth of the caching allocator's reserved bytes.
  virtual int64_t bytes() const = 0;
};

// True when one of the inputs is a CUDA tensor.
bool on_cuda(const std::vector<c10::IValue>& inputs);

// Warms `run` up on a side stream, then captures run(static copies of example) there.
// Throws c10::Error with the reason when the run cannot be captured (host synchronisation,
// CPU tensors, a build without CUDA); the device is left usable.
std::unique_ptr<CapturedGraph> capture_cuda_graph(const RunFn& run, const std::vector<c10::IValue>& example);

}  // namespace torch_ext::plan
