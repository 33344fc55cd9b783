"""bench_plan.py's traffic section: serving with plans chosen from the traffic (CPU).

Two models, a Hugging Face BERT encoder (4 layers, width 256, from its config; token ids and an
attention mask, batch 1..16 by sequence 2..128, the pooled output) and the CNN of bench_plan.py
(batch 1..16), each under two traffic shapes: uniform (every batch size and length alike) and
skewed (batch sizes mostly small, log-normal; lengths log-normal around 24 tokens). Each serves
2000 requests of a stream drawn afresh (seed 2), after any planning on a recorded stream of the same
shape (seed 1), by:
  (a) the eager module
  (b) TorchScript: script, freeze and optimize_for_inference (the CNN; BERT does not script)
  (c) torch.compile(dynamic=True), warmed on 4 requests of the recorded stream
  (d) one AOTInductor package compiled with dynamic batch (and sequence) dimensions
  (e) PlanCache with hand-chosen buckets (BERT [[4, 16], [32, 128]], the CNN [[4, 8, 16]]), every
      bucket preloaded, plan_shapes 'auto' (a static and a dynamic package and, where the module
      scripts, its frozen TorchScript, the fastest kept per bucket)
  (f) PlanCache.from_traffic on the recorded stream, a budget of 4 plans (an exported program: 3
      compiles to measure, and the frozen TorchScript timed where the module scripts; then 2
      compiles a plan with plan_shapes 'auto')
Every variant builds in a process of its own, one at a time (one intra-op thread, Inductor's caches
empty: its start-up includes every compile cold); then every process serves the stream in chunks,
in rounds over the variants, so each comparison is paired chunk by chunk.

    python benchmarks/bench_plan.py --traffic            # results in plan_traffic.{md,json}
    python benchmarks/bench_plan.py --traffic --quick    # 200 requests, the CNN only: a smoke run
"""
from __future__ import annotations

import functools
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Child, Report, format_seconds, paired_ratio, run_children, timing_of  # noqa: E402

MAX_BATCH, SEQ = 16, (2, 128)
PLAN_BUDGET = 4
CHUNKS = 10  # the served stream in rounds of this many chunks
VARIANTS = ["(a) eager", "(b) TorchScript, frozen", "(c) torch.compile(dynamic=True)",
            "(d) one dynamic AOTInductor package", "(e) PlanCache, hand-chosen buckets",
            f"(f) PlanCache.from_traffic, {PLAN_BUDGET} plans"]


class Bert(torch.nn.Module):
    """transformers' BertModel from a config (4 layers, width 256, 4 heads), its pooled output."""

    def __init__(self) -> None:
        super().__init__()
        import transformers
        config = transformers.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                         intermediate_size=1024, max_position_embeddings=SEQ[1])
        self.bert = transformers.BertModel(config)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=ids, attention_mask=mask).pooler_output


def make_cnn() -> torch.nn.Module:
    from bench_plan import CNN
    return CNN()


MODELS = {
    "BERT encoder (HF, 4 layers, width 256)": dict(
        make=Bert, sequence=True, buckets=[[4, 16], [32, 128]], pad_values=[0, 0],
        request=lambda n, s, g: (torch.randint(1, 1000, (n, s), generator=g), torch.ones(n, s, dtype=torch.long)),
        shapes=lambda b, s: {"ids": {0: b, 1: s}, "mask": {0: b, 1: s}}),
    "CNN (2 conv, 3x16x16)": dict(
        make=make_cnn, sequence=False, buckets=[[4, 8, 16]], pad_values=[],
        request=lambda n, s, g: (torch.randn(n, 3, 16, 16, generator=g),), shapes=lambda b, s: ({0: b},)),
}


def traffic(model: dict, shape: str, requests: int, seed: int) -> list:
    """Requests' sizes: (batch,) or (batch, length)."""
    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        if shape == "uniform":
            n, s = rng.randint(1, MAX_BATCH), rng.randint(*SEQ)
        else:
            n = min(MAX_BATCH, max(1, int(rng.lognormvariate(0.3, 0.9))))
            s = min(SEQ[1], max(SEQ[0], int(rng.lognormvariate(math.log(24), 0.7))))
        out.append((n, s) if model["sequence"] else (n,))
    return out


def inputs_of(model: dict, sizes: tuple, seed: int) -> tuple:
    return model["request"](sizes[0], sizes[1] if len(sizes) > 1 else 0, torch.Generator().manual_seed(seed))


def dims(model: dict):
    return model["shapes"](torch.export.Dim("batch", min=1, max=MAX_BATCH), torch.export.Dim("seq", min=SEQ[0], max=SEQ[1]))


