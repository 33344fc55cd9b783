// The dynamic dimensions of a cache's inputs and outputs: sizes, buckets, and padding, slicing
// and joining along them.
#include "torch_ext/plan/layout.h"

#include <algorithm>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>

namespace torch_ext::plan {

namespace {

// An entry of a per-position list: past the end, the last entry; an empty list, `fallback`.
int64_t entry(const std::vector<int64_t>& list, size_t index, int64_t fallback) {
  if (list.empty()) return fallback;
  return list[std::min(index, list.size() - 1)];
}

std::vector<c10::IValue> unpack(const c10::IValue& output, bool& is_tuple, bool& is_list) {
  is_tuple = output.isTuple();
  is_list = output.isList();
  if (is_tuple) return output.toTupleRef().elements().vec();
  if (is_list) return output.toList().vec();
  return {output};
}

c10::IValue repack(const c10::IValue& like, std::vector<c10::IValue> parts, bool is_tuple, bool is_list) {
  if (is_tuple) return c10::ivalue::Tuple::create(std::move(parts));
  if (is_list) {
    c10::impl::GenericList list(like.toList().elementType());
    for (auto& p : parts) list.push_back(std::move(p));
    return list;
  }
  return parts[0];
}

// t extended along d to `size` by repeating its last position.
at::Tensor extend(const at::Tensor& t, int64_t d, int64_t size) {
  if (t.size(d) >= size) return t.narrow(d, 0, size);
  std::vector<int64_t> repeats(t.dim(), 1);
  repeats[d] = size - t.size(d);
  return at::cat({t, t.narrow(d, t.size(d) - 1, 1).repeat(repeats)}, d);
}

}  // namespace

Layout::Layout(const PlanCacheOptions& options)
    : rank_(1 + static_cast<int>(options.dims.size())), buckets_(options.buckets), pad_values_(options.pad_values) {
  input_dims_.push_back(options.batch_dims);
  output_dims_.push_back(options.output_batch_dims);
  for (int k = 1; k < rank_; ++k) {
    input_dims_.push_back(options.dims[k - 1]);
    output_dims_.push_back(static_cast<size_t>(k - 1) < options.output_dims.size() ? options.output_dims[k - 1]
                                                                                    : std::vector<int64_t>{-1});
  }
  for (int k = 0; k < rank_; ++k) {
    names_.push_back(static_cast<size_t>(k) < options.dim_names.size() ? options.dim_names[k]
                     : k == 0                                          ? std::string("batch")
                                                                       : "dim" + std::to_string(k));
    const bool ranged = static_cast<size_t>(k) < options.size_ranges.size();
    min_.push_back(ranged ? options.size_ranges[k][0] : 1);
    int64_t max = ranged ? options.size_ranges[k][1] : 0;
    if (k == 0 && options.max_batch_size > 0) max = max > 0 ? std::min(max, options.max_batch_size) : options.max_batch_size;
    max_.push_back(max);
  }
  buckets_.resize(rank_);
}

int64_t Layout::input_dim(size_t i, int k) const { return entry(input_dims_[k], i, k == 0 ? 0 : -1); }

int64_t Layout::output_dim(size_t j, int k) const { return entry(output_dims_[k], j, k == 0 ? 0 : -1); }

std::string Layout::describe(const Bucket& sizes) const {
  std::ostringstream out;
  if (rank_ == 1) {
    out << "batch size " << sizes[0];
    return out.str();
  }
  for (int k = 0; k < rank_; ++k) out << (k ? " x " : "") << names_[k] << " " << sizes[k];
  return out.str();
}

Bucket Layout::sizes_of(const std::vector<c10::IValue>& inputs) const {
  TORCH_CHECK(!inputs.empty(), "PlanCache: no inputs given");
  Bucket sizes;
  sizes.rank = rank_;
  for (int k = 0; k < rank_; ++k) {
    int64_t size = -1;
    size_t first = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const int64_t d = input_dim(i, k);
      if (d < 0 || !inputs[i].isTensor()) continue;
      const at::Tensor& t = inputs[i].toTensor();
      TORCH_CHECK(t.defined(), "PlanCache: input ", i, " is an undefined tensor");
      TORCH_CHECK(d < t.dim(), "PlanCache: input ", i, " has ", t.dim(), " dimension(s), so it has no ", names_[k],
                  " dimension ", d);
      if (size < 0) {
        size = t.size(d);
        first = i;
      } else {
        TORCH_CHECK(t.size(d) == size, "PlanCache: inputs have different ", k == 0 ? "batch sizes" : names_[k] + " sizes",
                    ": input ", first, " has ", size, " and input ", i, " has ", t.size(d), " along their ", names_[k],
                    " dimensions");
      }
    }
    TORCH_CHECK(size >= 0, "PlanCache: none of the ", inputs.size(), " inputs is a tensor with a ", names_[k],
                " dimension");
    TORCH_CHECK(size > 0, "PlanCache: empty ", k == 0 ? "batch (batch size 0)" : names_[k] + " (size 0)",
                "; nothing to run");
    TORCH_CHECK(max_[k] == 0 || size <= max_[k], "PlanCache: ", k == 0 ? "batch size " : names_[k] + " ", size,
                " is above ", k == 0 ? "max_batch_size " : "the largest size the module accepts, ", max_[k],
                k == 0 ? "; use infer_batch to split it" : "");
    TORCH_CHECK(size >= min_[k] || pads(k), "PlanCache: ", names_[k], " ", size, " is below the smallest size the ",
                "module accepts, ", min_[k], ", and is not padded (no pad_values)");
    sizes[k] = size;
  }
  return sizes;
}

