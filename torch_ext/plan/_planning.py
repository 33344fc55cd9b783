"""How a PlanCache's buckets are chosen and re-chosen: the budget a choice is made within, the
costs it is made by, the one path from_traffic and replan share, and replan_on_drift's state."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Optional

from . import traffic as _traffic

__all__ = ["Budget", "Costs", "Drift", "DriftStats", "planned"]


class Budget:
    """What a choice of buckets may build: at most `plans` plans, and/or builds that fit in
    `seconds` (the measurement's included). Checked before anything is measured or built."""

    def __init__(self, owner: str, plans: Optional[int], seconds: Optional[float]) -> None:
        if plans is None and seconds is None:
            raise TypeError(f"{owner}: give plan_budget (plans), compile_seconds (seconds of builds), or both")
        if plans is not None and (not isinstance(plans, int) or isinstance(plans, bool) or plans < 1):
            raise ValueError(f"{owner}: plan_budget must be a positive integer, got {plans!r}")
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not 0 < seconds < float("inf")):
            raise ValueError(f"{owner}: compile_seconds must be a positive number of seconds, got {seconds!r}")
        self.owner, self.plans, self.seconds = owner, plans, seconds

    def max_plans(self, traffic: dict, costs: Costs, spent: float, builds_per_plan: int) -> int:
        """The most plans within the budget, after `spent` seconds of builds; never more than the
        traffic has sizes."""
        limit = len(traffic) if self.plans is None else min(self.plans, len(traffic))
        if self.seconds is None:
            return limit
        per_plan = builds_per_plan * costs.seconds_per_build
        left = self.seconds - spent
        fits = int(left // per_plan) if per_plan > 0 else limit
        if fits < 1:
            raise ValueError(
                f"{self.owner}: compile_seconds={self.seconds:g} leaves {max(left, 0.0):.2f} s after measuring the "
                f"model ({spent:.2f} s of builds), less than one plan's predicted {per_plan:.2f} s ({builds_per_plan} "
                f"build(s) of {costs.seconds_per_build:.2f} s); raise compile_seconds, or give plan_budget alone")
        return min(limit, fits)


@dataclasses.dataclass(frozen=True)
class DriftStats:
    """What PlanCache.replan_on_drift's checks found."""

    checks: int                # windows of requests checked
    replans: int               # checks that swapped in new plans
    current_seconds: float     # the last check: the current buckets' predicted mean seconds a request
                               # over its window (inf: a request with no bucket, or no buckets yet)
    best_seconds: float        # the last check: the best choice's, within the budget (nan before any)
    error: Optional[str]       # the last check's error, if it failed (the cache serves on as it was)


class Drift:
    """replan_on_drift's settings and what its checks found; checks run one at a time, on the
    re-plan thread, and requests only count down."""

    def __init__(self, budget: Budget, every: int, tolerance: float, example_inputs: Any, seen: dict) -> None:
        self.budget, self.every, self.tolerance, self.example_inputs = budget, every, tolerance, example_inputs
        self.countdown, self.seen = every, seen  # seen: the traffic log at the last check
        self.checks = self.replans = 0
        self.current, self.best, self.error = float("inf"), float("nan"), None

    def found(self, current: float, best: float) -> None:
        self.current, self.best, self.error = current, best, None

    def failed(self, error: Exception) -> None:
        if self.error is None:
            warnings.warn(f"PlanCache.replan_on_drift: the check failed and the cache serves on with its plans: "
                          f"{error}", RuntimeWarning, stacklevel=1)
        self.error = f"{type(error).__name__}: {error}"

    def stats(self) -> DriftStats:
        return DriftStats(self.checks, self.replans, self.current, self.best, self.error)


class Costs:
    """The measured costs (torch_ext.plan.traffic.measure_plans), the sizes they span (outside them
    the interpolation only repeats the nearest measured size) and the seconds a build took there."""

    def __init__(self, make: Callable[..., Any], traffic: dict, example_inputs: Any, exported: bool,
                 progress: bool) -> None:
        probes = []
        ranges = make.size_ranges()  # an exported program's, before any cache is made
        if ranges is not None:
            refuse_traffic_outside(ranges, make.dim_names, traffic)

        def probe(**options: Any) -> Any:
            probes.append(make(**options))
            if ranges is None and len(probes) == 1:  # TorchScript: the first probe has no buckets to refuse
                refuse_traffic_the_cache_cannot_take(probes[0], traffic)
            return probes[-1]

        self.cost, self.dynamic_cost, self.script_cost = _traffic.measure_plans(probe, traffic, example_inputs,
                                                                                exported, progress=progress)
        self.smallest, self.largest = (tuple(map(f, zip(*traffic))) for f in (min, max))
        stats = [p.stats() for p in probes]
        self.build_seconds = sum(s.build_seconds for s in stats)
        # A plan's build is predicted at the probes' that compile (an exported program's TorchScript
        # probe compiles nothing, and would make compiles look cheaper than they are).
        compiled = [s for s in stats if s.compiles] or stats
        self.seconds_per_build = sum(s.build_seconds for s in compiled) / max(1, sum(s.builds for s in compiled))

    def span(self, traffic: dict) -> bool:
        return all(all(lo <= n <= hi for n, lo, hi in zip(sizes, self.smallest, self.largest)) for sizes in traffic)


def refuse_traffic_outside(size_ranges: list, dim_names: list, traffic: dict, rank: Optional[int] = None) -> None:
    """Raise, before anything compiles, where the traffic's requests have another number of sizes
    than the cache has dynamic dimensions (rank; default: a range each), or sizes above those it
    accepts (it would refuse those requests, and their plans cannot be built)."""
    rank = len(size_ranges) if rank is None else rank
    given = len(next(iter(traffic)))
    if given != rank:
        raise ValueError(f"PlanCache: the traffic's requests have {given} size(s) each, and the program has {rank} "
                         f"dynamic dimension(s); give one size per dynamic dimension, the batch first")
    for k, (_, largest) in enumerate(size_ranges):
        above = [sizes for sizes in traffic if 0 < largest < sizes[k]]  # 0: no largest
        if above:
            name = dim_names[k] if k < len(dim_names) else ("batch" if k == 0 else f"dim{k}")
            raise ValueError(f"PlanCache: {sum(traffic[sizes] for sizes in above)} of the traffic's requests have a "
                             f"{name} above {largest}, the largest the program accepts (up to "
                             f"{max(sizes[k] for sizes in above)}); leave them out of the traffic, or export the "
                             f"program with a larger maximum")


def refuse_traffic_the_cache_cannot_take(cache: Any, traffic: dict) -> None:
    """refuse_traffic_outside for a cache made: its rank is the batch and one per other dimension it buckets."""
    refuse_traffic_outside(cache.size_ranges, cache.dim_names, traffic, 1 + len(cache.dims))


def planned(make: Callable[..., Any], traffic: dict, budget: Budget, example_inputs: Any, exported: bool,
             progress: bool, costs: Optional[Costs] = None,
             keep: Optional[Callable[[_traffic.BucketChoice, Costs], bool]] = None) -> tuple:
    """Choose the buckets for `traffic` within `budget` by `costs` (measured here unless they span
    the traffic); then make the cache with them, holding the traffic, the costs and the chosen
    plans. (choice, cache, costs), the cache None when keep(choice, costs) says the current one stays."""
    spent = 0.0
    if costs is None or not costs.span(traffic):
        costs = Costs(make, traffic, example_inputs, exported, progress)
        spent = costs.build_seconds
    builds_per_plan = 2 if exported and make.plan_shapes == "auto" else 1  # 'auto': a static and a dynamic
    choice = _traffic.choose_buckets(traffic, budget.max_plans(traffic, costs, spent, builds_per_plan),
                                     costs.cost, costs.dynamic_cost, script_cost=costs.script_cost)
    if keep is not None and keep(choice, costs):
        return choice, None, costs
    cache = make(buckets=choice.buckets)
    cache.observe_traffic(traffic)
    cache.preload(choice.plans, example_inputs, progress=progress)
    cache.bucket_choice, cache._costs = choice, costs
    return choice, cache, costs
