"""Plans chosen from traffic: which buckets a PlanCache holds, from the sizes its requests bring.

A request's sizes are one per dynamic dimension, batch first (a batch size; or a batch and a
sequence length). A bucket serves every request up to its upper bounds, padded to them. Which
buckets to hold is a trade: each plan costs a compile and memory, and each padded element costs
time on every request it pads. choose_buckets weighs that over the traffic with costs measured on
the model (measure_plans: the seconds of one call at each size, of a static and of a dynamic plan)
and picks the bounds with the least predicted time within a plan budget.

PlanCache.from_traffic measures, chooses, makes the cache with the chosen buckets, hands it the
traffic (so plan_shapes='auto' times each bucket's kinds of plan, static, dynamic and, where the
module scripts, TorchScript, at the sizes that bucket serves, weighted by their requests) and
builds the plans.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Union

import numpy as np
import torch

__all__ = ["BucketChoice", "as_traffic", "choose_buckets", "measure_plans", "measured_cost", "predicted_seconds"]

Traffic = dict
# The seconds of one call at each row of an (m x rank) array of sizes.
CostFn = Callable[[np.ndarray], np.ndarray]


def as_traffic(traffic: Union[Mapping, Iterable, Any]) -> Traffic:
    """{sizes: requests} from a mapping of sizes (an int or a tuple of ints) to counts, a PlanCache
    or its script_object (its traffic log), or an iterable of requests' sizes (one request each;
    a tensor or array of them: one row per request)."""
    if isinstance(traffic, torch.ScriptObject):
        traffic = {tuple(row[:-1]): row[-1] for row in traffic.traffic()}
    elif hasattr(traffic, "script_object"):
        traffic = traffic.traffic()
    elif isinstance(traffic, (torch.Tensor, np.ndarray)):
        traffic = traffic.tolist()
    pairs = traffic.items() if isinstance(traffic, Mapping) else ((sizes, 1) for sizes in traffic)
    out: Traffic = {}
    rank = None
    for sizes, count in pairs:
        try:
            key = tuple(sizes)
        except TypeError:  # one dynamic dimension: a request's size alone
            key = (sizes,)
        if not key or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1 for s in key):
            raise ValueError(f"traffic: sizes must be positive integers, one per dynamic dimension; got {sizes!r}")
        if rank is not None and len(key) != rank:
            raise ValueError(f"traffic: every request has a size per dynamic dimension; {sizes!r} has {len(key)}, "
                             f"others {rank}")
        if not isinstance(count, (int, np.integer)) or count < 1:
            raise ValueError(f"traffic: the count of {sizes!r} must be a positive integer, got {count!r}")
        rank = len(key)
        key = tuple(int(s) for s in key)
        out[key] = out.get(key, 0) + int(count)
    if not out:
        raise ValueError("traffic: no requests")
    return out


@dataclass(frozen=True)
class BucketChoice:
    """What choose_buckets chose, and what it predicts."""

    buckets: list             # the PlanCache option: per dynamic dimension, its ascending upper bounds
    plans: list               # the buckets the traffic uses (their largest sizes): the plans to build
    plan_requests: list       # requests each of `plans` serves
    plan_kinds: list          # the kind predicted cheapest for each: 'static' (padded), 'dynamic' or 'script'
    plan_seconds: list        # predicted mean seconds of a request in each of `plans`
    predicted_seconds: float  # mean predicted seconds per request, padding included
    unpadded_seconds: float   # the same were every request run at its own sizes (one plan per size)
    padding: float            # the share of computed elements that are padding
    max_plans: int            # the budget it was chosen under, in plans

    def describe(self) -> str:
        return (f"{len(self.plans)} plan(s) {', '.join('x'.join(map(str, p)) for p in self.plans)}: predicted "
                f"{self.predicted_seconds * 1e3:.3f} ms a request ({self.predicted_seconds / self.unpadded_seconds:.2f}x "
                f"of one plan per size), {self.padding:.0%} of elements padding")


def _candidates(values: np.ndarray, limit: int) -> np.ndarray:
    """At most `limit` of a dimension's distinct sizes, spread over them, the largest always in."""
    if values.size <= limit:
        return values
    picks = np.unique(np.round(np.linspace(0, values.size - 1, limit)).astype(np.int64))
    return values[picks]


