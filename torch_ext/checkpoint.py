"""Segment checkpointing: keep only a segment's inputs during forward, recompute it in backward.

The autograd node is torch_ext's C++ core (csrc/torch_ext/checkpoint): its forward runs the
segment without building a graph and stores only the boundary inputs; its backward restores the
RNG, autocast and grad-mode state of the forward, replays the segment and back-propagates
through the replay. Parameters are explicit inputs of the node, so torch.autograd.grad,
backward(inputs=...), hooks and DistributedDataParallel behave as without checkpointing.
On CPU, the replays of Python segments stop early: the ops after the last one whose output
backward saves are not computed (see _ReplayTail).

    torch_ext.checkpoint            decorator for nn.Module subclasses, instances and functions
    torch_ext.CheckpointedSequential a chain with checkpointed boundaries and memory accounting
    torch_ext.checkpoint_sequential drop-in for torch.utils.checkpoint.checkpoint_sequential
    torch_ext.plan_checkpoints      measured, budgeted boundary placement (dynamic programming)

Storage policies for the boundary: "keep" (default, exact), "offload" (accelerator inputs go to
pinned CPU memory asynchronously; CPU inputs are kept), "bf16" / "fp16" (lossy and opt-in: float
inputs are stored rounded, so gradients are approximate).

Under torch.compile a checkpointed call is a graph break: the compiled code runs up to it, the
checkpoint runs eagerly, and compilation resumes after it.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import math
import statistics
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import _C, memory

__all__ = ["checkpoint", "CheckpointedSequential", "checkpoint_sequential", "plan_checkpoints",
           "CheckpointPlan", "STORAGE_POLICIES"]

STORAGE_POLICIES = ("keep", "offload", "bf16", "fp16")

_apply = _C.checkpoint.apply


def _validate_storage(storage: Any, owner: str) -> str:
    if not isinstance(storage, str) or storage not in STORAGE_POLICIES:
        raise ValueError(f"{owner}: unknown storage policy {storage!r}; expected one of {', '.join(STORAGE_POLICIES)}")
    return storage


def _trainable_parameters(module: nn.Module) -> list[torch.Tensor]:
    """module.parameters() that require grad (each once), without the generator machinery."""
    if not module._modules:
        return [p for p in module._parameters.values() if p is not None and p.requires_grad]
    seen, params = set(), []
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def _plain_tensors(args: tuple) -> bool:
    for a in args:
        if type(a) is not torch.Tensor:
            return False
    return True


def _flatten_output(out: Any, box: list) -> list[torch.Tensor]:
    leaves, spec = pytree.tree_flatten(out)
    box[0] = (spec, leaves)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _unflatten_output(outputs: list[torch.Tensor], box: list) -> Any:
    spec, leaves = box[0]
    it = iter(outputs)
    return pytree.tree_unflatten([next(it) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)


def _name_of(fn: Any) -> str:
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _call_segment(box: list, tail: Optional["_ReplayTail"], params: list[torch.Tensor], modules: Sequence[nn.Module],
                  fn: Callable, tensors: list[torch.Tensor]) -> Any:
    """What the core calls as the segment: fn(*tensors), through the call site's early stop unless
    it has none or it is off; an output other than one tensor is flattened, its structure kept in box."""
    out = fn(*tensors) if tail is None or tail.off else tail.replay(fn, tensors, params, modules)
    return out if type(out) is torch.Tensor else _flatten_output(out, box)


def _run(fn: Callable, args: tuple, kwargs: dict, params: list[torch.Tensor], storage: str,
         preserve_rng_state: bool, name: str, tail: Optional["_ReplayTail"] = None,
         modules: Sequence[nn.Module] = ()) -> Any:
    """fn(*args, **kwargs) as one checkpointed segment whose other tensors requiring grad are params;
    tail: the call site's early stop for its replays; modules: those fn calls or runs."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    box: list = [None]  # the output's structure when it is not one tensor
    if not kwargs and _plain_tensors(args):
        # Fast path: positional plain tensors. The segment holds no input, so the storage policy
        # alone decides what stays alive.
        segment = functools.partial(_call_segment, box, tail, params, modules, fn)
        outputs = _apply(segment, list(args), params, storage, preserve_rng_state, name)
    else:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in slots]
        for leaf in leaves:
            if isinstance(leaf, nn.Module):
                params = params + [p for p in _trainable_parameters(leaf) if not any(p is q for q in params)]
        if not params and not any(t.requires_grad for t in tensors):
            return fn(*args, **kwargs)
        # The replay needs the non-tensor leaves; the tensors come back from the boundary.
        for i in slots:
            leaves[i] = None

        def segment(replayed):
            call_leaves = list(leaves)
            for i, t in zip(slots, replayed):
                call_leaves[i] = t
            call_args, call_kwargs = pytree.tree_unflatten(call_leaves, spec)
            return _call_segment(box, tail, params, modules, lambda *_: fn(*call_args, **call_kwargs), replayed)

        outputs = _apply(segment, tensors, params, storage, preserve_rng_state, name)
    return outputs[0] if box[0] is None else _unflatten_output(outputs, box)


