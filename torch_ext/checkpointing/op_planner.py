"""The op-level planner: measure every op inside each block of a chain on real inputs (a
TorchDispatchMode over one forward: the bytes of its output, the time it takes), then choose, per
block, whether to checkpoint it and which of its ops' outputs a checkpointed block saves, so that
the predicted peak fits a byte budget at the least predicted recompute time (greedy: the exact
choice is a knapsack problem). The ops a plan saves are kept by torch_ext's native selective
checkpointing (the `save` option, decided in C++), the others are recomputed in backward; a block
left unwrapped keeps all its activations and costs no replay.

Each block's choices form a curve of recompute seconds against bytes kept: nothing saved, then
its ops in order of seconds per byte, then the block left unwrapped (its activations kept, its
replay's fixed cost saved too); the steps of the curve's lower convex hull are the items. The
choice is O(N log N) in the number N of candidate ops: a heap of all blocks' steps by seconds
saved per byte, each step taken when the predicted peak with it fits (a segment tree over the
blocks keeps the peak, O(log n) a step). The plans are monotonic: a lower budget never predicts
a higher peak."""
from __future__ import annotations

import functools
import heapq
import json
import math
import statistics
import time
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

from .. import _C
from .api import _CheckpointedForward, checkpoint
from .planner import _call, _detach_like, _evaluate, _measure_once, _tensor_leaves, _trainable_parameters
from .selective import dropout_p


