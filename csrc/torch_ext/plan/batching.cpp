// Serving a miss from cached plans of other sizes: padding up to a larger one or splitting into
// smaller ones (choosing between them), and the batch dimensions of inputs and outputs that
// slicing, padding and concatenating follow.
#include "torch_ext/plan/plan.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <utility>
#include <vector>

#include <ATen/ops/cat.h>

namespace torch_ext::plan {

namespace {

std::vector<c10::IValue> unpack_outputs(const c10::IValue& output, bool& is_tuple, bool& is_list) {
  is_tuple = output.isTuple();
  is_list = output.isList();
  if (is_tuple) {
    return output.toTupleRef().elements().vec();
  }
  if (is_list) {
    return output.toList().vec();
  }
  return {output};
}

// The fewest pieces of the given sizes (ascending, each usable any number of times) that sum to
// n, largest first, by dynamic programming over the sizes; among as few pieces, the larger last
// piece wins. Empty when no pieces sum to n.
std::vector<int64_t> fewest_pieces(const std::vector<int64_t>& sizes, int64_t n) {
  std::vector<int64_t> pieces(n + 1, -1), last(n + 1, 0);
  pieces[0] = 0;
  for (int64_t total = 1; total <= n; ++total) {
    for (const int64_t size : sizes) {
      if (size > total) break;
      if (pieces[total - size] >= 0 && (pieces[total] < 0 || pieces[total - size] + 1 < pieces[total] ||
                                        (pieces[total - size] + 1 == pieces[total] && size > last[total]))) {
        pieces[total] = pieces[total - size] + 1;
        last[total] = size;
      }
    }
  }
  std::vector<int64_t> out;
  if (pieces[n] < 0) return out;
  for (int64_t total = n; total > 0; total -= last[total]) out.push_back(last[total]);
  std::sort(out.rbegin(), out.rend());
  return out;
}

}  // namespace

int64_t PlanCache::input_batch_dim(size_t index, int64_t dim) const {
  (void)dim;
  if (options_.batch_dims.empty()) return 0;
  return options_.batch_dims[std::min(index, options_.batch_dims.size() - 1)];
}

int64_t PlanCache::output_batch_dim(size_t index, int64_t dim) const {
  (void)dim;
  if (options_.output_batch_dims.empty()) return 0;
  return options_.output_batch_dims[std::min(index, options_.output_batch_dims.size() - 1)];
}

std::optional<PlanCache::Route> PlanCache::choose_route(int64_t batch_size) const {
  std::vector<std::pair<int64_t, std::shared_ptr<Plan>>> cached;
  {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    cached.assign(plans_.begin(), plans_.end());
  }
  if (cached.empty()) return std::nullopt;
  std::sort(cached.begin(), cached.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::optional<Route> pad;
  double pad_cost = 0;
  for (const auto& [size, plan] : cached) {
    if (size >= batch_size) {
      pad = Route{true, {plan}};
      pad_cost = plan->estimated_seconds();
      break;
    }
  }
  // Split: the fewest cached pieces that sum to batch_size, run largest first.
  std::optional<Route> split;
  double split_cost = 0;
  if (cached.front().first < batch_size) {
    std::vector<int64_t> sizes;
    for (const auto& entry : cached) sizes.push_back(entry.first);
    const std::vector<int64_t> pieces = fewest_pieces(sizes, batch_size);
    if (pieces.size() > 1) {
      Route route;
      for (int64_t size : pieces) {
        auto it = std::find_if(cached.begin(), cached.end(), [size](const auto& e) { return e.first == size; });
        route.plans.push_back(it->second);
        split_cost += it->second->estimated_seconds();
      }
      split = std::move(route);
    }
  }
  switch (options_.miss_mode) {
    case MissMode::pad: return pad;
    case MissMode::split: return split;
    case MissMode::auto_:
      if (pad && split) return pad_cost <= split_cost ? pad : split;
      return pad ? pad : split;
    case MissMode::exact: return std::nullopt;
  }
  return std::nullopt;
}

std::vector<c10::IValue> PlanCache::slice_inputs(const std::vector<c10::IValue>& inputs, int64_t start,
                                                 int64_t length) const {
  std::vector<c10::IValue> out;
  out.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int64_t d = input_batch_dim(i, 0);
    if (d >= 0 && inputs[i].isTensor()) {
      out.emplace_back(inputs[i].toTensor().narrow(d, start, length).contiguous());
    } else {
      out.push_back(inputs[i]);
    }
  }
  return out;
}

std::vector<c10::IValue> PlanCache::pad_inputs(const std::vector<c10::IValue>& inputs, int64_t batch_size,
                                               int64_t target) const {
  // Padding repeats the last row, so padded rows are valid inputs (no zeros fed to a log or a division).
  std::vector<c10::IValue> out;
  out.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int64_t d = input_batch_dim(i, 0);
    if (d >= 0 && inputs[i].isTensor()) {
      const at::Tensor& t = inputs[i].toTensor();
      std::vector<int64_t> repeats(t.dim(), 1);
      repeats[d] = target - batch_size;
      out.emplace_back(at::cat({t, t.narrow(d, batch_size - 1, 1).repeat(repeats)}, d));
    } else {
      out.push_back(inputs[i]);
    }
  }
  return out;
}

