"""Segment checkpointing benchmarks, in six parts (--part, default all):

gpt: a GPT-2-style decoder training step (torch_ext.demos.GPT) through torch_ext's chain API:
  (a) no checkpointing
  (b) torch.utils.checkpoint per block (use_reentrant=False)
  (b') the same with early_stop=False: torch replays the whole block (how much of (b)'s step
       time its early stop saves; torch_ext's replays stop early by the recorded graph's tail)
  (c) torch_ext per block (CheckpointedSequential(every=1))
  (d) torch_ext planned (plan_checkpoints) at 50% and 25% of (a)'s activation memory
  Peak memory: torch_ext.memory.track around one step (peak above the step's start; parameter
  gradients are preallocated and accumulate in place, so the peak is activations and temporaries).
  "Blocks peak" runs only the block chain forward and backward: the memory the planner budgets.
  Step time: harness.measure_interleaved (rounds of a b c d, median); (c) against (b): further
  rounds of (b) and (c) alone in alternating order, judged by a 95% sign-test interval on the
  per-round difference.
hf: Hugging Face GPT-2 and Llama with padded batches, eager and compiled (checkpoint_hf.py).
overhead: per-region overhead on a Linear and a parameter-free function region (checkpoint_overhead.py).
selective: torch's selective checkpointing (context_fn, a torchtitan-style policy) on Hugging Face
  GPT-2 and Llama, through torch's checkpoint and through torch_ext's (checkpoint_selective.py).
compiled: op-level plans on the same models under torch.compile: what the forward keeps for
  backward and the step's peak, eager and compiled (checkpoint_compiled.py).
script: TorchScript blocks through the TorchScript front door (checkpoint_module), against
  torch's reentrant checkpoint and without early stop (checkpoint_script.py).

--device cuda runs the same code on the GPU (torch.cuda peak memory, steps synchronised); the gpt
part then uses a GPT-2-small-width model and adds (c-offload) and (c-bf16)
(CheckpointedSequential(every=1, storage=...)), the whole step's absolute peak and each variant's
gradient difference from (a). Results: results/checkpoint{,_hf,_overhead,_script}[_cuda][_quick].{md,json}.

    python benchmarks/bench_checkpoint.py [--part gpt|hf|overhead|selective|compiled|script] [--quick] [--device cuda] [--eager-only]
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkpoint_compiled  # noqa: E402
import checkpoint_hf  # noqa: E402
import checkpoint_overhead  # noqa: E402
import checkpoint_script  # noqa: E402
import checkpoint_selective  # noqa: E402
import harness  # noqa: E402

import torch_ext  # noqa: E402
from torch_ext import memory  # noqa: E402
from torch_ext.demos import GPT, GPTConfig, language_model_loss  # noqa: E402

OFFLOAD = "(c-offload) torch_ext per block, offload storage"
BF16 = "(c-bf16) torch_ext per block, bf16 storage"


class TorchCheckpointPerBlock(nn.Module):
    def __init__(self, blocks, early_stop: bool = True):
        super().__init__()
        self.blocks = blocks
        self.early_stop = early_stop

    def forward(self, x):
        for block in self.blocks:
            x = torch_checkpoint(block, x, use_reentrant=False, early_stop=self.early_stop)
        return x


CUDA_REPORT = "checkpoint_cuda"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "gpt", "hf", "overhead", "selective", "compiled", "script"),
                        default="all", help="which part to run (default all)")
    parser.add_argument("--quick", action="store_true", help="smaller models and fewer repeats")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared 2-core machine, OpenMP workers spinning "
                             "against other processes make multi-threaded timings erratic)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu (default: results/checkpoint.{md,json}) or cuda (a GPU-sized model, offload "
                             "and bf16 storage too: results/checkpoint_cuda.{md,json}, _quick with --quick)")
    parser.add_argument("--eager-only", action="store_true",
                        help="part selective: its eager rows only (no torch.compile rows: their 20 Inductor "
                             "compiles outlast a GPU lent for minutes)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: CUDA is not available here (torch {torch.__version__}, "
                     f"torch.version.cuda={torch.version.cuda}, torch.cuda.device_count()={torch.cuda.device_count()})")
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    options = ((f" --part {args.part}" if args.part != "all" else "") + (" --device cuda" if args.device == "cuda" else "")
               + (" --quick" if args.quick else "") + (" --eager-only" if args.eager_only else ""))
    selective = functools.partial(checkpoint_selective.run, compiled=not args.eager_only)
    for part, run_part in (("gpt", run), ("hf", checkpoint_hf.run), ("overhead", checkpoint_overhead.run),
                           ("selective", selective), ("compiled", checkpoint_compiled.run),
                           ("script", checkpoint_script.run)):
        if args.part in ("all", part):
            run_part(device, args.quick, "python benchmarks/bench_checkpoint.py" + options)


def run(device: torch.device, quick: bool, command: str) -> None:
    device_mode = device.type == "cuda"
    torch.manual_seed(0)
    if device_mode and quick:
        config = GPTConfig(n_layer=12, n_embd=256, n_head=4, vocab_size=1024, block_size=128)
        batch, warmup, repeat, pair_repeat = 4, 1, 3, 6
    elif device_mode:
        config = GPTConfig(n_layer=12, n_embd=768, n_head=12, vocab_size=8192, block_size=512)
        batch, warmup, repeat, pair_repeat = 8, 2, 12, 30
    elif quick:
        config = GPTConfig(n_layer=12, n_embd=64, n_head=4, vocab_size=256, block_size=64)
        batch, warmup, repeat, pair_repeat = 2, 1, 3, 6
    else:
        config = GPTConfig(n_layer=12, n_embd=192, n_head=6, vocab_size=1024, block_size=256)
        batch, warmup, repeat, pair_repeat = 4, 1, 15, 30
    model = GPT(config).to(device)
    tokens = torch.randint(0, config.vocab_size, (batch, config.block_size + 1)).to(device)
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
        with memory.track(device) as tracked:
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
    if device_mode:
        chains[OFFLOAD] = torch_ext.CheckpointedSequential(model.blocks, every=1, storage="offload")
        chains[BF16] = torch_ext.CheckpointedSequential(model.blocks, every=1, storage="bf16")
    budgets = {}
    plans = {}
    failed = {}
    for fraction in (0.5, 0.25):
        name = f"(d) torch_ext planned, {fraction:.0%} budget"
        budget = int(activation_bytes * fraction)
        try:
            plan = torch_ext.plan_checkpoints(list(model.blocks), sample, budget_bytes=budget, repeat=2,
                                              gradients="accumulated")  # the steps preallocate .grad
        except ValueError as error:  # no plan fits this budget
            if not device_mode:
                raise
            failed[name] = str(error)
            continue
        plans[name] = plan
        budgets[name] = budget
        chains[name] = torch_ext.CheckpointedSequential(model.blocks, boundaries=plan)

    def step_of(chain):
        def step():
            x = model.embed(inputs)
            loss = language_model_loss(model.head(chain(x)), targets)
            loss.backward()
        return step

    def flat_grads() -> torch.Tensor:
        return torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()]).float().cpu()

    steps = {name: step_of(chain) for name, chain in chains.items()}
    peaks, chain_peaks, total_peaks, grad_diffs = {}, {}, {}, {}
    reference_grads = None
    for name, step in list(steps.items()):
        try:
            step()
            zero_grads()
            with memory.track(device) as tracked:
                step()
            peaks[name] = tracked.peak_delta_bytes
            total_peaks[name] = tracked.peak_bytes
            if device_mode:
                # Gradients of one step against (a)'s: max |g - g_a| / max |g_a| over all parameters.
                grads = flat_grads()
                if reference_grads is None and name == "(a) no checkpointing":
                    reference_grads = grads
                if reference_grads is not None:
                    scale = reference_grads.abs().max().item() or 1.0
                    grad_diffs[name] = (grads - reference_grads).abs().max().item() / scale
                del grads
            zero_grads()
            chain_peaks[name] = chain_peak(chains[name])
        except Exception as error:  # device mode reports a failing variant and goes on
            if not device_mode:
                raise
            failed[name] = f"{type(error).__name__}: {error}"
            del steps[name]
            for table in (peaks, total_peaks, grad_diffs, chain_peaks):
                table.pop(name, None)
            zero_grads()
    del reference_grads
    timings = harness.measure_interleaved(steps, warmup=warmup, repeat=repeat,
                                          before_each={name: zero_grads for name in steps})
    # (c) against (b), about 1% apart: rounds of their own, more of them, in alternating order so
    # that neither always runs after the same variant (in the rounds above (b) always follows (a)).
    a, b, c = "(a) no checkpointing", "(b) torch.utils.checkpoint per block", "(c) torch_ext per block"
    pair = (harness.measure_interleaved({b: steps[b], c: steps[c]}, warmup=1, repeat=pair_repeat,
                                        before_each={b: zero_grads, c: zero_grads}, alternate=True)
            if b in steps and c in steps else {})

    # ---- report
    columns = ["variant", "step peak memory", "blocks peak memory", "step time", "vs (a)", "checkpoints", "budget"]
    if device_mode:
        columns[1:1] = ["step peak (total)"]
        columns.append("grad diff vs (a)")
        where = (f"CUDA, {torch.cuda.get_device_name(device)}" if device.type == "cuda"
                 else "dry run of the CUDA code path on CPU")
        report = harness.Report(CUDA_REPORT + ("_quick" if quick else ""),
                                f"Segment checkpointing: GPT-2-style decoder training step ({where})", columns, command)
    else:
        report = harness.Report("checkpoint" + ("_quick" if quick else ""),
                                "Segment checkpointing: GPT-2-style decoder training step (CPU)", columns, command)
    base_time = timings[a].median_seconds if a in timings else float("nan")
    for name in steps:
        t = timings[name]
        plan = plans.get(name)
        cells = {
            "variant": name,
            "step peak memory": harness.format_bytes(peaks[name]),
            "blocks peak memory": harness.format_bytes(chain_peaks[name]),
            "step time": f"{harness.format_seconds(t.median_seconds)} ±{t.spread:.0%}",
            "vs (a)": f"{t.median_seconds / base_time:.2f}x",
            "checkpoints": str(plan.boundaries) if plan else ("0" if name.startswith("(a)") else "every block"),
            "budget": harness.format_bytes(budgets[name]) if name in budgets else "",
        }
        raw = {}
        if device_mode:
            cells["step peak (total)"] = harness.format_bytes(total_peaks[name])
            cells["grad diff vs (a)"] = f"{grad_diffs[name]:.1e}" if name in grad_diffs else ""
            raw = {"total_peak_bytes": total_peaks[name], "grad_max_rel_diff": grad_diffs.get(name)}
        report.add_row(cells, peak_bytes=peaks[name], blocks_peak_bytes=chain_peaks[name], step_seconds=t.median_seconds,
                       timing=t, budget_bytes=budgets.get(name), plan=plan.as_dict() if plan else None, **raw)

    median = {name: t.median_seconds for name, t in timings.items()}
    ta, tb, tc = (median.get(k, float("nan")) for k in (a, b, c))
    checks = []
    if pair:
        # Each round's (c) - (b) cancels the load that hits both.
        paired, low, high, faster = harness.paired_difference(pair[c], pair[b])
        verdict = "lower" if high < 0 else ("higher" if low > 0 else "a tie within this run's noise")
        checks.append(
            (f"(c) has (b)'s peak memory at lower step time: blocks peak {harness.format_bytes(chain_peaks[c])} vs "
             f"{harness.format_bytes(chain_peaks[b])}, step peak {harness.format_bytes(peaks[c])} vs "
             f"{harness.format_bytes(peaks[b])}; step {harness.format_seconds(tc)} vs {harness.format_seconds(tb)} in the "
             f"table; in {pair_repeat} rounds of (b) and (c) alone, alternating which runs first, "
             f"{harness.format_seconds(pair[c].median_seconds)} vs {harness.format_seconds(pair[b].median_seconds)}, "
             f"per round (c) - (b) has median {paired * 1e3:+.2f} ms, 95% interval [{low * 1e3:+.2f}, "
             f"{high * 1e3:+.2f}] ms (sign test), (c) faster in {faster} of {pair_repeat} rounds: "
             f"{verdict} (met only when the whole interval is below zero)",
             chain_peaks[c] <= chain_peaks[b] * 1.02 and high < 0))
    for name, budget in budgets.items():
        if name not in chain_peaks:
            continue
        checks.append((f"{name} stays within its budget: blocks peak {harness.format_bytes(chain_peaks[name])} <= "
                       f"{harness.format_bytes(budget)} (predicted {harness.format_bytes(plans[name].predicted_peak_bytes)})",
                       chain_peaks[name] <= budget))
    if a in timings and c in timings:
        checks.append((f"(c) step time at most 1.35x (a)'s: {tc / ta:.2f}x", tc <= 1.35 * ta))
    if device_mode and OFFLOAD in timings and c in timings:
        to = timings[OFFLOAD].median_seconds
        checks.append((f"(c-offload) keeps less GPU memory than (c) (boundaries leave the device): blocks peak "
                       f"{harness.format_bytes(chain_peaks[OFFLOAD])} vs {harness.format_bytes(chain_peaks[c])}, step peak "
                       f"{harness.format_bytes(peaks[OFFLOAD])} vs {harness.format_bytes(peaks[c])}; step "
                       f"{harness.format_seconds(to)} vs {harness.format_seconds(tc)} ({to / tc:.2f}x (c)'s)",
                       chain_peaks[OFFLOAD] < chain_peaks[c] and peaks[OFFLOAD] < peaks[c]))
    for name, error in failed.items():
        checks.append((f"{name} could not run: {error}", False))
    report.notes.append("")
    if device_mode:
        report.notes.append(
            f"Model: GPT, {config.n_layer} blocks, width {config.n_embd}, {config.n_head} heads, vocabulary "
            f"{config.vocab_size}, batch {tuple(inputs.shape)}, fp32 (float32 matmul precision "
            f"{torch.get_float32_matmul_precision()!r}), random weights, on {device}; (a)'s blocks activation memory "
            f"{harness.format_bytes(activation_bytes)}. Step time: median of {repeat} interleaved rounds after "
            f"{warmup} warm-up round(s), synchronised.'")
        report.notes.append("")
        report.notes.append(
            "Step peak (total): the highest allocated memory during the step, weights and gradients included; step "
            "peak and blocks peak: above the memory live when the step (or the blocks' forward and backward) began. "
            "Grad diff: max |g - g_(a)| / max |g_(a)| over all parameters after one step.")
    else:
        report.notes.append(f"Model: GPT, {config.n_layer} blocks, width {config.n_embd}, {config.n_head} heads, "
                            f"batch {tuple(inputs.shape)}, {torch.get_num_threads()} torch thread(s); (a)'s blocks "
                            f"activation memory {harness.format_bytes(activation_bytes)}.")
    bp = "(b') (b) with early_stop=False"
    if bp in timings and b in timings:
        report.notes.append("")
        report.notes.append(f"(b') is (b) without torch's early stop (the replay runs the whole block): "
                            f"{harness.format_seconds(timings[bp].median_seconds)}; early stop saves (b) "
                            f"{harness.format_seconds(timings[bp].median_seconds - tb)} per step.")
    if device_mode and BF16 in timings and c in timings:
        report.notes.append("")
        report.notes.append(f"(c-bf16) stores the boundaries in bfloat16: blocks peak {harness.format_bytes(chain_peaks[BF16])} "
                            f"vs (c)'s {harness.format_bytes(chain_peaks[c])}, step "
                            f"{harness.format_seconds(timings[BF16].median_seconds)} vs {harness.format_seconds(tc)}.")
    report.data = {"pair_timings": pair, "activation_bytes": activation_bytes}
    if device_mode:
        report.data.update({"device": str(device), "failed": failed,
                            "config": {"n_layer": config.n_layer, "n_embd": config.n_embd, "n_head": config.n_head,
                                       "vocab_size": config.vocab_size, "block_size": config.block_size,
                                       "batch": batch}})
    report.add_checks(checks)
    report.write()


if __name__ == "__main__":
    main()
