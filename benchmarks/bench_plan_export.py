"""bench_plan.py's export section: serving torch.export programs on CPU.

A stream of requests, batch sizes uniform in 1..64 (and, for the transformer encoder, sequence
lengths uniform in 8..128 with an attention mask), served by:
  (a) the eager module
  (b) TorchScript: script + freeze + optimize_for_inference
  (c) torch.compile(dynamic=True), after warm-up calls
  (d) one AOTInductor package compiled with dynamic batch (and sequence) dimensions
  (e) PlanCache over the exported program: AOTInductor plans per bucket, preloaded (plan_shapes
      "auto": each bucket compiled static and dynamic, the faster kept)
  (f) (e)'s cache saved, loaded by PlanCache(folder), serving the same stream
  (g) the dynamic batcher on (e)'s cache: 8 client threads sending single requests (one row each),
      against (e) serving the same single requests one at a time
Each variant builds and serves the stream in a new process of its own (what one variant leaves in a
process slows the next: after (b)'s optimize_for_inference the same loaded plans served 8% fewer
items a second), in two passes (forward, then reversed). Inductor compiles into a fresh cache
folder, so the first pass's start-up includes every compile cold. (g) runs in (e)'s first process.

    python benchmarks/bench_plan.py --export            # results in plan_export.{md,json}
    python benchmarks/bench_plan.py --export --quick    # 200 requests, fewer buckets: a smoke run
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Report, format_seconds, run_threads  # noqa: E402

MAX_BATCH = 64
SEQ = (8, 128)
CLIENTS = 8


class Encoder(torch.nn.Module):
    """A small transformer encoder classifier: token ids and an attention mask (1: token, 0: padding),
    2 layers of width 64 and 4 heads, masked mean pooling, 10 classes. Padded positions are masked
    out of attention and pooling, so padding a request does not change its output."""

    def __init__(self, vocab: int = 1000, width: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Parameter(torch.randn(SEQ[1], width) * 0.02)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(width, 3 * width) for _ in range(layers))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.norm1 = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(layers))
        self.ff1 = torch.nn.ModuleList(torch.nn.Linear(width, 2 * width) for _ in range(layers))
        self.ff2 = torch.nn.ModuleList(torch.nn.Linear(2 * width, width) for _ in range(layers))
        self.norm2 = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(layers))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.embed(ids) + self.position[:t]
        attend = mask[:, None, None, :].to(torch.bool)
        for qkv, proj, norm1, ff1, ff2, norm2 in zip(self.qkv, self.proj, self.norm1, self.ff1, self.ff2, self.norm2):
            q, k, v = qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=attend).transpose(1, 2).reshape(b, t, -1)
            x = norm1(x + proj(a))
            x = norm2(x + ff2(F.gelu(ff1(x))))
        weights = mask.to(x.dtype)[:, :, None]
        return self.head((x * weights).sum(1) / weights.sum(1))


def make_cnn() -> torch.nn.Module:
    from bench_plan import CNN
    return CNN()


# Per model: constructor, the request for (batch, length, seed), the dynamic shapes, the
# buckets of (e), the size of one single request for (g).
def cnn_request(n: int, length: int, seed: int) -> tuple:
    return (torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed)),)


def encoder_request(n: int, length: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 1000, (n, length), generator=g), torch.ones(n, length, dtype=torch.long)


MODELS = {
    "CNN (2 conv, 3x16x16)": dict(
        make=make_cnn, request=cnn_request, sequence=False,
        dynamic_shapes=lambda b, s: ({0: b},),
        buckets=[[4, 8, 16, 32, 64]], quick_buckets=[[16, 64]], pad_values=[]),
    "Transformer encoder (2 layers, d=64, seq 8..128, mask)": dict(
        make=Encoder, request=encoder_request, sequence=True,
        dynamic_shapes=lambda b, s: {"ids": {0: b, 1: s}, "mask": {0: b, 1: s}},
        buckets=[[8, 16, 32, 64], [32, 64, 128]], quick_buckets=[[64], [64, 128]], pad_values=[0, 0]),
}


def stream_of(model: dict, requests: int) -> list[tuple[int, int]]:
    rng = random.Random(0)
    return [(rng.randint(1, MAX_BATCH), rng.randint(*SEQ) if model["sequence"] else 0) for _ in range(requests)]


def serve(fn: Callable, model: dict, stream: list) -> list[float]:
    """Latency of each request of the stream (inputs made before each is timed)."""
    latencies = []
    with torch.no_grad():
        for i, (n, length) in enumerate(stream):
            inputs = model["request"](n, length, i)
            t = time.perf_counter()
            fn(*inputs)
            latencies.append(time.perf_counter() - t)
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def size_key(n: int, length: int) -> tuple:
    """Requests compared for spikes: the same batch size (the CNN), or the same cell of 8 batch sizes
    by 16 sequence lengths (the encoder, whose 64 x 121 sizes are too many for a median each)."""
    return (n,) if length == 0 else ((n - 1) // 8, (length - 1) // 16)


def spikes(latencies: list[float], stream: list) -> tuple[int, float]:
    keys = [size_key(*stream[i % len(stream)]) for i in range(len(latencies))]
    by_key: dict = {}
    for key, t in zip(keys, latencies):
        by_key.setdefault(key, []).append(t)
    medians = {key: statistics.median(v) for key, v in by_key.items()}
    ratios = [t / medians[key] for key, t in zip(keys, latencies)]
    return sum(r > 2 for r in ratios), max(ratios)


# ---- the variants: each returns (serve function, what to keep alive, notes) ----

def dims(model: dict, lo_batch: int = 1):
    b = torch.export.Dim("batch", min=lo_batch, max=MAX_BATCH)
    s = torch.export.Dim("seq", min=SEQ[0], max=SEQ[1])
    return model["dynamic_shapes"](b, s)


def example(model: dict) -> tuple:
    return model["request"](4, 16 if model["sequence"] else 0, 10**6)


def variant_eager(module, model, work):
    return module, None


def variant_torchscript(module, model, work):
    frozen = torch.jit.optimize_for_inference(torch.jit.freeze(torch.jit.script(module)))
    with torch.no_grad():
        frozen(*example(model))
    return frozen, None


def variant_compile(module, model, work):
    compiled = torch.compile(module, dynamic=True)
    with torch.no_grad():  # warm-up: the shapes' extremes, and sizes 1 and 2 that dynamo specialises
        for n, length in ((1, SEQ[0]), (2, SEQ[0] + 1), (MAX_BATCH, SEQ[1]), (17, 77)):
            compiled(*model["request"](n, length if model["sequence"] else 0, 10**6 + n))
    return compiled, None


def variant_one_package(module, model, work):
    import torch._inductor
    program = torch.export.export(module, example(model), dynamic_shapes=dims(model))
    path = torch._inductor.aoti_compile_and_package(program, package_path=os.path.join(work, "one.pt2"))
    return torch._inductor.aoti_load_package(path), None


def make_plan_cache(module, model, work, quick):
    from torch_ext import PlanCache
    cache = PlanCache(module, example(model), dims(model), buckets=model["quick_buckets" if quick else "buckets"],
                      pad_values=model["pad_values"], miss_mode="pad", plan_shapes="auto", warmup_calls=3,
                      dim_names=["batch", "seq"] if model["sequence"] else [])
    buckets = cache.script_object.buckets
    grid = [(b,) for b in buckets[0]] if len(buckets) == 1 else [(b, s) for b in buckets[0] for s in buckets[1]]
    cache.preload(grid, progress=False)
    return cache


# ---- every variant serves in a process of its own ----

E_LABEL = "(e) PlanCache over export, buckets preloaded"
F_LABEL = "(f) (e) saved, loaded in a fresh process"


def build_variant(label: str, model: dict, quick: bool, work: str) -> tuple:
    """(the callable that serves, what the row reports of it, seconds to start up)."""
    if label == F_LABEL:
        import torch_ext
        t = time.perf_counter()
        cache = torch_ext.PlanCache(os.path.join(work, "saved"), miss_mode="pad")
        return cache, cache, time.perf_counter() - t
    torch.manual_seed(0)
    module = model["make"]().eval()
    t = time.perf_counter()
    if label == E_LABEL:
        cache = make_plan_cache(module, model, work, quick)
        return cache, cache, time.perf_counter() - t
    fn, _ = BASELINES[label](module, model, work)
    return fn, None, time.perf_counter() - t


def serve_variant(label: str, model_name: str, requests: int, quick: bool, work: str, out: str,
                  with_batcher: bool) -> None:
    """The child: builds one variant (its start-up timed), serves the stream, writes what it measured.
    (e) saves its cache for (f) and, with_batcher, runs (g) on it."""
    model = MODELS[model_name]
    stream = stream_of(model, requests)
    fn, cache, startup = build_variant(label, model, quick, work)
    result: dict = dict(startup_seconds=startup, ready_at=time.time(), latencies=serve(fn, model, stream))
    if cache is not None:
        s = cache.stats()
        result.update(compiles=s.compiles, builds=s.builds, plans=s.plans, sizes=[
            dict(bucket=list(z.bucket), shapes=z.shapes, static_seconds=z.static_seconds,
                 dynamic_seconds=z.dynamic_seconds) for z in s.sizes if z.cached])
    if label == E_LABEL and not os.path.isdir(os.path.join(work, "saved")):
        cache.save(os.path.join(work, "saved"))
    if label == E_LABEL and with_batcher:
        singles = [(1, length) for _, length in stream]
        inputs_of = [model["request"](1, length, i) for i, (_, length) in enumerate(singles)]
        result["singles"] = singles
        result["serial"] = serve(cache, model, singles)
        result["batched"] = run_batcher(cache, inputs_of, max_delay_ms=2.0)
    Path(out).write_text(json.dumps(result))


def run_variant(label: str, model_name: str, requests: int, quick: bool, work: str, with_batcher: bool) -> dict:
    """serve_variant in a new process (the interpreter's start and imports before the clock starts)."""
    out = os.path.join(work, "variant.json")
    code = [sys.executable, __file__, "--serve", label, model_name, str(requests), str(int(quick)), work, out,
            str(int(with_batcher))]
    launched = time.time()
    subprocess.run(code, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=3600)
    result = json.loads(Path(out).read_text())
    result["launch_to_ready_seconds"] = result["ready_at"] - launched  # the interpreter, imports, start-up
    print(f"  {label}: start-up {result['startup_seconds']:.2f} s, stream {sum(result['latencies']):.1f} s",
          file=sys.stderr)
    return result


# ---- (g): the batcher under 8 client threads ----

def run_batcher(cache, inputs_of: list, max_delay_ms: float) -> dict:
    """8 client threads send the requests of inputs_of (made beforehand, as serve() makes (e)'s
    outside its timings), each one after another; wall time from the first start to the last join."""
    from torch_ext import Batcher
    latencies = [0.0] * len(inputs_of)
    with Batcher(cache, max_batch_size=CLIENTS, max_delay_ms=max_delay_ms) as batcher:
        def client(k: int) -> None:
            with torch.no_grad():
                for i in range(k, len(inputs_of), CLIENTS):
                    inputs = inputs_of[i]
                    t = time.perf_counter()
                    batcher(*inputs)
                    latencies[i] = time.perf_counter() - t

        wall = run_threads(client, CLIENTS)
        s = batcher.stats()
    return dict(latencies=latencies, wall=wall, batches=s.batches, mean_batch_seconds=s.batch_seconds / s.batches,
                mean_rows=s.rows / s.batches)


# ---- the section ----

BASELINES = {
    "(a) eager": variant_eager,
    "(b) TorchScript frozen": variant_torchscript,
    "(c) torch.compile(dynamic=True), warmed up": variant_compile,
    "(d) one dynamic AOTInductor package": variant_one_package,
}


def bench_model(name: str, model: dict, requests: int, quick: bool, report: Report, work: str,
                checks: list) -> None:
    """Runs (a)-(g) for one model: rows into report, targets into checks as (text, met)."""
    stream = stream_of(model, requests)
    results: dict = {}
    labels = list(BASELINES) + [E_LABEL, F_LABEL]
    batcher_run: dict = {}
    for order in (labels, labels[::-1]):
        for label in order:
            if label == F_LABEL and not os.path.isdir(os.path.join(work, "saved")):
                continue  # (e) has not run yet: the folder exists once it has
            out = run_variant(label, name, requests, quick, work, with_batcher=label == E_LABEL and not batcher_run)
            if "batched" in out:
                batcher_run = out
            r = results.setdefault(label, dict(startup=[], latencies=[], extra=[]))
            r["startup"].append(out["startup_seconds"])
            r["latencies"] += out["latencies"]
            r["extra"].append({k: v for k, v in out.items() if k not in ("latencies", "serial", "batched", "singles")})
    items = sum(n for n, _ in stream)
    throughput = {label: items * len(r["latencies"]) / len(stream) / sum(r["latencies"]) for label, r in results.items()}
    best_ad = max(throughput[label] for label in BASELINES)
    stats_e = results[E_LABEL]["extra"][0]  # the first pass's: its compiles are cold
    for label, r in results.items():
        count, worst = spikes(r["latencies"], stream)
        extra = ""
        if label == E_LABEL:
            shapes = [z["shapes"] for z in stats_e["sizes"]]
            extra = (f"{stats_e['plans']} plans ({shapes.count('static')} static, {shapes.count('dynamic')} dynamic), "
                     f"{stats_e['compiles']} compiles")
        elif label == F_LABEL:
            extra = f"{r['extra'][-1]['plans']} plans loaded, {max(x['compiles'] for x in r['extra'])} compiles"
        report.add_row({
            "model": name, "variant": label,
            "start-up": format_seconds(r["startup"][0]),
            "throughput (items/s)": f"{throughput[label]:,.0f}",
            "vs best of (a)-(d)": f"{throughput[label] / best_ad:.2f}x",
            "p50": format_seconds(percentile(r["latencies"], 0.5)),
            "p99": format_seconds(percentile(r["latencies"], 0.99)),
            "max": format_seconds(max(r["latencies"])),
            "requests > 2x their size's median": f"{count} (worst {worst:.1f}x)",
            "plans / compiles": extra,
        }, model=name, variant=label, startup_seconds=r["startup"], throughput=throughput[label],
            p50_seconds=percentile(r["latencies"], 0.5), p99_seconds=percentile(r["latencies"], 0.99),
            max_seconds=max(r["latencies"]), spikes=count, worst_ratio=worst)
    saved = results[F_LABEL]["extra"]
    report.data.setdefault("restart", {})[name] = saved and [{k: v for k, v in s.items() if k != "latencies"}
                                                             for s in saved]
    notes = [f"\n{name}: (e) per bucket, the measured choice (static / dynamic mean latency over the bucket's "
             "probe sizes): " + "; ".join(
                 f"{'x'.join(map(str, z['bucket']))} {z['shapes']} ({format_seconds(z['static_seconds'])} / "
                 f"{format_seconds(z['dynamic_seconds'])})" for z in stats_e["sizes"]) + "."]
    short = name.split(" (")[0]
    for label in (E_LABEL, F_LABEL):
        checks.append((f"{short}: {label[:3]} throughput at least the best of (a)-(d): {throughput[label]:,.0f} vs "
                       f"{best_ad:,.0f} items/s ({throughput[label] / best_ad:.2f}x)", throughput[label] >= best_ad))
    restart = max(s["startup_seconds"] for s in saved) if saved else float("nan")
    compiles = max(s["compiles"] for s in saved) if saved else -1
    checks.append((f"{short}: (f) zero compiles and start-up under 1 s: {compiles} compiles, PlanCache(folder) took "
                   f"{format_seconds(restart)} (the slower of its processes; from launching the process to serving, "
                   f"interpreter and imports included: {format_seconds(max(s['launch_to_ready_seconds'] for s in saved))})",
                   compiles == 0 and restart < 1.0))
    # (g): the batcher against (e) serving the same single requests one at a time.
    singles, serial, batched = batcher_run["singles"], batcher_run["serial"], batcher_run["batched"]
    serial_rate, batched_rate = len(singles) / sum(serial), len(singles) / batched["wall"]
    p99 = percentile(batched["latencies"], 0.99)
    bound = 2e-3 + batched["mean_batch_seconds"]
    count, worst = spikes(batched["latencies"], singles)
    report.add_row({
        "model": name, "variant": f"(g) dynamic batcher, {CLIENTS} clients of single requests (max 8 rows, 2 ms)",
        "start-up": "-", "throughput (items/s)": f"{batched_rate:,.0f}",
        "vs best of (a)-(d)": f"{batched_rate / serial_rate:.2f}x (e)'s single requests",
        "p50": format_seconds(percentile(batched["latencies"], 0.5)), "p99": format_seconds(p99),
        "max": format_seconds(max(batched["latencies"])), "requests > 2x their size's median": f"{count} (worst {worst:.1f}x)",
        "plans / compiles": f"{batched['batches']} batches of {batched['mean_rows']:.1f} rows on average",
    }, model=name, variant="(g)", throughput=batched_rate, serial_throughput=serial_rate, p99_seconds=p99,
        mean_batch_seconds=batched["mean_batch_seconds"])
    checks.append((f"{short}: (g) throughput at least 2x (e) serving the same single requests one at a time: "
                   f"{batched_rate:,.0f} vs {serial_rate:,.0f} requests/s ({batched_rate / serial_rate:.2f}x)",
                   batched_rate >= 2 * serial_rate))
    checks.append((f"{short}: (g) p99 under max_delay + one batch's latency: {format_seconds(p99)} vs 2 ms + "
                   f"{format_seconds(batched['mean_batch_seconds'])} (the mean batch's run)", p99 <= bound))
    report.notes.extend(notes)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--serve"]:
        torch.set_num_threads(1)
        serve_variant(argv[1], argv[2], int(argv[3]), bool(int(argv[4])), argv[5], argv[6], bool(int(argv[7])))
        return
    quick = "--quick" in argv
    requests = 200 if quick else 2000
    command = "python benchmarks/bench_plan.py --export" + (" --quick" if quick else "")
    report = Report("plan_export" + ("_quick" if quick else ""),
                    f"PlanCache over torch.export (CPU): {requests} requests, batch sizes uniform in 1..{MAX_BATCH} "
                    f"(the encoder: sequence lengths uniform in {SEQ[0]}..{SEQ[1]})",
                    ["model", "variant", "start-up", "throughput (items/s)", "vs best of (a)-(d)", "p50", "p99", "max",
                     "requests > 2x their size's median", "plans / compiles"], command)
    checks: list = []
    with tempfile.TemporaryDirectory(prefix="bench_plan_export_") as work:
        for name, model in MODELS.items():
            print(name, file=sys.stderr)
            model_work = os.path.join(work, str(len(report.rows)))
            os.makedirs(model_work)
            bench_model(name, model, requests, quick, report, model_work, checks)
    report.notes.append(
        "\nOne intra-op thread everywhere (AOTInductor's CPU kernels use the count set when they were compiled). "
        "Throughput counts items (the sum of batch sizes) per second of serving, start-up excluded; (g) counts "
        "requests (one row each). Start-up (the first pass's: its compiles are cold, the second pass's may hit "
        "Inductor's cache): (b) script, freeze and optimise; (c) torch.compile and 4 warm-up calls; (d) export and one compile; (e) export, a static and a dynamic compile per bucket and their measurements, "
        "all with Inductor's caches empty (a fresh TORCHINDUCTOR_CACHE_DIR); (f) PlanCache(folder) in a new "
        "process after importing torch_ext. Latencies: each request timed alone, 2 passes over the variants "
        "(forward, reversed), each variant in a new process of its own in each pass. Requests > 2x their "
        "size's median: against the median of the same batch size (CNN) or of the same cell of 8 batch sizes by "
        f"16 sequence lengths (encoder). (g): 8 threads each send single requests one after another ({requests} in all, "
        "made beforehand: the stream's sequence lengths), the batcher gathers up to 8 rows or 2 ms; (e)'s single requests are the "
        "same ones served one at a time from one thread.")
    report.add_checks(checks)
    report.write()


if __name__ == "__main__":
    # Cold compiles: Inductor's caches start empty (this process and the compile workers it starts).
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench_plan_inductor_"))
    main(sys.argv[1:])