class _Problem:
    """The traffic on the candidate grid: per request its sizes, count, minimal bound per dimension,
    its cost at its own sizes in each plan kind that runs it so (dynamic, script), and the static
    cost table over every combination of candidate bounds."""

    def __init__(self, traffic: Traffic, cost: CostFn, own_costs: dict, max_candidates: int) -> None:
        self.sizes = np.array(list(traffic), dtype=np.int64)
        self.counts = np.array(list(traffic.values()), dtype=np.float64)
        self.rank = self.sizes.shape[1]
        self.cands = [_candidates(np.unique(self.sizes[:, d]), max_candidates) for d in range(self.rank)]
        # The smallest candidate bound holding each request, per dimension.
        self.pos = np.stack([np.searchsorted(self.cands[d], self.sizes[:, d], side="left")
                             for d in range(self.rank)], axis=1)
        grid = np.array(list(itertools.product(*self.cands)), dtype=np.int64)
        self.table = np.asarray(cost(grid), dtype=np.float64).reshape([c.size for c in self.cands])
        self.own_static = np.asarray(cost(self.sizes), dtype=np.float64)
        self.own = {kind: np.asarray(fn(self.sizes), dtype=np.float64) for kind, fn in own_costs.items() if fn is not None}

    def uppers(self, bounds: list) -> np.ndarray:
        """Each request's bucket: the index of its upper bound in each dimension (n x rank)."""
        return np.stack([bounds[d][np.searchsorted(bounds[d], self.pos[:, d], side="left")]
                         for d in range(self.rank)], axis=1)

    def evaluate(self, bounds: list) -> tuple:
        """(total predicted seconds, the buckets in use as flat grid indices, each request's bucket
        (an index into them), each bucket's predicted seconds, and its kind: 'static', or a kind of
        self.own where that is cheaper)."""
        flat = np.ravel_multi_index(self.uppers(bounds).T, self.table.shape)
        used, inverse = np.unique(flat, return_inverse=True)
        per_kind = np.stack([np.bincount(inverse, self.counts * self.table.ravel()[flat], minlength=used.size)] +
                            [np.bincount(inverse, self.counts * own, minlength=used.size) for own in self.own.values()])
        seconds = per_kind.min(axis=0)
        kinds = np.array(["static", *self.own])[per_kind.argmin(axis=0)]
        return float(seconds.sum()), used, inverse, seconds, kinds

    def best_bounds(self, d: int, bounds: list, max_plans: int) -> np.ndarray | None:
        """The bounds of dimension d, the others' fixed, that give the least total with at most
        max_plans buckets in use: exact, by dynamic programming over d's sorted candidates."""
        m = self.cands[d].size
        others = [k for k in range(self.rank) if k != d]
        if others:
            other_up = self.uppers(bounds)[:, others]
            _, group = np.unique(other_up, axis=0, return_inverse=True)
            group = group.reshape(-1)
        else:
            other_up, group = np.zeros((self.sizes.shape[0], 0), dtype=np.int64), np.zeros(self.sizes.shape[0], np.int64)
        groups = int(group.max()) + 1
        pos = self.pos[:, d]

        def prefix(weights: np.ndarray) -> np.ndarray:  # (groups x m+1): sums of requests with pos < x
            cells = np.bincount(group * m + pos, weights, minlength=groups * m).reshape(groups, m)
            return np.concatenate([np.zeros((groups, 1)), np.cumsum(cells, axis=1)], axis=1)

        requests = prefix(self.counts)
        owns = [prefix(self.counts * own) for own in self.own.values()]
        index = [None] * self.rank
        for k, other in enumerate(others):
            index[other] = other_up[:, k]
        static = []  # static[i]: prefix sums of the requests' costs were their bound in d candidate i
        for i in range(m):
            index[d] = np.full(self.sizes.shape[0], i)
            static.append(prefix(self.counts * self.table[tuple(index)]))
        best = np.full((m + 1, max_plans + 1), np.inf)  # best[x][p]: requests with pos < x, p buckets
        back = np.zeros((m + 1, max_plans + 1, 2), dtype=np.int64)
        best[0, 0] = 0.0
        for i in range(m):  # a bucket (j, i]: candidates j..i, bound i
            for j in range(i + 1):
                n = requests[:, i + 1] - requests[:, j]
                occupied = int((n > 0).sum())
                if occupied == 0:  # a bound no request needs: merged into the next one costs nothing
                    continue
                seg = static[i][:, i + 1] - static[i][:, j]
                for own in owns:
                    seg = np.minimum(seg, own[:, i + 1] - own[:, j])
                cost = float(seg[n > 0].sum())
                if occupied > max_plans:
                    continue
                before = best[j, :max_plans + 1 - occupied] + cost
                target = best[i + 1, occupied:]
                better = before < target
                target[better] = before[better]
                back[i + 1, occupied:][better] = np.stack([np.full(better.sum(), j),
                                                            np.nonzero(better)[0]], axis=1)
        least = float(best[m].min())
        if not np.isfinite(least):
            return None
        p = _fewest(best[m], least)
        chosen, x = [], m
        while x > 0:
            chosen.append(x - 1)
            x, p = int(back[x, p, 0]), int(back[x, p, 1])
        return np.array(sorted(chosen), dtype=np.int64)