# Under torch.compile a checkpoint is a graph break (dynamo cannot trace into the C++ node);
# eager calls skip the disable wrapper, which costs microseconds per call.
_run_eager = _run
_run_under_compile = torch.compiler.disable(_run)


def _runner():
    return _run_under_compile if torch.compiler.is_compiling() else _run_eager


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


class _CheckpointedForward:
    """An instance's checkpointed forward. It refers to its module weakly: the module holds it, and
    a strong reference back would leave the module (and its parameters) to the cycle collector.
    Deep-copies and pickles with its module."""

    def __init__(self, module: nn.Module, forward: Callable, storage: str, preserve_rng_state: bool) -> None:
        self._module = weakref.ref(module)
        self.forward = forward
        self.storage, self.preserve_rng_state = storage, preserve_rng_state
        self._torch_ext_checkpoint = (storage, preserve_rng_state)
        self.tail = _ReplayTail()

    @property
    def module(self) -> nn.Module:
        return self._module()

    def __deepcopy__(self, memo) -> "_CheckpointedForward":
        module = self._module()
        # Deep-copied with its module (from the module's __dict__), the copy belongs to the module's copy.
        return _CheckpointedForward(memo.get(id(module), module), self.forward, self.storage, self.preserve_rng_state)

    def __reduce__(self):
        return _CheckpointedForward, (self._module(), self.forward, self.storage, self.preserve_rng_state)

    def __call__(self, *args, **kwargs):
        module = self._module()
        forward = self.forward
        if not torch.is_grad_enabled():
            return forward(module, *args, **kwargs)
        if kwargs or not _plain_tensors(args) or torch.compiler.is_compiling():
            return _runner()(functools.partial(forward, module), args, kwargs, _trainable_parameters(module),
                             self.storage, self.preserve_rng_state, type(module).__name__, self.tail, (module,))
        # The common case, kept short: tensors in, tensors out.
        box: list = [None]
        params = _trainable_parameters(module)
        segment = functools.partial(_call_segment, box, self.tail, params, (module,),
                                    functools.partial(forward, module))
        outputs = _apply(segment, list(args), params, self.storage, self.preserve_rng_state,
                         type(module).__name__)
        return outputs[0] if box[0] is None else _unflatten_output(outputs, box)