@dataclass
class OpPlan:
    """Which blocks are checkpointed and which ops each saves, with what the plan measured and
    predicts.

    checkpointed[k]: whether block k is checkpointed (a block left unwrapped keeps all its
    activations; empty: every block, as plans made before this field). saved[k]: the ops block k
    saves, as [op name, occurrence] (the occurrence-th call of that aten overload in the block's
    forward, from 0); empty for a block left unwrapped. ops[k]: every candidate op measured in
    block k, as [op name, occurrence, output bytes, seconds]. block_replay_seconds[k]: what a
    replay of block k costs beyond its candidate ops (its forward's time less theirs: the Python
    code, views, the other ops). Bytes are activation bytes as
    plan_checkpoints counts them (parameters and their gradients excluded). Thread safety: a
    plan is not changed by its methods (with_budget returns a new one), and context_fn gives
    each checkpointed call a policy of its own, so planned layers may run in several threads."""

    saved: list[list[list]]
    budget_bytes: int
    predicted_peak_bytes: int
    min_budget_bytes: int
    no_checkpoint_peak_bytes: int
    predicted_recompute_seconds: float
    step_seconds: float
    ops: list[list[list]] = field(default_factory=list)
    block_input_bytes: list[int] = field(default_factory=list)
    block_output_bytes: list[int] = field(default_factory=list)
    block_activation_bytes: list[int] = field(default_factory=list)
    block_workspace_bytes: list[int] = field(default_factory=list)
    block_parameter_bytes: list[int] = field(default_factory=list)
    native_ops: list[list[str]] = field(default_factory=list)
    checkpointed: list[bool] = field(default_factory=list)
    block_replay_seconds: list[float] = field(default_factory=list)

    def is_checkpointed(self, block: int) -> bool:
        """Whether apply() checkpoints block (else it leaves it unwrapped)."""
        self._check_block("is_checkpointed", block)
        return not self.checkpointed or self.checkpointed[block]

    @property
    def predicted_overhead(self) -> float:
        """Predicted recompute time as a fraction of the measured step (forward + backward)."""
        return self.predicted_recompute_seconds / self.step_seconds if self.step_seconds > 0 else 0.0

    def saved_ops(self, block: int) -> list[tuple[str, int]]:
        """The (op name, occurrence) pairs block saves."""
        return [(name, index) for name, index in self.saved[block]]

    def save_items(self, block: int) -> list[str]:
        """torch_ext.checkpoint's `save` option for block: each op it saves with its occurrences,
        as 'aten.addmm.default#0,2' (empty: nothing saved). Raises for a block the plan leaves
        unwrapped."""
        self._check_checkpointed("save_items", block)
        occurrences: dict = {}
        for name, index in self.saved[block]:
            occurrences.setdefault(name, []).append(index)
        return [f"{name}#{','.join(map(str, sorted(indices)))}" for name, indices in occurrences.items()]

    def saves_natively(self, block: int) -> bool:
        """Whether apply() saves block's ops through the native policy: when the ops it saves were
        called alike with and without a Python dispatch mode (native_ops; else torch's policy)."""
        self._check_block("saves_natively", block)
        native = set(self.native_ops[block]) if block < len(self.native_ops) else set()
        return all(name in native for name, _ in self.saved[block])

    def context_fn(self, block: int) -> Callable:
        """torch's context_fn for block (the same choice as save_items, for torch.utils.checkpoint):
        create_selective_checkpoint_contexts with a policy that saves the plan's ops of that block
        (MUST_SAVE) and recomputes the others. Raises for a block the plan leaves unwrapped."""
        self._check_checkpointed("context_fn", block)
        return functools.partial(_plan_contexts, frozenset(self.saved_ops(block)))

    def _check_block(self, owner: str, block: int) -> None:
        if not 0 <= block < len(self.saved):
            raise IndexError(f"OpPlan.{owner}: block {block} is outside 0..{len(self.saved) - 1}")

    def _check_checkpointed(self, owner: str, block: int) -> None:
        self._check_block(owner, block)
        if self.checkpointed and not self.checkpointed[block]:
            raise ValueError(f"OpPlan.{owner}: the plan leaves block {block} unwrapped (is_checkpointed({block}) "
                             f"is False): it keeps all its activations, so it is not to be checkpointed")

    def with_budget(self, budget_bytes: int) -> "OpPlan":
        """The plan for another budget from this plan's measurements (nothing is measured again).
        Plans from one measurement are monotonic: a lower budget never predicts a higher peak."""
        _check_budget(budget_bytes)
        return _op_plan({"ops": self.ops, "native": self.native_ops, "inputs": self.block_input_bytes,
                         "outputs": self.block_output_bytes, "activations": self.block_activation_bytes,
                         "workspace": self.block_workspace_bytes, "params": self.block_parameter_bytes,
                         "replay": self.block_replay_seconds or [0.0] * len(self.ops),
                         "seconds": [self.step_seconds]}, budget_bytes)

    def apply(self, layers: Iterable[nn.Module]) -> list[nn.Module]:
        """Checkpoint each layer the plan checkpoints in place with torch_ext.checkpoint(layer,
        save=save_items(k)) (the plan's block of the same index) and leave the others as they are;
        returns the layers. They must be the plan's blocks, not checkpointed already."""
        layers = list(layers.values() if isinstance(layers, (dict, OrderedDict)) else layers)
        if len(layers) != len(self.saved):
            raise ValueError(f"OpPlan.apply: the plan has {len(self.saved)} blocks, got {len(layers)} layers")
        for index, layer in enumerate(layers):
            if not isinstance(layer, nn.Module):
                raise TypeError(f"OpPlan.apply: layer {index} is a {type(layer).__name__}, expected an nn.Module")
            if isinstance(layer.__dict__.get("forward"), _CheckpointedForward) or getattr(
                    type(layer).forward, "_torch_ext_checkpoint", None) is not None:
                raise ValueError(f"OpPlan.apply: layer {index} ({type(layer).__name__}) is already checkpointed")
        for index, layer in enumerate(layers):
            if not self.is_checkpointed(index):
                continue
            if self.saves_natively(index):
                checkpoint(layer, save=self.save_items(index) or None)
            else:
                checkpoint(layer, context_fn=self.context_fn(index))
        return layers

    def as_dict(self) -> dict:
        return {**asdict(self), "predicted_overhead": self.predicted_overhead}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "OpPlan":
        data = json.loads(text)
        names = set(cls.__dataclass_fields__)
        unknown, missing = set(data) - names, {"saved", "budget_bytes"} - set(data)
        if unknown or missing:
            raise ValueError(f"OpPlan.from_json: not an OpPlan (unknown fields {sorted(unknown)}, "
                             f"missing {sorted(missing)})")
        return cls(**data)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> "OpPlan":
        with open(path) as f:
            return cls.from_json(f.read())

    def __str__(self) -> str:
        mib = 2.0 ** 20
        checkpointed = sum(self.is_checkpointed(k) for k in range(len(self.saved)))
        return (f"OpPlan(blocks={len(self.saved)}, checkpointed={checkpointed}, "
                f"saved_ops={sum(map(len, self.saved))} of "
                f"{sum(map(len, self.ops))}, predicted_peak={self.predicted_peak_bytes / mib:.1f} MiB of budget "
                f"{self.budget_bytes / mib:.1f} MiB, predicted_overhead={self.predicted_overhead:.1%}, "
                f"min_budget={self.min_budget_bytes / mib:.1f} MiB)")


