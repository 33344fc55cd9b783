"""Hugging Face GPT-2 from a save_pretrained folder (issue 18), run by bench_paging.py --hf:

  inference  GPT-2 (12 layers, width 768, from its config, saved sharded) on the CPU: one forward
             of 1xTOKENS tokens and a greedy generate() of NEW_TOKENS tokens, for the resident
             model, accelerate's cpu_offload, disk_offload and from_pretrained(device_map="auto",
             max_memory, offload_folder), and torch_ext.load_paged from the folder at 25% and 50%
             budgets with its defaults (no option given).
  bf16       the same GPT-2 saved in bf16 and served as fp32 (from_pretrained(dtype=float32), the
             accelerate variants over it, load_paged(..., dtype=torch.float32) with its defaults);
             budgets are 25% and 50% of the fp32 weights.
  training   one step (forward, backward, AdamW on the adapters) of LoRA adapters on every Conv1D,
             over the resident model and over torch_ext.load_paged at 25% and 50%.

Each variant runs in a fresh subprocess (python benchmarks/paging_hf.py --child ...), so its peak
RSS (VmHWM after a reset at the start, before the model is loaded, minus the RSS then) is its own;
set-up is the time from that start to a model ready to run. One torch thread (the other core is
left to the pager's prefetch thread, as in bench_paging.py).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Child, Report, format_bytes, format_seconds, run_children, timing_of  # noqa: E402

FULL = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024, shard="100MB",
            tokens=64, new_tokens=32, repeat=10, generate_repeat=6, train_repeat=5)
QUICK = dict(n_layer=2, n_embd=128, n_head=4, vocab_size=1024, n_positions=128, shard="200KB",
             tokens=16, new_tokens=8, repeat=3, generate_repeat=1, train_repeat=2)
# What a paged run's peak RSS may hold besides budget + largest tensor (docs/paging.md): the model's
# Python objects, the forward's activations and logits at 1x64 tokens, generate()'s KV cache,
# tensors under a page and allocator slack; for training also the adapters, their AdamW state and
# the activations autograd saves.
RSS_CONSTANT = 64 << 20
SETUP_TARGET_SECONDS = 2.0
ACCELERATE = ("accelerate cpu_offload", "accelerate disk_offload", "accelerate device_map=auto")


# ------------------------------------------------------------------------ child side

def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _build(variant: str, budget: int, folder: str, offload: str):
    import accelerate
    import transformers

    import torch_ext

    fp32 = dict(dtype=torch.float32)  # a bf16 folder is served as fp32 by every variant
    if variant == "resident":
        return transformers.GPT2LMHeadModel.from_pretrained(folder, **fp32).eval()
    if variant == "accelerate cpu_offload":
        return accelerate.cpu_offload(transformers.GPT2LMHeadModel.from_pretrained(folder, **fp32).eval(),
                                      execution_device="cpu")
    if variant == "accelerate disk_offload":
        # On the meta device, then offloaded to an index pointing at the folder's own shards (no
        # copy of the weights, none loaded into memory first).
        config = transformers.AutoConfig.from_pretrained(folder)
        with accelerate.init_empty_weights():
            model = transformers.GPT2LMHeadModel(config).float().eval()
        return accelerate.disk_offload(model, offload, execution_device="cpu")
    if variant == "accelerate device_map=auto":
        return transformers.GPT2LMHeadModel.from_pretrained(folder, device_map="auto", max_memory={"cpu": budget},
                                                            offload_folder=offload, **fp32).eval()
    if variant == "torch_ext":  # the defaults: nothing but the budget (and the dtype to serve in)
        return torch_ext.load_paged(folder, budget, **fp32)
    raise ValueError(f"paging_hf: unknown variant {variant!r}")


def _add_adapters(model, rank: int = 8):
    """LoRA on every Conv1D (attention and MLP projections); everything else frozen."""
    from torch import nn
    from transformers.pytorch_utils import Conv1D

    class LoRA(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base
            fan_in, fan_out = base.weight.shape
            generator = torch.Generator().manual_seed(fan_in * 7919 + fan_out)
            self.lora_a = nn.Parameter(torch.randn(fan_in, rank, generator=generator) / rank)
            self.lora_b = nn.Parameter(torch.zeros(rank, fan_out))

        def forward(self, x):
            return self.base(x) + (x @ self.lora_a) @ self.lora_b

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                setattr(module, name, LoRA(child))
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def child(args) -> None:
    """Set up one variant, then run what the parent asks, one line each on stdin ("forward",
    "generate", "step", each "warm" or "run"; "finish"), replying with the seconds it took, so
    the parent interleaves the variants' runs and drift on the shared machine hits all alike."""
    import accelerate  # noqa: F401  (imports are not the set-up's cost)
    import transformers  # noqa: F401
    from transformers.models.gpt2 import modeling_gpt2  # noqa: F401

    import torch_ext

    torch.set_num_threads(1)
    sizes = json.loads(args.sizes)
    ids = torch.randint(0, sizes["vocab_size"], (1, sizes["tokens"]), generator=torch.Generator().manual_seed(0))
    start_rss = _rss_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS
        f.write("5")
    start = time.perf_counter()
    model = _build(args.child, args.budget, args.folder, args.offload)
    setup = time.perf_counter() - start
    paged = torch_ext.paging.is_paged(model)
    result = {"variant": args.child, "budget": args.budget, "setup_seconds": setup,
              "bytes_loaded_at_setup": torch_ext.pager_of(model).stats().bytes_loaded if paged else None}
    run = _Runs(model, ids, sizes, train=args.train)
    print("ready", flush=True)
    for line in sys.stdin:
        what, _, mode = line.strip().partition(" ")
        if what == "finish":
            break
        print(f"{run.once(what, timed=mode == 'run'):.6f}", flush=True)
    result.update(run.results())
    result["peak_rss_above_start"] = _rss_bytes("VmHWM") - start_rss
    if paged:
        stats = torch_ext.pager_of(model).stats()
        result["largest_tensor_bytes"] = stats.largest_tensor_bytes
        result["over_budget_loads"] = stats.over_budget_loads
    Path(args.json).write_text(json.dumps(result))


