"""Backward through paged weights within the budget.

Autograd saves the tensors a backward formula needs: a matmul saves its weight to compute the
input's gradient. Kept as they are, the paged weights would stay alive until the backward, past
the budget. While a paged module runs its forward with grad enabled, saved-tensor hooks are pushed
that save a paged weight (or a view of one) as its checkpoint key and view geometry instead of
the tensor; the backward re-acquires it from the pager for that node only. Every other tensor goes
to the hooks that were active before (torch_ext.checkpoint's, torch.utils.checkpoint's, a user's)
or is kept as autograd would keep it, so the hooks compose with checkpointing: a replay runs the
module's hooks again and saves its weights the same way.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

_autograd = torch._C._autograd


class _SavedWeight:
    """A paged weight (or a view of it) saved for backward: its key and its view's geometry
    relative to the acquired tensor."""

    __slots__ = ("key", "size", "stride", "offset")

    def __init__(self, key: str, size: torch.Size, stride: tuple, offset: int) -> None:
        self.key, self.size, self.stride, self.offset = key, size, stride, offset


class _Enclosing:
    """A tensor saved by the hooks that were active when the module's forward began."""

    __slots__ = ("unpack", "packed")

    def __init__(self, unpack: Callable[[Any], torch.Tensor], packed: Any) -> None:
        self.unpack, self.packed = unpack, packed


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    try:
        storage = t.untyped_storage()
        return (storage.data_ptr(), storage.nbytes()) if storage.data_ptr() else None
    except (RuntimeError, NotImplementedError):  # tensors without storage (subclasses, sparse)
        return None


class SavedWeightHooks:
    """push(owner, weights) when a paged module's forward starts, pop(owner) when it ends (LIFO with
    other saved-tensor hooks; a pop without its push, after a pre-hook that raised, does nothing).
    Holds acquired tensors only between the two."""

    def __init__(self, acquire: Callable[[str], torch.Tensor]) -> None:
        self._acquire = acquire
        self._local = threading.local()  # saved-tensor hooks are per thread, and so are the frames

    @property
    def _frames(self) -> list[tuple[object, dict | None]]:
        frames = getattr(self._local, "frames", None)
        if frames is None:
            frames = self._local.frames = []
        return frames

    def push(self, owner: object, weights: list[tuple[str, torch.Tensor]]) -> None:
        if not (torch.is_grad_enabled() and _autograd._saved_tensors_hooks_is_enabled()):
            self._frames.append((owner, None))
            return
        registry: dict[tuple[int, int], tuple[str, torch.Tensor]] = {}
        for key, t in weights:
            storage = _storage_key(t)
            if storage is not None:
                registry[storage] = (key, t)
        enclosing = _autograd._top_saved_tensors_default_hooks(False)
        acquire = self._acquire

        # The pack hook stays referenced by each tensor it saved, until the graph is freed: it must
        # not keep the weights alive after the forward, so pop() empties the registry it reads.
        def pack(t: torch.Tensor) -> Any:
            storage = _storage_key(t) if registry else None
            found = registry.get(storage) if storage is not None else None
            if found is not None and found[1].dtype == t.dtype:
                key, base = found
                return _SavedWeight(key, t.size(), t.stride(), t.storage_offset() - base.storage_offset())
            if enclosing is not None:
                return _Enclosing(enclosing[1], enclosing[0](t))
            return t.detach()  # as autograd keeps it; a tensor (not a detached alias) would make a cycle

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, _SavedWeight):
                base = acquire(packed.key)  # held by this backward node only
                return base.as_strided(packed.size, packed.stride, base.storage_offset() + packed.offset)
            if isinstance(packed, _Enclosing):
                return packed.unpack(packed.packed)
            return packed

        _autograd._push_saved_tensors_default_hooks(pack, unpack)
        self._frames.append((owner, registry))

    def pop(self, owner: object) -> None:
        frames = self._frames
        if not frames or frames[-1][0] is not owner:
            return
        registry = frames.pop()[1]
        if registry is not None:
            registry.clear()
            _autograd._pop_saved_tensors_default_hooks()
