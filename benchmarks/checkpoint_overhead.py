"""Part "overhead" of bench_checkpoint: what one checkpointed region costs beyond its own work, on
regions too small for their work to hide it.

  Linear region:   nn.Linear(32, 32) on 8 rows
  function region: x * 2 + 1 on a 16x32 tensor (no parameters)
  the function region under a selective checkpointing policy (torch's context_fn from
  create_selective_checkpoint_contexts, saving the product): the same policy through both
  the function region with torch_ext's native policy saving the product (save="aten.mul.Tensor",
  decided in C++) against torch's policy above (target: overhead at least 5x below torch's)

A chain of `regions` regions runs forward and backward plainly, through torch.utils.checkpoint
(use_reentrant=False) and through torch_ext.checkpoint, in rounds that alternate their order. The
overhead of a kind in one round is (its chain - the plain chain) / regions; the table gives the
median over rounds. A replayed region also pays its replay: one plain forward, in the notes (torch_ext does not
replay a Linear region: it keeps the input and weight its backward needs, which live anyway).
"""
from __future__ import annotations

import copy
import functools
import statistics

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import harness
import torch_ext


def scale_and_shift(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def chains(device, regions: int) -> dict[str, dict]:
    torch.manual_seed(0)
    linears = [nn.Linear(32, 32).to(device) for _ in range(regions)]
    ours = [torch_ext.checkpoint(copy.deepcopy(layer)) for layer in linears]
    function = torch_ext.checkpoint(scale_and_shift)
    save_mul = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mul.Tensor])
    selective = torch_ext.checkpoint(scale_and_shift, context_fn=save_mul)
    native = torch_ext.checkpoint(scale_and_shift, save="aten.mul.Tensor")
    return {
        "Linear(32, 32) on 8 rows": {"input": torch.randn(8, 32, device=device, requires_grad=True),
                                     "plain": linears, "torch": linears, "torch_ext": ours},
        "x * 2 + 1 on 16x32": {"input": torch.randn(16, 32, device=device, requires_grad=True),
                               "plain": [scale_and_shift] * regions, "torch": [scale_and_shift] * regions,
                               "torch_ext": [function] * regions},
        "x * 2 + 1 on 16x32, SAC policy (context_fn)": {
            "input": torch.randn(16, 32, device=device, requires_grad=True), "plain": [scale_and_shift] * regions,
            "torch": [scale_and_shift] * regions, "torch_ext": [selective] * regions, "context_fn": save_mul,
            "target": 1.0},
        "x * 2 + 1 on 16x32, native policy (save=) vs torch's SAC policy": {
            "input": torch.randn(16, 32, device=device, requires_grad=True), "plain": [scale_and_shift] * regions,
            "torch": [scale_and_shift] * regions, "torch_ext": [native] * regions, "context_fn": save_mul},
    }


def chain_of(region: dict, kind: str):
    x0, fns = region["input"], region["plain" if kind == "forward" else kind]

    if kind == "torch":
        keywords = {"context_fn": region["context_fn"]} if "context_fn" in region else {}

        def run():
            x = x0
            for fn in fns:
                x = torch_checkpoint(fn, x, use_reentrant=False, **keywords)
            x.sum().backward()
    elif kind == "forward":
        def run():
            with torch.enable_grad():
                x = x0
                for fn in fns:
                    x = fn(x)
    else:
        def run():
            x = x0
            for fn in fns:
                x = fn(x)
            x.sum().backward()
    return run


def forward_runs_per_step(device) -> dict[str, int]:
    """How often one checkpointed Linear region runs its forward in a step, per checkpoint."""
    layer = nn.Linear(32, 32).to(device)
    runs = {"torch": 0, "torch_ext": 0}

    def counted(kind):
        def forward(x):
            runs[kind] += 1
            return layer(x)
        return forward

    x = torch.randn(8, 32, device=device, requires_grad=True)
    torch_checkpoint(counted("torch"), x, use_reentrant=False).sum().backward()
    torch_ext.checkpoint(counted("torch_ext"))(x).sum().backward()
    return runs


def run(device: torch.device, quick: bool, command: str) -> None:
    regions, repeat = (20, 20) if quick else (50, 60)
    where = f"CUDA, {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "CPU"
    name = "checkpoint_overhead" + ("_cuda" if device.type == "cuda" else "") + ("_quick" if quick else "")
    report = harness.Report(name, f"Segment checkpointing: per-region overhead ({where})",
                            ["region", "torch.utils.checkpoint", "torch_ext", "torch / torch_ext", "replay (one forward)"],
                            command)
    checks, data = [], {}
    for label, region in chains(device, regions).items():
        kinds = ("plain", "torch", "torch_ext", "forward")
        timings = harness.measure_interleaved({kind: chain_of(region, kind) for kind in kinds},
                                              warmup=3, repeat=repeat, alternate=True)
        per_round = {kind: [(t - p) / regions for t, p in zip(timings[kind].samples, timings["plain"].samples)]
                     for kind in ("torch", "torch_ext")}
        overhead = {kind: statistics.median(values) for kind, values in per_round.items()}
        ratio = overhead["torch"] / overhead["torch_ext"] if overhead["torch_ext"] > 0 else float("inf")
        replay = timings["forward"].median_seconds / regions
        report.add_row({"region": label, "torch.utils.checkpoint": harness.format_seconds(overhead["torch"]),
                        "torch_ext": harness.format_seconds(overhead["torch_ext"]), "torch / torch_ext": f"{ratio:.1f}x",
                        "replay (one forward)": harness.format_seconds(replay)},
                       overhead_seconds=overhead, ratio=ratio, replay_seconds=replay,
                       timings={kind: timings[kind] for kind in kinds})
        target = region.get("target", 5.0)
        checks.append((f"{label}: overhead " + (f"at least {target:g}x below torch's" if target > 1 else "at most torch's")
                       + f" ({ratio:.1f}x)"
                       + (": both run torch's policy dispatch modes per op" if target == 1.0 else ""), ratio >= target))
        data[label] = {"ratio": ratio, "overhead_seconds": overhead}
    report.notes.append("")
    runs = forward_runs_per_step(device)
    report.notes.append(f"Forward runs of a Linear region per step (forward and backward): torch.utils.checkpoint "
                        f"{runs['torch']}, torch_ext {runs['torch_ext']} (its addmm saves only the region's input "
                        f"and the weight's transpose, which live until backward anyway: torch_ext keeps them and "
                        f"does not replay the region).")
    report.notes.append("")
    report.notes.append(f"{regions} regions per chain, forward and backward, {repeat} rounds after 3 warm-up rounds, "
                        f"{torch.get_num_threads()} torch thread(s); overhead: median over rounds of (chain - plain "
                        f"chain) / regions.")
    report.data = {"regions": data}
    report.add_checks(checks)
    report.write()