def choose_buckets(traffic: Union[Mapping, Iterable, Any], max_plans: int, cost: CostFn,
                   dynamic_cost: CostFn | None = None, *, script_cost: CostFn | None = None,
                   max_candidates: int = 32) -> BucketChoice:
    """Bucket bounds for `traffic` (see as_traffic) with at most max_plans buckets in use, at the
    least predicted time. cost(sizes): the seconds of a static plan's call at those sizes (each
    request runs padded to its bucket's largest sizes); dynamic_cost(sizes), where plans may be
    compiled over a range: the seconds of a dynamic plan's call at the request's own sizes;
    script_cost(sizes), where an exported program's module scripts: the seconds of its frozen
    TorchScript plan's call at the request's own sizes. Each bucket is predicted at the cheapest
    kind over its requests. max_candidates: the most sizes per dimension considered as bounds.

    The search: for one dimension with the others' bounds fixed, dynamic programming finds the best
    bounds exactly; with several dimensions it starts from each count of bounds in the last
    dimension (spread by requests) and optimises one dimension at a time until none improves."""
    if not isinstance(max_plans, (int, np.integer)) or max_plans < 1:
        raise ValueError(f"choose_buckets: max_plans must be a positive integer, got {max_plans!r}")
    problem = _Problem(as_traffic(traffic), cost, {"dynamic": dynamic_cost, "script": script_cost}, max_candidates)
    if problem.rank == 1:
        return _choice(problem, [problem.best_bounds(0, [], max_plans)], max_plans)
    best = None
    last = problem.cands[-1].size
    for k in range(1, min(max_plans, last) + 1):
        # Start: k bounds in the last dimension, spread by requests; one (the largest) in the others.
        spread = np.quantile(problem.pos[:, -1], np.linspace(0, 1, k + 1)[1:], method="inverted_cdf")
        bounds = [np.array([c.size - 1]) for c in problem.cands[:-1]]
        bounds.append(np.unique(np.append(spread.astype(np.int64), last - 1)))
        total = problem.evaluate(bounds)[0]
        improved = True
        while improved:
            improved = False
            for d in range(problem.rank):
                found = problem.best_bounds(d, bounds, max_plans)
                if found is None:
                    continue
                trial = bounds[:d] + [found] + bounds[d + 1:]
                trial_total = problem.evaluate(trial)[0]
                if trial_total < total and not _ties(trial_total, total):
                    bounds, total, improved = trial, trial_total, True
        # Every start and every step keeps within max_plans; a start with more bounds wins only by
        # more than rounding (see _fewest).
        if best is None or total < best[0] and not _ties(total, best[0]):
            best = (total, bounds)
    return _choice(problem, best[1], max_plans)


def _ties(a: float, b: float) -> bool:
    """Whether two predicted totals differ by no more than the rounding of summing the same costs
    in other groupings: dynamic plans cost each request at its own sizes, so one bucket or four
    over the same requests predict the same time, up to the last bits."""
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def _fewest(totals: np.ndarray, least: float) -> int:
    """The fewest plans whose total ties the least: a plan more that saves nothing costs a compile,
    its memory, and its code and weights competing for the caches with the others'."""
    return int(next(p for p, total in enumerate(totals) if np.isfinite(total) and _ties(float(total), least)))


def _choice(problem: _Problem, bounds: list, max_plans: int) -> BucketChoice:
    total, used, inverse, seconds, kinds = problem.evaluate(bounds)
    counts = problem.counts
    requests = np.bincount(inverse, counts)
    plan_sizes = [tuple(int(problem.cands[d][i]) for d, i in enumerate(np.unravel_index(f, problem.table.shape)))
                  for f in used]
    padded = np.array([np.prod(p) for p in plan_sizes], dtype=np.float64)
    own_volume = counts * np.prod(problem.sizes, axis=1)
    computed = np.where(kinds[inverse] != "static", own_volume, counts * padded[inverse])
    own = np.min(np.stack([problem.own_static, *problem.own.values()]), axis=0)
    return BucketChoice(
        buckets=[[int(problem.cands[d][j]) for j in bounds[d]] for d in range(problem.rank)],
        plans=plan_sizes, plan_requests=[int(r) for r in requests],
        plan_kinds=[str(k) for k in kinds],
        plan_seconds=[float(t / r) for t, r in zip(seconds, requests)],
        predicted_seconds=total / float(counts.sum()), unpadded_seconds=float((counts * own).sum() / counts.sum()),
        padding=float(1 - own_volume.sum() / computed.sum()), max_plans=int(max_plans))