def checkpoint(target: Any = None, *, storage: str = "keep", preserve_rng_state: bool = True) -> Any:
    """Checkpoint a module class, a module instance or a function.

    - ``@checkpoint`` on an nn.Module subclass: every instance's forward is checkpointed (the
      class is changed in place and returned).
    - ``checkpoint(module)``: that instance's forward is checkpointed in place; state_dict keys,
      hooks and parameters are unchanged. Returns the module.
    - ``@checkpoint`` on a function: returns a checkpointed wrapper. Gradients flow to its tensor
      arguments (nested in lists, tuples, dicts), to the parameters of nn.Modules among its
      arguments and of the module a bound method belongs to; a tensor requiring grad reached any
      other way (a closure) raises in backward, since its gradient would be lost.

    Keyword arguments, pytree inputs and outputs, non-tensor arguments and outputs, inputs that do
    not require grad and nested checkpoints all work. storage: "keep" (exact), "offload", "bf16"
    or "fp16" (lossy). Use as ``@checkpoint(storage="bf16")`` to pass options.
    """
    _validate_storage(storage, "torch_ext.checkpoint")
    if target is None:
        return functools.partial(checkpoint, storage=storage, preserve_rng_state=preserve_rng_state)
    if isinstance(target, type):
        if not issubclass(target, nn.Module):
            raise TypeError(f"torch_ext.checkpoint: class {target.__name__} is not an nn.Module subclass")
        original = target.forward
        if getattr(original, "_torch_ext_checkpoint", None) is not None:
            return target

        @functools.wraps(original)
        def forward(self, *args, **kwargs):
            if not torch.is_grad_enabled():
                return original(self, *args, **kwargs)
            tail = self.__dict__.get(_TAIL_ATTRIBUTE) or self.__dict__.setdefault(_TAIL_ATTRIBUTE, _ReplayTail())
            return _runner()(functools.partial(original, self), args, kwargs, _trainable_parameters(self), storage,
                             preserve_rng_state, type(self).__name__, tail, (self,))

        forward._torch_ext_checkpoint = (storage, preserve_rng_state)
        target.forward = forward
        return target
    if isinstance(target, nn.Module):
        if isinstance(target.__dict__.get("forward"), _CheckpointedForward) or getattr(
                type(target).forward, "_torch_ext_checkpoint", None) is not None:
            return target
        if "forward" in target.__dict__:
            raise TypeError(f"torch_ext.checkpoint: {type(target).__name__} instance has its own forward attribute; "
                            "checkpoint its class or a function instead")
        target.forward = _CheckpointedForward(target, type(target).forward, storage, preserve_rng_state)
        return target
    if callable(target):
        fn = target
        owner = fn.__self__ if inspect.ismethod(fn) and isinstance(fn.__self__, nn.Module) else None
        name = _name_of(fn)

        tail = _ReplayTail()

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not torch.is_grad_enabled():
                return fn(*args, **kwargs)
            params = _trainable_parameters(owner) if owner is not None else []
            return _runner()(fn, args, kwargs, params, storage, preserve_rng_state, name, tail)

        wrapper._torch_ext_checkpoint = (storage, preserve_rng_state)
        return wrapper
    raise TypeError(f"torch_ext.checkpoint: expected an nn.Module subclass, an nn.Module or a callable, "
                    f"got {type(target).__name__}")


# ---------------------------------------------------------------------------------------------
# Planning


@dataclass
class CheckpointPlan:
    """A checkpoint placement for a chain of layers, with what it predicts.

    segments: (start, end, checkpointed) covering layers [0, n); a checkpointed segment keeps its
    input and replays in backward, the others keep their activations. boundaries: the first layer
    of each checkpointed segment. Bytes are activation bytes (boundaries, saved activations and
    the largest backward workspace; parameters and their gradients excluded)."""

    segments: list[tuple[int, int, bool]]
    budget_bytes: int
    predicted_peak_bytes: int
    min_budget_bytes: int
    no_checkpoint_peak_bytes: int
    predicted_recompute_seconds: float
    step_seconds: float
    layer_forward_seconds: list[float] = field(default_factory=list)
    layer_backward_seconds: list[float] = field(default_factory=list)
    layer_saved_bytes: list[int] = field(default_factory=list)
    layer_output_bytes: list[int] = field(default_factory=list)
    layer_workspace_bytes: list[int] = field(default_factory=list)
    layer_parameter_bytes: list[int] = field(default_factory=list)
    input_bytes: int = 0

    @property
    def boundaries(self) -> list[int]:
        return [start for start, _, checkpointed in self.segments if checkpointed]

    @property
    def predicted_overhead(self) -> float:
        """Predicted recompute time as a fraction of the measured step (forward + backward)."""
        return self.predicted_recompute_seconds / self.step_seconds if self.step_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "boundaries": self.boundaries, "predicted_overhead": self.predicted_overhead}

    def __str__(self) -> str:
        mib = 2.0 ** 20
        return (f"CheckpointPlan(boundaries={self.boundaries}, segments={len(self.segments)}, "
                f"predicted_peak={self.predicted_peak_bytes / mib:.1f} MiB of budget {self.budget_bytes / mib:.1f} MiB, "
                f"predicted_overhead={self.predicted_overhead:.1%}, min_budget={self.min_budget_bytes / mib:.1f} MiB)")


