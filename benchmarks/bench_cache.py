"""Lazy node cache: the plain module against torch_ext.LazyExecutor, in one run.

    python benchmarks/bench_cache.py [--quick]

1. diffusion loop: a conditioning encoder + denoiser called for N steps with the same
   conditioning (torch_ext.demos.ConditionedDenoiser); time per step of the plain module, of the
   LazyExecutor, and of the denoiser alone (conditioning computed once by hand). Target: the
   LazyExecutor's step at most 1.1x the denoiser's alone.
2. preprocessed weights: inference through layers whose weights are rebuilt at every forward
   (weight normalisation and int8 dequantisation written out in forward), a new batch per call.
3. full miss: GPT-2 small (torch_ext.demos.GPTConfig.gpt2_small()), a new token batch at every
   call, so nothing but position embeddings can be reused: the executor's overhead. Target: at
   most 5% over the plain module, and content keys (the default) at most 2% slower than identity
   keys alone (content_keys=False), in paired rounds. `--full-miss` runs only this part.

`--pipeline` runs benchmarks/cache_pipeline.py instead: a diffusers pipeline across calls and
processes (see its docstring).

Variants of a workload run interleaved (plain, lazy, plain, lazy, ...) under torch.no_grad();
times are medians of the repeats after warm-up calls (which also let the executor learn which
inputs vary), with the ratio of the fastest repeats beside them. One intra-op thread by default
(--threads): on a shared machine a multi-threaded kernel stalls whenever another process takes
one of its cores, which swamps the differences measured here.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Report, format_bytes, format_seconds, measure_interleaved, paired_difference  # noqa: E402

from torch_ext.cache import LazyExecutor  # noqa: E402
from torch_ext.demos import ConditionedDenoiser, sample  # noqa: E402
from torch_ext.demos import GPT, GPTConfig  # noqa: E402


class WeightNormLinear(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.g = nn.Parameter(torch.ones(n_out, 1))
        self.b = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.g * self.v / self.v.norm(dim=1, keepdim=True), self.b)


class DequantLinear(nn.Module):
    """int8 weights with a per-output-channel scale, dequantised at every forward."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        weight = torch.randn(n_out, n_in) / n_in**0.5
        scale = weight.abs().amax(dim=1, keepdim=True) / 127
        self.register_buffer("qweight", torch.round(weight / scale).to(torch.int8))
        self.register_buffer("scale", scale)
        self.b = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.qweight.float() * self.scale, self.b)


class PreprocessedMLP(nn.Module):
    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            (WeightNormLinear if i % 2 == 0 else DequantLinear)(width, width) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return x


