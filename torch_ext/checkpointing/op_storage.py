"""Storage in the op-level planner (torch_ext.plan_ops' storage option): what a checkpointed
block's input holds when stored rounded to 16 bits (torch_ext.checkpoint's lossy "bf16" / "fp16"
storage), and what rounding it and widening it back costs."""
from __future__ import annotations

import statistics
from typing import Any

import torch

from .measuring import _device_clock, _storage_bytes

_STORAGE = ("keep", "bf16", "fp16")


def _check_storage(storage: Any) -> list[str]:
    options = [storage] if isinstance(storage, str) else list(storage) if isinstance(storage, (list, tuple)) else None
    if not options or any(option not in _STORAGE for option in options) or len(set(options)) != len(options):
        raise ValueError(f"plan_ops: storage must be one or more of {', '.join(map(repr, _STORAGE))} (no repeats), "
                         f"got {storage!r}")
    return options


def _rounds(t: torch.Tensor) -> bool:
    """Whether checkpoint storage "bf16" / "fp16" stores t rounded (a float wider than 16 bits)."""
    return t.is_floating_point() and t.element_size() > 2


def _rounded_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of tensors stored rounded to 16 bits (the others as they are)."""
    return _storage_bytes([t for t in tensors if not _rounds(t)], set()) + sum(2 * t.numel() for t in tensors if _rounds(t))


def _rounding_seconds(tensors: list[torch.Tensor], repeat: int) -> float:
    """Median time to round tensors to bfloat16 and widen them back (what rounded storage adds to
    a checkpointed block: the forward stores, the replay restores)."""
    wide = [t.detach() for t in tensors if _rounds(t)]
    if not wide:
        return 0.0
    samples, clock = [], _device_clock(wide)
    for _ in range(repeat):
        start = clock()
        for t in wide:
            t.to(torch.bfloat16).to(t.dtype)
        samples.append(clock() - start)
    return statistics.median(samples)
