"""The op-level planner's recording (op_planner.py): every aten op of a block's forward as torch's
selective checkpointing sees it, with the bytes of its outputs and its time, and which of them the
native policy counts alike (a forward without a Python dispatch mode can call other ops)."""
from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS

from .. import _C
from .measuring import _call, _detach_like, _device_clock, _tensor_leaves
from .replay_draws import draws


# The draws of dropout masks (bernoulli_ in place): the native policy keeps the mask as bool (one
# byte an element) and the generator's state after the draw (csrc/torch_ext/checkpoint/selective.h).
# By name (str(op)), as plans name ops: an OpOverload object is not unique (see selective._qualified).
_KEPT_DRAWS = frozenset({"aten.bernoulli_.float", "aten.bernoulli_.Tensor"})


class _OpRecorder(TorchDispatchMode):
    """Records each op of a forward as torch's selective checkpointing sees it (SAC_IGNORED_OPS
    skipped): name, occurrence, the bytes of its outputs' new storages (of a mask draw, its bool
    copy), its seconds. Ops whose outputs alias an input (views, in-place), that return no tensor,
    or whose outputs a later op of the forward mutates are not candidates, nor are random ops other
    than mask draws: a replay restores the forward's RNG state and draws the random ops again in
    order, which gives the forward's numbers only if the generator passes where it passed before
    (a kept draw puts it there). Nor are the ops of the tail, from the op whose saved tensor autograd
    packed last on (pack() is the forward's saved-tensor hook): torch_ext's early stop ends a replay
    there (an input is packed before its op runs, an output after), so saving a tail op buys
    nothing, and tail_seconds (the tail's time, every op) is not recompute. A tail too small for
    the Frame to stop before (under 65,536 elementwise elements of work, frame.h) is replayed:
    that little is not counted."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__()
        self.clock = clock
        self.records: list[list] = []
        self.positions: list[int] = []  # of each record, in the forward's ops
        self.seconds: list[float] = []  # of every op of the forward
        self.tail_start = math.inf  # no tensor saved: a block never replayed has no tail
        self.mutated: set[int] = set()
        self.by_storage: dict[int, list[int]] = {}
        self.seen: Counter = Counter()
        self.alive: list = []  # the candidates' outputs, so that no storage address is reused in the forward

    def __exit__(self, *exc: Any) -> None:
        # The outputs go with the forward: kept, they made what runs next (the probe, the block's
        # timed forward) allocate fresh pages, which the timed forward of a GPT-2 layer paid for
        # with up to 10 ms more (its replay estimate, forward time less the ops', went from 2 to
        # 12 ms at random).
        self.alive.clear()
        return super().__exit__(*exc)

    @property
    def ops(self) -> list[list]:
        return [record for i, record in enumerate(self.records)
                if i not in self.mutated and self.positions[i] < self.tail_start]

    @property
    def tail_seconds(self) -> float:
        return sum(self.seconds[self.tail_start:]) if self.tail_start < len(self.seconds) else 0.0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.tail_start = len(self.seconds)
        return tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        start = self.clock()
        out = func(*args, **kwargs)
        seconds = self.clock() - start
        self.seconds.append(seconds)
        name = str(func)
        index = self.seen[name]
        self.seen[name] += 1
        inputs = {t.untyped_storage().data_ptr() for t in _tensor_leaves((args, kwargs))}
        if func._schema.is_mutable:  # an output mutated later cannot be saved (torch's SAC raises)
            for ptr in inputs:
                self.mutated.update(self.by_storage.get(ptr, ()))
        outputs, nbytes = _tensor_leaves(out), 0
        if name in _KEPT_DRAWS:  # kept as a bool copy: later changes to the mask do not reach it
            if args[0].device.type == "cpu" and kwargs.get("generator") is None:
                self._record([name, index, args[0].numel(), seconds])
            return out
        if outputs and not any(t.untyped_storage().data_ptr() in inputs for t in outputs):
            nbytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in outputs}.values())
        if nbytes > 0 and not draws(func, args, kwargs):
            for t in outputs:
                self.by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(len(self.records))
            self._record([name, index, int(nbytes), seconds])
            self.alive.append(outputs)
        return out

    def _record(self, record: list) -> None:
        self.records.append(record)
        self.positions.append(len(self.seconds) - 1)


def _record_ops(layer: Callable, value: Any, kwargs: dict, first: bool, repeat: int, recorded: bool,
                measured: Counter) -> tuple[list[list], list[str], int, float]:
    """The candidate ops of one forward of layer (with grad, as in training): those the native
    policy can save as measured, so that every block of a plan saves natively (no Python dispatch
    mode per op); the names the native policy counts alike, how many times the block is to be
    measured, and the seconds of its tail (which a replay does not run, _OpRecorder): seconds are
    the median of `repeat` forwards, or of one when `repeat` earlier blocks ran the same ops with the same bytes
    (counted in measured): their timings are pooled with this block's (_pool_alike_blocks), so a
    deep model of identical layers is not timed `repeat` times over."""
    runs: list = []
    tails: list[float] = []
    clock = _device_clock(value, layer)
    while len(runs) < repeat:
        recorder = _OpRecorder(clock)
        with torch.enable_grad(), recorder, torch.autograd.graph.saved_tensors_hooks(recorder.pack, _unpacked):
            _call(layer, _detach_like(value, recorded), kwargs, first)
        runs.append(recorder.ops)
        tails.append(recorder.tail_seconds)
        signature = tuple(tuple(op[:3]) for op in runs[0])
        if len(runs) == 1 and measured[signature] >= repeat:
            break
    if any([op[:3] for op in run] != [op[:3] for op in runs[0]] for run in runs):
        raise ValueError("plan_ops: a block ran different ops on the same input in repeated forwards; "
                         "an op-level plan needs a block whose ops do not depend on data or state")
    if len(runs) == repeat:
        measured[signature] += 1
    ops = [op[:3] + [statistics.median(run[i][3] for run in runs)] for i, op in enumerate(runs[0])]
    native, savable = _native_names(layer, value, kwargs, first, recorded, ops, recorder.seen)
    return [op for op in ops if tuple(op[:2]) in savable], native, len(runs), statistics.median(tails)


def _unpacked(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _native_names(layer: Callable, value: Any, kwargs: dict, first: bool, recorded: bool, ops: list,
                  calls: Counter) -> tuple[list[str], set[tuple[str, int]]]:
    """The candidate op names whose calls the native policy counts as the recorder did, and of
    their calls the ones it can save as measured: a forward without a Python dispatch mode may
    call other ops (torch's math attention adds its mask in place unless a mode is active, so its
    first bmm's output changes after it is made), and an occurrence must name the same call in
    both, with the same bytes."""
    def probe(items: list[str]) -> list:
        with torch.enable_grad():
            return _C.checkpoint.probe(lambda: _call(layer, _detach_like(value, recorded), kwargs, first), items)

    names = sorted({op[0] for op in ops})
    try:
        probed = probe(names)
    except ValueError:  # an op the native policy cannot save: check them one by one
        probed = []
        for name in names:
            try:
                probed += probe([name])
            except ValueError:
                pass
    native_calls = Counter(op.replace("::", ".", 1) for op, _, _ in probed)  # named as str(OpOverload) names them
    native_bytes = {(op.replace("::", ".", 1), k): n for op, k, n in probed}
    consistent = [name for name in names if native_calls[name] == calls[name]]
    savable = {(name, index) for name, index, nbytes, _ in ops
               if name in consistent and native_bytes.get((name, index)) == nbytes}
    return consistent, savable
