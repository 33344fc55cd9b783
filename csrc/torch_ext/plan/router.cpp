// The router's choice between padding and splitting (router.h).
#include "torch_ext/plan/router.h"

#include <algorithm>
#include <map>
#include <utility>

namespace torch_ext::plan {

Bucket run_target(const Bucket& upper, const Bucket& lower, bool dynamic, const Bucket& sizes) {
  if (!dynamic) return upper;
  Bucket t = sizes;
  for (int k = 0; k < t.rank; ++k) t[k] = std::max(lower[k], std::min(sizes[k], upper[k]));
  return t;
}

// By dynamic programming over the sizes.
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

namespace {

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

std::optional<RouteChoice> choose_route(const Layout& layout, MissMode mode, const std::vector<RoutePlan>& cached,
                                        const Bucket& sizes) {
  if (cached.empty()) return std::nullopt;
  auto target_of = [&](const RoutePlan& p) { return run_target(p.upper, p.lower, p.dynamic, sizes); };
  // Pad: the plan whose run holds the request with the fewest elements.
  std::optional<RouteChoice> pad;
  double pad_cost = 0;
  for (std::size_t i = 0; i < cached.size(); ++i) {
    const Bucket target = target_of(cached[i]);
    if (!holds(layout, target, sizes, 0)) continue;
    if (!pad || target.volume() < pad->target.volume()) {
      pad = RouteChoice{true, {i}, {}, target};
      pad_cost = cached[i].seconds;
    }
  }
  // Split the batch: among plans whose other dimensions hold the request, those at the smallest
  // other sizes that can sum to the batch, in the fewest pieces.
  std::optional<RouteChoice> split;
  double split_cost = 0;
  std::map<double, std::vector<std::size_t>> groups;  // by other dimensions' volume
  for (std::size_t i = 0; i < cached.size(); ++i) {
    const Bucket target = target_of(cached[i]);
    if (holds(layout, target, sizes, 1)) groups[other_volume(target)].push_back(i);
  }
  for (const auto& [volume, members] : groups) {
    std::map<int64_t, std::size_t> by_batch;  // a batch size -> the plan that runs it
    for (const std::size_t i : members) {
      const RoutePlan& p = cached[i];
      const int64_t lo = p.dynamic ? p.lower[0] : p.upper[0];
      for (int64_t n = lo; n <= p.upper[0] && n <= sizes[0]; ++n) by_batch.emplace(n, i);
    }
    std::vector<int64_t> batch_sizes;
    for (const auto& entry : by_batch) batch_sizes.push_back(entry.first);
    const std::vector<int64_t> pieces = fewest_pieces(batch_sizes, sizes[0]);
    if (pieces.size() > 1) {
      RouteChoice route;
      route.pieces = pieces;
      for (int64_t n : pieces) {
        route.plans.push_back(by_batch.at(n));
        split_cost += cached[by_batch.at(n)].seconds;
      }
      split = std::move(route);
      break;
    }
  }
  switch (mode) {
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

}  // namespace torch_ext::plan
