"""Chains of layers with checkpointed boundaries: CheckpointedSequential (with memory accounting
and recompute()) and checkpoint_sequential, the drop-in for torch.utils.checkpoint's."""
from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .api import _pop_torch_keywords, _run, checkpoint_options, option_names
from .measuring import _call, _check_parameter_bytes, _storage_bytes, _tensor_leaves
from .planner import CheckpointPlan, _planning_gradients, plan_checkpoints

def _segments_from_boundaries(n: int, boundaries: Sequence[int], owner: str) -> list[tuple[int, int, bool]]:
    bounds = list(boundaries)
    for b in bounds:
        if not isinstance(b, int) or isinstance(b, bool):
            raise TypeError(f"{owner}: boundaries must be layer indices (int), got {b!r}")
        if not 0 <= b < n:
            raise ValueError(f"{owner}: boundary {b} is outside the chain of {n} layers (expected 0 <= b < {n})")
    if bounds != sorted(set(bounds)):
        raise ValueError(f"{owner}: boundaries {bounds} must be strictly increasing")
    segments = []
    if not bounds or bounds[0] > 0:
        segments.append((0, bounds[0] if bounds else n, False))
    for j, start in enumerate(bounds):
        segments.append((start, bounds[j + 1] if j + 1 < len(bounds) else n, True))
    return segments