def build(label: str, module: torch.nn.Module, model: dict, recorded: list):
    """(what serves a request, the PlanCache or None)."""
    import torch_ext
    example = inputs_of(model, (4, 16) if model["sequence"] else (4,), 10**6)
    options = dict(pad_values=model["pad_values"], miss_mode="pad",
                   dim_names=["batch", "seq"] if model["sequence"] else [])
    if label.startswith("(a)"):
        return module, None
    if label.startswith("(b)"):
        frozen = torch.jit.optimize_for_inference(torch.jit.freeze(torch.jit.script(module)))
        for sizes in recorded[:4]:
            frozen(*inputs_of(model, sizes, 0))
        return frozen, None
    if label.startswith("(c)"):
        compiled = torch.compile(module, dynamic=True)
        for sizes in recorded[:4]:
            compiled(*inputs_of(model, sizes, 0))
        return compiled, None
    if label.startswith("(d)"):
        from torch import _inductor
        program = torch.export.export(module, example, dynamic_shapes=dims(model))
        path = _inductor.aoti_compile_and_package(program, package_path=os.path.join(tempfile.mkdtemp(), "one.pt2"))
        return _inductor.aoti_load_package(path), None
    if label.startswith("(e)"):
        cache = torch_ext.PlanCache(module, example, dims(model), buckets=model["buckets"], **options)
        buckets = model["buckets"]
        cache.preload([(b,) for b in buckets[0]] if len(buckets) == 1 else
                      [(b, s) for b in buckets[0] for s in buckets[1]], progress=False)
        return cache, cache
    cache = torch_ext.PlanCache.from_traffic(module, recorded, PLAN_BUDGET, example, dims(model), progress=False,
                                             **options)
    return cache, cache


def child(label: str, model_name: str, shape: str, requests: int, out: str) -> None:
    """Builds the variant, says "ready", then serves the chunks the parent names ("serve I": chunk I
    of the served stream, answered with its seconds) until "finish" writes the results to `out`."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else the libraries print goes to stderr, not into the replies
    torch.set_num_threads(1)
    model = MODELS[model_name]
    torch.manual_seed(0)
    module = model["make"]().eval()
    recorded, served = traffic(model, shape, requests, 1), traffic(model, shape, requests, 2)
    chunk = len(served) // CHUNKS
    start = time.perf_counter()
    with torch.no_grad():
        fn, cache = build(label, module, model, recorded)
    startup = time.perf_counter() - start
    latencies, worst = [], 0.0
    print("ready", file=replies, flush=True)
    for line in sys.stdin:
        command = line.split()
        if command == ["finish"]:
            break
        first = int(command[1]) * chunk
        seconds = 0.0
        with torch.no_grad():
            for i in range(first, first + chunk):
                inputs = inputs_of(model, served[i], i)
                t = time.perf_counter()
                got = fn(*inputs)
                latencies.append(time.perf_counter() - t)
                seconds += latencies[-1]
                if i < 20:  # the same outputs as the eager module's
                    worst = max(worst, float((got - module(*inputs)).abs().max()))
        print(seconds, file=replies, flush=True)
    result = dict(startup_seconds=startup, latencies=latencies, max_diff=worst)
    if cache is not None:
        s = cache.stats()
        result.update(plans=s.plans, compiles=s.compiles,
                      kinds=[z.shapes for z in s.sizes if z.cached], buckets=[list(z.bucket) for z in s.sizes if z.cached])
        choice = cache.bucket_choice
        if choice is not None:
            result.update(predicted_seconds=choice.predicted_seconds, unpadded_seconds=choice.unpadded_seconds,
                          chosen=choice.describe())
    Path(out).write_text(json.dumps(result))


def variant_child(label: str, model_name: str, shape: str, requests: int, work: str) -> Child:
    """One variant in a process of its own, built on creation (alone, so its start-up is its own)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(dir=work, prefix="inductor_"))
    out = os.path.join(work, f"variant{label[1]}.json")
    return Child(label, [sys.executable, __file__, "--child", label, model_name, shape, str(requests), out], env, out)


def run_variants(labels: list, model_name: str, shape: str, requests: int, work: str) -> dict:
    """Each variant built in turn, then the served stream's chunks in rounds over all of them (every
    other round reversed), so drift on the machine hits every variant alike."""
    runs = run_children([functools.partial(variant_child, label, model_name, shape, requests, work)
                         for label in labels], [f"serve {chunk}" for chunk in range(CHUNKS)])
    results = {}
    for label, (result, answers) in zip(labels, runs):
        result["chunk_seconds"] = [float(a) for a in answers]
        print(f"  {label}: start-up {result['startup_seconds']:.1f} s, serving {sum(result['chunk_seconds']):.1f} s",
              file=sys.stderr)
        results[label] = result
    return results


