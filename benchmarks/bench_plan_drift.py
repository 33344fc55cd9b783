"""bench_plan.py's drift section: a PlanCache whose traffic moves after it was planned (CPU, one
torch thread).

The CNN of bench_plan.py and the demo EncoderClassifier (2 layers, d=64, sequence 16), scripted.
Each, planned by PlanCache.from_traffic (a budget of 2 plans) on
500 requests of small batches (log-normal, at most 4), it then serves 2000 requests whose batch
sizes moved to 9..16 (uniform), one after another from one thread, three ways (each variant's
cache made afresh, miss_mode='pad'):
  (a) as planned: the buckets chosen for the small batches (a larger request is split onto them)
  (b) re-planned: the same cache, replan(2, background=True) called after the first 200 drifted
      requests; serving goes on while the re-plan measures and builds on the cache's thread
  (c) planned knowing the drift: from_traffic on the drifted requests themselves
Throughput over the drifted requests (items/s), each request's latency (p50, p99, the worst), and
for (b) the requests served while the re-plan ran and how long it took. ROUNDS rounds, the
variants' order rotated each round; the table shows each variant's median round.

    python benchmarks/bench_plan.py --drift           # results in plan_drift.{md,json}
    python benchmarks/bench_plan.py --drift --quick   # fewer requests and rounds: a smoke run
"""
from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_plan_batcher import percentile  # noqa: E402
from harness import Report, format_seconds  # noqa: E402

PLAN_BUDGET = 2
REPLAN_AFTER = 200
VARIANTS = ["(a) as planned", "(b) re-planned in the background", "(c) planned knowing the drift"]


def planned(rng: random.Random, count: int) -> list:
    return [min(4, max(1, int(rng.lognormvariate(0.3, 0.7)))) for _ in range(count)]


def drifted(rng: random.Random, count: int) -> list:
    return [rng.randint(9, 16) for _ in range(count)]


def serve(variant: str, scripted, before: list, after: list, inputs: dict) -> dict:
    from torch_ext import PlanCache
    example = (inputs[2],)
    start = time.perf_counter()
    cache = PlanCache.from_traffic(scripted, after if variant.startswith("(c)") else before, PLAN_BUDGET, example,
                                   miss_mode="pad", progress=False)
    setup = time.perf_counter() - start
    first_buckets = cache.buckets
    latencies, future, during, replan_seconds = [], None, 0, None
    with torch.no_grad():
        for n in before[:50]:  # warm-up at the planned sizes, logged as served traffic too
            cache(inputs[n])
        start = time.perf_counter()
        for i, n in enumerate(after):
            if variant.startswith("(b)") and i == REPLAN_AFTER:
                replan_start = time.perf_counter()
                future = cache.replan(PLAN_BUDGET, background=True)
            t = time.perf_counter()
            cache(inputs[n])
            latencies.append(time.perf_counter() - t)
            if future is not None and replan_seconds is None:
                during += 1
                if future.done():
                    replan_seconds = time.perf_counter() - replan_start
        wall = time.perf_counter() - start
    if future is not None:
        future.result()
        if replan_seconds is None:
            replan_seconds = time.perf_counter() - replan_start
    return dict(variant=variant, wall=wall, items=sum(after), latencies=latencies, setup=setup,
                buckets=cache.buckets, first_buckets=first_buckets, during=during, replan_seconds=replan_seconds)


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
                    f"A PlanCache whose traffic drifts (CPU, one torch thread): planned on 500 batches of at most 4 "
                    f"rows, then {count} requests of 9..16 rows, {rounds} rounds",
                    ["model", "variant", "buckets while serving the drift", "items/s", "vs (a)", "p50", "p99", "worst",
                     "re-plan"], command)
    for name, (make, row) in MODELS.items():
        print(name, file=sys.stderr)
        torch.manual_seed(0)
        scripted = torch.jit.script(make().eval())
        rng = random.Random(1)
        before, after = planned(rng, 500), drifted(rng, count)
        g = torch.Generator().manual_seed(2)
        inputs = {n: torch.randn(n, *row, generator=g) for n in range(1, 17)}
        runs: dict = {v: [] for v in VARIANTS}
        for r in range(rounds):
            for variant in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                print(f"round {r + 1}/{rounds}: {variant}", file=sys.stderr)
                runs[variant].append(serve(variant, scripted, before, after, inputs))
        median = {v: sorted(runs[v], key=lambda x: x["items"] / x["wall"])[len(runs[v]) // 2] for v in VARIANTS}
        base = median[VARIANTS[0]]["items"] / median[VARIANTS[0]]["wall"]
        for v in VARIANTS:
            m = median[v]
            rate = m["items"] / m["wall"]
            replan = (f"{format_seconds(m['replan_seconds'])}, {m['during']} requests served meanwhile"
                      if m["replan_seconds"] is not None else "-")
            buckets = (f"{m['first_buckets']}, then " if m["buckets"] != m["first_buckets"] else "") + str(m["buckets"])
            report.add_row({"model": name, "variant": v, "buckets while serving the drift": buckets,
                            "items/s": f"{rate:,.0f}", "vs (a)": f"{rate / base:.2f}x",
                            "p50": format_seconds(percentile(m["latencies"], 0.5)),
                            "p99": format_seconds(percentile(m["latencies"], 0.99)),
                            "worst": format_seconds(max(m["latencies"])), "re-plan": replan},
                           model=name, variant=v, throughput=rate, rounds=[x["items"] / x["wall"] for x in runs[v]],
                           replan_seconds=m["replan_seconds"], served_during_replan=m["during"])
        b, c = (median[v]["items"] / median[v]["wall"] for v in VARIANTS[1:])
        report.notes.append(
            f"- {name}: throughput per round: " + "; ".join(
                f"{v.split(')')[0]}) " + ", ".join(f"{x['items'] / x['wall']:,.0f}" for x in runs[v]) for v in VARIANTS)
            + f". (b) reached {b / c:.2f}x of (c), which knew the drift before it served.")
    report.notes.insert(0, (
        f"\n(b) re-plans after {REPLAN_AFTER} of the drifted requests, on its whole log (the 500 planned requests, "
        f"the 50 warm-up ones and those {REPLAN_AFTER}), with the costs from_traffic measured where the drifted sizes "
        "lie within them and measured again past them; its row includes the requests served before the swap. A "
        "request no plan's bucket holds is split onto the largest plan (miss_mode='pad'): (a) serves a request of 12 "
        "as three calls of 4.\n"))
    report.write()


if __name__ == "__main__":
    main(sys.argv[1:])
