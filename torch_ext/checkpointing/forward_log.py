"""What a segment's forward did under torch's selective checkpointing policy (context_fn), noted
through the policy, which torch asks once for every op of the forward: the random ops' generator
states (for replay_draws.py) and the in-place writes after an output was kept.

torch checks the outputs its policy keeps for in-place changes by their version counters, and
misses changes that reach them through a tensor with a counter of its own: at::matmul returns a
batched product through aten::_unsafe_view, and a factory such as rand_like returns a shallow copy
of its output. Its replay then serves the changed value (Hugging Face's T5 under sdpa adds its mask
to the kept scores in place), and where the counter does show the change it raises on reaching
the output (Falcon adds its attention into its MLP's kept product). torch_ext notes the storage
every in-place op writes, and an output the forward wrote after the policy kept it is recomputed
in the replay instead, as the native policy does; allow_cache_entry_mutation=True keeps torch's
behaviour and serves the changed value.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import _RECOMPUTE, CheckpointPolicy

from .replay_draws import ReplayDraws, _generator, draws


def _written(schema: Any, args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors an in-place or out= op (of this schema) writes."""
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = kwargs.get(argument.name) if argument.kwarg_only or position >= len(args) else args[position]
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                yield leaf


def _storage(tensor: torch.Tensor) -> Optional[tuple]:
    """The tensor's storage, by device and address (None where it has none to write)."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse tensors, some subclasses
        return None
    return (tensor.device, storage.data_ptr()) if storage.nbytes() else None


class ForwardLog:
    """A selective checkpointing policy, wrapped to note each op of the forward: for a random op its
    generator, the generator's state when the policy was asked, whether that was after the draw (the
    context carries the op's output) and whether the policy saved it; for an in-place op the
    storage it wrote; for a kept output the op, its call index (the caching mode's) and when."""

    __slots__ = ("policy", "draws", "reruns_saved_draw", "_step", "_calls", "_kept", "_written_at")

    def __init__(self, policy: Callable) -> None:
        self.policy = policy
        self.draws: list[tuple[Optional[torch.Generator], Optional[torch.Tensor], bool, bool]] = []
        self.reruns_saved_draw = False  # a saved draw changed in place: the replay draws it again
        self._step = 0
        self._calls: dict = defaultdict(int)
        self._kept: list[tuple[Any, int, int]] = []
        self._written_at: dict = {}

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        decision = self.policy(ctx, op, *args, **kwargs)
        saved = decision is True or decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
        self._step += 1
        index = self._calls[op]
        self._calls[op] = index + 1
        schema = getattr(op, "_schema", None)  # higher-order ops have none
        if schema is not None and schema.is_mutable:
            for tensor in _written(schema, args, kwargs):
                storage = _storage(tensor)
                if storage is not None:
                    self._written_at[storage] = self._step
        if saved:
            self._kept.append((op, index, self._step))
        if draws(op, args, kwargs):
            generator = _generator(args, kwargs)
            state = None if generator is None else generator.get_state()
            self.draws.append((generator, state, hasattr(ctx, "op_output"), saved))
        return decision

    def recompute_changed(self, storage: dict) -> None:
        """Marks for recomputation the kept outputs (in the policy contexts' storage) that the forward
        wrote in place after keeping them, or that changed by their version counters, and drops them."""
        for op, index, step in self._kept:
            entries = storage.get(op)
            entry = entries.get(index) if entries is not None else None
            if entry is None or entry is _RECOMPUTE:
                continue
            if any(self._changed(leaf, step) for leaf in pytree.tree_leaves(entry)):
                entries[index] = _RECOMPUTE
                if torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
                    self.reruns_saved_draw = True
        self._kept.clear()
        self._written_at.clear()

    def _changed(self, leaf: Any, step: int) -> bool:
        value, version = getattr(leaf, "val", None), getattr(leaf, "version", None)
        if not isinstance(value, torch.Tensor):
            return False
        if version is not None and value._version != version:
            return True
        storage = _storage(value)
        return storage is not None and self._written_at.get(storage, 0) > step

    def replay(self, name: str) -> Optional[ReplayDraws]:
        """The mode that gives the replay the forward's draws, where one is needed: a saved draw
        before one the replay runs. Raises naming the segment where a generator cannot be set."""
        if not self.reruns_saved_draw and not self._saves_a_draw_before_a_rerun():
            return None
        if any(noted[0] is None for noted in self.draws):
            raise RuntimeError(f"torch_ext.checkpoint: {name}: the policy saves a random op before one its "
                               f"replay runs again, on a device without default generators to set")
        return ReplayDraws(self.draws)

    def _saves_a_draw_before_a_rerun(self) -> bool:
        saved = False
        for *_, kept in self.draws:
            saved = saved or kept
            if saved and not kept:
                return True
        return False
