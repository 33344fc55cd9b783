"""Memory accounting with one API for CPU and CUDA.

CPU figures come from torch_ext's counting allocator (installed when the library loads);
CUDA figures come from torch.cuda's caching allocator statistics.
"""
from __future__ import annotations

import threading
from collections import namedtuple
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Union

import torch

from . import _C

DeviceLike = Union[str, torch.device, int, None]

# The fields are the names of torch.ops.torch_ext.memory_stats' results (C++: MemoryStats).
MemoryStats = namedtuple("MemoryStats", [r.name for r in torch.ops.torch_ext.memory_stats.default._schema.returns])
MemoryStats.__doc__ = """Bytes of live tensor memory now (current_bytes), their peak since the last reset
(peak_bytes), and the number of allocations counted so far."""


def _device(device: DeviceLike) -> torch.device:
    if device is None:
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"torch_ext.memory: device {device} is not supported; expected cpu or cuda")
    return device


def stats(device: DeviceLike = None) -> MemoryStats:
    """Current and peak bytes of live tensor memory and the allocation count, on device (default CPU)."""
    device = _device(device)
    if device.type == "cuda":
        cuda = torch.cuda.memory_stats(device)
        return MemoryStats(current_bytes=int(cuda.get("allocated_bytes.all.current", 0)),
                           peak_bytes=int(cuda.get("allocated_bytes.all.peak", 0)),
                           allocations=int(cuda.get("allocation.all.allocated", 0)))
    return MemoryStats(*torch.ops.torch_ext.memory_stats())


def reset_peak(device: DeviceLike = None) -> None:
    """Set the peak to the current figure on device (default CPU). Open track() blocks keep the
    peak they have seen so far."""
    device = _device(device)
    with _open_tracks_lock:
        _reset_peak_keeping_open_tracks(device)


def _reset_peak_keeping_open_tracks(device: torch.device) -> None:
    """reset_peak's work, with _open_tracks_lock held: the open blocks on device first carry the
    peak so far, which the reset would forget."""
    peak_so_far = stats(device).peak_bytes
    for outer in _open_tracks:
        if outer.device == device:
            outer._carried_peak = max(outer._carried_peak, peak_so_far)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        torch.ops.torch_ext.reset_peak_memory()


@dataclass
class TrackResult:
    """What track() measured: peak_bytes is the highest live memory during the block,
    peak_delta_bytes that peak above the memory live when the block began, and saved_bytes
    the bytes saved for backward inside it (each storage counted once)."""

    device: torch.device
    start_bytes: int = 0
    peak_bytes: int = 0
    saved_bytes: int = 0
    _storages: set = field(default_factory=set, repr=False)
    _carried_peak: int = field(default=0, repr=False)

    @property
    def peak_delta_bytes(self) -> int:
        return self.peak_bytes - self.start_bytes


_open_tracks: list[TrackResult] = []
_open_tracks_lock = threading.Lock()


@contextmanager
def track(device: DeviceLike = None) -> Iterator[TrackResult]:
    """Measure a block: its peak memory and the bytes its autograd graph saves for backward.

    Figures are process-wide: allocations by other threads during the block count too.
    Blocks may nest; an inner block does not disturb the outer one's peak. A storage is
    recognised by its address, so one freed inside the block (after a backward) and another
    allocated at the same address are counted once.
    """
    device = _device(device)
    result = TrackResult(device=device)
    with _open_tracks_lock:
        _reset_peak_keeping_open_tracks(device)
        result.start_bytes = stats(device).current_bytes
        _open_tracks.append(result)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if key not in result._storages:
            result._storages.add(key)
            result.saved_bytes += storage.nbytes()
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            # pack returns each tensor as it is: checkpoints under it keep what they keep untracked.
            _C.checkpoint.mark_hooks_transparent()
            try:
                yield result
            finally:
                _C.checkpoint.unmark_hooks_transparent()
    finally:
        with _open_tracks_lock:
            result.peak_bytes = max(result._carried_peak, stats(device).peak_bytes)
            _open_tracks.remove(result)
            for outer in _open_tracks:
                if outer.device == device:
                    outer._carried_peak = max(outer._carried_peak, result.peak_bytes)
