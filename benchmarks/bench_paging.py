"""Weight paging benchmark: a GPT-2-style decoder whose fp32 weights (>= 1 GB) live in a
safetensors file, run at budgets of 25%, 50% and 100% of the weights.

Variants (each measured in its own subprocess, so peak RSS never mixes):
  resident        the whole model in memory (load_model from the file)
  accelerate-disk accelerate.disk_offload reading the same safetensors file (its index points at it)
  accelerate-cpu  accelerate.cpu_offload with the file's state dict in RAM
  lru             torch_ext.page_weights, LRU, no prefetch
  scan+prefetch   torch_ext.page_weights, scan-resistant policy + prefetch
  scan+prefetch+mmap       the same, zero_copy: views of the mapped file (pages mapped in ahead)
  scan+prefetch+O_DIRECT   the same with copies read by O_DIRECT (past the page cache; 25% only
                           unless --all-direct)

    python benchmarks/bench_paging.py            # full run (~1.2 GB model)
    python benchmarks/bench_paging.py --quick    # small model, a smoke test
    python benchmarks/bench_paging.py --threads 2   # torch on every core: results/paging_threads2.{md,json}
    python benchmarks/bench_paging.py --device cuda   # the GPU run: results/paging_cuda.{md,json}
    python benchmarks/bench_paging.py --header --copy-rss   # header open vs safe_open; copy-path RSS
    python benchmarks/bench_paging.py --hf [--quick]   # Hugging Face GPT-2 from a folder vs accelerate; adapters
    python benchmarks/bench_paging.py --hooks [--quick]   # the pager's cost per paged module

--device DEVICE: the same variants computing on DEVICE, the budget being DEVICE memory for the
weights (the pager copies through pinned staging buffers on a side stream). No mmap rows there
(zero_copy is CPU only); O_DIRECT rows read into the pinned staging buffers. Time is the median of
synchronised forwards, and the report adds peak GPU memory (torch.cuda.max_memory_allocated) and
the pinned host-to-device bandwidth. Without --device the CPU benchmark runs as it always has.

Needs accelerate==1.15.0 for the accelerate rows (benchmark-only; skipped when missing).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Report, format_bytes, format_seconds, timing_of  # noqa: E402
import torch_ext  # noqa: E402
from torch_ext.demos import GPT, GPTConfig  # noqa: E402

FULL = dict(vocab_size=50257, block_size=1024, n_layer=20, n_head=16, n_embd=1024)
QUICK = dict(vocab_size=8192, block_size=256, n_layer=6, n_head=8, n_embd=512)
PREFETCH = 12  # tensors ahead: one transformer block's 12 tensors
# Torch threads on the CPU benchmark: the prefetcher overlaps loads with compute only on a core the
# forward leaves free, and torch's default takes every core (on this 2-core machine both).
CPU_THREADS = 1
CUDA_TOKENS = 1024  # tokens per forward on a GPU (capped at block_size): 1x16 leaves an H100 idle


# ------------------------------------------------------------------------ child side

def _vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets VmHWM (peak RSS) to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _tied_names(model) -> dict[str, list[str]]:
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {n: names for names in groups.values() for n in names}


def _full_state_dict(model, path: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The file's tensors under every name the model uses (tied weights are stored once)."""
    from safetensors.torch import load_file

    stored = load_file(path, device=device)
    out = {}
    for name, names in _tied_names(model).items():
        out[name] = stored[next(n for n in names if n in stored)]
    return out