def _plan_contexts(saved: frozenset) -> tuple:
    """A fresh policy per checkpointed call: it counts each op's occurrences in the forward."""
    seen: Counter = Counter()

    def policy(ctx, op, *args, **kwargs):
        if ctx.is_recompute:
            return CheckpointPolicy.PREFER_RECOMPUTE
        name = str(op)
        index = seen[name]
        seen[name] += 1
        # torch's policy would hand the replay the forward's mask tensor, which dropout then scales in
        # place: it draws masks again (only the native policy keeps them).
        keep = (name, index) in saved and op not in _KEPT_DRAWS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


# The draws of dropout masks (bernoulli_ in place): the native policy keeps the mask as bool (one
# byte an element) and the generator's state after the draw (csrc/torch_ext/checkpoint/selective.h).
_KEPT_DRAWS = (torch.ops.aten.bernoulli_.float, torch.ops.aten.bernoulli_.Tensor)


class _OpRecorder(TorchDispatchMode):
    """Records each op of a forward as torch's selective checkpointing sees it (SAC_IGNORED_OPS
    skipped): name, occurrence, the bytes of its outputs' new storages (of a mask draw, its bool
    copy), its seconds. Ops whose outputs alias an input (views, in-place), that return no tensor,
    or whose outputs a later op of the forward mutates are not candidates, nor are random ops other
    than mask draws: a replay restores the forward's RNG state and draws the random ops again in
    order, which gives the forward's numbers only if the generator passes where it passed before
    (a kept draw puts it there)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[list] = []
        self.mutated: set[int] = set()
        self.by_storage: dict[int, list[int]] = {}
        self.seen: Counter = Counter()
        self.alive: list = []  # the candidates' outputs, so that no storage address is reused in the forward

    @property
    def ops(self) -> list[list]:
        return [record for i, record in enumerate(self.records) if i not in self.mutated]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - start
        name = str(func)
        index = self.seen[name]
        self.seen[name] += 1
        inputs = {t.untyped_storage().data_ptr() for t in _tensor_leaves((args, kwargs))}
        if func._schema.is_mutable:  # an output mutated later cannot be saved (torch's SAC raises)
            for ptr in inputs:
                self.mutated.update(self.by_storage.get(ptr, ()))
        outputs, nbytes = _tensor_leaves(out), 0
        if func in _KEPT_DRAWS:  # kept as a bool copy: later changes to the mask do not reach it
            if args[0].device.type == "cpu" and kwargs.get("generator") is None:
                self.records.append([name, index, args[0].numel(), seconds])
            return out
        if outputs and not any(t.untyped_storage().data_ptr() in inputs for t in outputs):
            nbytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in outputs}.values())
        if nbytes > 0 and not _draws(func, args, kwargs):
            for t in outputs:
                self.by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(len(self.records))
            self.records.append([name, index, int(nbytes), seconds])
            self.alive.append(outputs)
        return out


def _draws(func, args: tuple, kwargs: dict) -> bool:
    """Whether the call draws random numbers: a random op, unless its dropout_p is 0 (attention)."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    p = dropout_p(func, args, kwargs)
    return p is None or p != 0.0


