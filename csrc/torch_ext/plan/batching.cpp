// Serving a miss from cached plans of other buckets: the router (router.h) chooses padding or
// splitting; this runs its choice.
#include "torch_ext/plan/plan.h"

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "torch_ext/plan/plan_table.h"
#include "torch_ext/plan/router.h"

namespace torch_ext::plan {

std::optional<PlanCache::Route> PlanCache::choose_route(const Bucket& sizes) const {
  const auto cached = table_->plans();
  std::vector<RoutePlan> views;
  for (const auto& plan : cached) {
    views.push_back(RoutePlan{plan->spec.upper, plan->spec.lower, plan->spec.dynamic, plan->estimated_seconds()});
  }
  const auto choice = plan::choose_route(*layout_, options_.miss_mode, views, sizes);
  if (!choice) return std::nullopt;
  Route route{choice->pad, {}, choice->pieces, choice->target};
  for (const std::size_t i : choice->plans) route.plans.push_back(cached[i]);
  return route;
}

c10::IValue PlanCache::run_route(const Route& route, const std::vector<c10::IValue>& inputs, const Bucket& sizes) {
  auto rec = table_->record(layout_->bucket_of(sizes));
  if (route.pad) {
    Plan& plan = *route.plans[0];
    table_->touch(plan);
    rec->padded_calls.fetch_add(1, std::memory_order_relaxed);
    return run_on(plan, inputs, sizes, *rec);
  }
  rec->split_calls.fetch_add(1, std::memory_order_relaxed);
  std::vector<c10::IValue> outputs;
  int64_t offset = 0;
  for (size_t p = 0; p < route.plans.size(); ++p) {
    Plan& plan = *route.plans[p];
    table_->touch(plan);
    Bucket piece = sizes;
    piece[0] = route.pieces[p];
    outputs.push_back(run_on(plan, layout_->slice_batch(inputs, offset, piece[0]), piece, *rec));
    offset += piece[0];
  }
  return layout_->concat_outputs(outputs);
}

}  // namespace torch_ext::plan
