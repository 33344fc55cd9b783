#pragma once
// The router: which cached plans serve a request whose own bucket has no plan. Pad: the plan whose
// run holds the request with the fewest elements (sliced back after); split: the batch as the
// fewest pieces that cached plans at the smallest other sizes run, largest first; auto: the
// cheaper of the two by the plans' estimated seconds; exact: whichever serves (only asked when
// no plan can be built). It sees plans as plain values (RoutePlan), not the cache: pure
// functions, thread-safe.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "torch_ext/plan/layout.h"
#include "torch_ext/plan/plan_cache.h"

namespace torch_ext::plan {

// The sizes a plan over [lower, upper] runs for a request of `sizes`: its upper bucket when it is
// static, the sizes clamped into its range when it is dynamic.
Bucket run_target(const Bucket& upper, const Bucket& lower, bool dynamic, const Bucket& sizes);

struct RoutePlan {  // what the router knows of one cached plan
  Bucket upper, lower;
  bool dynamic = false;
  double seconds = 0;  // its estimated latency per run
};

struct RouteChoice {
  bool pad = false;
  std::vector<std::size_t> plans;  // indices into the cached plans: pad, one; split, each piece's
  std::vector<int64_t> pieces;     // split: each piece's batch size, largest first
  Bucket target;                   // pad: the sizes run
};

// `cached` in ascending order of upper bucket (among equals, the earlier wins). nullopt: none serves.
std::optional<RouteChoice> choose_route(const Layout& layout, MissMode mode, const std::vector<RoutePlan>& cached,
                                        const Bucket& sizes);

// The fewest pieces of the given sizes (ascending, each usable any number of times) that sum to
// n, largest first; among as few pieces, the larger last piece wins. Empty when none sum to n.
std::vector<int64_t> fewest_pieces(const std::vector<int64_t>& sizes, int64_t n);

}  // namespace torch_ext::plan