def _record_ops(layer: Callable, value: Any, kwargs: dict, first: bool, repeat: int, recorded: bool) -> list[list]:
    """The candidate ops of one forward of layer (with grad, as in training); seconds are the
    median of `repeat` forwards."""
    runs = []
    for _ in range(repeat):
        with torch.enable_grad(), _OpRecorder() as recorder:
            _call(layer, _detach_like(value, recorded), kwargs, first)
        runs.append(recorder.ops)
    if any([op[:3] for op in run] != [op[:3] for op in runs[0]] for run in runs):
        raise ValueError("plan_ops: a block ran different ops on the same input in repeated forwards; "
                         "an op-level plan needs a block whose ops do not depend on data or state")
    ops = [op[:3] + [statistics.median(run[i][3] for run in runs)] for i, op in enumerate(runs[0])]
    return ops, _native_names(layer, value, kwargs, first, recorded, ops, recorder.seen)


def _native_names(layer: Callable, value: Any, kwargs: dict, first: bool, recorded: bool, ops: list,
                  calls: Counter) -> list[str]:
    """The candidate op names whose calls the native policy counts as the recorder did: a forward
    without a Python dispatch mode may call other ops (torch's math attention adds its mask in
    place unless a mode is active), and an occurrence must name the same call in both."""
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
    consistent = {name for name in names if native_calls[name] == calls[name]}
    for name, index, nbytes, _ in ops:
        if native_bytes.get((name, index)) != nbytes:
            consistent.discard(name)
    return sorted(consistent)


def _peak(kept_per_block: Sequence[int], inputs: Sequence[int], outputs: Sequence[int], activations: Sequence[int],
          workspace: Sequence[int], params: Sequence[int]) -> int:
    """Predicted peak with block i keeping kept_per_block[i] bytes for backward (a checkpointed
    block: the outputs it saves; an unwrapped one: its activations): while block k runs backward,
    the blocks before it hold their inputs and what they keep, block k its input, its activations
    (recomputed or kept), its backward workspace, the gradient of its output and its parameters'
    gradients. After the last block, what consumes the chain's output (a model's head, the loss)
    runs while every block holds its input and what it keeps; the plan does not see it and counts
    it as needing what the last block's backward needs. O(number of blocks)."""
    held, peak = 0, 0
    for k in range(len(inputs)):
        peak = max(peak, held + inputs[k] + activations[k] + workspace[k] + outputs[k] + params[k])
        held += inputs[k] + kept_per_block[k]
    return max(peak, held + _after_chain(outputs, activations, workspace, params)) if inputs else peak


def _after_chain(outputs, activations, workspace, params) -> int:
    return activations[-1] + workspace[-1] + outputs[-1] + params[-1]


class _Counted:
    """A sort key that counts its comparisons (the step count of the choice)."""
    __slots__ = ("key", "counter")

    def __init__(self, key, counter):
        self.key, self.counter = key, counter

    def __lt__(self, other):
        self.counter[0] += 1
        return self.key < other.key