Bucket Layout::bucket_of(const Bucket& sizes) const {
  Bucket bucket = sizes;
  for (int k = 0; k < rank_; ++k) {
    const int64_t size = std::max(sizes[k], min_[k]);
    const auto& bounds = buckets_[k];
    auto it = std::lower_bound(bounds.begin(), bounds.end(), size);
    bucket[k] = it == bounds.end() ? size : *it;
  }
  return bucket;
}

Bucket Layout::lower_of(const Bucket& bucket) const {
  Bucket lower = bucket;
  for (int k = 0; k < rank_; ++k) {
    const auto& bounds = buckets_[k];
    auto it = std::lower_bound(bounds.begin(), bounds.end(), bucket[k]);
    if (it != bounds.end() && *it == bucket[k]) {
      lower[k] = std::max(min_[k], it == bounds.begin() ? int64_t{1} : *(it - 1) + 1);
    }
  }
  return lower;
}

void Layout::check_bucket(const Bucket& bucket, const std::string& who) const {
  TORCH_CHECK(bucket.rank == rank_, who, ": a bucket has ", bucket.rank, " size(s); this cache has ", rank_,
              " dynamic dimension(s)");
  for (int k = 0; k < rank_; ++k) {
    TORCH_CHECK(bucket[k] >= min_[k] && (max_[k] == 0 || bucket[k] <= max_[k]), who, ": ", names_[k], " ", bucket[k],
                " is outside ", min_[k], "..", max_[k] == 0 ? std::string("(no limit)") : std::to_string(max_[k]));
  }
}

std::vector<c10::IValue> Layout::pad(const std::vector<c10::IValue>& inputs, const Bucket& sizes,
                                     const Bucket& target) const {
  std::vector<c10::IValue> out;
  out.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].isTensor()) {
      out.push_back(inputs[i]);
      continue;
    }
    at::Tensor t = inputs[i].toTensor();
    std::vector<int64_t> shape = t.sizes().vec();
    bool fill = false;
    for (int k = 1; k < rank_; ++k) {
      const int64_t d = input_dim(i, k);
      if (d >= 0 && target[k] != sizes[k]) {
        shape[d] = target[k];
        fill = true;
      }
    }
    if (fill) {
      // Padded positions hold the input's pad value (a mask's value masks them out).
      const double value = pad_values_[std::min(i, pad_values_.size() - 1)];
      at::Tensor padded = at::full(shape, value, t.options());
      at::Tensor region = padded;
      for (int k = 1; k < rank_; ++k) {
        const int64_t d = input_dim(i, k);
        if (d >= 0) region = region.narrow(d, 0, sizes[k]);
      }
      region.copy_(t);
      t = padded;
    }
    const int64_t d = input_dim(i, 0);
    // Padding along the batch repeats the last row, so padded rows are valid inputs.
    if (d >= 0 && target[0] != sizes[0]) t = extend(t, d, target[0]);
    out.emplace_back(std::move(t));
  }
  return out;
}

std::vector<c10::IValue> Layout::resize(const std::vector<c10::IValue>& inputs, const Bucket& target) const {
  std::vector<c10::IValue> out;
  out.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].isTensor()) {
      out.push_back(inputs[i]);
      continue;
    }
    at::Tensor t = inputs[i].toTensor();
    for (int k = 0; k < rank_; ++k) {
      const int64_t d = input_dim(i, k);
      if (d >= 0 && d < t.dim() && t.size(d) != target[k]) t = extend(t, d, target[k]);
    }
    out.emplace_back(t.contiguous());
  }
  return out;
}

std::vector<c10::IValue> Layout::slice_batch(const std::vector<c10::IValue>& inputs, int64_t start,
                                             int64_t length) const {
  std::vector<c10::IValue> out;
  out.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int64_t d = input_dim(i, 0);
    if (d >= 0 && inputs[i].isTensor()) {
      out.emplace_back(inputs[i].toTensor().narrow(d, start, length).contiguous());
    } else {
      out.push_back(inputs[i]);
    }
  }
  return out;
}