def predicted_seconds(traffic: Union[Mapping, Iterable, Any], buckets: list, cost: CostFn,
                      dynamic_cost: CostFn | None = None, *, script_cost: CostFn | None = None) -> float:
    """The mean predicted seconds of a request of `traffic` served by `buckets` (the PlanCache option:
    per dynamic dimension, its upper bounds), as choose_buckets predicts its own choice: each request
    padded to its bucket's upper bounds, or each bucket at its dynamic or script cost (each request
    at its own sizes) where that is cheaper.
    inf when a request is past every bound of a dimension (no bucket holds it)."""
    traffic = as_traffic(traffic)
    sizes = np.array(list(traffic), dtype=np.int64)
    counts = np.array(list(traffic.values()), dtype=np.float64)
    if len(buckets) != sizes.shape[1]:
        raise ValueError(f"predicted_seconds: the traffic has {sizes.shape[1]} dynamic dimension(s), the buckets "
                         f"{len(buckets)}")
    uppers = np.empty_like(sizes)
    for d, bounds in enumerate(buckets):
        bounds = np.array(sorted(bounds), dtype=np.int64)
        at = np.searchsorted(bounds, sizes[:, d], side="left")
        if bounds.size == 0 or (at >= bounds.size).any():
            return float("inf")
        uppers[:, d] = bounds[at]
    _, bucket = np.unique(uppers, axis=0, return_inverse=True)
    bucket = bucket.reshape(-1)
    seconds = np.bincount(bucket, counts * np.asarray(cost(uppers), dtype=np.float64))
    for own_cost in (dynamic_cost, script_cost):
        if own_cost is not None:
            seconds = np.minimum(seconds, np.bincount(bucket, counts * np.asarray(own_cost(sizes), dtype=np.float64)))
    return float(seconds.sum() / counts.sum())


def _sample_points(values: np.ndarray, points: int) -> np.ndarray:
    """`points` sizes spread over [min, max] of a dimension's sizes (all of them when fewer)."""
    distinct = np.unique(values)
    if distinct.size <= points:
        return distinct
    return np.unique(np.round(np.linspace(distinct[0], distinct[-1], points)).astype(np.int64))


def measured_cost(run: Callable[[tuple], Any], traffic: Union[Mapping, Iterable, Any], *, points: int = 5,
                  repeat: int = 3, progress: bool = False) -> CostFn:
    """A cost for choose_buckets, measured: run(sizes) is timed (the fastest of `repeat` calls
    after one warm-up) at `points` sizes per dimension spread over the traffic's range, every
    combination of them, and the cost elsewhere interpolated linearly in each dimension. A size
    costs at least what any smaller one measured (the running maximum along each dimension), so
    timing noise cannot make padding look free."""
    sizes = np.array(list(as_traffic(traffic)), dtype=np.int64)
    axes = [_sample_points(sizes[:, d], points) for d in range(sizes.shape[1])]
    seconds = np.empty([a.size for a in axes])
    grid: Iterable = list(itertools.product(*(range(a.size) for a in axes)))
    if progress:
        from tqdm import tqdm
        grid = tqdm(grid, desc="PlanCache.from_traffic: timing sizes", unit="size", leave=False, disable=None)
    for index in grid:
        seconds[index] = _fastest(run, tuple(int(axes[d][i]) for d, i in enumerate(index)), repeat)
    for d in range(seconds.ndim):
        seconds = np.maximum.accumulate(seconds, axis=d)
    return _interpolated(axes, seconds)


def _fastest(run: Callable[[tuple], Any], sizes: tuple, repeat: int) -> float:
    run(sizes)
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run(sizes)
        best = min(best, time.perf_counter() - start)
    return best


