"""Two reliability benchmarks of weight paging (issue 16), run by bench_paging.py:

  --header    opening a safetensors header of 10k, 80k and 160k one-element tensors:
              torch_ext.SafetensorsSource against the safetensors package's safe_open
              (target: within 2x at every size).
  --copy-rss  the copy path's peak RSS against its budget: a GPT-2-sized model paged at
              30% of its weights, with the pager's own buffers (the default), with c10's CPU
              allocator (own_buffers=False), and with that allocator under MALLOC_MMAP_THRESHOLD_
              (the former workaround). Target: peak RSS above start <= budget + the largest tensor
              + COPY_RSS_CONSTANT.
Each variant runs in its own subprocess.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import Report, format_bytes, format_seconds

HEADER_SIZES = (10_000, 80_000, 160_000)
# What the copy path's peak RSS may hold besides budget + largest tensor (docs/paging.md): the
# forward's activations and temporaries, tensors under a page (c10's allocator), and glibc's
# arenas. Measured need at 1x16 tokens is in the table's notes.
COPY_RSS_CONSTANT = 64 << 20
GPT2 = dict(vocab_size=50257, block_size=1024, n_layer=8, n_head=12, n_embd=768)


NAME_STYLES = {"short": "t{i}", "long": "model.layers.{layer}.block_sparse_moe.experts.{expert}.w{w}.weight"}


def _write_header_file(path: Path, n: int, style: str) -> None:
    header, offset = {}, 0
    for i in range(n):
        header[NAME_STYLES[style].format(i=i, layer=i // 16, expert=i % 16, w=i % 3)] = {
            "dtype": "F32", "shape": [1], "data_offsets": [offset, offset + 4]}
        offset += 4
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(offset))


_OPEN_CHILD = """
import json, sys, time, statistics
import torch_ext
from safetensors import safe_open
path, repeat = sys.argv[1], int(sys.argv[2])
def ours():
    return len(torch_ext.SafetensorsSource(path).names())
def theirs():
    with safe_open(path, "pt") as f:
        return len(list(f.keys()))
assert ours() == theirs()
times = {"torch_ext": [], "safe_open": []}
for _ in range(repeat):
    for name, fn in (("torch_ext", ours), ("safe_open", theirs)):
        start = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - start)
print(json.dumps({k: statistics.median(v) for k, v in times.items()}))
"""


def header_benchmark(command: str, repeat: int = 5) -> Report:
    report = Report("paging_header", "Weight paging: opening a safetensors header (n one-element tensors)",
                    ["tensors", "names", "header", "torch_ext SafetensorsSource", "safetensors safe_open", "ratio", "target"],
                    command)
    with tempfile.TemporaryDirectory() as folder:
        for style, n in [(style, n) for style in NAME_STYLES for n in HEADER_SIZES]:
            path = Path(folder) / f"h{n}{style}.safetensors"
            _write_header_file(path, n, style)
            out = subprocess.run([sys.executable, "-c", _OPEN_CHILD, str(path), str(repeat)], check=True,
                                 capture_output=True, text=True, env=_child_env()).stdout
            medians = json.loads(out.strip().splitlines()[-1])
            ratio = medians["torch_ext"] / medians["safe_open"]
            header_bytes = struct.unpack("<Q", path.read_bytes()[:8])[0]
            report.add_row({"tensors": f"{n:,}", "names": style, "header": format_bytes(header_bytes),
                            "torch_ext SafetensorsSource": format_seconds(medians["torch_ext"]),
                            "safetensors safe_open": format_seconds(medians["safe_open"]), "ratio": f"{ratio:.2f}x",
                            "target": "met" if ratio <= 2 else "MISSED"},
                           tensors=n, names=style, header_bytes=header_bytes, ratio=ratio, **medians)
    report.notes.append(f"Median of {repeat} opens each, alternating, in one subprocess per size, file in the page "
                        f"cache. torch_ext's open parses and validates the whole header (UTF-8, duplicate keys, "
                        f"offsets tiling the data) and maps the file; safe_open parses the header, and its keys are "
                        f"listed. Short names `t123`, long ones like "
                        f"`model.layers.7.block_sparse_moe.experts.3.w1.weight`. Target: within 2x of safe_open.")
    return report


_RSS_CHILD = """
import json, sys, time, torch, torch_ext
from torch_ext.demos import GPT, GPTConfig
path, config, budget, own = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
torch.set_num_threads(1)
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
with torch.device("meta"):
    model = GPT(GPTConfig(**config)).eval()
