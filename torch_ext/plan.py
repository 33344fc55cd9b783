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

from ._script import ScriptObjectFace

__all__ = ["PlanCache"]


class PlanCache(ScriptObjectFace):
    """Per-batch-size specialised plans of a TorchScript module.

    module: a torch.jit.ScriptModule in eval mode, or the path of one saved with torch.jit.save.
    Keyword options are those of the C++ PlanCacheOptions (torch_ext/plan/plan_cache.h), with its
    defaults and checks: batch_dims, output_batch_dims, miss_mode ("exact", "pad", "split",
    "auto"), background_builds, admit_after, max_plans, max_bytes, max_batch_size, warmup_calls,
    optimize_for_inference, specialize_shapes, static_runtime, cuda_graphs, method; each is also
    a property. The object is torch.classes.torch_ext.PlanCache (`script_object`, which scripted
    code takes): select_batch_size(n), cached_sizes(), stats() (a PlanCacheStats whose `sizes`
    lists a SizeStats per batch size), reset_stats(), clear() and wait_for_builds() are its own.
    """

    def __init__(self, module: Union[torch.jit.ScriptModule, str, os.PathLike], **options: Any) -> None:
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
        self.script_object = torch.classes.torch_ext.PlanCache(source, **options)
        # Bound once: looking a method up on a ScriptObject costs about 1 us a call.
        self._infer, self._infer_tensors = self.script_object.infer, self.script_object.infer_tensors

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
        return self.script_object.infer_batch(tuple(inputs))

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
            self.script_object.preload([n], example)

    def __contains__(self, batch_size: int) -> bool:
        return int(batch_size) in self.script_object

    def plan_module(self, batch_size: int) -> Optional[torch.jit.ScriptModule]:
        """The plan's frozen, optimised module for batch_size, or None when not cached."""
        module = self.script_object.plan_module(int(batch_size))
        if module is None:
            return None
        return torch.jit._recursive.wrap_cpp_module(module._c if hasattr(module, "_c") else module)

    def save(self, directory: Union[str, os.PathLike]) -> None:
        """Write the frozen module, an example row and the cached sizes to directory."""
        self.script_object.save(os.fspath(directory))

    def load(self, directory: Union[str, os.PathLike]) -> int:
        """Rebuild the saved sizes from directory without freezing again; returns how many were loaded."""
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"PlanCache.load: {directory} is not a directory")
        return int(self.script_object.load(directory))

    def __repr__(self) -> str:
        return f"PlanCache(miss_mode={self.miss_mode!r}, plans={self.stats().plans}, sizes={self.cached_sizes()})"
