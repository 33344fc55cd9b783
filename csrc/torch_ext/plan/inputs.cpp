// What a call's inputs must be: one batch size along their batch dimensions, and the signature
// (count, kinds, non-batch shapes, dtypes, devices) of the inputs the cache took first, whose
// first row is kept as the example that later builds repeat to their size.
#include "torch_ext/plan/plan_cache.h"

#include <memory>
#include <mutex>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch_ext::plan {

struct PlanCache::Signature {
  struct Input {
    bool tensor = false;
    int64_t batch_dim = -1;
    std::vector<int64_t> sizes;  // the batch dimension's entry is ignored
    at::ScalarType dtype = at::kFloat;
    at::Device device = at::kCPU;
  };
  std::vector<Input> inputs;
};

int64_t PlanCache::batch_size_of(const std::vector<c10::IValue>& inputs) const {
  TORCH_CHECK(!inputs.empty(), "PlanCache: no inputs given");
  int64_t batch = -1;
  size_t first = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int64_t d = input_batch_dim(i, 0);
    if (d < 0 || !inputs[i].isTensor()) {
      continue;
    }
    const at::Tensor& t = inputs[i].toTensor();
    TORCH_CHECK(t.defined(), "PlanCache: input ", i, " is an undefined tensor");
    TORCH_CHECK(d < t.dim(), "PlanCache: input ", i, " has ", t.dim(), " dimension(s), so it has no batch dimension ",
                d);
    const int64_t n = t.size(d);
    if (batch < 0) {
      batch = n;
      first = i;
    } else {
      TORCH_CHECK(n == batch, "PlanCache: inputs have different batch sizes: input ", first, " has ", batch,
                  " and input ", i, " has ", n, " along their batch dimensions");
    }
  }
  TORCH_CHECK(batch >= 0, "PlanCache: none of the ", inputs.size(), " inputs is a tensor with a batch dimension");
  TORCH_CHECK(batch > 0, "PlanCache: empty batch (batch size 0); nothing to run");
  return batch;
}

void PlanCache::check_signature(const std::vector<c10::IValue>& inputs, int64_t batch_size) const {
  std::shared_ptr<const Signature> signature;
  {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    signature = signature_;
  }
  check_signature(signature.get(), inputs, batch_size);
}

void PlanCache::check_signature(const Signature* signature, const std::vector<c10::IValue>& inputs,
                                int64_t batch_size) const {
  if (!signature) {
    return;
  }
  TORCH_CHECK(inputs.size() == signature->inputs.size(), "PlanCache: got ", inputs.size(),
              " inputs; the cache serves ", signature->inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& expected = signature->inputs[i];
    if (!expected.tensor) {
      TORCH_CHECK(!inputs[i].isTensor(), "PlanCache: input ", i, " is a tensor; the cache serves a ",
                  "non-tensor there");
      continue;
    }
    TORCH_CHECK(inputs[i].isTensor(), "PlanCache: input ", i, " is a ", inputs[i].tagKind(),
                "; the cache serves a tensor there");
    const at::Tensor& t = inputs[i].toTensor();
    bool same = t.dim() == static_cast<int64_t>(expected.sizes.size());
    for (int64_t d = 0; same && d < t.dim(); ++d) {
      same = d == expected.batch_dim || t.size(d) == expected.sizes[d];
    }
    if (!same) {
      std::ostringstream want;
      want << "[";
      for (size_t d = 0; d < expected.sizes.size(); ++d) {
        want << (d ? ", " : "");
        if (static_cast<int64_t>(d) == expected.batch_dim) want << "*"; else want << expected.sizes[d];
      }
      want << "]";
      TORCH_CHECK(false, "PlanCache: input ", i, " has shape ", t.sizes(), " at batch size ", batch_size,
                  "; the module's plans take ", want.str(), " (* is the batch dimension)");
    }
    TORCH_CHECK(t.scalar_type() == expected.dtype, "PlanCache: input ", i, " has dtype ", t.scalar_type(),
                "; the cache serves ", expected.dtype);
    TORCH_CHECK(t.device() == expected.device, "PlanCache: input ", i, " is on ", t.device(),
                "; the cache serves ", expected.device);
  }
}

void PlanCache::remember_example(const std::vector<c10::IValue>& inputs, int64_t batch_size) {
  {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    if (signature_) return;
  }
  auto signature = std::make_shared<Signature>();
  std::vector<c10::IValue> example;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Signature::Input input;
    input.tensor = inputs[i].isTensor();
    if (input.tensor) {
      const at::Tensor& t = inputs[i].toTensor();
      input.batch_dim = input_batch_dim(i, t.dim());
      input.sizes = t.sizes().vec();
      input.dtype = t.scalar_type();
      input.device = t.device();
      example.emplace_back(input.batch_dim >= 0 ? t.narrow(input.batch_dim, 0, 1).clone() : t);
    } else {
      example.push_back(inputs[i]);
    }
    signature->inputs.push_back(std::move(input));
  }
  (void)batch_size;
  std::unique_lock<std::shared_mutex> lock(mutex_);
  if (!signature_) {
    signature_ = std::move(signature);
    example_ = std::move(example);
  }
}

std::vector<c10::IValue> PlanCache::example_at(int64_t batch_size) const {
  std::vector<c10::IValue> example;
  {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    example = example_;
  }
  TORCH_CHECK(!example.empty(), "PlanCache: no example inputs yet; pass example inputs or call infer() first");
  for (size_t i = 0; i < example.size(); ++i) {
    const int64_t d = input_batch_dim(i, 0);
    if (d >= 0 && example[i].isTensor()) {
      const at::Tensor& row = example[i].toTensor();
      std::vector<int64_t> repeats(row.dim(), 1);
      repeats[d] = batch_size;
      example[i] = row.repeat(repeats);
    }
  }
  return example;
}

}  // namespace torch_ext::plan