def traffic_check(case: str, results: dict, ours: str, best_other: str, rate: dict) -> tuple[str, bool]:
    """(text, met): `ours` at or above `best_other`'s throughput in the paired chunks (the 95% interval
    of the per-chunk ratio reaches 1 or above; the chunks hold the same requests for every variant)."""
    ratio, low, high = paired_ratio(timing_of(results[best_other]["chunk_seconds"]),
                                    timing_of(results[ours]["chunk_seconds"]))
    verdict = "above" if low > 1 else ("below" if high < 1 else "a tie within this run's noise")
    return (f"{case}: (f) at or above the best other variant's throughput: {rate[ours]:,.0f} vs {best_other[:3]} "
            f"{rate[best_other]:,.0f} items/s ({rate[ours] / rate[best_other]:.2f}x); in {CHUNKS} paired chunks "
            f"the ratio's median {ratio:.2f}x, 95% interval [{low:.2f}, {high:.2f}]x (sign test): {verdict}",
            high >= 1)


def percentile(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main(argv: list) -> None:
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2], argv[3], int(argv[4]), argv[5])
        return
    quick = "--quick" in argv
    requests = 200 if quick else 2000
    models = {k: v for k, v in MODELS.items() if not (quick and v["sequence"])}
    command = "python benchmarks/bench_plan.py --traffic" + (" --quick" if quick else "")
    report = Report("plan_traffic" + ("_quick" if quick else ""),
                    f"Plans chosen from traffic (CPU): {requests} requests per model and traffic shape",
                    ["model", "traffic", "variant", "start-up", "throughput (items/s)", "vs best of the others",
                     "p50", "p99", "plans / compiles", "max diff vs eager"], command)
    checks, notes = [], []
    with tempfile.TemporaryDirectory(prefix="bench_plan_traffic_") as work:
        for model_name, model in models.items():
            for shape in ("uniform", "skewed"):
                print(f"{model_name}, {shape}", file=sys.stderr)
                served = traffic(model, shape, requests, 2)
                items = sum(s[0] for s in served[:len(served) // CHUNKS * CHUNKS])  # what the chunks serve
                labels = [v for v in VARIANTS if not (v.startswith("(b)") and model["sequence"])]
                results = run_variants(labels, model_name, shape, requests, work)
                rate = {label: items / sum(r["latencies"]) for label, r in results.items()}
                ours = labels[-1]
                best_other = max((label for label in labels if label != ours), key=rate.get)
                for label, r in results.items():
                    others = max(v for k, v in rate.items() if k != label)
                    plans = (f"{r['plans']} plans ({', '.join(r['kinds'])}), {r['compiles']} compiles"
                             if "plans" in r else "-")
                    report.add_row({"model": model_name, "traffic": shape, "variant": label,
                                    "start-up": format_seconds(r["startup_seconds"]),
                                    "throughput (items/s)": f"{rate[label]:,.0f}",
                                    "vs best of the others": f"{rate[label] / others:.2f}x",
                                    "p50": format_seconds(percentile(r["latencies"], 0.5)),
                                    "p99": format_seconds(percentile(r["latencies"], 0.99)),
                                    "plans / compiles": plans, "max diff vs eager": f"{r['max_diff']:.1e}"},
                                   model=model_name, traffic=shape, variant=label, throughput=rate[label],
                                   startup_seconds=r["startup_seconds"], p50_seconds=percentile(r["latencies"], 0.5),
                                   p99_seconds=percentile(r["latencies"], 0.99),
                                   **{k: v for k, v in r.items() if k not in ("latencies", "startup_seconds")})
                mine = results[ours]
                measured = sum(mine["latencies"]) / len(mine["latencies"])
                notes.append(f"{model_name}, {shape}: (f) chose {mine['chosen']}; measured "
                             f"{format_seconds(measured)} a request on the served stream.")
                checks.append(traffic_check(f"{model_name}, {shape}", results, ours, best_other, rate))
    report.notes.append(
        "\nThroughput: items (the sum of batch sizes) per second of serving, each request timed alone, start-up "
        f"excluded. Each variant in a process of its own, built in turn; then the served stream in {CHUNKS} chunks "
        "of equal count, served in rounds over every variant (every other round reversed), so the machine's drift "
        "hits each alike; (f) against the best other variant: the median of the per-chunk throughput ratios with "
        "its 95% interval (sign test), met when the interval reaches 1.00x or above. Start-up: building the "
        "variant alone, compiles "
        "cold (an empty TORCHINDUCTOR_CACHE_DIR per process). (f) plans from the recorded stream (seed 1) and "
        "serves another drawn the same way (seed 2): the traffic it planned for, not the requests it serves. "
        "Max diff: the first 20 requests' outputs against the eager module's.")
    report.notes.extend(notes)
    report.add_checks(checks)
    report.write()


if __name__ == "__main__":
    main(sys.argv[1:])