pager = torch_ext.page_weights(model, path, budget, policy="scan_resistant", prefetch=12, own_buffers=own,
                                 zero_copy=False)
tokens = torch.zeros(1, 16, dtype=torch.long)
open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM
start = status("VmRSS:")
with torch.no_grad():
    for _ in range(3):
        model(tokens)
time.sleep(0.2)
print(json.dumps({"peak_above_start": status("VmHWM:") - start, "after_above_start": status("VmRSS:") - start,
                  "stats": pager.stats().as_dict()}))
"""


def copy_rss_benchmark(command: str) -> Report:
    import torch
    import torch_ext
    from torch_ext.demos import GPT, GPTConfig

    report = Report("paging_copy_rss", "Weight paging: the copy path's peak RSS against its budget",
                    ["variant", "budget", "largest tensor", "peak RSS above start", "RSS after",
                     "bound (budget + largest + constant)", "target"], command)
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "gpt2.safetensors")
        torch.manual_seed(0)
        torch_ext.save_pageable(GPT(GPTConfig(**GPT2)), path)
        source = torch_ext.SafetensorsSource(path)
        weights = source.total_bytes()
        largest = max(source.nbytes(n) for n in source.names())
        budget = int(weights * 0.3)
        bound = budget + largest + COPY_RSS_CONSTANT
        variants = [("own buffers (default)", True, {}), ("c10 allocator (own_buffers=False)", False, {}),
                    ("c10 allocator + MALLOC_MMAP_THRESHOLD_=1 MiB", False, {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})]
        for name, own, env in variants:
            out = subprocess.run([sys.executable, "-c", _RSS_CHILD, path, json.dumps(GPT2), str(budget), str(int(own))],
                                 capture_output=True, text=True, env={**_child_env(), **env})
            if out.returncode != 0:
                raise RuntimeError(f"copy-rss child {name!r} failed:\n{out.stderr}")
            got = json.loads(out.stdout.strip().splitlines()[-1])
            peak = got["peak_above_start"]
            report.add_row({"variant": name, "budget": f"30% ({format_bytes(budget)})",
                            "largest tensor": format_bytes(largest), "peak RSS above start": format_bytes(peak),
                            "RSS after": format_bytes(got["after_above_start"]),
                            "bound (budget + largest + constant)": format_bytes(bound),
                            "target": "met" if peak <= bound else "MISSED"},
                           peak_above_start=peak, after_above_start=got["after_above_start"], budget=budget,
                           largest=largest, bound=bound, weights=weights, stats=got["stats"])
    report.notes.append(f"GPT ({format_bytes(weights)} fp32: {GPT2}), paged at 30% of its weights, scan-resistant, "
                        f"prefetch 12, 3 forwards of 1x16 tokens with 1 torch thread, in a fresh subprocess per row. "
                        f"Peak RSS: VmHWM after a reset once the model is paged, minus the RSS then. The constant is "
                        f"{format_bytes(COPY_RSS_CONSTANT)} (docs/paging.md). The budget is below the largest tensor "
                        f"(the tied embedding), which is loaded over budget: the bound counts it once.")
    return report


def _child_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


def run(args, command: str) -> None:
    if args.header:
        header_benchmark(command).write()
    if args.copy_rss:
        copy_rss_benchmark(command).write()


__all__ = ["run", "header_benchmark", "copy_rss_benchmark", "COPY_RSS_CONSTANT", "HEADER_SIZES"]