def _call(layer: Callable, value: Any, kwargs: Optional[dict] = None, first: bool = False) -> Any:
    if first:
        return layer(*value, **(kwargs or {}))
    return layer(value)


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _storage_bytes(tensors: Iterable[torch.Tensor], exclude: set) -> int:
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if key in exclude or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _storage_keys(tensors: Iterable[torch.Tensor]) -> set:
    keys = set()
    for t in tensors:
        storage = t.untyped_storage()
        keys.add((storage.device, storage.data_ptr()))
    return keys


def _detach_like(value: Any) -> Any:
    def detach(leaf):
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().requires_grad_(leaf.requires_grad or leaf.is_floating_point())
        return leaf
    return pytree.tree_map(detach, value)


def _measure_layers(layers: Sequence[Callable], inputs: tuple, kwargs: dict, repeat: int, storage: str, progress):
    """Per layer: forward and backward seconds (median of `repeat`), bytes saved for backward
    (excluding parameters and the layer's input), output bytes, and backward workspace bytes."""
    devices = sorted({t.device.index for t in _tensor_leaves(inputs) if t.device.type == "cuda"})
    device = next((t.device for t in _tensor_leaves(inputs)), torch.device("cpu"))
    fwd, bwd, saved, out_bytes, workspace = [], [], [], [], []
    buffers = []
    for layer in layers:
        if isinstance(layer, nn.Module):
            buffers.extend((b, b.detach().clone()) for b in layer.buffers())
    input_bytes = int(_C.checkpoint.boundary_bytes(_tensor_leaves(inputs), storage))
    value: Any = inputs
    with torch.random.fork_rng(devices=devices):
        try:
            for index in progress(range(len(layers)), desc="measuring layers"):
                layer = layers[index]
                first = index == 0
                params = _trainable_parameters(layer) if isinstance(layer, nn.Module) else []
                param_keys = _storage_keys(params)
                fwd_samples, bwd_samples = [], []
                for _ in range(repeat):
                    x = _detach_like(value)
                    x_leaves = _tensor_leaves(x)
                    exclude = param_keys | _storage_keys(x_leaves)
                    packed: list[torch.Tensor] = []

                    def pack(t):
                        packed.append(t)
                        return t

                    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        start = time.perf_counter()
                        out = _call(layer, x, kwargs, first)
                        fwd_samples.append(time.perf_counter() - start)
                    out_leaves = [t for t in _tensor_leaves(out) if t.requires_grad]
                    layer_saved = _storage_bytes(packed + _tensor_leaves(out), exclude)
                    layer_out = _storage_bytes(_tensor_leaves(out), set())
                    targets = [t for t in x_leaves if t.requires_grad] + params
                    del packed
                    layer_workspace = 0
                    if out_leaves and targets:
                        # Backward as in training: parameter gradients accumulate into existing
                        # .grad buffers, so what is measured is the transient working memory
                        # (intermediate gradients, the input's gradient, one parameter gradient
                        # before it is added).
                        grads_out = [torch.ones_like(t) for t in out_leaves]
                        kept_grads = [p.grad for p in params]
                        for p in params:
                            p.grad = torch.zeros_like(p)
                        try:
                            with memory.track(device) as tracked:
                                start = time.perf_counter()
                                torch.autograd.backward(out_leaves, grads_out, inputs=targets)
                                bwd_samples.append(time.perf_counter() - start)
                        finally:
                            for p, g in zip(params, kept_grads):
                                p.grad = g
                        layer_workspace = max(0, tracked.peak_delta_bytes)
                        del grads_out
                    else:
                        bwd_samples.append(0.0)
                    next_value = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
                    del out, out_leaves, x, x_leaves
                fwd.append(statistics.median(fwd_samples))
                bwd.append(statistics.median(bwd_samples))
                saved.append(layer_saved)
                out_bytes.append(int(_C.checkpoint.boundary_bytes(_tensor_leaves(next_value), storage)))
                workspace.append(layer_workspace)
                value = next_value
        finally:
            with torch.no_grad():
                for buffer, copy in buffers:
                    buffer.copy_(copy)
    return fwd, bwd, saved, out_bytes, workspace, input_bytes


