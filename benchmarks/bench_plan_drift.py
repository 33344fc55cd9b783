"""bench_plan.py's drift section: a PlanCache whose traffic moves after it was planned (CPU, one
torch thread).

The CNN of bench_plan.py and the demo EncoderClassifier (2 layers, d=64, sequence 16), scripted.
Each is planned by PlanCache.from_traffic (a budget of 2 plans) on 500 requests of one kind and
then serves 2000 of another, one after another from one thread; two drifts:
  down  planned on batches of 9..16 rows (uniform), then serving batches of 1..4 (log-normal)
  up    planned on batches of 1..4, then serving batches of 9..16
three ways each (each variant's cache made afresh, miss_mode='pad'):
  (a) as planned: the buckets chosen before the drift (a request past every bucket is padded onto
      a plan that holds it, or its own plan is built: miss_mode='pad')
  (b) re-planned: the same cache, replan(2, background=True) called after the first 200 drifted
      requests; serving goes on while the re-plan measures and builds on the cache's thread
  (c) planned knowing the drift: from_traffic on the drifted requests themselves
  (d) re-planned on its own: replan_on_drift(2, every=200) set after the warm-up; its first check,
      after 200 drifted requests, re-plans on them when the plans it has predict slower than the
      best choice for them
Throughput over the drifted requests (items/s), each request's latency (p50, p99, the worst), and
for (b) the requests served while the re-plan ran and how long it took. ROUNDS rounds, the
variants' order rotated each round; the table shows each variant's median round.

    python benchmarks/bench_plan.py --drift           # results in plan_drift.{md,json}
    python benchmarks/bench_plan.py --drift --quick   # fewer requests and rounds: a smoke run
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_plan_batcher import percentile  # noqa: E402
from harness import Report, format_seconds  # noqa: E402

PLAN_BUDGET = 2
REPLAN_AFTER = 200
VARIANTS = ["(a) as planned", "(b) re-planned in the background", "(c) planned knowing the drift",
            "(d) re-planned on its own (replan_on_drift)"]


def small(rng: random.Random, count: int) -> list:
    return [min(4, max(1, int(rng.lognormvariate(0.3, 0.7)))) for _ in range(count)]


def large(rng: random.Random, count: int) -> list:
    return [rng.randint(9, 16) for _ in range(count)]


DRIFTS = {"down: 9..16 rows, then 1..4": (large, small), "up: 1..4 rows, then 9..16": (small, large)}


def serve(variant: str, scripted, before: list, after: list, inputs: dict) -> dict:
    from torch_ext import PlanCache
    example = (inputs[2],)
    start = time.perf_counter()
    cache = PlanCache.from_traffic(scripted, after if variant.startswith("(c)") else before, PLAN_BUDGET, example,
                                   miss_mode="pad", progress=False)
    setup = time.perf_counter() - start
    first_buckets = cache.buckets
    latencies, future, during, replan_start, replan_seconds = [], None, 0, None, None
    with torch.no_grad():
        for n in before[:50]:  # warm-up at the planned sizes, logged as served traffic too
            cache(inputs[n])
        if variant.startswith("(d)"):
            cache.replan_on_drift(PLAN_BUDGET, every=REPLAN_AFTER)
        plans = cache.script_object
        start = time.perf_counter()
        for i, n in enumerate(after):
            if variant.startswith(("(b)", "(d)")) and i == REPLAN_AFTER:
                replan_start = time.perf_counter()
                if variant.startswith("(b)"):
                    future = cache.replan(PLAN_BUDGET, background=True)
            t = time.perf_counter()
            cache(inputs[n])
            latencies.append(time.perf_counter() - t)
            if replan_start is not None and replan_seconds is None:
                during += 1
                if (future.done() if future is not None else cache.script_object is not plans):
                    replan_seconds = time.perf_counter() - replan_start
        wall = time.perf_counter() - start
    if variant.startswith("(d)"):
        cache.wait_for_replans()
    elif future is not None:
        future.result()
    if replan_start is not None and replan_seconds is None:
        replan_seconds = time.perf_counter() - replan_start
        if cache.script_object is plans:
            replan_seconds = None  # (d) found nothing to re-plan
    return dict(variant=variant, wall=wall, items=sum(after), latencies=latencies, setup=setup,
                buckets=cache.buckets, first_buckets=first_buckets, during=during,
                plans=[b[0] for b in cache.cached_buckets()], replan_seconds=replan_seconds)


MODELS = {
    "CNN (2 conv, 3x16x16)": (lambda: __import__("bench_plan").CNN(), (3, 16, 16)),
    "EncoderClassifier (demo, 2 layers, d=64, seq 16)": (
        lambda: __import__("torch_ext.demos", fromlist=["EncoderClassifier"]).EncoderClassifier(), (16, 64)),
}


def main(argv: list) -> None:
    torch.set_num_threads(1)
    quick = "--quick" in argv
    count, rounds = (500, 1) if quick else (2000, 3)
    command = "python benchmarks/bench_plan.py --drift" + (" --quick" if quick else "")
    report = Report("plan_drift" + ("_quick" if quick else ""),
                    f"A PlanCache whose traffic drifts (CPU, one torch thread): planned on 500 requests, then serving "
                    f"{count} of other batch sizes, {rounds} rounds",
                    ["model", "drift", "variant", "buckets while serving the drift", "plans at the end", "items/s",
                     "vs (a)", "p50", "p99", "worst", "re-plan"], command)
    for name, (make, row) in MODELS.items():
        torch.manual_seed(0)
        scripted = torch.jit.script(make().eval())
        g = torch.Generator().manual_seed(2)
        inputs = {n: torch.randn(n, *row, generator=g) for n in range(1, 17)}
        for drift, (first, then) in DRIFTS.items():
            print(name, drift, file=sys.stderr)
            rng = random.Random(1)
            before, after = first(rng, 500), then(rng, count)
            runs: dict = {v: [] for v in VARIANTS}
            for r in range(rounds):
                for variant in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
                    runs[variant].append(serve(variant, scripted, before, after, inputs))
            median = {v: sorted(runs[v], key=lambda x: x["items"] / x["wall"])[len(runs[v]) // 2] for v in VARIANTS}
            base = median[VARIANTS[0]]["items"] / median[VARIANTS[0]]["wall"]
            for v in VARIANTS:
                m = median[v]
                rate = m["items"] / m["wall"]
                replan = (f"{format_seconds(m['replan_seconds'])}, {m['during']} requests served meanwhile"
                          if m["replan_seconds"] is not None else "-")
                buckets = (f"{m['first_buckets']}, then " if m["buckets"] != m["first_buckets"] else "") + str(m["buckets"])
                report.add_row({"model": name, "drift": drift.split(":")[0], "variant": v,
                                "buckets while serving the drift": buckets,
                                "plans at the end": ", ".join(map(str, m["plans"])), "items/s": f"{rate:,.0f}",
                                "vs (a)": f"{rate / base:.2f}x", "p50": format_seconds(percentile(m["latencies"], 0.5)),
                                "p99": format_seconds(percentile(m["latencies"], 0.99)),
                                "worst": format_seconds(max(m["latencies"])), "re-plan": replan},
                               model=name, drift=drift, variant=v, throughput=rate,
                               rounds=[x["items"] / x["wall"] for x in runs[v]],
                               replan_seconds=m["replan_seconds"], served_during_replan=m["during"])
            b, c, d = (median[v]["items"] / median[v]["wall"] for v in VARIANTS[1:])
            report.notes.append(
                f"- {name}, {drift}: throughput per round: " + "; ".join(
                    f"{v.split(')')[0]}) " + ", ".join(f"{x['items'] / x['wall']:,.0f}" for x in runs[v])
                    for v in VARIANTS) + f". (b) reached {b / c:.2f}x and (d) {d / c:.2f}x of (c), which knew the drift before "
                f"it served.")
    report.notes.insert(0, (
        f"\n(b) re-plans after {REPLAN_AFTER} of the drifted requests, on its whole log (the 500 planned requests, "
        f"the 50 warm-up ones and those {REPLAN_AFTER}), with the costs from_traffic measured where the drifted sizes "
        "lie within them and measured again past them; its row includes the requests served before the swap. (d) "
        f"checks the {REPLAN_AFTER} drifted requests alone (its window) and re-plans on them where the plans it has "
        "predict more than 1.1x the best choice's time for them, or hold no bucket for some. A "
        "request inside a bucket is padded to the bucket's bound; one past every bucket is padded onto a cached plan "
        "that holds it, and where none does its own plan is built (miss_mode='pad'), a plan the budget of "
        f"{PLAN_BUDGET} does not count: 'plans at the end' lists the batch sizes of the plans each cache held.\n"))
    report.write()


if __name__ == "__main__":
    main(sys.argv[1:])
