"""Early stop for the replays of Python segments on CPU: the ops after the last one whose output
backward reads (the tail) need their autograd nodes, not their values."""
from __future__ import annotations

import itertools
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

_DETACH = torch.ops.aten.detach.default
_TAIL_ATTRIBUTE = "_torch_ext_replay_tail"  # a class-decorated module's _ReplayTail
# A tail is skipped only when its ops took longer than this, plus the dispatch mode's cost per op
# (about 10 µs of Python each), in the replay that recorded them: tiny segments never pay for it.
_TAIL_MIN_SECONDS = 100e-6
_TAIL_SECONDS_PER_OP = 10e-6


def _storage_key(t: torch.Tensor) -> Optional[int]:
    storage = t.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else None


def _tensors_in(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _tensor_metas(tensors: Sequence[torch.Tensor]) -> list:
    # requires_grad decides which inputs an op's backward saves
    return [(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad) for t in tensors]


def _sources(storages: Iterable[Optional[int]], producers: dict) -> tuple:
    """For each storage key, the index of the tail op that produced it (producers), or -1."""
    return tuple(producers.get(key, -1) for key in storages)


@dataclass
class _RecordedOp:
    func: Any
    inputs: list          # metas of its tensor arguments
    outputs: list         # metas of its outputs
    alias: bool           # it returns views of its inputs: always run (cheap, and aliasing matters)
    skippable: bool       # tensors out, no mutation, no randomness, shapes known without the data
    seconds: float
    storages: set         # storage keys of its outputs
    input_storages: list  # storage key of each tensor argument
    sources: tuple = ()   # in the tail: which tail op produced each tensor argument (-1: none)


class _RecordOps(TorchDispatchMode):
    """The replay's ops below autograd, as recorded by the first replay of a segment."""

    def __init__(self, pack) -> None:
        super().__init__()
        self.pack, self.ops, self.foreign_hooks = pack, [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DETACH:  # saving an output for backward detaches it unless hooks pack it
            return func(*args, **kwargs)
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or top[0] is not self.pack:
            self.foreign_hooks = True  # other hooks would hide what backward saves from ours
        start = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - start
        schema = func._schema
        returns_tensors = all(str(r.type) in ("Tensor", "Tensor[]") for r in schema.returns)
        skippable = (returns_tensors and not schema.is_mutable and bool(schema.returns)
                     and not {torch.Tag.nondeterministic_seeded, torch.Tag.dynamic_output_shape,
                              torch.Tag.data_dependent_output} & set(func.tags))
        inputs, outputs = _tensors_in((args, kwargs)), _tensors_in(out)
        self.ops.append(_RecordedOp(func, _tensor_metas(inputs), _tensor_metas(outputs),
                                    any(r.alias_info is not None for r in schema.returns), skippable, seconds,
                                    {_storage_key(t) for t in outputs} - {None},
                                    [_storage_key(t) for t in inputs]))
        return out


class _TailDiverged(Exception):
    pass


class _SkipTail(TorchDispatchMode):
    """Runs a replay whose ops match the recorded ones from op `first` on, except that the tail's
    ops (after `cut`) return empty tensors of the recorded shapes: backward needs their nodes, not
    their values. A tail op must match its record in function, input metadata and which tail ops
    produced its inputs, so that its backward saves what the record's did: no skipped value."""

    def __init__(self, ops: list, cut: int, first: int) -> None:
        super().__init__()
        self.ops, self.cut, self.index, self.skipped, self.off = ops, cut, first - 1, 0, False
        self.producers: dict = {}  # storage key -> index of the tail op that produced it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _DETACH or self.off:
            return func(*args, **kwargs)
        self.index += 1
        op = self.ops[self.index] if self.index < len(self.ops) else None
        if self.index <= self.cut:
            if op is None or op.func is not func:
                self.off = True  # another path before anything was skipped: run it all
            return func(*args, **kwargs)
        inputs = _tensors_in((args, kwargs))
        if (op is None or op.func is not func or _tensor_metas(inputs) != op.inputs
                or _sources(map(_storage_key, inputs), self.producers) != op.sources):
            raise _TailDiverged()  # ops already skipped may feed this one: the caller replays again
        if op.alias:
            out = func(*args, **kwargs)
            outs = _tensors_in(out)
        else:
            self.skipped += 1
            outs = [torch.empty_strided(size, stride, dtype=dtype, device=device)
                    for size, stride, dtype, device, _ in op.outputs]
            returns = func._schema.returns
            if len(returns) == 1:
                out = outs if str(returns[0].type) == "Tensor[]" else outs[0]
            else:
                out = tuple(outs)
        self.producers.update(dict.fromkeys({_storage_key(t) for t in outs} - {None}, self.index))
        return out


@dataclass
class _TailRecord:
    ops: list  # _RecordedOp of one replay
    cut: int   # the last op whose output backward reads (or that must run); the tail follows it
    # Where the skipping mode is entered: (a module of the segment, which of its calls in one
    # replay, the index of the first op that call dispatches), or None: from the start.
    # Entering late spares the ops before it the mode's Python cost.
    anchor: Optional[tuple] = None


class _ReplayTail:
    """Early stop for the replays of one checkpoint call site.

    A replay must rebuild the segment's autograd graph, but backward reads only the tensors its
    nodes saved: the ops after the last one whose output is saved (the tail: a block's output
    projection and residual add) need their nodes, not their values. The first replay at given
    input shapes records its ops and what backward saved (saved-tensor hooks); later replays at
    those shapes, under a dispatch mode below autograd, run the tail's ops as empty tensors of the
    recorded shapes. The mode is entered at the call of the segment's last submodule that starts
    before the tail (its forward pre-hook), not for the whole replay. Off for segments on
    accelerators, under other saved-tensor hooks, or whose tail took less time than the mode
    costs; random, mutating and data-dependent ops always run. A replay whose tail departs from
    the record runs again in full, from the same RNG state, and its shapes are not skipped again.
    Thread-safe."""

    MAX_SHAPES = 8  # records kept per site; replays at further shapes run in full

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.off = False
        self.records: dict[tuple, Optional[_TailRecord]] = {}  # input shapes -> record (None: run in full)
        self.skipped_ops = 0

    def __deepcopy__(self, memo) -> "_ReplayTail":
        return _ReplayTail()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def replay(self, run: Callable, tensors: Sequence[torch.Tensor], params: Iterable[torch.Tensor],
               modules: Sequence[nn.Module] = ()) -> Any:
        """run(*tensors): the segment's forward (the core runs it without grad: nothing to skip) or its
        replay (with grad); params: the other tensors it reads; modules: those whose calls it makes
        (their submodules' forward pre-hooks place the mode)."""
        if self.off or not torch.is_grad_enabled():
            return run(*tensors)
        shapes = tuple((t.shape, t.dtype) for t in tensors)
        record = self.records.get(shapes, False)
        if record is False:
            if len(self.records) >= self.MAX_SHAPES:
                return run(*tensors)
            return self._record(shapes, run, tensors, params, modules)
        if record is None:
            return run(*tensors)
        rng = torch.get_rng_state()
        try:
            out, skipped = self._skipping(record, run, tensors)
        except _TailDiverged:
            with self._lock:
                self.records[shapes] = None
            torch.set_rng_state(rng)
            return run(*tensors)
        with self._lock:
            self.skipped_ops += skipped
        return out

    @staticmethod
    def _skipping(record: _TailRecord, run: Callable, tensors: Sequence[torch.Tensor]) -> tuple[Any, int]:
        """run(*tensors) with the tail skipped; the number of ops skipped."""
        if record.anchor is None:
            mode = _SkipTail(record.ops, record.cut, 0)
            with mode:
                return run(*tensors), mode.skipped
        module_ref, call, first = record.anchor
        module = module_ref()
        if module is None:
            return run(*tensors), 0
        mode = _SkipTail(record.ops, record.cut, first)
        thread, depth = threading.get_ident(), torch._C._len_torch_dispatch_stack()
        calls, entered = 0, False

        def enter(_module, _args):
            nonlocal calls, entered
            if threading.get_ident() != thread:
                return  # another thread calls the module meanwhile
            calls += 1
            # Not inside a dispatch mode the segment entered: leaving it would pop ours.
            if calls == call and torch._C._len_torch_dispatch_stack() == depth:
                mode.__enter__()
                entered = True

        handle = module.register_forward_pre_hook(enter)
        try:
            return run(*tensors), mode.skipped
        finally:
            handle.remove()
            if entered:
                mode.__exit__(None, None, None)

    def _record(self, shapes: tuple, run: Callable, tensors: Sequence[torch.Tensor],
                params: Iterable[torch.Tensor], modules: Sequence[nn.Module]) -> Any:
        on_cpu = all(t.device.type == "cpu" for t in itertools.chain(tensors, params))
        if not on_cpu or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            self.off = True
            return run(*tensors)
        saved: set = set()

        def pack(t):
            key = _storage_key(t)
            if key is not None:
                saved.add(key)
            return t

        recorder = _RecordOps(pack)
        calls: list = []  # (module, which of its calls, ops dispatched before it)
        thread, counts = threading.get_ident(), {}

        def note(module, _args):
            if threading.get_ident() == thread:
                counts[module] = counts.get(module, 0) + 1
                calls.append((module, counts[module], len(recorder.ops)))

        submodules = {id(m): m for root in modules for m in root.modules()}
        handles = [m.register_forward_pre_hook(note) for m in submodules.values()]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder:
                out = run(*tensors)
        finally:
            for handle in handles:
                handle.remove()
        ops = recorder.ops
        cut = -1
        for i, op in enumerate(ops):
            if not op.skippable or (not op.alias and op.storages & saved):
                cut = i
        producers: dict = {}
        for i in range(cut + 1, len(ops)):
            ops[i].sources = _sources(ops[i].input_storages, producers)
            producers.update(dict.fromkeys(ops[i].storages, i))
        # The mode starts at the last submodule call that dispatches no tail op before it.
        anchor = None
        for module, call, first in calls:
            if 0 < first <= cut + 1:
                anchor = (weakref.ref(module), call, first)
        first = anchor[2] if anchor else 0
        gain = sum(op.seconds for op in ops[cut + 1:] if not op.alias)
        if recorder.foreign_hooks or gain <= _TAIL_MIN_SECONDS + _TAIL_SECONDS_PER_OP * (len(ops) - first):
            self.off = True  # no shape would pay: spare every later replay the lookup
        else:
            with self._lock:
                self.records.setdefault(shapes, _TailRecord(ops, cut, anchor))
        return out