def _solve(n: int, seconds: list[float], saved: list[int], out_bytes: list[int], workspace: list[int],
           param_bytes: list[int], input_bytes: int, budget: Optional[float]):
    """Dynamic programming over the chain. Each segment [p, q) is either checkpointed (holds its
    input; replays in backward at the cost of its forward time) or stored (holds its input and
    its activations). While segment j runs backward, memory is what segments before it hold plus
    its input, its activations, its largest backward workspace and the gradient of its output, plus,
    for a checkpointed segment, its parameters' gradients (the replay hands them back together); the
    peak is the maximum of that over j.
    With budget=None, returns the plan of least peak; otherwise the least recompute time whose
    peak fits the budget (None if none does). States on the frontier are Pareto-optimal in
    (held bytes, peak or cost)."""
    prefix_seconds = [0.0]
    prefix_saved = [0]
    prefix_params = [0]
    for i in range(n):
        prefix_params.append(prefix_params[-1] + param_bytes[i])
        prefix_seconds.append(prefix_seconds[-1] + seconds[i])
        prefix_saved.append(prefix_saved[-1] + saved[i])
    seg_input = [input_bytes] + out_bytes[:-1]
    # frontier[p]: list of (held, peak, cost, segments)
    frontier: list[list[tuple[int, int, float, tuple]]] = [[] for _ in range(n + 1)]
    frontier[0] = [(0, 0, 0.0, ())]
    for p in range(n):
        states = frontier[p]
        if not states:
            continue
        for q in range(p + 1, n + 1):
            activations = prefix_saved[q] - prefix_saved[p]
            work = max(workspace[p:q])
            replay = prefix_seconds[q] - prefix_seconds[p]
            grads = prefix_params[q] - prefix_params[p]
            for held, peak, cost, segs in states:
                local = held + seg_input[p] + activations + work + out_bytes[q - 1]
                if budget is None or max(peak, local + grads) <= budget:
                    frontier[q].append((held + seg_input[p], max(peak, local + grads), cost + replay,
                                        segs + ((p, q, True),)))
                if budget is None or max(peak, local) <= budget:
                    frontier[q].append((held + seg_input[p] + activations, max(peak, local), cost,
                                        segs + ((p, q, False),)))
        for q in range(p + 1, n + 1):
            frontier[q] = _pareto(frontier[q], by_cost=budget is not None)
    finals = frontier[n]
    if not finals:
        return None
    if budget is None:
        return min(finals, key=lambda s: (s[1], s[2]))
    return min(finals, key=lambda s: (s[2], s[1]))


def _pareto(states, by_cost: bool):
    """Keep states not dominated in (held, cost) (by_cost) or (held, peak)."""
    key = (lambda s: (s[0], s[2], s[1])) if by_cost else (lambda s: (s[0], s[1], s[2]))
    states.sort(key=key)
    kept, best = [], math.inf
    for s in states:
        second = s[2] if by_cost else s[1]
        if second < best:
            kept.append(s)
            best = second
    return kept