class CheckpointedSequential(nn.Sequential):
    """An nn.Sequential whose layer boundaries are checkpointed.

    Exactly one of: every=k (a checkpoint every k layers, from layer 0), boundaries=[...] (the
    layers whose inputs are kept; layers before the first run without checkpointing), or
    budget_bytes=B (planned by plan_checkpoints on the first forward with grad, with its
    `gradients` and `head` options; see .plan). A CheckpointPlan may be given as boundaries (for
    these layers: one whose trainable parameter bytes differ from the plan's is refused). The
    state_dict keys are nn.Sequential's (a head is not one of the layers).

    After a forward with grad the chain keeps weak references to each segment's input, for
    recompute(), and the bytes of the stored boundaries, for the accounting methods: it never keeps
    a boundary alive itself, so backward frees them (and offloaded or compressed boundaries leave
    their device right after the forward). recompute() therefore works while the autograd graph
    holds the boundaries (before backward, with keep storage). Not thread-safe: one forward at a
    time per instance.
    """

    def __init__(self, layers: Any, *, every: Optional[int] = None, boundaries: Any = None,
                 budget_bytes: Optional[int] = None, gradients: Optional[str] = None, head: Optional[Callable] = None,
                 **options: Any) -> None:
        if isinstance(layers, (dict, OrderedDict)):
            super().__init__(OrderedDict(layers))
        elif isinstance(layers, nn.Module) and not isinstance(layers, (nn.Sequential, nn.ModuleList)):
            super().__init__(layers)
        else:
            super().__init__(*list(layers))
        n = len(self)
        if n == 0:
            raise ValueError("CheckpointedSequential: the chain has no layers")
        chosen = [name for name, value in (("every", every), ("boundaries", boundaries), ("budget_bytes", budget_bytes))
                  if value is not None]
        if len(chosen) > 1:
            raise ValueError(f"CheckpointedSequential: give one of every, boundaries or budget_bytes, not {chosen}")
        self.options = checkpoint_options("CheckpointedSequential", **options)
        if budget_bytes is not None and self.options.chooses_ops:
            raise ValueError(f"CheckpointedSequential: {_PLANNED_POLICY}")
        self.budget_bytes = budget_bytes
        self.gradients = _planning_gradients(gradients, budget_bytes, "CheckpointedSequential")
        if head is not None and budget_bytes is None:
            raise ValueError("CheckpointedSequential: head is an option of planning under a budget; give budget_bytes")
        # Kept out of the module tree: the head is the caller's, not one of the chain's layers.
        self.__dict__["_head"] = head
        self.plan: Optional[CheckpointPlan] = None
        if budget_bytes is not None:
            if not isinstance(budget_bytes, (int, float)) or budget_bytes <= 0:
                raise ValueError(f"CheckpointedSequential: budget_bytes must be a positive number, got {budget_bytes!r}")
            self._segments: Optional[list] = None
        elif boundaries is not None:
            if isinstance(boundaries, CheckpointPlan):
                if boundaries.segments[-1][1] != n:
                    raise ValueError(f"CheckpointedSequential: the plan covers {boundaries.segments[-1][1]} layers, "
                                     f"the chain has {n}")
                _check_parameter_bytes(list(self), boundaries.layer_parameter_bytes, "CheckpointedSequential")
                self.plan = boundaries
                self._segments = list(boundaries.segments)
            else:
                self._segments = _segments_from_boundaries(n, boundaries, "CheckpointedSequential")
        else:
            every = 1 if every is None else every
            if not isinstance(every, int) or every < 1:
                raise ValueError(f"CheckpointedSequential: every must be a positive int, got {every!r}")
            self._segments = _segments_from_boundaries(n, list(range(0, n, every)), "CheckpointedSequential")
        # Per segment of the last forward with grad: (start, checkpointed, weak (args, kwargs),
        # stored boundary bytes, rng).
        self._records: list = []
        self._layer_output_bytes: list[int] = [0] * n
        self._layer_output_meta: list = [None] * n

    # ---- structure
    @property
    def boundaries(self) -> list[int]:
        if self._segments is None:
            raise RuntimeError("CheckpointedSequential: the plan for budget_bytes is made on the first forward with grad")
        return [start for start, _, checkpointed in self._segments if checkpointed]

    def is_checkpoint_layer(self, index: int) -> bool:
        self._check_index(index)
        return index in self.boundaries

    def num_checkpoints(self) -> int:
        return len(self.boundaries)

    # ---- accounting (of the last forward with grad)
    def memory_bytes(self) -> int:
        """Bytes of the boundaries the last forward stored (checkpointed segments' inputs, under the storage policy)."""
        return sum(nbytes for _, checkpointed, _, nbytes, _ in self._records if checkpointed)

    def full_memory_bytes(self) -> int:
        """Bytes that storing every layer's output of the last forward would take."""
        return sum(self._layer_output_bytes)

    def memory_savings(self) -> float:
        """1 - memory_bytes() / full_memory_bytes(), clamped to [0, 1)."""
        full = self.full_memory_bytes()
        if full <= 0:
            return 0.0
        return min(max(0.0, 1.0 - self.memory_bytes() / full), math.nextafter(1.0, 0.0))

    def memory_saved_bytes(self) -> int:
        return max(0, self.full_memory_bytes() - self.memory_bytes())

    def clear(self) -> None:
        """Forget the last forward (its accounting and what recompute() would replay)."""
        self._records = []

    # ---- running
    def _check_index(self, index: int) -> None:
        if not isinstance(index, int) or not 0 <= index < len(self):
            raise IndexError(f"CheckpointedSequential: layer index {index!r} is outside 0..{len(self) - 1}")

    def _segment_fn(self, start: int, end: int, record: bool):
        # The closure lives in the autograd graph, which the records of the last forward keep
        # alive: it must not hold the chain itself (a cycle through C++ that Python's GC cannot see).
        layers = [self[i] for i in range(start, end)]
        output_bytes, output_meta = self._layer_output_bytes, self._layer_output_meta

        def run(*args, **kwargs):
            value: Any = None
            for offset, layer in enumerate(layers):
                value = layer(*args, **kwargs) if offset == 0 else layer(value)
                if record:
                    leaves = _tensor_leaves(value)
                    output_bytes[start + offset] = _storage_bytes(leaves, set())
                    output_meta[start + offset] = [(t.shape, t.dtype) for t in leaves]
            return value
        return run

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self._records = []
        grad = torch.is_grad_enabled()
        if self._segments is None:
            if not grad:
                return self._plain(inputs, kwargs)
            self.plan = plan_checkpoints(list(self), *inputs, budget_bytes=self.budget_bytes,
                                         storage=self.options.script.storage, gradients=self.gradients,
                                         head=self._head, **kwargs)
            self._segments = list(self.plan.segments)
        value: Any = None
        for start, end, checkpointed in self._segments:
            args, kw = (inputs, kwargs) if start == 0 else ((value,), {})
            run = self._segment_fn(start, end, record=grad)
            if grad:
                leaves = _tensor_leaves((args, kw))
                nbytes = _boundary_bytes(leaves, self.options.script.storage) if checkpointed else 0
                weak = pytree.tree_map_only(torch.Tensor, weakref.ref, (args, kw))
                self._records.append((start, checkpointed, weak, nbytes, _rng_snapshot(leaves)))
            if checkpointed and grad:
                value = _run(run, args, kw, self.options, f"CheckpointedSequential[{start}:{end}]")
            else:
                value = run(*args, **kw)
        return value

    def _plain(self, inputs, kwargs):
        value = self[0](*inputs, **kwargs)
        for i in range(1, len(self)):
            value = self[i](value)
        return value

    @torch.no_grad()
    def recompute(self, layer_idx: int) -> Any:
        """Replay from the nearest checkpoint at or before layer_idx (with the RNG state of the
        forward) and return that layer's output, as the last forward computed it."""
        self._check_index(layer_idx)
        if not self._records:
            raise RuntimeError("CheckpointedSequential.recompute: no forward with grad has run since construction or clear()")
        start, _, weak, _, rng = max((r for r in self._records if r[0] <= layer_idx), key=lambda r: r[0])
        if any(isinstance(leaf, weakref.ref) and leaf() is None for leaf in pytree.tree_leaves(weak)):
            raise RuntimeError(f"CheckpointedSequential.recompute: the input of layer {start} (the checkpoint before "
                               f"layer {layer_idx}) is no longer alive: backward freed it, or the storage policy "
                               f"({self.options.script.storage!r}) kept only a copy; call recompute() between forward and backward")
        args, kwargs = pytree.tree_map_only(weakref.ref, lambda ref: ref(), weak)
        with torch.random.fork_rng(devices=[d for d, _ in rng if d is not None]):
            _restore_rng(rng)
            value: Any = None
            for i in range(start, layer_idx + 1):
                value = self[i](*args, **kwargs) if i == start else self[i](value)
                got = [(t.shape, t.dtype) for t in _tensor_leaves(value)]
                expected = self._layer_output_meta[i]
                if got != expected:
                    raise RuntimeError(f"CheckpointedSequential.recompute: the replay of layer {i} ({type(self[i]).__name__}) "
                                       f"produced {got} but the forward produced {expected}")
        return value