class _Runs:
    """A variant's forwards, generate() calls or training steps, and their timings."""

    def __init__(self, model, ids, sizes: dict, train: bool) -> None:
        self.model, self.ids, self.sizes = model, ids, sizes
        self.samples: dict[str, list[float]] = {"forward": [], "generate": [], "step": []}
        self.logits = self.tokens = None
        self.losses: list[float] = []
        if train:
            self.model = _add_adapters(model).train()
            self.adapters = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(self.adapters, lr=1e-3)
            torch.manual_seed(0)  # the same dropout masks in every variant

    def once(self, what: str, timed: bool) -> float:
        begin = time.perf_counter()
        if what == "forward":
            with torch.no_grad():
                self.logits = self.model(self.ids).logits
        elif what == "generate":
            new = self.sizes["new_tokens"] if timed else 2
            self.tokens = self.model.generate(self.ids, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                                              pad_token_id=0)
        elif what == "step":
            loss = self.model(self.ids, labels=self.ids).loss
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.losses.append(loss.detach().item())
        else:
            raise ValueError(f"paging_hf: unknown command {what!r}")
        seconds = time.perf_counter() - begin
        if timed:
            self.samples[what].append(seconds)
        return seconds

    def results(self) -> dict:
        out = {name: timing_of(values).__dict__ for name, values in self.samples.items() if values}
        if self.logits is not None:
            out["logits_sum"] = float(self.logits.double().sum())
        if self.tokens is not None:
            out["generated"] = self.tokens[0, self.ids.shape[1]:].tolist()
        if self.losses:
            out.update(losses=self.losses, adapter_bytes=sum(p.nbytes for p in self.adapters))
        return out


# ------------------------------------------------------------------------ parent side