def plan_checkpoints(layers: Iterable[Callable], *sample_inputs: Any, budget_bytes: int, storage: str = "keep",
                     repeat: int = 3, progress: Optional[Callable] = None, **kwargs: Any) -> CheckpointPlan:
    """Measure one step of a chain of layers and choose checkpoint boundaries for a memory budget.

    Each layer runs forward and backward `repeat` times on the outputs of the previous one
    (RNG state and module buffers are restored afterwards): its forward and backward seconds,
    the bytes it saves for backward, its output bytes and its backward workspace are measured
    (torch_ext.memory). A dynamic program over the chain then picks the segments that minimise
    recompute time while the predicted peak activation memory stays within budget_bytes.
    Raises ValueError, stating the minimum, when no plan fits. kwargs go to the first layer.
    """
    layers = list(layers.values() if isinstance(layers, (dict, OrderedDict)) else layers)
    if not layers:
        raise ValueError("plan_checkpoints: the chain has no layers")
    if not sample_inputs:
        raise ValueError("plan_checkpoints: give sample inputs for the first layer")
    if not isinstance(budget_bytes, (int, float)) or budget_bytes <= 0:
        raise ValueError(f"plan_checkpoints: budget_bytes must be a positive number of bytes, got {budget_bytes!r}")
    _validate_storage(storage, "plan_checkpoints")
    if repeat < 1:
        raise ValueError(f"plan_checkpoints: repeat must be >= 1, got {repeat}")
    progress = progress or (lambda iterable, desc: iterable)
    fwd, bwd, saved, out_bytes, workspace, input_bytes = _measure_layers(layers, sample_inputs, kwargs, repeat,
                                                                         storage, progress)
    n = len(layers)
    param_bytes = [sum(p.nbytes for p in _trainable_parameters(layer)) if isinstance(layer, nn.Module) else 0
                   for layer in layers]
    least = _solve(n, fwd, saved, out_bytes, workspace, param_bytes, input_bytes, None)
    min_budget = least[1]
    no_checkpoint = _evaluate([(0, n, False)], saved, out_bytes, workspace, param_bytes, input_bytes)
    if budget_bytes < min_budget:
        raise ValueError(f"plan_checkpoints: budget_bytes={int(budget_bytes)} ({budget_bytes / 2**20:.2f} MiB) is below "
                         f"the minimum any plan of these {n} layers can meet: {min_budget} bytes "
                         f"({min_budget / 2**20:.2f} MiB); without checkpointing the peak is {no_checkpoint} bytes")
    best = _solve(n, fwd, saved, out_bytes, workspace, param_bytes, input_bytes, float(budget_bytes))
    _, peak, cost, segments = best
    return CheckpointPlan(segments=[tuple(s) for s in segments], budget_bytes=int(budget_bytes),
                          predicted_peak_bytes=int(peak), min_budget_bytes=int(min_budget),
                          no_checkpoint_peak_bytes=int(no_checkpoint), predicted_recompute_seconds=cost,
                          step_seconds=sum(fwd) + sum(bwd), layer_forward_seconds=fwd, layer_backward_seconds=bwd,
                          layer_saved_bytes=saved, layer_output_bytes=out_bytes, layer_workspace_bytes=workspace,
                          layer_parameter_bytes=param_bytes, input_bytes=input_bytes)


def _evaluate(segments, saved, out_bytes, workspace, param_bytes, input_bytes) -> int:
    seg_input = [input_bytes] + out_bytes[:-1]
    held, peak = 0, 0
    for p, q, checkpointed in segments:
        activations = sum(saved[p:q])
        grads = sum(param_bytes[p:q]) if checkpointed else 0
        peak = max(peak, held + seg_input[p] + activations + max(workspace[p:q]) + out_bytes[q - 1] + grads)
        held += seg_input[p] + (0 if checkpointed else activations)
    return peak