def _rng_snapshot(tensors: list[torch.Tensor]) -> list:
    states = [(None, torch.get_rng_state())]
    for index in sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"}):
        states.append((index, torch.cuda.get_rng_state(index)))
    return states


def _restore_rng(states: list) -> None:
    for index, state in states:
        if index is None:
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, index)


_PLANNED_POLICY = ("budget_bytes with context_fn or save: the planner measures layers without a selective "
                   "checkpointing policy, so its plan would not account for the outputs the policy keeps; choose the "
                   "layers (every / boundaries), plan without the policy, or plan ops (ops=True / plan_ops)")

def _boundary_bytes(tensors: list[torch.Tensor], storage: str) -> int:
    return int(torch.ops.torch_ext.checkpoint_boundary_bytes(tensors, storage))


def checkpoint_sequential(functions: Any, segments: int, *inputs: Any, **kwargs: Any) -> Any:
    """Drop-in for torch.utils.checkpoint.checkpoint_sequential: run `functions` (an
    nn.Sequential or a list of modules / callables) in `segments` parts of len(functions) //
    segments functions; all but the last are checkpointed, and the last runs plainly with the rest
    (its activations are needed right away by backward), as torch does. Unlike torch's, the first
    function may take several inputs, and the keyword arguments that are not options. Options are
    torch_ext.checkpoint's, context_fn (selective checkpointing) included; torch's keywords as
    checkpoint_call takes them (use_reentrant and debug ignored, determinism_check "default")."""
    _pop_torch_keywords("checkpoint_sequential", kwargs)
    names = option_names()
    options = checkpoint_options("checkpoint_sequential", **{k: kwargs.pop(k) for k in list(kwargs) if k in names})
    if isinstance(functions, nn.Sequential):
        functions = list(functions.children())
    functions = list(functions)
    n = len(functions)
    if not isinstance(segments, int) or not 1 <= segments <= max(n, 1):
        raise ValueError(f"checkpoint_sequential: segments={segments!r} must be between 1 and the number of functions ({n})")
    if not inputs:
        raise TypeError("checkpoint_sequential() missing its input: give at least one input after segments")

    def run_chunk(chunk: list, first: bool):
        def run(*args, **kw):
            value = args if first else args[0]
            for offset, fn in enumerate(chunk):
                value = _call(fn, value, kw, first=first and offset == 0)
            return value
        return run

    per_segment = n // segments
    value: Any = None
    args, kw = inputs, kwargs
    for start in range(0, per_segment * (segments - 1), per_segment):
        end = start + per_segment
        value = _run(run_chunk(functions[start:end], start == 0), args, kw, options,
                     f"checkpoint_sequential[{start}:{end}]")
        args, kw = (value,), {}
    last = per_segment * (segments - 1)
    return run_chunk(functions[last:], last == 0)(*args, **kw)