def full_miss(report: Report, quick: bool, repeat: int) -> None:
    """3. GPT-2 small with new tokens at every call: plain, identity keys alone, content keys."""
    tokens_per_call = 32 if quick else 128
    model = GPT(GPTConfig.gpt2_small()).eval()
    executor = LazyExecutor(model)
    identity = LazyExecutor(model, content_keys=False)
    inputs = [torch.randint(0, 50257, (1, tokens_per_call)) for _ in range(3)]
    for idx in inputs:
        assert torch.equal(executor(idx), model(idx)) and torch.equal(identity(idx), model(idx))
    executor.reset_stats()

    def fresh(fn):
        return lambda: fn(torch.randint(0, 50257, (1, tokens_per_call)))

    timings = measure_interleaved({"plain": fresh(model), "identity": fresh(identity), "lazy": fresh(executor)},
                                  warmup=1, repeat=repeat * 2)
    stats = executor.stats().as_dict()
    plain, lazy = timings["plain"].median_seconds, timings["lazy"].median_seconds
    overhead = lazy / plain - 1
    median, low, high, _ = paired_difference(timings["lazy"], timings["identity"])
    content = median / timings["identity"].median_seconds
    report.add_row({
        "workload": f"full miss: GPT-2 small, {tokens_per_call} new tokens per call (per forward)",
        "plain": format_seconds(plain), "LazyExecutor": format_seconds(lazy), "lazy / plain": f"{lazy / plain:.3f}",
        "reference": f"overhead {overhead:+.1%} (of the fastest runs: "
                     f"{timings['lazy'].min_seconds / timings['plain'].min_seconds - 1:+.1%}; spread plain "
                     f"{timings['plain'].spread:.0%}, lazy {timings['lazy'].spread:.0%}); content keys against "
                     f"identity keys alone ({format_seconds(timings['identity'].median_seconds)}): {content:+.1%} "
                     f"(paired, 95%: {low * 1e3:+.2f} .. {high * 1e3:+.2f} ms)",
        "hit rate": f"{stats['hit_rate']:.1%}", "held": format_bytes(stats["cached_bytes"]),
        "target": f"overhead <= 5%: {'met' if overhead <= 0.05 else 'NOT met'}; content keys <= +2%: "
                  f"{'met' if content <= 0.02 else 'NOT met'}",
    }, plain_seconds=plain, lazy_seconds=lazy, identity_seconds=timings["identity"].median_seconds,
        overhead=overhead, content_key_overhead=content, hit_rate=stats["hit_rate"],
        cached_bytes=stats["cached_bytes"])
    report.data["full_miss"] = timings
    del model, executor, identity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads, fewer repeats")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--full-miss", action="store_true", help="only the GPT-2 full miss (3.), written as cache_full_miss")
    parser.add_argument("--pipeline", action="store_true",
                        help="the diffusers pipeline (benchmarks/cache_pipeline.py), written as cache_pipeline")
    args = parser.parse_args()
    quick = args.quick
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    command = "python benchmarks/bench_cache.py" + (" --quick" if quick else "") + (
        " --full-miss" if args.full_miss else "") + (
        f" --threads {args.threads}" if args.threads != 1 else "")
    report = Report("cache" + ("_full_miss" if args.full_miss else "") + ("_quick" if quick else ""), "Lazy node cache: plain module vs LazyExecutor",
                    ["workload", "plain", "LazyExecutor", "lazy / plain", "reference", "hit rate", "held",
                     "target"], command)
    repeat = 3 if quick else 9

    if args.pipeline:
        import cache_pipeline

        report = Report("cache_pipeline", "Lazy node cache on a diffusers pipeline: the text encoder across calls "
                        "and processes", ["workload", "variant", "time per call", "vs plain (paired)",
                                          "text-encoder runs", "hit rate", "bytes on disk", "target"],
                        "python benchmarks/bench_cache.py --pipeline" + (
                            f" --threads {args.threads}" if args.threads != 1 else ""))
        cache_pipeline.run(report)
        report.write()
        return
    if args.full_miss:
        with torch.no_grad():
            full_miss(report, quick, repeat)
        report.write()
        return
    with torch.no_grad():
        # 1. diffusion loop, with a small and a four times larger latent
        steps = 10 if quick else 50
        model = ConditionedDenoiser().eval()
        executor = LazyExecutor(model)
        tokens = torch.randint(0, 1024, (1, 77))
        cond = model.encode(tokens)
        for latent_tokens in ((64,) if quick else (64, 256)):
            latent = torch.randn(1, latent_tokens, 256)
            sample(executor, latent, tokens, 2)
            executor.reset_stats()
            timings = measure_interleaved({
                "plain": lambda: sample(model, latent, tokens, steps),
                "lazy": lambda: sample(executor, latent, tokens, steps),
                "denoiser alone": lambda: sample(lambda x, t, _: model.denoise(x, t, cond), latent, tokens, steps),
            }, warmup=1, repeat=repeat)
            assert torch.equal(sample(model, latent, tokens, 3), sample(executor, latent, tokens, 3))
            stats = executor.stats().as_dict()
            plain, lazy, alone = (timings[k].median_seconds / steps for k in ("plain", "lazy", "denoiser alone"))
            fastest = timings["lazy"].min_seconds / timings["denoiser alone"].min_seconds
            report.add_row({
                "workload": f"diffusion loop, {steps} steps, {latent_tokens} latent tokens (time per step)",
                "plain": format_seconds(plain), "LazyExecutor": format_seconds(lazy),
                "lazy / plain": f"{lazy / plain:.2f}",
                "reference": f"denoiser alone {format_seconds(alone)}; lazy / alone = {lazy / alone:.2f} "
                             f"(fastest runs: {fastest:.2f})",
                "hit rate": f"{stats['hit_rate']:.0%}", "held": format_bytes(stats["cached_bytes"]),
                "target": f"lazy <= 1.1x alone: {'met' if lazy <= 1.1 * alone else 'NOT met'}",
            }, plain_seconds=plain, lazy_seconds=lazy, alone_seconds=alone, fastest_ratio=fastest,
                hit_rate=stats["hit_rate"], cached_bytes=stats["cached_bytes"])
            report.data[f"diffusion_{latent_tokens}"] = {k: v for k, v in timings.items()}
        del model, executor

        # 2. preprocessed weights, a new batch at every call
        width, layers, batch = (512, 4, 8) if quick else (1024, 8, 16)
        model = PreprocessedMLP(width, layers).eval()
        executor = LazyExecutor(model)
        batches = [torch.randn(batch, width) for _ in range(4)]
        cursor = {"plain": 0, "lazy": 0}

        def call(name, fn):
            def run():
                cursor[name] += 1
                return fn(batches[cursor[name] % len(batches)])
            return run

        for x in batches[:3]:
            assert torch.equal(executor(x), model(x))
        executor.reset_stats()
        timings = measure_interleaved({"plain": call("plain", model), "lazy": call("lazy", executor)},
                                      warmup=2, repeat=repeat * 3)
        stats = executor.stats().as_dict()
        plain, lazy = timings["plain"].median_seconds, timings["lazy"].median_seconds
        report.add_row({
            "workload": f"weight-norm + int8-dequant MLP, {layers} x {width}, batch {batch} (per forward)",
            "plain": format_seconds(plain), "LazyExecutor": format_seconds(lazy), "lazy / plain": f"{lazy / plain:.2f}",
            "reference": f"{plain / lazy:.2f}x faster", "hit rate": f"{stats['hit_rate']:.0%}",
            "held": format_bytes(stats["cached_bytes"]), "target": "-",
        }, plain_seconds=plain, lazy_seconds=lazy, hit_rate=stats["hit_rate"], cached_bytes=stats["cached_bytes"])
        report.data["preprocessed"] = timings
        del model, executor

        full_miss(report, quick, repeat)

        # 4. the same full miss where the executor's overhead dominates: a tiny GPT, per node
        model = GPT(GPTConfig.gpt2_small(n_embd=48, n_head=12, vocab_size=128, block_size=16)).eval()
        executor = LazyExecutor(model)
        nodes = len(executor.graph_module.graph.nodes)
        calls = 20

        def loop(fn):
            def run():
                for _ in range(calls):
                    fn(torch.randint(0, 128, (1, 8)))
            return run

        loop(executor)()
        timings = measure_interleaved({"plain": loop(model), "lazy": loop(executor)}, warmup=1, repeat=repeat * 2)
        plain, lazy = timings["plain"].median_seconds / calls, timings["lazy"].median_seconds / calls
        per_node = (lazy - plain) / nodes
        report.add_row({
            "workload": f"full miss: tiny GPT (12 blocks, width 48, 8 tokens): overhead per node of {nodes}",
            "plain": format_seconds(plain), "LazyExecutor": format_seconds(lazy), "lazy / plain": f"{lazy / plain:.2f}",
            "reference": f"{per_node * 1e6:+.1f} µs per node (graph interpretation, source checks, bookkeeping)",
            "hit rate": "-", "held": "-", "target": "-",
        }, plain_seconds=plain, lazy_seconds=lazy, per_node_seconds=per_node, nodes=nodes)
        report.data["per_node"] = timings

    report.notes.append("")
    report.notes.append("Time: median over interleaved repeats (plain, lazy, ... in rounds) after warm-up calls; "
                        "hit rate: node executions served from the cache / all node executions; held: bytes of "
                        "cached outputs at the end (each storage once).")
    report.write()


if __name__ == "__main__":
    main()
