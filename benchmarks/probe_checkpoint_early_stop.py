"""Probe (pure PyTorch, no torch_ext build needed): how much of torch.utils.checkpoint's step
time on the checkpoint benchmark's GPT comes from its early stop, and which ops it skips.

Runs, interleaved in rounds, one training step of the benchmark's model (12 blocks, width 192,
batch (4, 256), one torch thread) with (a) no checkpointing, (b) torch.utils.checkpoint per block
(use_reentrant=False, early_stop=True, torch's default) and (b') the same with early_stop=False.
Time is the thread's CPU time (time.thread_time), so waiting for a core on a shared machine does
not count. A dispatch mode lists the ops run in one block's backward with and without early stop.
Writes benchmarks/results/checkpoint_early_stop.{md,json}.

    python benchmarks/probe_checkpoint_early_stop.py [--repeat N]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parent.parent
# torch_ext/demos.py imports only PyTorch at the top; load it by path so the probe needs no built torch_ext.
_spec = importlib.util.spec_from_file_location("torch_ext_models", ROOT / "torch_ext" / "demos.py")
models = importlib.util.module_from_spec(_spec)
sys.modules["torch_ext_models"] = models
_spec.loader.exec_module(models)


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15, help="timed rounds (2 warm-up rounds more)")
    args = parser.parse_args()
    if args.repeat < 1:
        raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = models.GPTConfig(n_layer=12, n_embd=192, n_head=6, vocab_size=1024, block_size=256)
    model = models.GPT(config)
    tokens = torch.randint(0, config.vocab_size, (4, config.block_size + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def step(mode: str):
        def run() -> None:
            x = model.embed(inputs)
            for block in model.blocks:
                x = block(x) if mode == "plain" else checkpoint(block, x, use_reentrant=False,
                                                                  early_stop=(mode == "early"))
            models.language_model_loss(model.head(x), targets).backward()
        return run

    # Ops of one block's backward (replay + gradient) with and without early stop.
    block = model.blocks[0]
    x0 = model.embed(inputs).detach().requires_grad_()
    backward_ops = {}
    for mode in ("early", "full"):
        y = checkpoint(block, x0, use_reentrant=False, early_stop=(mode == "early"))
        with OpCounter() as counter:
            y.sum().backward()
        backward_ops[mode] = counter.ops
    with OpCounter() as counter, torch.no_grad():
        block(x0)
    forward_ops = set(counter.ops)
    # Ops of the forward that early stop does not replay (gradient ops such as add_ excluded).
    skipped = Counter({op: n for op, n in (Counter(backward_ops["full"]) - Counter(backward_ops["early"])).items()
                       if op in forward_ops})

    variants = {"(a) no checkpointing": step("plain"),
                "(b) torch.utils.checkpoint per block, early_stop=True (default)": step("early"),
                "(b') torch.utils.checkpoint per block, early_stop=False": step("full")}
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for round_index in range(2 + args.repeat):
        for name, fn in variants.items():
            for p in model.parameters():
                p.grad.zero_()
            start = time.thread_time()
            fn()
            elapsed = time.thread_time() - start
            if round_index >= 2:
                samples[name].append(elapsed)
    median = {name: statistics.median(values) for name, values in samples.items()}
    base = median["(a) no checkpointing"]

    lines = ["### Early stop in torch.utils.checkpoint (probe)", "",
             "| variant | step CPU time (median) | min-max | vs (a) |", "|---|---|---|---|"]
    for name, values in samples.items():
        lines.append(f"| {name} | {median[name] * 1e3:.1f} ms | {min(values) * 1e3:.1f}-{max(values) * 1e3:.1f} ms | "
                     f"{median[name] / base:.3f}x |")
    lines += ["", f"Measured with `python benchmarks/probe_checkpoint_early_stop.py --repeat {args.repeat}` on "
              f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 torch thread, thread CPU "
              f"time, {args.repeat} interleaved rounds after 2 warm-up rounds.", "",
              f"Ops in one block's backward: {len(backward_ops['full'])} without early stop, "
              f"{len(backward_ops['early'])} with it; forward ops early stop does not replay: "
              + ", ".join(f"{op} x{n}" if n > 1 else op for op, n in sorted(skipped.items())) + "."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "benchmarks" / "results"
    (out / "checkpoint_early_stop.md").write_text(text)
    (out / "checkpoint_early_stop.json").write_text(json.dumps(
        {"samples_seconds": samples, "median_seconds": median, "backward_ops": backward_ops,
         "skipped_by_early_stop": dict(skipped), "repeat": args.repeat, "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