c10::IValue PlanCache::slice_output(const c10::IValue& output, int64_t length) const {
  bool is_tuple = false, is_list = false;
  auto parts = unpack_outputs(output, is_tuple, is_list);
  for (size_t i = 0; i < parts.size(); ++i) {
    TORCH_CHECK(parts[i].isTensor(), "PlanCache: padding needs outputs that are tensors or tuples or lists of ",
                "tensors; output ", i, " is a ", parts[i].tagKind());
    const at::Tensor& t = parts[i].toTensor();
    const int64_t d = output_batch_dim(i, t.dim());
    TORCH_CHECK(d < t.dim(), "PlanCache: output ", i, " has ", t.dim(), " dimension(s); no batch dimension ", d);
    parts[i] = t.narrow(d, 0, length);
  }
  if (is_tuple) return c10::ivalue::Tuple::create(std::move(parts));
  if (is_list) {
    c10::impl::GenericList list(output.toList().elementType());
    for (auto& p : parts) list.push_back(std::move(p));
    return list;
  }
  return parts[0];
}

c10::IValue PlanCache::concat_outputs(const std::vector<c10::IValue>& outputs) const {
  if (outputs.size() == 1) return outputs[0];
  bool is_tuple = false, is_list = false;
  std::vector<std::vector<c10::IValue>> pieces;
  for (const auto& output : outputs) pieces.push_back(unpack_outputs(output, is_tuple, is_list));
  std::vector<c10::IValue> joined;
  for (size_t i = 0; i < pieces[0].size(); ++i) {
    std::vector<at::Tensor> tensors;
    for (const auto& piece : pieces) {
      TORCH_CHECK(piece.size() == pieces[0].size() && piece[i].isTensor(), "PlanCache: splitting needs outputs ",
                  "that are tensors or tuples or lists of tensors; output ", i, " is a ", piece[i].tagKind());
      tensors.push_back(piece[i].toTensor());
    }
    const int64_t d = output_batch_dim(i, tensors[0].dim());
    TORCH_CHECK(d < tensors[0].dim(), "PlanCache: output ", i, " has ", tensors[0].dim(),
                " dimension(s); no batch dimension ", d);
    joined.emplace_back(at::cat(tensors, d));
  }
  if (is_tuple) return c10::ivalue::Tuple::create(std::move(joined));
  if (is_list) {
    c10::impl::GenericList list(outputs[0].toList().elementType());
    for (auto& p : joined) list.push_back(std::move(p));
    return list;
  }
  return joined[0];
}

c10::IValue PlanCache::run_route(const Route& route, const std::vector<c10::IValue>& inputs, int64_t batch_size) {
  auto rec = record(batch_size);
  if (route.pad) {
    Plan& plan = *route.plans[0];
    plan.last_used.store(clock_.fetch_add(1, std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    rec->padded_calls.fetch_add(1, std::memory_order_relaxed);
    rec->padded_elements.fetch_add(plan.batch_size - batch_size, std::memory_order_relaxed);
    return slice_output(run_plan(plan, pad_inputs(inputs, batch_size, plan.batch_size)), batch_size);
  }
  rec->split_calls.fetch_add(1, std::memory_order_relaxed);
  std::vector<c10::IValue> outputs;
  int64_t offset = 0;
  for (const auto& plan : route.plans) {
    plan->last_used.store(clock_.fetch_add(1, std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    outputs.push_back(run_plan(*plan, slice_inputs(inputs, offset, plan->batch_size)));
    offset += plan->batch_size;
  }
  return concat_outputs(outputs);
}

}  // namespace torch_ext::plan
