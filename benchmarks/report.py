"""Assemble docs/benchmarks.md from the latest results of each benchmark (benchmarks/results/).

    python benchmarks/report.py

Each bench_<capability>.py writes results/<name>.{md,json} (harness.Report): the table, the
command that produced it, the machine and the notes on its targets. This page is those files in
a fixed order, so it always holds the latest run of each; older runs stay in results/ under other
names. A result measured on another torch_ext version than this checkout's says so.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOC = HERE.parent / "docs" / "benchmarks.md"
sys.path.insert(0, str(HERE.parent))

SECTIONS = [
    ("Memory", "The counting CPU allocator's cost on an allocation-bound loop.", ["memory"]),
    ("Checkpoint", "Segment checkpointing: a GPT-style decoder's training step, Hugging Face GPT-2 and Llama with "
     "padded batches (eager and compiled), selective checkpointing policies and op-level plans on them (eager and "
     "compiled), the per-region overhead, and TorchScript blocks through the TorchScript front door.",
     ["checkpoint", "checkpoint_hf", "checkpoint_selective", "checkpoint_selective_replay", "checkpoint_compiled", "checkpoint_overhead",
      "checkpoint_script",
      "checkpoint_cuda", "checkpoint_selective_cuda_eager", "checkpoint_hf_cuda", "checkpoint_overhead_cuda"]),
    ("Paging", "Weight paging of a GPT from a safetensors file at several budgets, against accelerate's offloads; "
     "Hugging Face GPT-2 loaded from its folder, generating, and training adapters over paged weights.",
     ["paging", "paging_threads2", "paging_cuda", "paging_header", "paging_copy_rss", "paging_hf", "paging_hf_bf16",
      "paging_hf_bf16_amd_epyc", "paging_hf_train", "paging_moe", "paging_moe_analysis",
      "paging_quantized", "paging_quantized_analysis", "paging_hooks", "paging_hooks_analysis"]),
    ("Cache", "The lazy node cache on a diffusion-style loop, preprocessed weights and full misses.", ["cache"]),
    ("Cache across calls and processes", "Content keys against identity keys alone on a full miss, and a diffusers "
     "pipeline's text encoder across calls and processes (content keys, the store).",
     ["cache_full_miss", "cache_pipeline"]),
    ("Plan", "The plan cache serving random batch sizes, what each step of a plan buys, serving torch.export "
     "programs (AOTInductor plans per bucket, a saved cache restarted, the dynamic batcher), and plans chosen "
     "from traffic.",
     ["plan", "plan_steps", "plan_cuda", "plan_cuda_steps", "plan_export", "plan_traffic", "plan_traffic_intel_xeon",
      "plan_drift", "plan_batcher", "plan_batcher_asyncio", "plan_batcher_asyncio_wake",
      "plan_batcher_intel_xeon_wakeups"]),
]

INTRO = """# Benchmarks

The latest run of each benchmark, assembled by `python benchmarks/report.py` from
`benchmarks/results/` (older runs live there under other names). Every benchmark uses
`benchmarks/harness.py`: warm-up, then repeated timing (median and spread) with the variants
interleaved in one process or in back-to-back processes on the same inputs, memory through
`torch_ext.memory` (CPU) or `torch.cuda` (GPU), and the machine's description. The CPU runs are on
a shared 2-core VM: compare ratios measured in one run, not absolute times across runs.

On a machine with an NVIDIA GPU and a CUDA build of torch, `bash benchmarks/run_gpu.sh` builds
against that torch, runs the C++ and CUDA tests, then the benchmarks with `--device cuda`.
"""


def provenance(name: str) -> str:
    """Which torch_ext measured a result, flagged when it is not this checkout's version."""
    from torch_ext.version import __version__

    path = RESULTS / f"{name}.json"
    if not path.exists():
        return ""
    machine = json.loads(path.read_text()).get("machine", {})
    version, commit, date = machine.get("torch_ext"), machine.get("commit"), machine.get("date")
    where = f"torch_ext {version}" + (f" ({commit})" if commit else "") + (f", {date}" if date else "")
    if version != __version__:
        return f"*Measured on {where}, an earlier version than this checkout's {__version__}.*\n\n"
    return f"*Measured on {where}.*\n\n"


def main() -> None:
    parts = [INTRO]
    for title, what, names in SECTIONS:
        parts.append(f"## {title}\n\n{what}\n")
        for name in names:
            path = RESULTS / f"{name}.md"
            if path.exists():
                text = path.read_text().strip()
                heading, _, body = text.partition("\n")
                parts.append(f"{heading}\n\n{provenance(name)}{body.strip()}\n")
    DOC.write_text("\n".join(parts))
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
