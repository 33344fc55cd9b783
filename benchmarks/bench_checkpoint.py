"""Segment checkpointing on a GPT-2-style decoder training step (CPU), in one run:

  (a) no checkpointing
  (b) torch.utils.checkpoint per block (use_reentrant=False)
  (b') the same with early_stop=False: torch replays the whole block, as torch_ext does (reference
       for how much of (b)'s step time its early stop saves)
  (c) torch_ext per block (CheckpointedSequential(every=1))
  (d) torch_ext planned (plan_checkpoints) at 50% and 25% of (a)'s activation memory

Peak memory: torch_ext.memory.track around one step (peak above the step's start; parameter
gradients are preallocated and accumulate in place, so the peak is activations and temporaries).
"Blocks peak" runs only the block chain forward and backward: the memory the planner budgets.
Step time: harness.measure_interleaved (rounds of a b c d, median), one torch thread by default. Per-region overhead: a chain of
tiny regions (Linear 32x32 on 8 rows) timed forward + backward with and without checkpointing;
(time - plain time) / regions.

    python benchmarks/bench_checkpoint.py [--quick]
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import torch_ext  # noqa: E402
from torch_ext import memory  # noqa: E402
from torch_ext.models import GPT, GPTConfig, language_model_loss  # noqa: E402


class TorchCheckpointPerBlock(nn.Module):
    def __init__(self, blocks, early_stop: bool = True):
        super().__init__()
        self.blocks = blocks
        self.early_stop = early_stop

    def forward(self, x):
        for block in self.blocks:
            x = torch_checkpoint(block, x, use_reentrant=False, early_stop=self.early_stop)
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer repeats")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared 2-core machine, OpenMP workers spinning "
                             "against other processes make multi-threaded timings erratic)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    command = "python benchmarks/bench_checkpoint.py" + (" --quick" if args.quick else "")

    torch.manual_seed(0)
    if args.quick:
        config = GPTConfig(n_layer=12, n_embd=64, n_head=4, vocab_size=256, block_size=64)
        batch, repeat, regions, region_repeat = 2, 3, 20, 20
    else:
        config = GPTConfig(n_layer=12, n_embd=192, n_head=6, vocab_size=1024, block_size=256)
        batch, repeat, regions, region_repeat = 4, 9, 50, 60
    model = GPT(config)
    tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def zero_grads():
        for p in model.parameters():
            p.grad.zero_()

    sample = model.embed(inputs).detach().requires_grad_()
    plain_chain = nn.Sequential(*model.blocks)

    def chain_peak(chain) -> int:
        x = sample.detach().requires_grad_()
        with memory.track() as tracked:
            chain(x).backward(torch.ones_like(sample))
        zero_grads()
        return tracked.peak_delta_bytes

    chain_peak(plain_chain)  # warm-up
    activation_bytes = chain_peak(plain_chain)
    chains = {
        "(a) no checkpointing": plain_chain,
        "(b) torch.utils.checkpoint per block": TorchCheckpointPerBlock(model.blocks),
        "(b') (b) with early_stop=False": TorchCheckpointPerBlock(model.blocks, early_stop=False),
        "(c) torch_ext per block": torch_ext.CheckpointedSequential(model.blocks, every=1),
    }
    budgets = {}
    plans = {}
    for fraction in (0.5, 0.25):
        name = f"(d) torch_ext planned, {fraction:.0%} budget"
        budget = int(activation_bytes * fraction)
        plan = torch_ext.plan_checkpoints(list(model.blocks), sample, budget_bytes=budget, repeat=2)
        plans[name] = plan
        budgets[name] = budget
        chains[name] = torch_ext.CheckpointedSequential(model.blocks, boundaries=plan)

    def step_of(chain):
        def step():
            x = model.embed(inputs)
            loss = language_model_loss(model.head(chain(x)), targets)
            loss.backward()
        return step

    steps = {name: step_of(chain) for name, chain in chains.items()}
    peaks, chain_peaks = {}, {}
    for name, step in steps.items():
        step()
        zero_grads()
        with memory.track() as tracked:
            step()
        peaks[name] = tracked.peak_delta_bytes
        zero_grads()
        chain_peaks[name] = chain_peak(chains[name])
    timings = harness.measure_interleaved(steps, warmup=1, repeat=repeat,
                                          before_each={name: zero_grads for name in steps})

    # ---- per-region overhead on tiny segments
    torch.manual_seed(0)
    tiny = [nn.Linear(32, 32) for _ in range(regions)]
    ours = [torch_ext.checkpoint(copy.deepcopy(layer)) for layer in tiny]
    x_tiny = torch.randn(8, 32, requires_grad=True)

    def region_chain(kind):
        def run():
            x = x_tiny
            if kind == "plain":
                for layer in tiny:
                    x = layer(x)
            elif kind == "torch":
                for layer in tiny:
                    x = torch_checkpoint(layer, x, use_reentrant=False)
            else:
                for layer in ours:
                    x = layer(x)
            x.sum().backward()
        return run

    def region_forward():
        with torch.enable_grad():
            x = x_tiny
            for layer in tiny:
                x = layer(x)

    region_timings = harness.measure_interleaved(
        {"plain": region_chain("plain"), "torch": region_chain("torch"), "torch_ext": region_chain("ours"),
         "forward only": region_forward}, warmup=3, repeat=region_repeat)
    plain_region = region_timings["plain"].median_seconds
    overhead = {kind: (region_timings[kind].median_seconds - plain_region) / regions for kind in ("torch", "torch_ext")}
    replay_seconds = region_timings["forward only"].median_seconds / regions

    # ---- report
    report = harness.Report("checkpoint", "Segment checkpointing: GPT-2-style decoder training step (CPU)",
                            ["variant", "step peak memory", "blocks peak memory", "step time", "vs (a)", "checkpoints",
                             "budget"], command)
    base_time = timings["(a) no checkpointing"].median_seconds
    for name in steps:
        t = timings[name]
        plan = plans.get(name)
        report.add_row({
            "variant": name,
            "step peak memory": harness.format_bytes(peaks[name]),
            "blocks peak memory": harness.format_bytes(chain_peaks[name]),
            "step time": f"{harness.format_seconds(t.median_seconds)} ±{t.spread:.0%}",
            "vs (a)": f"{t.median_seconds / base_time:.2f}x",
            "checkpoints": str(plan.boundaries) if plan else ("0" if name.startswith("(a)") else "every block"),
            "budget": harness.format_bytes(budgets[name]) if name in budgets else "",
        }, peak_bytes=peaks[name], blocks_peak_bytes=chain_peaks[name], step_seconds=t.median_seconds,
            timing=t, budget_bytes=budgets.get(name), plan=plan.as_dict() if plan else None)

    a, b, c = "(a) no checkpointing", "(b) torch.utils.checkpoint per block", "(c) torch_ext per block"
    tb, tc, ta = (timings[k].median_seconds for k in (b, c, a))
    ratio = overhead["torch"] / overhead["torch_ext"] if overhead["torch_ext"] > 0 else float("inf")
    checks = [
        (f"(c) has (b)'s peak memory at lower step time: blocks peak {harness.format_bytes(chain_peaks[c])} vs "
         f"{harness.format_bytes(chain_peaks[b])}, step peak {harness.format_bytes(peaks[c])} vs "
         f"{harness.format_bytes(peaks[b])}; step {harness.format_seconds(tc)} vs {harness.format_seconds(tb)}",
         chain_peaks[c] <= chain_peaks[b] * 1.02 and tc < tb),
        (f"per-region overhead at least 5x smaller: torch {harness.format_seconds(overhead['torch'])}, torch_ext "
         f"{harness.format_seconds(overhead['torch_ext'])} per region ({ratio:.1f}x); one plain forward of a region "
         f"(the replay every checkpoint pays) is {harness.format_seconds(replay_seconds)}", ratio >= 5),
    ]
    for name, budget in budgets.items():
        checks.append((f"{name} stays within its budget: blocks peak {harness.format_bytes(chain_peaks[name])} <= "
                       f"{harness.format_bytes(budget)} (predicted {harness.format_bytes(plans[name].predicted_peak_bytes)})",
                       chain_peaks[name] <= budget))
    checks.append((f"(c) step time at most 1.35x (a)'s: {tc / ta:.2f}x", tc <= 1.35 * ta))
    report.notes.append("")
    report.notes.append(f"Model: GPT, {config.n_layer} blocks, width {config.n_embd}, {config.n_head} heads, "
                        f"batch {tuple(inputs.shape)}, {torch.get_num_threads()} torch thread(s); (a)'s blocks activation memory {harness.format_bytes(activation_bytes)}. "
                        f"Per-region overhead over {regions} regions x {region_repeat} rounds.")
    bp = "(b') (b) with early_stop=False"
    report.notes.append("")
    report.notes.append(f"(b') is (b) without torch's early stop (the replay runs the whole block, as torch_ext's does): "
                        f"{harness.format_seconds(timings[bp].median_seconds)}; early stop saves (b) "
                        f"{harness.format_seconds(timings[bp].median_seconds - tb)} per step.")
    report.notes.append("")
    for text, ok in checks:
        report.notes.append(f"- {'met' if ok else 'NOT met'}: {text}")
    report.data = {"overhead_seconds_per_region": overhead, "replay_seconds_per_region": replay_seconds,
                   "overhead_ratio": ratio, "region_timings": region_timings, "activation_bytes": activation_bytes,
                   "checks": [{"target": text, "met": ok} for text, ok in checks]}
    report.write()


if __name__ == "__main__":
    main()