# ---------------------------------------------------------------------------------------------
# Chains


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
    budget_bytes=B (planned by plan_checkpoints on the first forward with grad; see .plan). A
    CheckpointPlan may be given as boundaries. The state_dict keys are nn.Sequential's.

    After a forward with grad the chain keeps weak references to each segment's input, for
    recompute(), and the bytes of the stored boundaries, for the accounting methods: it never keeps
    a boundary alive itself, so backward frees them (and offloaded or compressed boundaries leave
    their device right after the forward). recompute() therefore works while the autograd graph
    holds the boundaries (before backward, with keep storage). Not thread-safe: one forward at a
    time per instance.
    """

    def __init__(self, layers: Any, *, every: Optional[int] = None, boundaries: Any = None,
                 budget_bytes: Optional[int] = None, storage: str = "keep", preserve_rng_state: bool = True) -> None:
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
        self.storage = _validate_storage(storage, "CheckpointedSequential")
        self.preserve_rng_state = preserve_rng_state
        self.budget_bytes = budget_bytes
        self.plan: Optional[CheckpointPlan] = None
        self._tails: dict[tuple[int, int], _ReplayTail] = {}  # early stop per segment (start, end)
        if budget_bytes is not None:
            if not isinstance(budget_bytes, (int, float)) or budget_bytes <= 0:
                raise ValueError(f"CheckpointedSequential: budget_bytes must be a positive number, got {budget_bytes!r}")
            self._segments: Optional[list] = None
        elif boundaries is not None:
            if isinstance(boundaries, CheckpointPlan):
                if boundaries.segments[-1][1] != n:
                    raise ValueError(f"CheckpointedSequential: the plan covers {boundaries.segments[-1][1]} layers, "
                                     f"the chain has {n}")
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
            self.plan = plan_checkpoints(list(self), *inputs, budget_bytes=self.budget_bytes, storage=self.storage,
                                         **kwargs)
            self._segments = list(self.plan.segments)
        value: Any = None
        for start, end, checkpointed in self._segments:
            args, kw = (inputs, kwargs) if start == 0 else ((value,), {})
            run = self._segment_fn(start, end, record=grad)
            if grad:
                leaves = _tensor_leaves((args, kw))
                nbytes = int(_C.checkpoint.boundary_bytes(leaves, self.storage)) if checkpointed else 0
                weak = pytree.tree_map_only(torch.Tensor, weakref.ref, (args, kw))
                self._records.append((start, checkpointed, weak, nbytes, _rng_snapshot(leaves)))
            if checkpointed and grad:
                layers = [self[i] for i in range(start, end)]
                params = [p for layer in layers for p in _trainable_parameters(layer)]
                tail = self._tails.get((start, end)) or self._tails.setdefault((start, end), _ReplayTail())
                value = _runner()(run, args, kw, params, self.storage, self.preserve_rng_state,
                                  f"CheckpointedSequential[{start}:{end}]", tail, layers)
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
                               f"({self.storage!r}) kept only a copy; call recompute() between forward and backward")
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


_SEQUENTIAL_OPTIONS = ("use_reentrant", "preserve_rng_state", "storage", "determinism_check", "debug", "context_fn")


def checkpoint_sequential(functions: Any, segments: int, *inputs: Any, **kwargs: Any) -> Any:
    """Drop-in for torch.utils.checkpoint.checkpoint_sequential: run `functions` (an
    nn.Sequential or a list of modules / callables) in `segments` checkpointed segments (the last
    takes the remainder). The first function receives all inputs and the keyword arguments that
    are not options; options: preserve_rng_state, storage (use_reentrant etc. are accepted and
    ignored: there is one implementation)."""
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in _SEQUENTIAL_OPTIONS}
    storage = _validate_storage(options.get("storage", "keep"), "checkpoint_sequential")
    preserve = options.get("preserve_rng_state", True)
    if isinstance(functions, nn.Sequential):
        functions = list(functions.children())
    functions = list(functions)
    n = len(functions)
    if not isinstance(segments, int) or not 1 <= segments <= max(n, 1):
        raise ValueError(f"checkpoint_sequential: segments={segments!r} must be between 1 and the number of functions ({n})")
    if not inputs:
        raise ValueError("checkpoint_sequential: give at least one input")
    per_segment = n // segments
    value: Any = None
    start = 0
    for index in range(segments):
        end = n if index == segments - 1 else start + per_segment
        chunk = functions[start:end]
        first = start == 0

        def run(*args, _chunk=chunk, _first=first, **kw):
            value = args if _first else args[0]
            for offset, fn in enumerate(_chunk):
                value = _call(fn, value, kw, first=_first and offset == 0)
            return value

        params = [p for fn in chunk if isinstance(fn, nn.Module) for p in _trainable_parameters(fn)]
        args, kw = (inputs, kwargs) if first else ((value,), {})
        value = _runner()(run, args, kw, params, storage, preserve, f"checkpoint_sequential[{start}:{end}]")
        start = end
    return value