def child(args) -> None:
    import psutil

    config = GPTConfig(**json.loads(args.config))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or "cpu")
    on_gpu = device.type == "cuda"
    with torch.device("meta"):
        model = GPT(config).eval()
    batch = torch.randint(0, config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    batch = batch.to(device)
    pager = None
    variant = args.child
    if variant == "resident":
        # Tied weights share one tensor, as in the checkpoint.
        model.load_state_dict(_full_state_dict(model, args.path, str(device)), strict=True, assign=True)
    elif variant == "accelerate-disk":
        from accelerate import disk_offload

        disk_offload(model, args.offload_dir, execution_device=device)
    elif variant == "accelerate-cpu":
        from accelerate import cpu_offload

        cpu_offload(model, execution_device=device, state_dict=_full_state_dict(model, args.path))
    else:
        policy, prefetch, direct, zero_copy = {
            "lru": ("lru", 0, False, False),
            "scan+prefetch": ("scan_resistant", PREFETCH, False, False),
            "scan+prefetch+mmap": ("scan_resistant", PREFETCH, False, True),
            "scan+prefetch+O_DIRECT": ("scan_resistant", PREFETCH, True, False)}[variant]
        source = torch_ext.SafetensorsSource(args.path, direct_io=direct)
        pager = torch_ext.page_weights(model, source, args.budget, policy=policy, prefetch=prefetch,
                                       zero_copy=zero_copy, device=device)
    if on_gpu:
        torch.cuda.synchronize(device)
        baseline_gpu = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    baseline_rss = psutil.Process().memory_info().rss
    _reset_peak_rss()
    # Protocol on stdin/stdout, one line each: "warm" / "run" -> one forward (reply: seconds),
    # "reset" -> reset the pager's statistics, "finish" -> write results and exit.
    samples, cpu_samples, forwards, out = [], [], 0, None
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command in ("warm", "run"):
            with torch.no_grad():
                cpu_start = time.process_time()
                start = time.perf_counter()
                out = model(batch)
                if on_gpu:
                    torch.cuda.synchronize(device)
                seconds = time.perf_counter() - start
            if pager is not None:
                _wait_until_quiet(pager)
            else:
                time.sleep(0.02)  # idle as long as a quiet pager's wait: torch's threads spin a while when idle
            # CPU time of every thread of the process over the forward and the loads it set off.
            cpu_seconds = time.process_time() - cpu_start
            if command == "run":
                samples.append(seconds)
                cpu_samples.append(cpu_seconds)
                forwards += 1
            print(f"{seconds:.6f}", flush=True)
        elif command == "reset":
            if pager is not None:
                pager.reset_stats()
            print("ok", flush=True)
        elif command == "finish":
            break
    peak = _vm_hwm_bytes()
    result = {"variant": variant, "timing": timing_of(samples).__dict__, "cpu_timing": timing_of(cpu_samples).__dict__,
              "baseline_rss": baseline_rss,
              "peak_rss": peak, "peak_above_baseline": peak - baseline_rss}
    if on_gpu:
        result.update(baseline_gpu=baseline_gpu, peak_gpu=torch.cuda.max_memory_allocated(device))
        result["peak_gpu_above_baseline"] = result["peak_gpu"] - baseline_gpu
    if pager is not None:
        result["stats"] = {k: (float(v) if isinstance(v, bool) else v) for k, v in pager.stats().as_dict().items()}
        result["forwards"] = forwards
    torch.save(out.cpu(), args.output)
    Path(args.json).write_text(json.dumps(result))


def _wait_until_quiet(pager) -> None:
    """Let the prefetcher finish what it started before another variant's forward is timed."""
    last = None
    while True:
        s = pager.stats()
        now = (s.prefetches, s.bytes_loaded)
        if now == last:
            return
        last = now
        time.sleep(0.02)


# ------------------------------------------------------------------------ parent side

def read_bandwidth(path: str, direct_io: bool) -> float:
    """Bytes per second reading every tensor of the file into fresh memory, as the pager does."""
    source = torch_ext.SafetensorsSource(path, direct_io=direct_io)
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        total = 0
        for name in source.names():
            total += source.load(name).nbytes
        best = max(best, total / (time.perf_counter() - start))
    return best


def h2d_bandwidth(device: torch.device, nbytes: int = 512 << 20) -> float | None:
    """Bytes per second copying a pinned host tensor to `device` (non_blocking, then synchronize);
    None where the device is the CPU."""
    if device.type != "cuda":
        return None
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = 0.0
    for i in range(6):  # the first copy is a warm-up
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        if i:
            best = max(best, nbytes / (time.perf_counter() - start))
    del host, target
    torch.cuda.empty_cache()
    return best


class Child:
    """One variant in its own process, driven a forward at a time so variants interleave."""

    def __init__(self, variant: str, budget: int, workdir: Path, config: dict, path: str, args,
                 wait: bool = True) -> None:
        self.variant, self.budget = variant, budget
        self.json = workdir / f"{variant}-{budget}.json"
        self.tensor = workdir / f"{variant}-{budget}.pt"
        command = [sys.executable, __file__, "--child", variant, "--budget", str(budget), "--path", path,
                   "--offload-dir", str(workdir / "offload"), "--config", json.dumps(config),
                   "--tokens", str(args.tokens), "--json", str(self.json), "--output", str(self.tensor)]
        if args.device is not None:
            command += ["--device", args.device]
        if args.threads is not None:
            command += ["--threads", str(args.threads)]
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
        # A fixed mmap threshold: glibc otherwise raises it after large frees and serves later
        # multi-MB allocations from the heap, whose RSS does not go back to the OS. Same for all variants.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if wait:
            self.expect("ready")

    def ask(self, command: str) -> str:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline().strip()
        if not reply:
            raise RuntimeError(f"bench_paging: variant {self.variant} (budget {self.budget}) exited "
                               f"with {self.process.wait()}")
        return reply

    def expect(self, word: str) -> None:
        reply = self.process.stdout.readline().strip()
        if reply != word:
            raise RuntimeError(f"bench_paging: variant {self.variant} said {reply!r}, expected {word!r} "
                               f"(exit code {self.process.poll()})")

    def finish(self) -> dict:
        self.process.stdin.write("finish\n")
        self.process.stdin.flush()
        if self.process.wait() != 0:
            raise RuntimeError(f"bench_paging: variant {self.variant} failed")
        result = json.loads(self.json.read_text())
        result["output"] = torch.load(self.tensor)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model and fewer repeats")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="compute on this device, the budget being its memory for the weights; results go to "
                             "results/paging_<device>.{md,json} (default: the CPU benchmark, results/paging.{md,json})")
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"tokens per forward (batch of 1; default 16, on cuda {CUDA_TOKENS} capped at block_size)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None,
                        help=f"torch intra-op threads in every variant (default: {CPU_THREADS} on the CPU benchmark, "
                             f"leaving a core to the prefetcher; torch's default with --device; other counts write "
                             f"results/paging_threads<N>.{{md,json}})")
    parser.add_argument("--all-direct", action="store_true", help="O_DIRECT rows at every budget, not only 25%%")
    parser.add_argument("--workdir", default=None, help="where the checkpoint is written (default: a temp dir)")
    parser.add_argument("--header", action="store_true",
                        help="only the header-open benchmark (10k/80k/160k tensors vs safe_open): results/paging_header")
    parser.add_argument("--copy-rss", action="store_true",
                        help="only the copy path's peak RSS with and without its own buffers: results/paging_copy_rss")
    parser.add_argument("--hf", action="store_true",
                        help="only Hugging Face GPT-2 from a folder against accelerate, and adapter training over it "
                             "(benchmarks/paging_hf.py): results/paging_hf, paging_hf_train")
    parser.add_argument("--moe", action="store_true",
                        help="only a Mixtral stored per expert against the same saved fused "
                             "(benchmarks/paging_moe.py): results/paging_moe")
    parser.add_argument("--quantized", action="store_true",
                        help="only an FP8 Llama and an MXFP4 gpt-oss, dequantized as they are paged in "
                             "(benchmarks/paging_quantized.py): results/paging_quantized")
    parser.add_argument("--hooks", action="store_true",
                        help="only the pager's cost per paged module at a 100%% budget (a Linear stack, a Llama "
                             "decoding) (benchmarks/paging_hooks.py): results/paging_hooks")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--offload-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--config", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.moe:  # experts fused while loading, paged as compositions (benchmarks/paging_moe.py)
        import paging_moe

        paging_moe.run(args, "python benchmarks/bench_paging.py " + " ".join(sys.argv[1:]))
        return
    if args.hooks:  # the hooks around each paged module (benchmarks/paging_hooks.py)
        import paging_hooks

        paging_hooks.run(args, "python benchmarks/bench_paging.py " + " ".join(sys.argv[1:]))
        return
    if args.quantized:  # quantized weights dequantized as they are paged in (benchmarks/paging_quantized.py)
        import paging_quantized

        paging_quantized.run(args, "python benchmarks/bench_paging.py " + " ".join(sys.argv[1:]))
        return
    if args.hf:  # issue 18's benchmark (benchmarks/paging_hf.py)
        import paging_hf

        paging_hf.run(args, "python benchmarks/bench_paging.py " + " ".join(sys.argv[1:]))
        return
    if args.header or args.copy_rss:  # issue 16's benchmarks (benchmarks/paging_reliability.py)
        import paging_reliability

        paging_reliability.run(args, "python benchmarks/bench_paging.py " + " ".join(sys.argv[1:]))
        return
    from tqdm import tqdm

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"bench_paging: --device cuda needs a GPU, but torch.cuda.is_available() is False here "
                 f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). "
                 f"Run without --device for the CPU benchmark.")
    # device is None for the CPU benchmark as it always was; --device picks the device mode.
    device = torch.device(args.device) if args.device is not None else None
    on_gpu = device is not None and device.type == "cuda"
    config = QUICK if args.quick else FULL
    tokens_given = args.tokens is not None
    if args.tokens is None:
        args.tokens = min(CUDA_TOKENS, config["block_size"]) if on_gpu else 16
    if args.quick:
        args.repeat, args.warmup = min(args.repeat, 3), min(args.warmup, 2)
    default_threads = CPU_THREADS if device is None else None  # None: torch's default
    if args.threads is None:
        args.threads = default_threads
    threads_given = args.threads != default_threads
    threads = args.threads or torch.get_num_threads()  # what every variant's process runs with
    try:
        import accelerate  # noqa: F401
        have_accelerate = True
    except ImportError:
        have_accelerate = False

    with tempfile.TemporaryDirectory(dir=args.workdir) as folder:
        workdir = Path(folder)
        path = str(workdir / "gpt.safetensors")
        torch.manual_seed(0)
        model = GPT(GPTConfig(**config))
        torch_ext.save_pageable(model, path)
        source = torch_ext.SafetensorsSource(path)
        weights = source.total_bytes()
        largest_layer = max(sum(p.nbytes for p in m.parameters(recurse=False)) for m in model.modules())
        largest_block = sum(p.nbytes for p in model.blocks[0].parameters())
        # accelerate's disk offload reads the same file: its index points each weight at it.
        (workdir / "offload").mkdir()
        index = {}
        for name, names in _tied_names(model).items():
            stored = next(n for n in names if n in source)
            index[name] = {"safetensors_file": path, "weight_name": stored, "dtype": "float32"}
        (workdir / "offload" / "index.json").write_text(json.dumps(index))
        del model

        bandwidth = read_bandwidth(path, direct_io=False)
        try:
            direct_bandwidth = read_bandwidth(path, direct_io=True)
        except RuntimeError:
            direct_bandwidth = None
        h2d = h2d_bandwidth(device) if device is not None else None

        budgets = [weights // 4, weights // 2, weights]
        runs = [("resident", 0)]
        if have_accelerate:
            runs += [("accelerate-disk", 0), ("accelerate-cpu", 0)]
        for b in budgets:
            runs += [("lru", b), ("scan+prefetch", b)]
            if device is None or device.type == "cpu":  # zero_copy serves the mapped file: CPU only
                runs.append(("scan+prefetch+mmap", b))
            if direct_bandwidth is not None and (b == budgets[0] or args.all_direct):
                runs.append(("scan+prefetch+O_DIRECT", b))
        if device is None:
            children = [Child(variant, budget, workdir, config, path, args)
                        for variant, budget in tqdm(runs, desc="starting variants", file=sys.stderr)]
        else:
            # Set up side by side (nothing is measured before every variant is ready).
            children = [Child(variant, budget, workdir, config, path, args, wait=False) for variant, budget in runs]
            for c in tqdm(children, desc="starting variants", file=sys.stderr):
                c.expect("ready")
        for _ in range(args.warmup):
            for c in children:
                c.ask("warm")
        for c in children:
            c.ask("reset")
        for _ in tqdm(range(args.repeat), desc="interleaved rounds", file=sys.stderr):
            for c in children:
                c.ask("run")
        results = {(c.variant, c.budget): c.finish() for c in children}

    resident = results[("resident", 0)]
    # The machine is shared: other work only ever adds time, so the targets use each variant's
    # fastest forward (the table shows the median too). The device mode, for a machine of its own
    # with synchronised forwards, uses the median (and shows the fastest).
    stat, other_stat = ("min_seconds", "median_seconds") if device is None else ("median_seconds", "min_seconds")
    compute = resident["timing"][stat]
    # What a forward costs in RSS besides the weights (code pages, activations, scratch), from the
    # resident run: a paged run may exceed it by at most the budget plus one layer.
    floor = resident["peak_rss"] - weights
    # The same on the GPU: what a resident forward allocates there besides the weights (activations, logits).
    gpu_floor = resident["peak_gpu"] - weights if on_gpu else None
    command = "python benchmarks/bench_paging.py"
    if device is not None:
        command += f" --device {args.device}" + (f" --tokens {args.tokens}" if tokens_given else "")
    command += " --quick" if args.quick else ""
    command += f" --threads {args.threads}" if threads_given else ""
    time_column = "time / forward: min (median)" if device is None else "time / forward: median (min)"
    title = (f"Weight paging: GPT ({weights / 1e9:.2f} GB fp32), 1x{args.tokens} tokens per forward, "
             f"{threads} torch thread{'s' if threads > 1 else ''}")
    if device is not None:
        where = torch.cuda.get_device_name(device) if on_gpu else "the CPU"
        title = f"Weight paging on {where} ({args.device}): GPT ({weights / 1e9:.2f} GB fp32), 1x{args.tokens} tokens per forward"
    report = Report("paging" + (f"_{args.device}" if device is not None else "")
                    + (f"_threads{args.threads}" if threads_given else "") + ("_quick" if args.quick else ""),
                    title,
                    ["variant", "budget", time_column, "vs resident", "CPU / forward (median)"]
                    + (["peak GPU memory (above start)"] if on_gpu else [])
                    + ["peak RSS (above start)", "hit rate", "stall / forward", "loaded / forward", "target"],
                    command)
    checks = []
    for (variant, budget), r in results.items():
        t = r["timing"][stat]
        cells = {"variant": variant, "budget": f"{budget / weights:.0%} ({format_bytes(budget)})" if budget else "-",
                 time_column: f"{format_seconds(t)} ({format_seconds(r['timing'][other_stat])})",
                 "vs resident": f"{t / compute:.2f}x",
                 "CPU / forward (median)": format_seconds(r["cpu_timing"]["median_seconds"]),
                 "peak RSS (above start)": f"{format_bytes(r['peak_rss'])} ({format_bytes(r['peak_above_baseline'])})"}
        raw = {"seconds": t, "median_seconds": r["timing"]["median_seconds"],
               "cpu_median_seconds": r["cpu_timing"]["median_seconds"], "peak_rss": r["peak_rss"], "peak_above_baseline": r["peak_above_baseline"],
               "equal_to_resident": bool(torch.equal(r["output"], resident["output"]))}
        if device is not None:
            raw.update(min_seconds=r["timing"]["min_seconds"],
                       max_abs_difference=(r["output"] - resident["output"]).abs().max().item())
        if on_gpu:
            cells["peak GPU memory (above start)"] = (f"{format_bytes(r['peak_gpu'])} "
                                                      f"({format_bytes(r['peak_gpu_above_baseline'])})")
            raw.update(peak_gpu=r["peak_gpu"], peak_gpu_above_baseline=r["peak_gpu_above_baseline"])
        if "stats" in r:
            s, n = r["stats"], r["forwards"]
            accesses = s["hits"] + s["misses"]
            loaded = s["bytes_loaded"] / n
            cells["hit rate"] = f"{s['hits'] / accesses:.0%}" if accesses else "-"
            cells["stall / forward"] = format_seconds(s["stall_seconds"] / n)
            cells["loaded / forward"] = format_bytes(loaded)
            raw.update(stats=s, bytes_loaded_per_forward=loaded)
            if variant.startswith("scan+prefetch"):
                bw = direct_bandwidth if "O_DIRECT" in variant else bandwidth
                if h2d is not None:  # file -> pinned staging -> device: the slower link bounds it
                    bw = min(bw, h2d)
                bound = max(compute, loaded / bw)
                accelerate_best = min((results[(v, 0)]["timing"][stat]
                                       for v in ("accelerate-disk", "accelerate-cpu") if (v, 0) in results),
                                      default=None)
                if on_gpu:
                    within = r["peak_gpu"] <= gpu_floor + budget + largest_layer
                else:
                    within = r["peak_rss"] <= floor + budget + largest_layer
                ok_time = t <= 1.3 * bound
                ok_fast = accelerate_best is None or t < accelerate_best
                cells["target"] = (f"{'met' if ok_time else 'MISSED'} {t / bound:.2f}x of bound; "
                                   f"{'faster' if ok_fast else 'SLOWER'} than accelerate; "
                                   f"{'GPU memory' if on_gpu else 'RSS'} {'within' if within else 'OVER'} budget+layer")
                raw.update(bound_seconds=bound, ratio_to_bound=t / bound, faster_than_accelerate=ok_fast,
                           **{("gpu_memory" if on_gpu else "rss") + "_within_budget_plus_layer": within})
                checks.append((variant, budget, ok_time, ok_fast, within))
        if not raw["equal_to_resident"]:
            cells["target"] = (cells.get("target", "") + " OUTPUT DIFFERS").strip()
        report.add_row(cells, **raw)
    report.data = {"weights_bytes": weights, "rss_floor_bytes": floor, "largest_layer_bytes": largest_layer, "largest_block_bytes": largest_block,
                   "read_bandwidth_bytes_per_second": bandwidth,
                   "direct_read_bandwidth_bytes_per_second": direct_bandwidth, "compute_seconds": compute,
                   "config": config, "tokens": args.tokens, "warmup": args.warmup, "repeat": args.repeat}
    if device is not None:
        report.data.update(device=args.device, h2d_bandwidth_bytes_per_second=h2d, gpu_floor_bytes=gpu_floor,
                           gpu=torch.cuda.get_device_name(device) if on_gpu else None)
    if device is None:
        report.notes += [
            "",
            f"Time: fastest and median of {args.repeat} forwards after {args.warmup} warm-up forwards (the first "
            f"records the access order); ratios and targets use the fastest, since other work on this shared 2-core "
            f"machine only adds time. "
            f"Each variant lives in its own subprocess (all started up front) and the parent runs one "
            f"forward of each in turn, {args.repeat} rounds, so load from other work on the machine hits every variant "
            f"alike; after a forward a paged variant waits until its prefetcher is idle before the next variant runs. "
            f"Every variant computes with {threads} torch thread{'s' if threads > 1 else ''} on this machine's "
            f"{os.cpu_count()} cores: the prefetcher overlaps loads with compute only on a core the forward leaves "
            f"free (--threads sets the count). "
            f"Peak RSS: VmHWM of the variant's process, reset after its model is set up; in brackets, the peak "
            f"above the RSS at that point. CPU / forward: CPU time of all the variant's threads (torch's "
            f"{threads} compute thread{'s' if threads > 1 else ''}, the prefetcher) from the start of a forward until its loads "
            f"are done, the work a forward costs whatever else runs on the machine. Hit rate, stall and bytes loaded: "
            f"the pager's statistics over the timed forwards. Every variant's logits equal the resident model's "
            f"(torch.equal) unless the row says otherwise.",
            f"Read bandwidth measured here: {bandwidth / 1e9:.2f} GB/s with pread from the page cache"
            + (f", {direct_bandwidth / 1e9:.2f} GB/s with O_DIRECT" if direct_bandwidth else "")
            + f". The file ({weights / 1e9:.2f} GB) fits in this machine's page cache, so pread rows read from RAM; "
              f"the O_DIRECT rows bypass it and read the disk.",
            f"Targets for scan+prefetch: time <= 1.3 x max(compute {format_seconds(compute)} = resident time, bytes "
            f"loaded / read bandwidth); faster than accelerate's best offload; peak RSS <= the resident run's peak RSS "
            f"without its weights ({format_bytes(floor)}: interpreter, libraries, activations) + budget + the "
            f"largest layer's weights ({format_bytes(largest_layer)}, the tied embedding; one block is "
            f"{format_bytes(largest_block)}). accelerate's offloads have no budget (cpu_offload keeps every weight "
            f"in RAM). glibc's mmap threshold is fixed at 1 MiB (MALLOC_MMAP_THRESHOLD_) in every subprocess.",
        ]
    else:
        memory_target = (
            f"peak GPU memory <= the resident run's peak GPU memory without its weights ({format_bytes(gpu_floor)}: "
            f"activations and logits) + budget + the largest layer's weights" if on_gpu else
            f"peak RSS <= the resident run's peak RSS without its weights ({format_bytes(floor)}) + budget + the "
            f"largest layer's weights")
        report.notes += [
            "",
            f"Device mode (--device {args.device}): the weights live in the safetensors file, the model computes on "
            f"{args.device}, and the budget is {args.device} memory for the weights; the pager loads "
            + ("through pinned staging buffers and copies them on a side stream. " if on_gpu else "on the CPU. ")
            + "No mmap rows on a GPU (zero_copy is CPU only). accelerate's offloads (execution_device="
            f"{args.device}) keep every weight in RAM (cpu_offload) or read the same file (disk_offload) and have no "
            f"budget.",
            f"Time: median and fastest of {args.repeat} forwards after {args.warmup} warm-up forwards (the first "
            f"records the access order)" + (", each ending in torch.cuda.synchronize()" if on_gpu else "")
            + f"; ratios and targets use the median. Each variant lives in its own subprocess (all set up side by "
              f"side before anything is timed) and the parent runs one forward of each in turn, {args.repeat} rounds; "
              f"after a forward a paged variant waits until its prefetcher is idle before the next variant runs. "
            + ("Peak GPU memory: torch.cuda.max_memory_allocated in the variant's process, reset after its model is "
               "set up; in brackets, the peak above what was allocated at that point (the resident run's weights). "
               if on_gpu else "")
            + "Peak RSS: VmHWM of the variant's process, reset after its model is set up; in brackets, the peak above "
              "the RSS at that point. CPU / forward: CPU time of all the variant's threads from the start of a "
              "forward until its loads are done. Hit rate, stall and bytes loaded: the pager's statistics over the timed "
              "forwards. Every variant's logits equal the resident model's (torch.equal) unless the row says "
              "otherwise (the JSON has the largest difference).",
            f"Bandwidth measured here: {bandwidth / 1e9:.2f} GB/s reading the file with pread from the page cache"
            + (f", {direct_bandwidth / 1e9:.2f} GB/s with O_DIRECT" if direct_bandwidth else "")
            + (f"; {h2d / 1e9:.2f} GB/s host-to-device from pinned memory (a 512 MiB tensor, non_blocking copy then "
               f"synchronize, best of 5)" if h2d is not None else "")
            + f". The file ({weights / 1e9:.2f} GB) fits in this machine's page cache.",
            f"Targets for scan+prefetch: time <= 1.3 x max(compute {format_seconds(compute)} = resident time, bytes "
            f"loaded / " + ("min(read bandwidth, host-to-device bandwidth)" if on_gpu else "read bandwidth")
            + f"); faster than accelerate's best offload; {memory_target} ({format_bytes(largest_layer)}, the tied "
              f"embedding; one block is {format_bytes(largest_block)})."
            + (" The pager reads each tensor into its staging buffer and then copies it, one after the other, so "
               "without overlap a load costs bytes / read + bytes / host-to-device." if on_gpu else ""),
        ]
    report.write()


if __name__ == "__main__":
    main()