def measure_plans(make: Callable[..., Any], traffic: Traffic, example_inputs: Any, exported: bool, *,
                  progress: bool = False) -> tuple:
    """(cost, dynamic_cost, script_cost) for choose_buckets, measured on probe caches make(**options)
    returns. TorchScript: its plans at a grid of the traffic's sizes (a plan per size, no compile);
    static plans only (dynamic_cost and script_cost None). An exported program: one dynamic package
    spanning the traffic's sizes, timed on that grid, is the dynamic cost; static packages at the
    traffic's smallest and largest sizes (two compiles), timed against it there, scale it into the
    static cost (their ratio interpolated in the log of the sizes' product). Where the program's
    module scripts (the cache has a script module), its frozen TorchScript plan timed on the same
    grid is the script cost (None otherwise)."""
    sizes = np.array(list(traffic), dtype=np.int64)
    smallest, largest = tuple(int(v) for v in sizes.min(axis=0)), tuple(int(v) for v in sizes.max(axis=0))
    # Whatever the cache serving the traffic does with a miss, a probe builds each size it is timed
    # at, at once, and keeps it: padded onto another plan, every size would time as that plan.
    probe = dict(miss_mode="exact", background_builds=False, admit_after=1, max_plans=0, max_bytes=0)

    def timer(cache: Any) -> Callable[[tuple], None]:
        # Through the cache's call, which releases the GIL while the model runs: a re-plan measures
        # on a thread of its own while others serve, and neither waits on the other's model run.
        inputs: dict = {}

        def run(at: tuple) -> None:
            if at not in inputs:  # made on _fastest's warm-up call, outside the timed ones
                flat = list(cache.script_object.example_inputs(list(at)))
                device = next((v.device for v in flat if isinstance(v, torch.Tensor) and v.device.type != "cpu"), None)
                inputs[at] = (flat, all(type(value) is torch.Tensor for value in flat), device)
            flat, tensors, device = inputs[at]
            cache._infer_tensors(flat) if tensors else cache.script_object.infer(flat)
            if device is not None:  # a GPU run returns once queued: time what it costs the device
                torch.accelerator.synchronize(device)
        return run

    if not exported:
        plans = make(**probe)
        plans.preload([largest], example_inputs, progress=False)
        return measured_cost(timer(plans), traffic, progress=progress), None, None
    ranged = make(buckets=[[n] for n in largest], plan_shapes="dynamic", **probe)
    ranged.preload([largest], example_inputs, progress=False)
    dynamic = measured_cost(timer(ranged), traffic, progress=progress)
    script = None
    if ranged._scripted_module(required=False) is not None:  # the dynamic probe itself has no script plans
        scripted = make(buckets=[[n] for n in largest], plan_shapes="script", **probe)
        scripted.preload([largest], example_inputs, progress=False)
        script = measured_cost(timer(scripted), traffic, progress=progress)
    ends = [smallest, largest] if smallest != largest else [largest]
    fixed = make(buckets=[sorted({a, b}) for a, b in zip(smallest, largest)], plan_shapes="static", **probe)
    fixed.preload(ends, example_inputs, progress=False)
    ratios = [_fastest(timer(fixed), at, 3) / _fastest(timer(ranged), at, 3) for at in ends]
    volumes = np.log([float(np.prod(at)) for at in ends])

    def static(points: np.ndarray) -> np.ndarray:  # one end: np.interp gives its ratio everywhere
        points = np.asarray(points).reshape(-1, sizes.shape[1])
        return np.interp(np.log(np.prod(points, axis=1).astype(np.float64)), volumes, ratios) * dynamic(points)

    return static, dynamic, script


def _interpolated(axes: list, seconds: np.ndarray) -> CostFn:
    def cost(points: np.ndarray) -> np.ndarray:
        points = np.asarray(points, dtype=np.float64).reshape(-1, len(axes))
        lower, weight = [], []
        for d, axis in enumerate(axes):
            x = np.clip(points[:, d], axis[0], axis[-1])
            i = np.clip(np.searchsorted(axis, x, side="right") - 1, 0, max(axis.size - 2, 0))
            span = (axis[np.minimum(i + 1, axis.size - 1)] - axis[i]).astype(np.float64)
            lower.append(i)
            weight.append(np.where(span > 0, (x - axis[i]) / np.where(span > 0, span, 1), 0.0))
        out = np.zeros(points.shape[0])
        for corner in itertools.product((0, 1), repeat=len(axes)):
            w = np.ones(points.shape[0])
            index = []
            for d, up in enumerate(corner):
                w = w * (weight[d] if up else 1 - weight[d])
                index.append(np.minimum(lower[d] + up, axes[d].size - 1))
            out += w * seconds[tuple(index)]
        return out

    return cost
