"""Part "script" of bench_checkpoint: TorchScript blocks checkpointed through the TorchScript front
door (torch.ops.torch_ext.checkpoint_module, the C++ path), one training step:

  (a) no checkpointing
  (b) torch.utils.checkpoint per block, use_reentrant=True (torch's non-reentrant checkpoint raises
      on a scripted block's first backward: docs/checkpoint.md)
  (c) checkpoint_module per block with early_stop=False: every replay runs the whole block
  (d) checkpoint_module per block (defaults: the replay stops once the last saved tensor is back)

Blocks: LayerNorm, Linear(width, 4 width), GELU, Linear(4 width, width) and a residual, each
scripted; the loop over them is Python's. Each variant scripts copies of the same blocks as a class
of its own: TorchScript compiles a class once and keeps one plan per compiled method for all its
instances, and the plan a plain run with grad settles on (autodiff subgraphs, which save their
tensors at their end, so a replay has nothing to stop before) is not the one a checkpointed run
keeps (docs/checkpoint.md, TorchScript). Peak: torch_ext.memory around one step (above its
start). Step time: rounds of a b c d in alternating order, median. Grad diff: max |g - g_(a)| /
max |g_(a)| over the input and every parameter.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import harness

VARIANTS = {
    "a": "(a) no checkpointing",
    "b": "(b) torch.utils.checkpoint (reentrant) per block",
    "c": "(c) checkpoint_module per block, early_stop=False",
    "d": "(d) checkpoint_module per block",
}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def forward_of(kind: str, blocks: list):
    def forward(x: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            if kind == "a":
                x = block(x)
            elif kind == "b":
                x = torch_checkpoint(block, x, use_reentrant=True)
            else:
                x = torch.ops.torch_ext.checkpoint_module(block, [x], early_stop=kind == "d")[0]
        return x

    return forward


def run(device: torch.device, quick: bool, command: str) -> None:
    if device.type != "cpu":
        print("part script: CPU only (it measures the C++ front door's replays, not a device)")
        return
    n_blocks, width, batch, tokens, repeat = (4, 64, 4, 32, 6) if quick else (8, 256, 16, 128, 12)
    torch.manual_seed(0)
    blocks = [Block(width) for _ in range(n_blocks)]
    x0 = torch.randn(batch, tokens, width, device=device)
    say = harness.progress("bench_checkpoint --part script")

    def step_of(kind: str):
        variant_class = type(f"Block{kind.upper()}", (Block,), {})
        scripted = []
        for block in blocks:
            copied = variant_class(width)
            copied.load_state_dict(block.state_dict())
            scripted.append(torch.jit.script(copied))
        params = [p for block in scripted for p in block.parameters()]
        forward = forward_of(kind, scripted)

        def step() -> list[torch.Tensor]:
            for p in params:
                p.grad = None
            x = x0.clone().requires_grad_()
            forward(x).pow(2).mean().backward()
            return [x.grad] + [p.grad for p in params]

        return step

    steps = {kind: step_of(kind) for kind in VARIANTS}
    grads = {kind: step() for kind, step in steps.items()}  # also the TorchScript executors' first calls
    peaks = {kind: harness.peak_memory(step) for kind, step in steps.items()}
    say("peaks measured")
    timings = harness.measure_interleaved(steps, warmup=2, repeat=repeat, alternate=True)
    say("steps timed")
    scale = max(g.abs().max().item() for g in grads["a"])
    report = harness.Report("checkpoint_script" + ("_quick" if quick else ""),
                            "Segment checkpointing: TorchScript blocks through the TorchScript front door (CPU)",
                            ["variant", "step peak", "step time", "vs (a)", "grad diff"], command)
    for kind, label in VARIANTS.items():
        diff = max((g - r).abs().max().item() for g, r in zip(grads[kind], grads["a"])) / scale
        report.add_row({"variant": label, "step peak": harness.format_bytes(peaks[kind]),
                        "step time": harness.format_seconds(timings[kind].median_seconds),
                        "vs (a)": f"{timings[kind].median_seconds / timings['a'].median_seconds:.3f}x",
                        "grad diff": f"{diff:.1e}"},
                       peak_bytes=peaks[kind], timing=timings[kind], grad_diff=diff)
    report.notes.append("")
    report.notes.append(f"{n_blocks} scripted blocks of width {width}, input ({batch}, {tokens}, {width}), fp32, "
                        f"{torch.get_num_threads()} torch thread(s); {repeat} rounds after 2 warm-up rounds.")
    d_vs_c = harness.paired_ratio(timings["d"], timings["c"])
    report.add_checks([
        harness.peak_and_time_check("(d) against (b)", timings, peaks, "d", "b", ("(d)", "(b)")),
        (f"(d)'s early stop saves replay time: (d) / (c) per round {d_vs_c[0]:.3f}, 95% interval "
         f"[{d_vs_c[1]:.3f}, {d_vs_c[2]:.3f}], at the same peak ({harness.format_bytes(peaks['d'])} vs "
         f"{harness.format_bytes(peaks['c'])})", d_vs_c[2] < 1 and peaks["d"] <= peaks["c"] * 1.02),
        ("(c) and (d) give (a)'s gradients (to 1e-5 of the largest)",
         all(r["raw"]["grad_diff"] <= 1e-5 for r in report.rows[2:])),
    ])
    report.data = {"peaks": peaks}
    report.write()
