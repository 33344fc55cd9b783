// Serving a miss from cached plans of other buckets: padding up to one that holds the request, or
// splitting the batch into pieces that cached plans run (padding the other dimensions where
// allowed), and choosing between them by the plans' measured latencies.
#include "torch_ext/plan/plan.h"

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <utility>
#include <vector>

namespace torch_ext::plan {

namespace {

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

// Whether a plan run at `target` serves `sizes` from dimension `from` on: never smaller, and
// larger only where padding is allowed.
bool holds(const Layout& layout, const Bucket& target, const Bucket& sizes, int from) {
  for (int k = from; k < sizes.rank; ++k) {
    if (target[k] < sizes[k] || (target[k] > sizes[k] && !layout.pads(k))) return false;
  }
  return true;
}

double other_volume(const Bucket& b) {
  double v = 1;
  for (int k = 1; k < b.rank; ++k) v *= static_cast<double>(b[k]);
  return v;
}

}  // namespace

std::optional<PlanCache::Route> PlanCache::choose_route(const Bucket& sizes) const {
  std::vector<std::shared_ptr<Plan>> cached;
  {
    std::shared_lock<std::shared_mutex> lock(mutex_);
    for (const auto& entry : plans_) cached.push_back(entry.second);
  }
  if (cached.empty()) return std::nullopt;
  std::sort(cached.begin(), cached.end(), [](const auto& a, const auto& b) { return a->bucket() < b->bucket(); });
  // Pad: the plan whose run holds the request with the fewest elements.
  std::optional<Route> pad;
  double pad_cost = 0;
  for (const auto& plan : cached) {
    const Bucket target = plan->target(sizes);
    if (!holds(*layout_, target, sizes, 0)) continue;
    if (!pad || target.volume() < pad->target.volume()) {
      pad = Route{true, {plan}, {}, target};
      pad_cost = plan->estimated_seconds();
    }
  }
  // Split the batch: among plans whose other dimensions hold the request, those at the smallest
  // other sizes that can sum to the batch, in the fewest pieces.
  std::optional<Route> split;
  double split_cost = 0;
  std::map<double, std::vector<std::pair<Bucket, std::shared_ptr<Plan>>>> groups;  // by other dimensions' volume
  for (const auto& plan : cached) {
    const Bucket target = plan->target(sizes);
    if (holds(*layout_, target, sizes, 1)) groups[other_volume(target)].emplace_back(target, plan);
  }
  for (const auto& [volume, members] : groups) {
    std::map<int64_t, std::shared_ptr<Plan>> by_batch;  // a batch size -> the plan that runs it
    for (const auto& [target, plan] : members) {
      const int64_t lo = plan->spec.dynamic ? plan->spec.lower[0] : plan->bucket()[0];
      for (int64_t n = lo; n <= plan->bucket()[0] && n <= sizes[0]; ++n) by_batch.emplace(n, plan);
    }
    std::vector<int64_t> batch_sizes;
    for (const auto& entry : by_batch) batch_sizes.push_back(entry.first);
    const std::vector<int64_t> pieces = fewest_pieces(batch_sizes, sizes[0]);
    if (pieces.size() > 1) {
      Route route;
      route.pieces = pieces;
      for (int64_t n : pieces) {
        route.plans.push_back(by_batch.at(n));
        split_cost += by_batch.at(n)->estimated_seconds();
      }
      split = std::move(route);
      break;
    }
  }
  switch (options_.miss_mode) {
    case MissMode::pad: return pad;
    case MissMode::split: return split;
    case MissMode::auto_:
      if (pad && split) return pad_cost <= split_cost ? pad : split;
      return pad ? pad : split;
    case MissMode::exact:  // only when no plan can be built here: anything cached that serves
      return pad ? pad : split;
  }
  return std::nullopt;
}

c10::IValue PlanCache::run_route(const Route& route, const std::vector<c10::IValue>& inputs, const Bucket& sizes) {
  auto rec = record(layout_->bucket_of(sizes));
  if (route.pad) {
    Plan& plan = *route.plans[0];
    plan.last_used.store(clock_.fetch_add(1, std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    rec->padded_calls.fetch_add(1, std::memory_order_relaxed);
    return run_on(plan, inputs, sizes, *rec);
  }
  rec->split_calls.fetch_add(1, std::memory_order_relaxed);
  std::vector<c10::IValue> outputs;
  int64_t offset = 0;
  for (size_t p = 0; p < route.plans.size(); ++p) {
    Plan& plan = *route.plans[p];
    plan.last_used.store(clock_.fetch_add(1, std::memory_order_relaxed) + 1, std::memory_order_relaxed);
    Bucket piece = sizes;
    piece[0] = route.pieces[p];
    outputs.push_back(run_on(plan, layout_->slice_batch(inputs, offset, piece[0]), piece, *rec));
    offset += piece[0];
  }
  return layout_->concat_outputs(outputs);
}

}  // namespace torch_ext::plan