def _write_model(folder: Path, sizes: dict, dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """GPT-2 from its config, saved sharded in `dtype`; (fp32 weight bytes, largest fp32 tensor bytes)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import torch_ext

    torch.manual_seed(0)
    config = GPT2Config(n_layer=sizes["n_layer"], n_embd=sizes["n_embd"], n_head=sizes["n_head"],
                        vocab_size=sizes["vocab_size"], n_positions=sizes["n_positions"])
    GPT2LMHeadModel(config).to(dtype).save_pretrained(folder, max_shard_size=sizes["shard"])
    source = torch_ext.SafetensorsSource(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    # disk_offload's index: every name the model uses, pointing at the folder's own shards.
    offload = {name: {"safetensors_file": str(folder / shard), "weight_name": name, "dtype": str(dtype)[6:]}
               for name, shard in index.items()}
    offload["lm_head.weight"] = offload["transformer.wte.weight"]
    (folder.parent / "disk_offload").mkdir()
    (folder.parent / "disk_offload" / "index.json").write_text(json.dumps(offload))
    scale = 4 // dtype.itemsize
    return source.total_bytes() * scale, max(source.nbytes(n) for n in source.names()) * scale


def _child(variant: str, budget: int, workdir: Path, sizes: dict, train: bool) -> Child:
    """One variant in its own process, set up on creation."""
    out = workdir / f"{variant.replace(' ', '_')}-{budget}-{int(train)}.json"
    offload = workdir / ("disk_offload" if variant == "accelerate disk_offload" else f"offload-{budget}")
    command = [sys.executable, __file__, "--child", variant, "--budget", str(budget), "--folder",
               str(workdir / "model"), "--offload", str(offload), "--sizes", json.dumps(sizes),
               "--json", str(out)] + (["--train"] if train else [])
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
           "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "TRANSFORMERS_VERBOSITY": "error"}
    return Child(variant, command, env, out)


def _interleaved(runs: list[tuple[str, int]], workdir: Path, sizes: dict, plan: list[tuple[str, int, int]],
                 train: bool = False) -> list[dict]:
    """Each variant set up in turn (alone, so its set-up time is its own), then `plan`'s
    (command, warm-up, repeat) in rounds over all of them, every other round reversed."""
    rounds = [f"{command} {'warm' if index < warmup else 'run'}"
              for command, warmup, repeat in plan for index in range(warmup + repeat)]
    made = [functools.partial(_child, variant, budget, workdir, sizes, train) for variant, budget in runs]
    return [result for result, _ in run_children(made, rounds)]


def _variants(weights: int) -> list[tuple[str, int]]:
    quarter, half = weights // 4, weights // 2
    return [("resident", 0), ("accelerate cpu_offload", 0), ("accelerate disk_offload", 0),
            ("accelerate device_map=auto", quarter), ("accelerate device_map=auto", half),
            ("torch_ext", quarter), ("torch_ext", half)]


def inference_report(results: list[dict], weights: int, largest: int, sizes: dict, command: str,
                     stored: str = "fp32") -> Report:
    what = "fp32" if stored == "fp32" else f"a {stored} checkpoint served as fp32"
    report = Report(("paging_hf" if stored == "fp32" else f"paging_hf_{stored}") + ("_quick" if sizes is QUICK else ""),
                    f"Weight paging: Hugging Face GPT-2 from a save_pretrained folder ({format_bytes(weights)} fp32, "
                    f"{sizes['n_layer']} layers, width {sizes['n_embd']}; {what}), CPU, 1 torch thread",
                    ["variant", "budget", f"time / forward 1x{sizes['tokens']} (median)", "vs resident",
                     f"generate {sizes['new_tokens']} tokens", "peak RSS (above start)", "set-up", "same output"],
                    command)
    resident = results[0]
    for r in results:
        forward = r["forward"]["median_seconds"]
        tokens_per_second = sizes["new_tokens"] / r["generate"]["median_seconds"]
        same = r["generated"] == resident["generated"] and abs(r["logits_sum"] - resident["logits_sum"]) <= 1e-6 * abs(
            resident["logits_sum"])
        report.add_row({"variant": r["variant"], "budget": _budget_cell(r["budget"], weights),
                        f"time / forward 1x{sizes['tokens']} (median)": format_seconds(forward),
                        "vs resident": f"{forward / resident['forward']['median_seconds']:.2f}x",
                        f"generate {sizes['new_tokens']} tokens": f"{tokens_per_second:.1f} tokens/s",
                        "peak RSS (above start)": format_bytes(r["peak_rss_above_start"]),
                        "set-up": format_seconds(r["setup_seconds"]), "same output": "yes" if same else "NO"},
                       **r)
    ours = [r for r in results if r["variant"].startswith("torch_ext")]
    theirs = [r for r in results if r["variant"] in ACCELERATE]
    checks = []
    for what, key in (("forward", "forward"), ("generate()", "generate")):
        def beats(r, rivals):
            return all(r[key]["median_seconds"] < a[key]["median_seconds"] for a in rivals)
        at_rss = [r for r in ours if beats(r, [a for a in theirs if a["peak_rss_above_start"] >= r["peak_rss_above_start"]])]
        checks.append((f"torch_ext (defaults): {what} faster than every accelerate variant whose peak RSS is at or above "
                       f"its own, at every budget" + _only_at(at_rss, ours, weights), len(at_rss) == len(ours)))
        everyone = [r for r in ours if beats(r, theirs)]
        checks.append((f"torch_ext (defaults): {what} faster than every accelerate variant, whatever its memory (the "
                       f"unbudgeted cpu_offload holds every weight)" + _only_at(everyone, ours, weights),
                       len(everyone) == len(ours)))
    checks += _memory_and_setup_checks(ours, largest)
    checks.append(("every variant's tokens and logits equal the resident model's",
                   all(row["cells"]["same output"] == "yes" for row in report.rows)))
    report.add_checks(checks)
    report.notes.append("")
    report.notes.append(
        f"Each row is its own subprocess, all alive together: set-up (from the folder to a model ready to run; "
        f"imports excluded) one variant at a time, then 2 warm-up forwards and {sizes['repeat']} timed ones, a "
        f"2-token warm-up generate() and {sizes['generate_repeat']} greedy generate() of {sizes['new_tokens']} new "
        f"tokens (median), in rounds over all variants (every other round reversed), so drift on the shared "
        f"machine hits all alike. Peak RSS: VmHWM "
        f"after a reset before set-up, minus the RSS then (so the resident rows hold the whole model). The folder "
        f"has {sizes['shard']} shards. torch_ext: load_paged's defaults (on the CPU: views of the mapped file where "
        f"the file's dtype is the model's, converted copies where not; scan-resistant; prefetch 16); the largest "
        f"tensor (the tied embedding, {format_bytes(largest)} in fp32) is above the 25% budget and is loaded over "
        f"budget. accelerate "
        f"disk_offload reads the folder's own shards (an index pointing at them); device_map=auto gets "
        f"max_memory={{'cpu': budget}} and an offload folder. The machine is a shared 2-core VM: other work only adds "
        f"time; compare ratios within this run.")
    if stored != "fp32":
        report.notes.append("")
        report.notes.append(
            f"The folder holds {stored} weights ({format_bytes(weights // 2)}); every variant serves them as fp32. "
            f"torch_ext converts each tensor as it is paged in (from the mapped file into memory of its own); the "
            f"budget counts the converted, resident bytes. Below the whole model, the Conv1D and lm_head weights "
            f"are streamed instead: each product converts them block by block from the mapped file "
            f"(LayerPager.matmul), the pager's prefetch thread making part of the blocks on the core the benchmark "
            f"leaves it, and their file pages stay mapped while the budget has room for them (counted at the "
            f"file's bytes); the others are read from the file again each time.")
    return report


def _only_at(met: list[dict], rows: list[dict], weights: int) -> str:
    if len(met) == len(rows):
        return ""
    return f" (met only at: {', '.join(_budget_cell(r['budget'], weights) for r in met) or 'none'})"


def _budget_cell(budget: int, weights: int) -> str:
    return f"{budget / weights:.0%} ({format_bytes(budget)})" if budget else "-"


def _memory_and_setup_checks(ours: list[dict], largest: int) -> list[tuple[str, bool]]:
    return [
        (f"torch_ext peak RSS <= budget + largest tensor ({format_bytes(largest)}) + {format_bytes(RSS_CONSTANT)}",
         all(r["peak_rss_above_start"] <= r["budget"] + largest + RSS_CONSTANT for r in ours)),
        (f"torch_ext set-up from the folder < {SETUP_TARGET_SECONDS:.0f} s without reading weights (bytes loaded 0)",
         all(r["setup_seconds"] < SETUP_TARGET_SECONDS and r["bytes_loaded_at_setup"] == 0 for r in ours)),
    ]


def training_report(results: list[dict], weights: int, largest: int, sizes: dict, command: str) -> Report:
    report = Report("paging_hf_train" + ("_quick" if sizes is QUICK else ""),
                    f"Weight paging: LoRA adapters (rank 8, every Conv1D) trained over Hugging Face GPT-2 "
                    f"({format_bytes(weights)} fp32), CPU, 1 torch thread",
                    ["variant", "budget", f"step 1x{sizes['tokens']} (median)", "vs resident",
                     "peak RSS (above start)", "loads over budget", "same losses"], command)
    resident = results[0]
    for r in results:
        step = r["step"]["median_seconds"]
        same = all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r["losses"], resident["losses"]))
        report.add_row({"variant": r["variant"], "budget": _budget_cell(r["budget"], weights),
                        f"step 1x{sizes['tokens']} (median)": format_seconds(step),
                        "vs resident": f"{step / resident['step']['median_seconds']:.2f}x",
                        "peak RSS (above start)": format_bytes(r["peak_rss_above_start"]),
                        "loads over budget": r.get("over_budget_loads", "-"),
                        "same losses": "yes" if same else "NO"}, **r)
    ours = [r for r in results if r["variant"].startswith("torch_ext")]
    # Training holds more than weights: activations saved for backward, logits and their gradient,
    # the adapters' AdamW state. The resident run measures that overhead; a paged run may hold it
    # plus the budget and the largest tensor.
    overhead = resident["peak_rss_above_start"] - weights
    report.add_checks([
        (f"torch_ext peak RSS <= budget + largest tensor ({format_bytes(largest)}) + the resident run's peak above "
         f"its weights ({format_bytes(overhead)})",
         all(r["peak_rss_above_start"] <= r["budget"] + largest + overhead for r in ours))])
    report.notes.append("")
    report.notes.append("torch_ext peak RSS above budget + largest tensor: " + ", ".join(
        f"{r['variant'].split()[-1]} {_budget_cell(r['budget'], weights).split()[0]} "
        f"{format_bytes(r['peak_rss_above_start'] - r['budget'] - largest)}" for r in ours) + ".")
    report.notes.append("")
    report.notes.append(
        f"One untimed step then {sizes['train_repeat']} timed steps, in rounds over the variants (forward with "
        f"labels, backward, AdamW on the "
        f"adapters, {format_bytes(resident['adapter_bytes'])}). Base weights frozen; on torch_ext paged, and the "
        f"backward re-acquires each weight it needs from the pager (docs/paging.md#training-adapters). Loads over "
        f"budget: the tied embedding when it is larger than the budget, each time it is needed. Losses "
        f"compared with the resident run's within float rounding (tests/python/test_paging_hf.py checks exact "
        f"gradients on a small model).")
    return report


def run(args, command: str) -> None:
    sizes = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(dir=args.workdir) as folder:
        workdir = Path(folder)
        weights, largest = _write_model(workdir / "model", sizes)
        plan = [("forward", 2, sizes["repeat"]), ("generate", 1, sizes["generate_repeat"])]
        inference = _interleaved(_variants(weights), workdir, sizes, plan)
        inference_report(inference, weights, largest, sizes, command).write()
        with tempfile.TemporaryDirectory(dir=args.workdir) as bf16_folder:
            bf16_workdir = Path(bf16_folder)
            _write_model(bf16_workdir / "model", sizes, torch.bfloat16)
            bf16 = _interleaved(_variants(weights), bf16_workdir, sizes, plan)
            inference_report(bf16, weights, largest, sizes, command, stored="bf16").write()
        training_variants = [("resident", 0)] + [v for v in _variants(weights) if v[0].startswith("torch_ext")]
        training = _interleaved(training_variants, workdir, sizes, [("step", 1, sizes["train_repeat"])], train=True)
        training_report(training, weights, largest, sizes, command).write()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", required=True)
    parser.add_argument("--budget", type=int, default=0)
    parser.add_argument("--folder", required=True)
    parser.add_argument("--offload", required=True)
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--train", action="store_true")
    child(parser.parse_args())


if __name__ == "__main__":
    main()
