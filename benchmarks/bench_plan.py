"""PlanCache on a stream of random batch sizes: a scripted CNN and a scripted transformer encoder.

Variants, each served the same stream of requests (batch sizes drawn uniformly from 1..64):
  (a) the scripted module as is
  (b) torch.jit.freeze + torch.jit.optimize_for_inference of it (one generic module)
  (c) PlanCache, miss_mode="exact", cold (a new size builds its plan in the request)
  (d) PlanCache, exact, after preload(1..64)
  (d') (d)'s plans called directly, without the cache: the spikes this machine adds on its own
  (e) PlanCache, miss_mode="pad", background builds, after preload of buckets 1.5x apart (1,2,3,4,6,..,48,64)
With --device cuda (models and inputs on the GPU, every request synchronised), two more:
  (f) PlanCache exact + CUDA graphs, after preload(1..64)
  (g) PlanCache pad + background builds + CUDA graphs, after preload of the buckets
  (h) PlanCache.from_traffic + CUDA graphs: buckets learned from a recorded stream of the same
      distribution (another seed), at most 8 plans, misses padded, one graph per learned bucket
Each variant serves the whole stream in its own phase (a background build of (e) would otherwise
slow the others' requests), in four passes over the variants: forward, reversed, rotated by half,
and that reversed, so every variant's phases sit at the same mean position in time. A second
table measures what each step of a plan buys, interleaved, at fixed sizes, and the cost of a
hit's lookup.

    python benchmarks/bench_plan.py                  # 2000 requests per variant and model, CPU
    python benchmarks/bench_plan.py --quick          # 300 requests, a smoke run
    python benchmarks/bench_plan.py --device cuda    # on a GPU: results in plan_cuda{,_steps}.{md,json}
    python benchmarks/bench_plan.py --export         # torch.export programs: see bench_plan_export.py
    python benchmarks/bench_plan.py --batcher        # the batcher against pre-formed batches: bench_plan_batcher.py
    python benchmarks/bench_plan.py --traffic        # plans chosen from traffic: bench_plan_traffic.py
    python benchmarks/bench_plan.py --drift          # a cache re-planned when its traffic drifts: bench_plan_drift.py
"""
from __future__ import annotations

import argparse
import gc
import io
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Report, format_bytes, format_seconds, measure_interleaved, peak_memory  # noqa: E402
from torch_ext import PlanCache  # noqa: E402
from torch_ext.demos import EncoderClassifier  # noqa: E402

MAX_BATCH = 64
# A padded request costs about what its bucket's size costs: buckets at most 1.5x apart keep that
# under 1.5x its own size's latency (powers of two let it reach 2x).
BUCKETS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
LEARNED_PLANS = 8  # (h)'s plan budget


class CNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(16)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(32)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