class _Peaks:
    """The predicted peak of _peak, kept up to date as blocks keep more: value k is what the blocks
    before k hold plus what block k's backward holds, and block j keeping `nbytes` more adds them
    to every value after j. A segment tree (range add, range maximum): O(log n) an operation in n
    blocks; `counter` counts the nodes visited."""

    def __init__(self, values: Sequence[int], counter: list) -> None:
        self.n, self.counter = len(values), counter
        self.top = [0] * (4 * self.n)  # the maximum below a node, its own additions included
        self.added = [0] * (4 * self.n)  # added to every value below a node
        self._build(1, 0, self.n, values)

    def _build(self, node: int, low: int, high: int, values: Sequence[int]) -> None:
        if high - low == 1:
            self.top[node] = values[low]
            return
        mid = (low + high) // 2
        self._build(2 * node, low, mid, values)
        self._build(2 * node + 1, mid, high, values)
        self.top[node] = max(self.top[2 * node], self.top[2 * node + 1])

    def _apply(self, node: int, low: int, high: int, start: int, nbytes: int) -> None:
        self.counter[0] += 1
        if high <= start:
            return
        if low >= start:
            self.top[node] += nbytes
            self.added[node] += nbytes
            return
        mid = (low + high) // 2
        self._apply(2 * node, low, mid, start, nbytes)
        self._apply(2 * node + 1, mid, high, start, nbytes)
        self.top[node] = max(self.top[2 * node], self.top[2 * node + 1]) + self.added[node]

    def _max(self, node: int, low: int, high: int, start: int, end: int) -> float:
        self.counter[0] += 1
        if high <= start or low >= end:
            return -math.inf
        if start <= low and high <= end:
            return self.top[node]
        mid = (low + high) // 2
        return max(self._max(2 * node, low, mid, start, end),
                   self._max(2 * node + 1, mid, high, start, end)) + self.added[node]

    @property
    def peak(self) -> int:
        return self.top[1]

    def peak_if(self, block: int, nbytes: int) -> float:
        """The peak if block kept nbytes more."""
        return max(self._max(1, 0, self.n, 0, block + 1), self._max(1, 0, self.n, block + 1, self.n) + nbytes)

    def keep(self, block: int, nbytes: int) -> None:
        self._apply(1, 0, self.n, block + 1, nbytes)


_UNWRAP = -1  # a step that leaves its block unwrapped


def _steps(block: Sequence[list], activations: int, replay: float) -> tuple[list, list]:
    """Block's choices as steps (op index or _UNWRAP, bytes, seconds saved) along the lower convex
    hull of its curve: from nothing saved, its ops in order of seconds per byte, then the block
    unwrapped (activations bytes, no recompute), which replaces the op steps it beats per byte
    (and any that keep as many bytes as it does). Returns (the hull's steps, the op steps it
    replaced: the block's next choices when unwrapping it does not fit). O(n log n) in its n ops."""
    ops = sorted(range(len(block)), key=lambda i: (-block[i][3] / block[i][2], i))
    points = [(0, sum(op[3] for op in block) + replay, None)]  # (bytes kept, recompute seconds, op)
    for i in ops:
        kept, seconds, _ = points[-1]
        if kept + block[i][2] >= activations:
            break
        points.append((kept + block[i][2], seconds - block[i][3], i))

    def saving_per_byte(a, b):  # from point a to point b
        return (a[1] - b[1]) / (b[0] - a[0]) if b[0] > a[0] else math.inf

    unwrapped = (activations, 0.0, _UNWRAP)
    while len(points) > 1 and saving_per_byte(points[-2], unwrapped) >= saving_per_byte(points[-2], points[-1]):
        points.pop()
    points.append(unwrapped)
    replaced = [(i, block[i][2], block[i][3]) for i in ops[len(points) - 2:]]
    return [(b[2], b[0] - a[0], a[1] - b[1]) for a, b in zip(points, points[1:])], replaced


