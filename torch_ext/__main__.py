"""python -m torch_ext {info,demo}: what is installed, and a tour of what it does."""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

import torch_ext
from torch_ext import cache, memory, paging, plan
from torch_ext.checkpoint import demo as demo_checkpoint
from torch_ext.models import GPT, GPTConfig, language_model_loss


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def registered_ops() -> list[str]:
    return sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith("torch_ext::"))


def registered_classes() -> list[str]:
    # Each custom-class method schema takes the class itself as its first argument (self).
    prefix = "__torch__.torch.classes.torch_ext."
    names = set()
    for schema in torch._C._jit_get_custom_class_schemas():
        if schema.arguments:
            self_type = str(schema.arguments[0].type)
            if self_type.startswith(prefix):
                names.add(self_type[len(prefix):])
    return sorted(names)


def info() -> None:
    build = dict(torch_ext._C.build_info)
    rows = [
        ("torch_ext", torch_ext.__version__),
        ("torch", f"{torch.__version__} (built against {build['torch_version']})"),
        ("python", platform.python_version()),
        ("machine", f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"),
        ("build", f"C++ {build['cplusplus']}, {build['compiler']}, CUDA {'on' if build['cuda'] else 'off'}"),
        ("cuda available", str(torch.cuda.is_available())),
        ("library", torch_ext.library_path()),
        ("counting allocator", "installed" if torch_ext._C.memory.counting_allocator_installed() else "not installed"),
    ]
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print(f"ops ({len(registered_ops())}):")
    for name in registered_ops():
        print(f"  torch.ops.{name.replace('::', '.')}")
    print(f"classes ({len(registered_classes())}):")
    for name in registered_classes():
        print(f"  torch.classes.torch_ext.{name}")


def demo_memory(progress) -> None:
    """A training step of the built-in decoder: peak CPU memory and bytes saved for backward."""
    torch.manual_seed(0)
    config = GPTConfig(n_layer=6, n_embd=256, n_head=8, vocab_size=1024, block_size=256)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, config.vocab_size, (8, config.block_size))
    parameter_bytes = sum(p.nbytes for p in model.parameters())
    steps = 3
    results = []
    for _ in progress(range(steps), desc="training steps"):
        start = time.perf_counter()
        with memory.track() as tracked:
            loss = language_model_loss(model(batch[:, :-1]), batch[:, 1:])
            saved = tracked.saved_bytes
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        results.append((time.perf_counter() - start, tracked.peak_delta_bytes, saved, loss.item()))
    seconds, peak, saved, loss = results[-1]
    print(f"model: GPT, {config.n_layer} blocks, width {config.n_embd}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters ({_mib(parameter_bytes)})")
    print(f"batch: {tuple(batch[:, :-1].shape)} tokens")
    print(f"step time:             {seconds * 1e3:.0f} ms (last of {steps}; the first also creates optimizer state)")
    print(f"peak CPU memory above the step's start: {_mib(peak)}")
    print(f"saved for backward:    {_mib(saved)} (each storage once, parameters included)")
    print(f"loss:                  {loss:.4f}")


# Each capability adds its section here, in the order of the README.
DEMO_SECTIONS = [
    ("CPU memory accounting", demo_memory),
    ("Segment checkpointing", demo_checkpoint),
    ("Weight paging", paging.demo),
    ("Lazy node cache", cache.demo),
    ("Dynamic-batch plan cache", plan.demo),
]


def demo() -> None:
    from tqdm import tqdm

    def progress(iterable, desc):
        return tqdm(iterable, desc=desc, leave=False, file=sys.stderr, disable=None)

    print(f"torch_ext {torch_ext.__version__} demo on torch {torch.__version__}, {os.cpu_count()} cores\n")
    for title, section in DEMO_SECTIONS:
        print(f"== {title} ==")
        start = time.perf_counter()
        section(progress)
        print(f"({time.perf_counter() - start:.1f} s)\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_ext", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="torch version, build flags, library path, registered ops and classes")
    commands.add_parser("demo", help="a tour of each capability on built-in models")
    args = parser.parse_args(argv)
    {"info": info, "demo": demo}[args.command]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
