"""Dynamic-batch plan cache for TorchScript modules (torch.classes.torch_ext.PlanCache).

A plan is the module frozen, optimised for inference and warmed at one batch size; nothing
re-profiles when the batch size changes. Where TorchScript fuses on the device, each plan is a
clone that its profiling executor specialises to its size once; elsewhere the plans share the
optimised module, compiled once for every size. PlanCache keeps one plan per size, bounded and
LRU-evicted, and serves a miss by building the plan, by padding or splitting onto cached sizes,
or by the plain module while the plan builds in the background. Thread-safe: many threads may call
infer() at once; hits take a reader lock only.
"""
from __future__ import annotations

import os
import random
import tempfile
import time
from typing import Any, Iterable, Optional, Sequence, Union

import torch

from .models import EncoderClassifier

__all__ = ["PlanCache", "MISS_MODES", "demo"]

MISS_MODES = ("exact", "pad", "split", "auto")

_INT_FIELDS = {
    "calls", "hits", "misses", "builds", "build_failures", "evictions", "padded_calls", "split_calls",
    "fallback_calls", "padded_elements", "plans", "plan_bytes", "pending_builds", "batch_size", "plan_runs",
    "graph_capture_failures", "cuda_graphs", "graph_replays", "graph_bytes",
}
_BOOL_FIELDS = {"cached", "cuda_graph"}


def _typed(stats: dict) -> dict:
    out = {}
    for key, value in stats.items():
        if key in _BOOL_FIELDS:
            out[key] = bool(value)
        elif key in _INT_FIELDS:
            out[key] = int(value)
        else:
            out[key] = float(value)
    return out