def _choose(ops: Sequence[Sequence[list]], replay, inputs, outputs, activations, workspace, params, budget: float):
    """Every block's steps (_steps), in order of recompute seconds saved per byte kept (highest
    first), each taken when the predicted peak (_peak's) with it fits budget. A block whose step
    does not fit takes none of its later steps (they build on it), except that a block that cannot be
    unwrapped goes on with the op steps its unwrapping replaced. A checkpointed block therefore
    saves a prefix of its ops in order of seconds per byte. Returns (saved per block, checkpointed
    per block, peak, steps): steps counts the heap's comparisons and the peak updates' tree
    nodes, O(N log N). A higher budget never predicts a lower peak: at the first step the two
    budgets take differently, the higher one takes a step the lower one could not fit."""
    count = [0]
    blocks = len(ops)

    def entry(k: int, j: int, step: tuple) -> tuple:
        _, nbytes, seconds = step
        return (_Counted((-seconds / nbytes if nbytes > 0 else -math.inf, k, j), count), k, step)

    heap, replaced = [], []
    for k in range(blocks):
        steps, rest = _steps(ops[k], activations[k], replay[k])
        heap += [entry(k, j, step) for j, step in enumerate(steps)]
        replaced.append([entry(k, len(steps) + j, step) for j, step in enumerate(rest)])
    heapq.heapify(heap)
    held, own = 0, []
    for k in range(blocks):
        own.append(held + inputs[k] + activations[k] + workspace[k] + outputs[k] + params[k])
        held += inputs[k]
    peaks = _Peaks(own + [held + _after_chain(outputs, activations, workspace, params)], count)
    saved: list[list[int]] = [[] for _ in range(blocks)]
    wrapped, closed = [True] * blocks, [False] * blocks
    while heap:
        _, k, (op, nbytes, _) = heapq.heappop(heap)
        if closed[k]:
            continue
        if peaks.peak_if(k, nbytes) > budget:
            closed[k] = op != _UNWRAP
            for later in replaced[k] if op == _UNWRAP else ():
                heapq.heappush(heap, later)
        elif op == _UNWRAP:
            peaks.keep(k, nbytes)
            wrapped[k], saved[k] = False, []
        else:
            peaks.keep(k, nbytes)
            saved[k].append(op)
    return [[ops[k][i][:2] for i in sorted(block)] for k, block in enumerate(saved)], wrapped, peaks.peak, count[0]


def plan_ops(layers: Iterable[Callable], *sample_inputs: Any, budget_bytes: int, repeat: int = 3,
             progress: Optional[Callable] = None, **kwargs: Any) -> OpPlan:
    """Measure a chain of blocks on sample inputs, op by op, and choose which blocks to checkpoint
    and the ops each checkpointed block saves so that the predicted peak activation memory stays
    within budget_bytes, keeping first what saves the most recompute seconds per byte. Each block
    runs on the previous one's output (RNG state and buffers
    restored afterwards): forward and backward `repeat` times (its saved and workspace bytes, as
    plan_checkpoints measures them) and `repeat` forwards under a dispatch mode that times every
    op and counts its output bytes. Raises ValueError, stating the minimum, when no plan fits.
    Apply the plan with plan.apply(layers); plan.with_budget(B) plans another budget from the same
    measurements (plans of one measurement are monotonic in the budget; a new measurement may
    time ops differently and so order them differently). kwargs go to the first block."""
    layers = list(layers.values() if isinstance(layers, (dict, OrderedDict)) else layers)
    if not layers:
        raise ValueError("plan_ops: the chain has no layers")
    if not sample_inputs:
        raise ValueError("plan_ops: give sample inputs for the first layer")
    _check_budget(budget_bytes)
    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"plan_ops: repeat must be an int >= 1, got {repeat!r}")
    progress = progress or (lambda iterable, desc: iterable)
    measured = _measure_blocks(layers, repeat, progress, sample_inputs, kwargs)
    return _op_plan(measured, budget_bytes)


def _check_budget(budget_bytes: Any) -> None:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) or not budget_bytes > 0:
        raise ValueError(f"plan_ops: budget_bytes must be a positive number of bytes, got {budget_bytes!r}")


