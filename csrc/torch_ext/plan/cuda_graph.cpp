#include "torch_ext/plan/cuda_graph.h"

#include <mutex>

#include <c10/util/Exception.h>

#ifdef TORCH_EXT_WITH_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace torch_ext::plan {

bool on_cuda(const std::vector<c10::IValue>& inputs) {
  for (const auto& v : inputs) {
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().is_cuda()) return true;
  }
  return false;
}

#ifndef TORCH_EXT_WITH_CUDA

std::unique_ptr<CapturedGraph> capture_cuda_graph(const RunFn&, const std::vector<c10::IValue>&) {
  TORCH_CHECK(false, "CUDA graphs: this build of torch_ext has no CUDA support (torch without CUDA)");
}

#else

namespace {

// The value with every tensor in it (also inside tuples, lists and dict values) replaced by f(tensor).
template <typename F>
c10::IValue map_tensors(const c10::IValue& value, const F& f) {
  if (value.isTensor()) return f(value.toTensor());
  if (value.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const auto& e : value.toTupleRef().elements()) elements.push_back(map_tensors(e, f));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  if (value.isList()) {
    c10::impl::GenericList list(value.toList().elementType());
    for (const c10::IValue& e : value.toList()) list.push_back(map_tensors(e, f));
    return list;
  }
  if (value.isGenericDict()) {
    auto dict = value.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), dict.valueType());
    for (const auto& entry : dict) out.insert(entry.key(), map_tensors(entry.value(), f));
    return out;
  }
  return value;
}

// torch's CUDAGraph ends the capture of its generators only when the capture succeeds; after a
// failed one the default generator would stay marked as capturing and every later random op on
// the device would fail. This ends it either way.
struct Graph final : at::cuda::CUDAGraph {
  void end_generator_captures() {
    for (auto& entry : captured_generator_states_) entry.first->capturing_ = false;
  }
};

int64_t reserved_bytes(c10::DeviceIndex device) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  return stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
}

class CudaGraph final : public CapturedGraph {
 public:
  CudaGraph(c10::Device device, std::vector<c10::IValue> static_inputs)
      : device_(device), static_inputs_(std::move(static_inputs)), done_(c10::kCUDA) {}

  ~CudaGraph() override {
    // The static buffers and the graph's pool go back to the allocator: no replay may still read them.
    try {
      done_.synchronize();
    } catch (...) {
    }
  }

  void capture(const RunFn& run) {
    c10::impl::VirtualGuardImpl impl(c10::kCUDA);
    const c10::Stream caller = impl.getStream(device_);
    const c10::Stream side = impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
    c10::Event ready(c10::kCUDA);
    ready.record(caller);
    ready.block(side);
    {
      c10::StreamGuard on_side(side);
      // Lazy per-stream state (cuBLAS workspaces, fuser kernels) is created here, not in the capture.
      for (int i = 0; i < 2; ++i) run(static_inputs_);
      const int64_t before = reserved_bytes(device_.index());
      graph_ = std::make_unique<Graph>();
      // Thread-local mode: other threads may allocate and run while this one captures.
      graph_->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
      try {
        try {
          static_output_ = run(static_inputs_);
        } catch (...) {
          try {
            graph_->capture_end();  // ends the (invalidated) capture so the stream is usable again
          } catch (...) {
          }
          throw;
        }
        graph_->capture_end();
      } catch (...) {
        graph_->end_generator_captures();
        (void)cudaGetLastError();
        throw;  // the caller discards this object, graph and buffers with it
      }
      bytes_ = std::max<int64_t>(0, reserved_bytes(device_.index()) - before);
    }
    for (const auto& v : static_inputs_) {
      if (v.isTensor()) bytes_ += static_cast<int64_t>(v.toTensor().nbytes());
    }
    c10::Event captured(c10::kCUDA);
    captured.record(side);
    captured.block(caller);
  }

  c10::IValue replay(const std::vector<c10::IValue>& inputs) override {
    TORCH_CHECK(inputs.size() == static_inputs_.size(), "CUDA graph: got ", inputs.size(),
                " inputs; it was captured with ", static_inputs_.size());
    c10::DeviceGuard device_guard(device_);
    c10::impl::VirtualGuardImpl impl(c10::kCUDA);
    const c10::Stream stream = impl.getStream(device_);
    std::lock_guard<std::mutex> lock(mutex_);
    done_.block(stream);  // the previous replay's outputs are copied out before its inputs change
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].isTensor()) static_inputs_[i].toTensor().copy_(inputs[i].toTensor(), /*non_blocking=*/true);
    }
    graph_->replay();
    c10::IValue output = map_tensors(static_output_, [](const at::Tensor& t) { return t.clone(); });
    done_.record(stream);
    return output;
  }

  bool serves(const std::vector<c10::IValue>& inputs) const override {
    if (inputs.size() != static_inputs_.size()) return false;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].isTensor() != static_inputs_[i].isTensor()) return false;
      if (!inputs[i].isTensor() && !(inputs[i] == static_inputs_[i])) return false;
      // A plan over a range of sizes (an exported program's dynamic plan) is captured at one.
      if (inputs[i].isTensor() && inputs[i].toTensor().sizes() != static_inputs_[i].toTensor().sizes()) return false;
    }
    return true;
  }

  int64_t bytes() const override { return bytes_; }

 private:
  const c10::Device device_;
  std::vector<c10::IValue> static_inputs_;
  c10::IValue static_output_;
  std::unique_ptr<Graph> graph_;
  int64_t bytes_ = 0;
  std::mutex mutex_;
  c10::Event done_;  // recorded after each replay's output copies
};

}  // namespace

std::unique_ptr<CapturedGraph> capture_cuda_graph(const RunFn& run, const std::vector<c10::IValue>& example) {
  std::optional<c10::Device> device;
  std::vector<c10::IValue> static_inputs;
  for (size_t i = 0; i < example.size(); ++i) {
    if (!example[i].isTensor()) {
      static_inputs.push_back(example[i]);
      continue;
    }
    const at::Tensor& t = example[i].toTensor();
    TORCH_CHECK(t.is_cuda(), "CUDA graphs: input ", i, " is on ", t.device(), "; every tensor input must be on one ",
                "CUDA device to be captured");
    TORCH_CHECK(!device || t.device() == *device, "CUDA graphs: input ", i, " is on ", t.device(), " and an earlier ",
                "input on ", *device, "; a graph is captured on one device");
    device = t.device();
    static_inputs.emplace_back(t.clone());
  }
  TORCH_CHECK(device, "CUDA graphs: no input is a CUDA tensor");
  auto graph = std::make_unique<CudaGraph>(*device, std::move(static_inputs));
  graph->capture(run);
  return graph;
}

#endif

}  // namespace torch_ext::plan