class PlanCache:
    """Per-batch-size specialised plans of a TorchScript module.

    module: a torch.jit.ScriptModule in eval mode, or the path of one saved with torch.jit.save.
    batch_dims: the batch dimension of each positional input (-1: not batched; the last entry
    repeats; default 0 for all). output_batch_dims: the same for the outputs (tensors, or tuples
    or lists of tensors). miss_mode: "exact" builds the plan for a new size; "pad" pads to the
    smallest cached size >= n and slices the outputs; "split" runs a sum of cached sizes, largest
    first; "auto" picks pad or split by measured latency. pad / split / auto build the exact plan
    when no cached size can serve. background_builds: a miss is served by pad / split / the
    module while the plan builds on a background thread. admit_after: build a size only once it
    has been seen this many times. max_plans / max_bytes (0: unbounded) bound the cache, evicting
    the least recently used plan; max_bytes counts the distinct constants of the plans, which
    share the frozen weights (a budget below those keeps one plan) and their CUDA graphs' memory.
    specialize_shapes: give each plan a clone of its own, whose profiling executor compiles a graph
    specialised to the shapes of its warm-up calls (True), or let the plans share the optimised
    module, compiled once for every size, so that a build is only its warm-ups (False); None
    (default): True where TorchScript fuses on the inputs' device (the fusion groups are what
    the shapes feed), else False. static_runtime: run plans with TorchScript's static runtime.
    cuda_graphs: on CUDA inputs, capture each plan as a CUDA graph at its size (static buffers,
    one launch per call, outputs copied out); a plan that cannot be captured (host
    synchronisation, CPU tensors) runs without one, with a warning, and
    stats()["graph_capture_failures"] counts it. Ignored on CPU.
    """

    def __init__(self, module: Union[torch.jit.ScriptModule, str, os.PathLike], *,
                 batch_dims: Optional[Sequence[int]] = None, output_batch_dims: Optional[Sequence[int]] = None,
                 miss_mode: str = "exact", background_builds: bool = False, admit_after: int = 1,
                 max_plans: int = 0, max_bytes: int = 0, max_batch_size: int = 0, warmup_calls: int = 3,
                 optimize_for_inference: bool = True, specialize_shapes: Optional[bool] = None,
                 static_runtime: bool = False, cuda_graphs: bool = False, method: str = "forward") -> None:
        if isinstance(module, (str, os.PathLike)):
            path = os.fspath(module)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"PlanCache: no saved scripted module at {path}")
            source: Any = path
        elif isinstance(module, torch.jit.ScriptModule):
            source = module
        elif isinstance(module, torch.nn.Module):
            raise TypeError(f"PlanCache: {type(module).__name__} is not scripted; pass torch.jit.script(module).eval()")
        else:
            raise TypeError(f"PlanCache: expected a torch.jit.ScriptModule or a path, got {type(module).__name__}")
        if miss_mode not in MISS_MODES:
            raise ValueError(f"PlanCache: unknown miss_mode {miss_mode!r}; expected one of {', '.join(MISS_MODES)}")
        self._cache = torch.classes.torch_ext.PlanCache(
            source, [int(d) for d in (batch_dims or [])], [int(d) for d in (output_batch_dims or [])], miss_mode,
            bool(background_builds), int(admit_after), int(max_plans), int(max_bytes), int(max_batch_size),
            int(warmup_calls), bool(optimize_for_inference),
            None if specialize_shapes is None else bool(specialize_shapes), bool(static_runtime), bool(cuda_graphs),
            method)
        # Bound once: looking a method up on a ScriptObject costs about 1 us a call.
        self._infer, self._infer_tensors = self._cache.infer, self._cache.infer_tensors

    @property
    def script_object(self) -> torch.ScriptObject:
        """The torch.classes.torch_ext.PlanCache behind this object (to hand to scripted code)."""
        return self._cache

    def infer(self, *inputs: Any) -> Any:
        """Run the module on inputs whose batch dimensions all have one size."""
        # Typed calls skip the type inference Python does for an Any argument (~20 us a call).
        if len(inputs) == 1 and type(inputs[0]) is torch.Tensor:
            return self._infer(inputs[0])
        if all(type(value) is torch.Tensor for value in inputs):
            return self._infer_tensors(list(inputs))
        return self._infer(tuple(inputs))

    __call__ = infer

    def infer_batch(self, *inputs: Any) -> Any:
        """Any number of elements: split into calls of select_batch_size(remaining), outputs concatenated."""
        return self._cache.infer_batch(tuple(inputs))

    def preload(self, sizes: Iterable[int], example_inputs: Optional[Sequence[Any]] = None,
                progress: bool = True) -> None:
        """Build plans for sizes up front. example_inputs (any batch size) give the other dimensions;
        default: the inputs of an earlier call."""
        sizes = [int(n) for n in sizes]
        example = tuple(example_inputs) if example_inputs is not None else None
        iterator: Iterable[int] = sizes
        if progress:
            from tqdm import tqdm
            iterator = tqdm(sizes, desc="PlanCache.preload", unit="plan", leave=False, disable=None)
        for n in iterator:
            self._cache.preload([n], example)

    def select_batch_size(self, max_count: int) -> int:
        """How many of max_count waiting elements one call should take."""
        return self._cache.select_batch_size(int(max_count))

    def cached_sizes(self) -> list[int]:
        return list(self._cache.cached_sizes())

    def __contains__(self, batch_size: int) -> bool:
        return bool(self._cache.contains(int(batch_size)))

    def plan_module(self, batch_size: int) -> Optional[torch.jit.ScriptModule]:
        """The plan's frozen, optimised module for batch_size, or None when not cached."""
        module = self._cache.plan_module(int(batch_size))
        if module is None:
            return None
        return torch.jit._recursive.wrap_cpp_module(module._c if hasattr(module, "_c") else module)

    def stats(self) -> dict:
        """Totals (same fields as the C++ PlanCacheStats) and "sizes": {batch size: per-size stats}."""
        totals = _typed(dict(self._cache.stats()))
        totals["sizes"] = {int(n): _typed(dict(s)) for n, s in sorted(self._cache.size_stats().items())}
        return totals

    def reset_stats(self) -> None:
        self._cache.reset_stats()

    def clear(self) -> None:
        self._cache.clear()

    def wait_for_builds(self) -> None:
        """Block until no background build is queued or running."""
        self._cache.wait_for_builds()

    def save(self, directory: Union[str, os.PathLike]) -> None:
        """Write the frozen module, an example row and the cached sizes to directory."""
        self._cache.save(os.fspath(directory))

    def load(self, directory: Union[str, os.PathLike]) -> int:
        """Rebuild the saved sizes from directory without freezing again; returns how many were loaded."""
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"PlanCache.load: {directory} is not a directory")
        return int(self._cache.load(directory))

    def __repr__(self) -> str:
        s = self._cache.stats()
        return (f"PlanCache(miss_mode={self._cache.miss_mode()!r}, plans={int(s['plans'])}, "
                f"sizes={self.cached_sizes()})")


