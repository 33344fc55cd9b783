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
from typing import Any, Iterable, Optional, Sequence, Union

import torch

__all__ = ["PlanCache", "MISS_MODES"]

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