c10::IValue Layout::slice_output(const c10::IValue& output, const Bucket& sizes, const Bucket& padded) const {
  if (sizes == padded) return output;
  bool is_tuple = false, is_list = false;
  auto parts = unpack(output, is_tuple, is_list);
  for (size_t j = 0; j < parts.size(); ++j) {
    TORCH_CHECK(parts[j].isTensor(), "PlanCache: padding needs outputs that are tensors or tuples or lists of ",
                "tensors; output ", j, " is a ", parts[j].tagKind());
    at::Tensor t = parts[j].toTensor();
    for (int k = 0; k < rank_; ++k) {
      const int64_t d = output_dim(j, k);
      if (d < 0 || sizes[k] == padded[k]) continue;
      TORCH_CHECK(d < t.dim() && t.size(d) == padded[k], "PlanCache: output ", j, " has shape ", t.sizes(),
                  "; after padding to ", describe(padded), " its ", names_[k], " dimension ", d, " should have size ",
                  padded[k], " (check ", k == 0 ? "output_batch_dims" : "output_dims", ")");
      t = t.narrow(d, 0, sizes[k]);
    }
    parts[j] = t;
  }
  return repack(output, std::move(parts), is_tuple, is_list);
}

void Layout::check_output(const c10::IValue& output, const Bucket& sizes, const Bucket& plan) const {
  bool is_tuple = false, is_list = false;
  const auto parts = unpack(output, is_tuple, is_list);
  for (size_t j = 0; j < parts.size(); ++j) {
    if (!parts[j].isTensor()) continue;
    const at::Tensor& t = parts[j].toTensor();
    for (int k = 0; k < rank_; ++k) {
      const int64_t d = output_dim(j, k);
      TORCH_CHECK(d < 0 || (d < t.dim() && t.size(d) == sizes[k]), "PlanCache: the plan for ", describe(plan), " ran ",
                  describe(sizes), " and its output ", j, " has shape ", t.sizes(), ": its ", names_[k], " dimension ",
                  d, " should have size ", sizes[k], " (a wrong plan, or wrong ",
                  k == 0 ? "output_batch_dims" : "output_dims", ")");
    }
  }
}

c10::IValue Layout::output_rows(const c10::IValue& output, int64_t start, int64_t length) const {
  bool is_tuple = false, is_list = false;
  auto parts = unpack(output, is_tuple, is_list);
  for (size_t j = 0; j < parts.size(); ++j) {
    TORCH_CHECK(parts[j].isTensor(), "Batcher: outputs must be tensors or tuples or lists of tensors; output ", j,
                " is a ", parts[j].tagKind());
    const at::Tensor& t = parts[j].toTensor();
    const int64_t d = output_dim(j, 0);
    TORCH_CHECK(d < t.dim() && start + length <= t.size(d), "Batcher: output ", j, " has shape ", t.sizes(),
                "; it has no rows ", start, "..", start + length - 1, " along its batch dimension ", d);
    parts[j] = t.narrow(d, start, length);
  }
  return repack(output, std::move(parts), is_tuple, is_list);
}

c10::IValue Layout::concat_outputs(const std::vector<c10::IValue>& outputs) const {
  if (outputs.size() == 1) return outputs[0];
  bool is_tuple = false, is_list = false;
  std::vector<std::vector<c10::IValue>> pieces;
  for (const auto& output : outputs) pieces.push_back(unpack(output, is_tuple, is_list));
  std::vector<c10::IValue> joined;
  for (size_t j = 0; j < pieces[0].size(); ++j) {
    std::vector<at::Tensor> tensors;
    for (const auto& piece : pieces) {
      TORCH_CHECK(piece.size() == pieces[0].size() && piece[j].isTensor(), "PlanCache: splitting needs outputs ",
                  "that are tensors or tuples or lists of tensors; output ", j, " is a ", piece[j].tagKind());
      tensors.push_back(piece[j].toTensor());
    }
    const int64_t d = output_dim(j, 0);
    TORCH_CHECK(d < tensors[0].dim(), "PlanCache: output ", j, " has ", tensors[0].dim(),
                " dimension(s); no batch dimension ", d);
    joined.emplace_back(at::cat(tensors, d));
  }
  return repack(outputs[0], std::move(joined), is_tuple, is_list);
}

std::vector<c10::IValue> Layout::concat_inputs(const std::vector<std::vector<c10::IValue>>& requests) const {
  if (requests.size() == 1) return requests[0];
  std::vector<c10::IValue> out;
  for (size_t i = 0; i < requests[0].size(); ++i) {
    const int64_t d = input_dim(i, 0);
    if (d < 0 || !requests[0][i].isTensor()) {
      out.push_back(requests[0][i]);
      continue;
    }
    std::vector<at::Tensor> tensors;
    tensors.reserve(requests.size());
    for (const auto& request : requests) tensors.push_back(request[i].toTensor());
    out.emplace_back(at::cat(tensors, d));
  }
  return out;
}

}  // namespace torch_ext::plan
