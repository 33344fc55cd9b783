// What a call's inputs must be: the signature (count, kinds, the sizes of dimensions that are not
// dynamic, dtypes, devices) of the inputs the cache took first, whose first row is kept as the
// example that later builds resize to their bucket.
#include "torch_ext/plan/plan.h"

#include <memory>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>

namespace torch_ext::plan {

struct PlanCache::Signature {
  struct Input {
    bool tensor = false;
    std::vector<int64_t> sizes;
    std::vector<int> dynamic;  // per tensor dimension: the dynamic dimension it is, or -1
    at::ScalarType dtype = at::kFloat;
    at::Device device = at::kCPU;
  };
  std::vector<Input> inputs;
};

Bucket PlanCache::check_request(const std::vector<c10::IValue>& inputs) const {
  check_no_autograd(inputs);
  const Bucket sizes = layout_->sizes_of(inputs);
  check_signature(inputs, sizes);
  return sizes;
}

void PlanCache::check_no_autograd(const std::vector<c10::IValue>& inputs) {
  if (!c10::GradMode::is_enabled()) return;
  for (size_t i = 0; i < inputs.size(); ++i) {
    TORCH_CHECK_VALUE(!(inputs[i].isTensor() && inputs[i].toTensor().requires_grad()), "PlanCache: input ", i,
                      " requires grad, but plans serve inference and record no autograd: no gradient would reach it "
                      "through the output. Serve under torch.no_grad() or torch.inference_mode(), or pass it detached");
  }
}

void PlanCache::check_signature(const std::vector<c10::IValue>& inputs, const Bucket& sizes) const {
  std::shared_ptr<const Signature> signature;
  {
    std::shared_lock<std::shared_mutex> lock(example_mutex_);
    signature = signature_;
  }
  check_signature(signature.get(), inputs, sizes);
}

void PlanCache::check_signature(const Signature* signature, const std::vector<c10::IValue>& inputs,
                                const Bucket& sizes) const {
  if (!signature) return;
  TORCH_CHECK(inputs.size() == signature->inputs.size(), "PlanCache: got ", inputs.size(),
              " inputs; the cache serves ", signature->inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& expected = signature->inputs[i];
    if (!expected.tensor) {
      TORCH_CHECK(!inputs[i].isTensor(), "PlanCache: input ", i, " is a tensor; the cache serves a non-tensor there");
      continue;
    }
    TORCH_CHECK(inputs[i].isTensor(), "PlanCache: input ", i, " is a ", inputs[i].tagKind(),
                "; the cache serves a tensor there");
    const at::Tensor& t = inputs[i].toTensor();
    bool same = t.dim() == static_cast<int64_t>(expected.sizes.size());
    for (int64_t d = 0; same && d < t.dim(); ++d) {
      same = expected.dynamic[d] >= 0 || t.size(d) == expected.sizes[d];
    }
    if (!same) {
      std::ostringstream want;
      want << "[";
      for (size_t d = 0; d < expected.sizes.size(); ++d) {
        want << (d ? ", " : "");
        if (expected.dynamic[d] >= 0) want << layout_->name(expected.dynamic[d]); else want << expected.sizes[d];
      }
      want << "]";
      TORCH_CHECK(false, "PlanCache: input ", i, " has shape ", t.sizes(), " at ", layout_->describe(sizes),
                  "; the module's plans take ", want.str(), " (the names are its dynamic dimensions)");
    }
    TORCH_CHECK(t.scalar_type() == expected.dtype, "PlanCache: input ", i, " has dtype ", t.scalar_type(),
                "; the cache serves ", expected.dtype);
    TORCH_CHECK(t.device() == expected.device, "PlanCache: input ", i, " is on ", t.device(), "; the cache serves ",
                expected.device);
  }
}

void PlanCache::remember_example(const std::vector<c10::IValue>& inputs) {
  {
    std::shared_lock<std::shared_mutex> lock(example_mutex_);
    if (signature_) return;
  }
  auto signature = std::make_shared<Signature>();
  std::vector<c10::IValue> example;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Signature::Input input;
    input.tensor = inputs[i].isTensor();
    if (input.tensor) {
      const at::Tensor& t = inputs[i].toTensor();
      input.sizes = t.sizes().vec();
      input.dynamic.assign(t.dim(), -1);
      for (int k = 0; k < layout_->rank(); ++k) {
        const int64_t d = layout_->input_dim(i, k);
        if (d >= 0 && d < t.dim()) input.dynamic[d] = k;
      }
      input.dtype = t.scalar_type();
      input.device = t.device();
      const int64_t batch = layout_->input_dim(i, 0);
      example.emplace_back(batch >= 0 && batch < t.dim() ? t.narrow(batch, 0, 1).clone() : t);
    } else {
      example.push_back(inputs[i]);
    }
    signature->inputs.push_back(std::move(input));
  }
  std::unique_lock<std::shared_mutex> lock(example_mutex_);
  if (!signature_) {
    signature_ = std::move(signature);
    example_ = std::move(example);
  }
}

std::vector<c10::IValue> PlanCache::example_at(const Bucket& sizes) const {
  std::vector<c10::IValue> example;
  {
    std::shared_lock<std::shared_mutex> lock(example_mutex_);
    example = example_;
  }
  TORCH_CHECK(!example.empty(), "PlanCache: no example inputs yet; pass example inputs or call infer() first");
  return layout_->resize(example, sizes);
}

}  // namespace torch_ext::plan