def _measure_blocks(layers: list, repeat: int, progress, inputs: tuple = (), kwargs: Optional[dict] = None,
                    recorded: Optional[Sequence[tuple[tuple, dict]]] = None) -> dict:
    """Per block: its candidate ops, input / output / activation / workspace / parameter bytes
    and seconds. A chain (inputs, kwargs for the first block; each block runs on the previous
    one's output) or, with recorded, the (args, kwargs) each block received in a real forward
    (its boundary is its first argument, as plan_recorded_layers counts it)."""
    leaves = _tensor_leaves(recorded[0] if recorded is not None else inputs)
    device = leaves[0].device if leaves else torch.device("cpu")
    devices = sorted({t.device.index or 0 for t in leaves if t.device.type == "cuda"})
    m: dict = {key: [] for key in ("ops", "native", "inputs", "outputs", "activations", "workspace", "params",
                                   "replay", "seconds")}
    buffers = [(b, b.detach().clone()) for layer in layers if isinstance(layer, nn.Module) for b in layer.buffers()]
    value: Any = inputs
    with torch.random.fork_rng(devices=devices):
        try:
            for index in progress(range(len(layers)), desc="measuring ops"):
                first, layer = recorded is not None or index == 0, layers[index]
                if recorded is not None:
                    value, kwargs = recorded[index]
                boundary = _tensor_leaves(value)[:1] if recorded is not None else _tensor_leaves(value)
                m["inputs"].append(_bytes(boundary))
                ops, native = _record_ops(layer, value, kwargs, first, repeat, recorded is not None)
                # Only ops the native policy can save as measured are candidates: every block of a
                # plan then saves natively (no Python dispatch mode per op).
                m["ops"].append([op for op in ops if op[0] in native])
                m["native"].append(native)
                samples = [_measure_once(layer, value, kwargs, first, device, recorded is not None)
                           for _ in range(repeat)]
                m["seconds"].append(statistics.median(s[0] + s[1] for s in samples))
                forward = statistics.median(s[0] for s in samples)
                m["replay"].append(max(0.0, forward - sum(op[3] for op in m["ops"][-1])))
                m["activations"].append(samples[-1][2])
                m["workspace"].append(samples[-1][3])
                out = _tensor_leaves(samples[-1][4])
                m["outputs"].append(_bytes(out[:1] if recorded is not None else out))
                m["params"].append(sum(p.nbytes for p in _trainable_parameters(layer))
                                   if isinstance(layer, nn.Module) else 0)
                value = samples[-1][4]
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
    return m


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum({(t.device, t.untyped_storage().data_ptr()): t.untyped_storage().nbytes() for t in tensors}.values())


def plan_recorded_ops(layers: Sequence[nn.Module], recorded: Sequence[tuple[tuple, dict]], budget_bytes: int,
                      repeat: int, progress: Optional[Callable] = None) -> OpPlan:
    """plan_ops over layers that a model calls one by one, each measured on the (args, kwargs)
    it received in a real forward (hf.checkpoint_layers(..., ops=True))."""
    _check_budget(budget_bytes)
    progress = progress or (lambda iterable, desc: iterable)
    return _op_plan(_measure_blocks(list(layers), repeat, progress, recorded=recorded), budget_bytes)


def _op_plan(m: dict, budget_bytes: float) -> OpPlan:
    shape = (m["inputs"], m["outputs"], m["activations"], m["workspace"], m["params"])
    n = len(m["ops"])
    min_budget = _peak([0] * n, *shape)
    if budget_bytes < min_budget:
        raise ValueError(f"plan_ops: budget_bytes={int(budget_bytes)} ({budget_bytes / 2**20:.2f} MiB) is below the "
                         f"minimum any op-level plan of these {n} blocks can meet: {min_budget} bytes "
                         f"({min_budget / 2**20:.2f} MiB, every block checkpointed, nothing saved)")
    saved, checkpointed, peak, _ = _choose(m["ops"], m["replay"], *shape, float(budget_bytes))
    kept = [{tuple(op) for op in block} for block in saved]
    recompute = sum(m["replay"][k] + sum(op[3] for op in block if tuple(op[:2]) not in kept[k])
                    for k, block in enumerate(m["ops"]) if checkpointed[k])
    no_checkpoint = _evaluate([(0, n, False)], m["activations"], m["outputs"], m["workspace"], m["params"],
                              m["inputs"][0])
    return OpPlan(saved=saved, budget_bytes=int(budget_bytes), predicted_peak_bytes=int(peak),
                  min_budget_bytes=int(min_budget), no_checkpoint_peak_bytes=int(no_checkpoint),
                  predicted_recompute_seconds=recompute, step_seconds=sum(m["seconds"]), ops=m["ops"],
                  block_input_bytes=m["inputs"], block_output_bytes=m["outputs"],
                  block_activation_bytes=m["activations"], block_workspace_bytes=m["workspace"],
                  block_parameter_bytes=m["params"], native_ops=m["native"], checkpointed=checkpointed,
                  block_replay_seconds=m["replay"])