MODELS = {
    "CNN (2 conv, 3x16x16)": (CNN, lambda n: torch.randn(n, 3, 16, 16)),
    "Transformer encoder (2 layers, d=64, seq 16)": (EncoderClassifier, lambda n: torch.randn(n, 16, 64)),
}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def spike_indices(latencies: list[float], stream: list[int], skip_first_per_size: bool,
                  starts: Optional[list[int]] = None) -> tuple[list[int], float]:
    """Requests slower than twice their size's median (and the worst ratio). latencies holds one
    or more passes over stream, back to back; medians are over all of them, a size's first call is
    its first in each pass, and starts[p] skips pass p's requests before that index."""
    by_size: dict[int, list[float]] = {}
    for index, t in enumerate(latencies):
        by_size.setdefault(stream[index % len(stream)], []).append(t)
    medians = {n: statistics.median(v) for n, v in by_size.items()}
    indices, worst = [], 0.0
    for p in range(len(latencies) // len(stream)):
        seen: set[int] = set()
        for i, n in enumerate(stream):
            first = n not in seen
            seen.add(n)
            if (first and skip_first_per_size) or (starts is not None and i < starts[p]):
                continue
            ratio = latencies[p * len(stream) + i] / medians[n]
            worst = max(worst, ratio)
            if ratio > 2.0:
                indices.append(p * len(stream) + i)
    return indices, worst


def spikes(latencies: list[float], stream: list[int], skip_first_per_size: bool,
           starts: Optional[list[int]] = None) -> tuple[int, float]:
    indices, worst = spike_indices(latencies, stream, skip_first_per_size, starts)
    return len(indices), worst


def spike_causes(indices: list[int], switches: list[tuple[int, int]]) -> str:
    """What the request thread did during each spike, from its context switches: blocked (it
    waited: a lock, the GIL, I/O), preempted (only involuntary switches: other work took its
    core), or on CPU (no switch: it ran the whole time, slowed by its own work or the machine)."""
    blocked = sum(1 for i in indices if switches[i][0] > 0)
    preempted = sum(1 for i in indices if switches[i][0] == 0 and switches[i][1] > 0)
    return f"{blocked} / {preempted} / {len(indices) - blocked - preempted}"


def first_calls(latencies: list[float], stream: list[int]) -> list[float]:
    """Each size's first call in each pass over stream."""
    out = []
    for p in range(len(latencies) // len(stream)):
        seen: set[int] = set()
        for n, t in zip(stream, latencies[p * len(stream):]):
            if n not in seen:
                seen.add(n)
                out.append(t)
    return out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_model(name, make, make_input, stream, report, steps_report, lookup_rows, quick, device):
    torch.manual_seed(0)
    scripted = torch.jit.script(make().to(device).eval())
    inputs = {n: make_input(n).to(device) for n in range(1, MAX_BATCH + 1)}
    cuda = device.type == "cuda"
    variants = {}
    startup = {}

    # (a) is loaded afresh for each phase: a cold executor, as a restarted server has.
    saved = io.BytesIO()
    torch.jit.save(scripted, saved)
    variants["(a) scripted as is"] = lambda: (torch.jit.load(io.BytesIO(saved.getvalue()), map_location=device), None)

    def frozen():
        return torch.jit.optimize_for_inference(torch.jit.freeze(scripted)), None

    variants["(b) freeze + optimize_for_inference"] = frozen

    def cold_exact():
        cache = PlanCache(scripted)
        return cache.infer, cache

    variants["(c) PlanCache exact"] = cold_exact

    def preloaded():
        cache = PlanCache(scripted)
        cache.preload(range(1, MAX_BATCH + 1), example_inputs=(inputs[1],), progress=not quick)
        return cache.infer, cache

    variants["(d) PlanCache exact + preload 1..64"] = preloaded

    def plans_directly():
        cache = PlanCache(scripted)
        cache.preload(range(1, MAX_BATCH + 1), example_inputs=(inputs[1],), progress=not quick)
        plans = {n: cache.plan_module(n) for n in range(1, MAX_BATCH + 1)}
        with torch.no_grad():
            for n, plan in plans.items():  # a Python wrapper's first call sets it up
                plan(inputs[n])
        return (lambda x: plans[x.shape[0]](x)), None

    variants["(d') (d)'s plans called directly, no cache"] = plans_directly

    def background_pad():
        cache = PlanCache(scripted, miss_mode="pad", background_builds=True)
        cache.preload(BUCKETS, example_inputs=(inputs[1],), progress=not quick)
        return cache.infer, cache

    variants["(e) PlanCache pad + background builds"] = background_pad

    if cuda:
        def graphs_preloaded():
            cache = PlanCache(scripted, cuda_graphs=True)
            cache.preload(range(1, MAX_BATCH + 1), example_inputs=(inputs[1],), progress=not quick)
            return cache.infer, cache

        variants["(f) PlanCache exact + CUDA graphs + preload 1..64"] = graphs_preloaded

        def graphs_background_pad():
            cache = PlanCache(scripted, miss_mode="pad", background_builds=True, cuda_graphs=True)
            cache.preload(BUCKETS, example_inputs=(inputs[1],), progress=not quick)
            return cache.infer, cache

        variants["(g) PlanCache pad + background builds + CUDA graphs"] = graphs_background_pad

        recorded = random.Random(1)
        recorded_stream = [recorded.randint(1, MAX_BATCH) for _ in range(len(stream))]

        def graphs_from_traffic():
            cache = PlanCache.from_traffic(scripted, recorded_stream, LEARNED_PLANS, (inputs[1],), miss_mode="pad",
                                           cuda_graphs=True, progress=not quick)
            return cache.infer, cache

        variants[f"(h) PlanCache.from_traffic, {LEARNED_PLANS} plans + CUDA graphs"] = graphs_from_traffic

    # Each variant in its own phase: start-up (preloads), the whole stream, then one request at
    # every size for the peak memory. Phases keep one variant's builds (the cold cache's in its
    # requests, (e)'s on a background thread) and its memory churn out of the others' latencies.
    # Four passes over the variants (forward, reversed, rotated by half, that reversed), each
    # phase set up afresh: a machine that drifts (this shared VM does, by 10% within a minute)
    # then weighs on every variant alike rather than on those that run in its slow stretch.
    results = {}
    forward = list(variants)
    rotated = forward[len(forward) // 2:] + forward[:len(forward) // 2]
    for order in (forward, forward[::-1], rotated, rotated[::-1]):
        for label in order:
            gc.collect()
            synchronize(device)
            t = time.perf_counter()
            fn, cache = variants[label]()
            synchronize(device)
            startup.setdefault(label, []).append(time.perf_counter() - t)
            print(f"  {label}: start-up {startup[label][-1]:.2f} s", file=sys.stderr)
            latencies, switches = [], []  # switches: the request thread's (voluntary, involuntary) context switches
            done = None  # the request by which its background builds were done
            phase_start = time.perf_counter()
            with torch.no_grad():
                iterator = stream
                if not quick:
                    from tqdm import tqdm
                    iterator = tqdm(stream, desc="    stream", file=sys.stderr, leave=False, mininterval=5)
                for index, n in enumerate(iterator):
                    before = resource.getrusage(resource.RUSAGE_THREAD)
                    t = time.perf_counter()
                    fn(inputs[n])
                    synchronize(device)
                    latencies.append(time.perf_counter() - t)
                    after = resource.getrusage(resource.RUSAGE_THREAD)
                    switches.append((after.ru_nvcsw - before.ru_nvcsw, after.ru_nivcsw - before.ru_nivcsw))
                    if "background" in label and done is None and cache.stats().pending_builds == 0 \
                            and len(cache.cached_sizes()) == len(set(stream[:index + 1]) | set(BUCKETS)):
                        done = index
            print(f"    stream: {time.perf_counter() - phase_start:.1f} s", file=sys.stderr)
            if cache:
                cache.wait_for_builds()
            # Peak memory of one request at each size, on top of what the variant holds.
            peak = peak_memory(lambda: [fn(inputs[n]) for n in range(1, MAX_BATCH + 1)], device)
            r = results.setdefault(label, dict(latencies=[], switches=[], pass_totals=[], peak=0, stats=None, done=[]))
            r["latencies"] += latencies
            r["switches"] += switches
            r["pass_totals"].append(sum(latencies))
            r["peak"] = max(r["peak"], peak)
            r["stats"] = cache.stats().as_dict() if cache else None
            r["done"].append(done)
            del fn, cache
    report.data.setdefault("background_builds_done_at_request", {})[name] = {
        label: r["done"] for label, r in results.items() if "background" in label}
    for label, r in results.items():
        if "background" not in label:
            continue
        if None in r["done"]:
            report.notes.append(f"\n{name}, {label[:3]}: its background builds were still running when the stream "
                                f"ended in {r['done'].count(None)} of its passes (misses padded to a bucket meanwhile).")
            continue
        during, _ = spikes(r["latencies"], stream, skip_first_per_size=False)
        after, after_worst = spikes(r["latencies"], stream, skip_first_per_size=False,
                                    starts=[done + 1 for done in r["done"]])
        report.notes.append(f"\n{name}, {label[:3]}: its background builds ran until request "
                            f"{', '.join(str(done) for done in r['done'])} in its {len(r['done'])} passes; {during - after} of "
                            f"its {during} requests over twice their size's median came before then (padded while "
                            f"the exact plan built on another core), {after} after (worst {after_worst:.1f}x).")
        report.data.setdefault("background_spikes", {}).setdefault(name, {})[label] = dict(
            done_at=r["done"], total=during, after=after, worst_after=after_worst)

    def throughput_of(label):
        return len(results[label]["done"]) * sum(stream) / sum(results[label]["pass_totals"])

    best_ab = max(throughput_of(k) for k in list(variants)[:2])
    # Each pass on its own: how far this machine moves the ratios between passes.
    per_pass = {label: [min(results[k]["pass_totals"][p] for k in list(variants)[:2]) / total
                        for p, total in enumerate(r["pass_totals"])]
                for label, r in results.items() if label[:3] in ("(d)", "(e)", "(f)", "(g)", "(h)")}
    report.notes.append(f"\n{name}, throughput over the best of (a),(b) in each pass: " + "; ".join(
        f"{label[:3]} {', '.join(f'{ratio:.2f}x' for ratio in ratios)}" for label, ratios in per_pass.items()) + ".")
    report.data.setdefault("throughput_vs_best_ab_per_pass", {})[name] = per_pass
    for label, r in results.items():
        latencies, switches, peak, stats = r["latencies"], r["switches"], r["peak"], r["stats"]
        firsts = first_calls(latencies, stream)
        after_startup = label[:3] in ("(d)", "(e)", "(f)", "(g)", "(h)")
        spiked, worst = spike_indices(latencies, stream, skip_first_per_size=False)
        spike_count, causes = len(spiked), spike_causes(spiked, switches)
        later_count, later_worst = spikes(latencies, stream, skip_first_per_size=True)
        throughput = throughput_of(label)
        plan_bytes = stats["plan_bytes"] if stats else 0
        start_up = statistics.mean(startup[label])
        report.add_row({
            "model": name, "variant": label,
            "startup": format_seconds(start_up),
            "throughput (items/s)": f"{throughput:,.0f}",
            "vs best of (a),(b)": f"{throughput / best_ab:.2f}x",
            "p50": format_seconds(percentile(latencies, 0.5)),
            "p99": format_seconds(percentile(latencies, 0.99)),
            "max": format_seconds(max(latencies)),
            "first call at a new size (median / max)": f"{format_seconds(statistics.median(firsts))} / {format_seconds(max(firsts))}",
            "requests > 2x their size's median": f"{spike_count} (worst {worst:.1f}x)",
            "same, after each size's first call": f"{later_count} (worst {later_worst:.1f}x)",
            "spikes: blocked / preempted / on CPU": causes,
            "peak memory / plans": f"{format_bytes(peak)} / {format_bytes(plan_bytes)}",
        }, model=name, variant=label, startup_seconds=startup[label], throughput=throughput, total_seconds=sum(r["pass_totals"]),
            p50_seconds=percentile(latencies, 0.5), p99_seconds=percentile(latencies, 0.99), max_seconds=max(latencies),
            first_call_median_seconds=statistics.median(firsts), first_call_max_seconds=max(firsts),
            spikes_over_2x_median=spike_count, worst_ratio_to_median=worst,
            spike_causes=causes, spikes_after_first_call=later_count, worst_ratio_after_first_call=later_worst, peak_bytes=peak, plan_bytes=plan_bytes,
            after_startup_target=after_startup,
            stats={k: v for k, v in stats.items() if k != "sizes"} if stats else None)

    # The variants the throughput target names, serving the stream once more, request by request
    # in a shuffled order (a rotation would always run one variant right after the same other
    # one), so that the machine's drift cancels out of their ratios (phases cannot do that).
    # (e)'s background builds then overlap the others' requests as well as its own.
    rotation = [label for label in variants if label[:3] in ("(a)", "(b)", "(d)", "(e)")]
    served = {label: variants[label]()[0] for label in rotation}  # a bound infer keeps its cache alive
    times = {label: [] for label in rotation}
    order_rng = random.Random(1)
    gc.collect()
    with torch.no_grad():
        for n in stream:
            for label in order_rng.sample(rotation, len(rotation)):
                t = time.perf_counter()
                served[label](inputs[n])
                synchronize(device)
                times[label].append(time.perf_counter() - t)
    del served
    blocks = 10
    size = len(stream) // blocks

    def ratio(label, lo=0, hi=len(stream)):  # throughput over the best of (a),(b) on requests lo..hi
        return min(sum(times[k][lo:hi]) for k in rotation[:2]) / sum(times[label][lo:hi])

    interleaved = {label: dict(ratio=ratio(label), blocks=[ratio(label, b * size, (b + 1) * size) for b in range(blocks)])
                   for label in rotation[2:]}
    report.notes.append(f"\n{name}, the stream served once more by {', '.join(k[:3] for k in rotation)}, request by "
                        f"request in a shuffled order: throughput over the best of (a),(b): " + "; ".join(
                            f"{label[:3]} {r['ratio']:.2f}x (in {blocks} blocks of {size} requests: median "
                            f"{statistics.median(r['blocks']):.2f}x, {min(r['blocks']):.2f}x to {max(r['blocks']):.2f}x)"
                            for label, r in interleaved.items()) + ".")
    report.data.setdefault("interleaved_throughput_vs_best_ab", {})[name] = interleaved

    # What each step of a plan buys, at fixed sizes, interleaved; the build cost of each.
    sizes = [1, 8, 32, 64] if not quick else [1, 32]
    # By default (specialize_shapes unset) a PlanCache makes each plan a clone specialised to its
    # size only where TorchScript fuses on the device; elsewhere the plans share one module.
    steps = {
        "freeze only, one module for every size": dict(optimize_for_inference=False, specialize_shapes=False),
        "freeze + optimize_for_inference, one module for every size": dict(specialize_shapes=False),
        "freeze + optimize_for_inference, a clone per size specialised to it": dict(specialize_shapes=True),
    }
    if cuda:  # the static runtime runs CPU modules only
        steps["freeze + optimize_for_inference + CUDA graph"] = dict(cuda_graphs=True)
    else:
        steps["freeze + static runtime"] = dict(static_runtime=True)
    caches = {}
    build = {}
    for label, opts in steps.items():
        # Untimed calls at other sizes go to the source module: those sizes are never admitted.
        cache = PlanCache(scripted, admit_after=2**62, **opts)
        try:
            cache.preload(sizes, example_inputs=(inputs[1],), progress=False)
        except RuntimeError as error:
            reason = str(error).split("\n")[0]
            steps_report.notes.append(f"\n{name}, {label}: not supported by this module ({reason[:160]}).")
            continue
        caches[label] = cache
        build[label] = statistics.median(z.build_seconds for z in cache.stats().sizes if z.builds)
    generic = torch.jit.optimize_for_inference(torch.jit.freeze(scripted))
    graph_bytes = {label: sum(z.graph_bytes for z in cache.stats().sizes)
                   for label, cache in caches.items() if cache.stats().cuda_graphs}
    for label, nbytes in graph_bytes.items():
        steps_report.notes.append(f"\n{name}, {label}: {len(sizes)} graphs hold {format_bytes(nbytes)} of GPU memory "
                                  "(private pools and static inputs).")
    # Before each timed call at n, an untimed call at another size: the generic modules see the
    # sizes alternate as a server does; each plan sees only its own size.
    others = iter([m for m in range(1, MAX_BATCH + 1)] * 10_000)
    with torch.no_grad():
        timings = {}
        for n in sizes:
            def other(fn, n=n):
                m = next(others)
                fn(inputs[m if m != n else (m % MAX_BATCH) + 1])

            fns = {"(a) scripted, sizes alternating": lambda n=n: scripted(inputs[n]),
                   "(b) generic frozen, sizes alternating": lambda n=n: generic(inputs[n])}
            before = {"(a) scripted, sizes alternating": lambda: other(scripted),
                      "(b) generic frozen, sizes alternating": lambda: other(generic)}
            for label, cache in caches.items():
                fns[f"plan: {label}"] = lambda cache=cache, n=n: cache.infer(inputs[n])
                before[f"plan: {label}"] = lambda cache=cache: other(cache.infer)
            timings[n] = measure_interleaved(fns, warmup=2, repeat=5 if quick else 30, before_each=before,
                                             alternate=True)
    for label in timings[sizes[0]]:
        cells = {"model": name, "variant": label,
                 "build per size": format_seconds(build[label[6:]]) if label.startswith("plan: ") else "-"}
        for n in sizes:
            cells[f"n={n}"] = format_seconds(timings[n][label].median_seconds)
        steps_report.add_row(cells, model=name, variant=label,
                             **{f"n{n}_seconds": timings[n][label].median_seconds for n in sizes})

    # A hit's lookup: the C++ clock around it, and infer() against the plan module called directly.
    cache = caches["freeze + optimize_for_inference, one module for every size"]
    cache.reset_stats()
    plan = cache.plan_module(1)
    with torch.no_grad():
        t = measure_interleaved({"infer": lambda: cache.infer(inputs[1]), "plan module": lambda: plan(inputs[1])},
                                warmup=20, repeat=200 if not quick else 50)
    s = cache.stats()
    lookup_rows.append((name, s.hit_lookup_seconds / s.hits, t["infer"].median_seconds - t["plan module"].median_seconds,
                        t["infer"].median_seconds, t["plan module"].median_seconds))


def main() -> None:
    if "--batcher" in sys.argv[1:]:
        import bench_plan_batcher
        bench_plan_batcher.main([arg for arg in sys.argv[1:] if arg != "--batcher"])
        return
    if "--drift" in sys.argv[1:]:
        import bench_plan_drift
        bench_plan_drift.main([arg for arg in sys.argv[1:] if arg != "--drift"])
        return
    if "--traffic" in sys.argv[1:]:
        import bench_plan_traffic
        bench_plan_traffic.main([arg for arg in sys.argv[1:] if arg != "--traffic"])
        return
    if "--export" in sys.argv[1:]:
        import os
        import tempfile
        # Cold compiles: Inductor's caches start empty (this process and the compile workers it starts).
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench_plan_inductor_"))
        import bench_plan_export
        torch.set_num_threads(1)
        bench_plan_export.main([arg for arg in sys.argv[1:] if arg != "--export"])
        return
    # One intra-op thread: on this shared, oversubscribed 2-core machine a second OpenMP thread
    # stalls at every barrier whenever it is descheduled (80 ms outliers), which would bury
    # the differences measured here. Every variant runs under the same setting.
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="300 requests per variant: a smoke run")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    requests = args.requests or (300 if args.quick else 2000)
    rng = random.Random(0)
    stream = [rng.randint(1, MAX_BATCH) for _ in range(requests)]
    command = "python benchmarks/bench_plan.py" + (" --quick" if args.quick else "") + (
        f" --device {args.device}" if device.type != "cpu" else "")
    name = "plan" + ("_cuda" if device.type == "cuda" else "") + ("_quick" if args.quick else "")
    report = Report(name, f"PlanCache: {requests} requests, batch sizes uniform in 1..{MAX_BATCH}, served 4 times by each variant",
                    ["model", "variant", "startup", "throughput (items/s)", "vs best of (a),(b)", "p50", "p99", "max",
                     "first call at a new size (median / max)", "requests > 2x their size's median",
                     "same, after each size's first call", "spikes: blocked / preempted / on CPU",
                     "peak memory / plans"], command)
    sizes = [1, 32] if args.quick else [1, 8, 32, 64]
    steps_report = Report(f"{name}_steps", "What each step of a plan buys: median latency per call at fixed sizes",
                          ["model", "variant", "build per size"] + [f"n={n}" for n in sizes], command)
    lookup_rows = []
    for model_name, (make, make_input) in MODELS.items():
        print(f"{model_name}", file=sys.stderr)
        bench_model(model_name, make, make_input, stream, report, steps_report, lookup_rows, args.quick, device)
    for model_name, cpp, overhead, infer, direct in lookup_rows:
        report.notes.append(f"\nHit lookup, {model_name}: {format_seconds(cpp)} per hit by the C++ clock "
                            f"(validation, shared lock, map find, LRU tick); infer() {format_seconds(infer)} vs the "
                            f"plan module called directly {format_seconds(direct)} at n=1 (difference "
                            f"{format_seconds(overhead)}, Python binding included).")
    report.data["lookup"] = [dict(model=m, cpp_seconds=c, overhead_seconds=o, infer_seconds=i, direct_seconds=d)
                             for m, c, o, i, d in lookup_rows]
    report.data["stream_sizes"] = stream
    report.notes.append("\nThroughput counts items (sum of batch sizes) per second over the whole stream, builds "
                        "included; start-up (preload, the mean over passes) is not in it. Each variant serves the whole stream "
                        "in a phase of its own (its start-up just before), one intra-op thread, 4 times: in four "
                        "passes over the variants (forward, reversed, rotated by half, that reversed), each phase "
                        "set up afresh ((a) loaded from a saved copy, cold). Every column counts all passes: "
                        "percentiles, spikes (against each size's median over all), first calls (each size's first "
                        "in each pass). Spikes count every request, first calls included. Spikes' causes, from the "
                        "request thread's context switches during the request "
                        "(getrusage): blocked (it waited: a lock, the GIL), preempted (other work took its core), on "
                        "CPU (no switch: it computed the whole time, slowed by its own work or by the machine: "
                        "other tenants' use of shared caches, memory bandwidth and the hypervisor's time). "
                        "(d') runs (d)'s plans without the cache (a dict by size, called from Python): "
                        "the same work at every request, so its spikes are what this machine adds on its own. "
                        "(e) preloads buckets 1.5x apart, so a padded request costs at most about 1.5x its size's. "
                        "Peak memory: torch_ext.memory's peak (CPU, or torch.cuda's on the GPU) above the start during one request at "
                        "each size 1..64 after the stream; plans: the cache's plan_bytes (constants its plans "
                        "reference).")
    report.write()
    steps_report.notes.append("\nEach cell: median over 30 interleaved rounds (the order reversed every other round) of "
                              "one call at n, each preceded by an untimed "
                              "call of the same variant at another size (cycling 1..64), as a server sees them. The "
                              "plan variants are PlanCache.infer() with plans preloaded at the sizes shown (the other "
                              "sizes are served by the source module, untimed). Build per size: the median of the "
                              "sizes' build_seconds (the first build also freezes and optimises the module).")
    steps_report.write()


if __name__ == "__main__":
    main()