def stats_line(stats: dict) -> str:
    """One line of the figures a server operator looks at first."""
    calls = max(1, stats["calls"])
    return (f"calls {stats['calls']}, hits {stats['hits']} ({100 * stats['hits'] / calls:.0f}%), "
            f"misses {stats['misses']}, builds {stats['builds']} ({stats['build_seconds']:.2f} s), "
            f"padded {stats['padded_calls']} (+{stats['padded_elements']} rows), split {stats['split_calls']}, "
            f"fallback {stats['fallback_calls']}, evictions {stats['evictions']}, plans {stats['plans']} "
            f"({stats['plan_bytes'] / 2**20:.1f} MiB), mean hit lookup "
            f"{1e6 * stats['hit_lookup_seconds'] / max(1, stats['hits']):.2f} µs")


def demo(progress) -> None:
    """A scripted transformer encoder served a stream of random batch sizes, with and without the
    plan cache (preloaded for sizes 1..32), requests interleaved so machine noise hits both alike."""
    torch.manual_seed(0)
    rng = random.Random(0)
    requests = [rng.randint(1, 32) for _ in range(300)]
    inputs = {n: torch.randn(n, 16, 64) for n in range(1, 33)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a second OpenMP thread on a busy machine adds its own spikes
    try:
        scripted = torch.jit.script(EncoderClassifier().eval())
        cache = PlanCache(scripted)
        start = time.perf_counter()
        cache.preload(progress(range(1, 33), desc="preload"), example_inputs=(inputs[1],), progress=False)
        preload_seconds = time.perf_counter() - start
        latencies: dict[str, list[float]] = {"scripted module": [], "PlanCache (preloaded 1..32)": []}
        runs = {"scripted module": scripted, "PlanCache (preloaded 1..32)": cache.infer}
        with torch.no_grad():
            for n in progress(requests, desc="requests"):
                for name, run in runs.items():
                    t = time.perf_counter()
                    run(inputs[n])
                    latencies[name].append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    print(f"stream: {len(requests)} requests, batch sizes 1..32; preload of 32 plans took {preload_seconds:.1f} s")
    for name, values in latencies.items():
        ordered = sorted(values)
        print(f"{name:<28} total {sum(values):.2f} s, p50 {1e3 * ordered[len(ordered) // 2]:.2f} ms, "
              f"p99 {1e3 * ordered[int(0.99 * (len(ordered) - 1))]:.1f} ms, max {1e3 * ordered[-1]:.1f} ms")
    print("cache:", stats_line(cache.stats()))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot; pip install matplotlib for one)")
        return
    path = os.path.join(os.environ.get("TORCH_EXT_DEMO_DIR", tempfile.gettempdir()), "plan_cache_latency.png")
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, values in latencies.items():
        ax.plot([1e3 * v for v in values], label=name, linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("request index")
    ax.set_ylabel("latency (ms)")
    ax.set_title("Random batch sizes 1..32: latency by request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")
