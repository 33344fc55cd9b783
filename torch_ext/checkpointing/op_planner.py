"""The op-level planner: measure every op inside each block of a chain on real inputs (a
TorchDispatchMode over one forward, op_recording.py: the bytes of its output, its time), then
choose, per block, whether to checkpoint it and which of its ops' outputs a checkpointed block
saves, so that the predicted peak fits a byte budget at the least predicted recompute time
(op_choice.py). The ops a plan saves are kept by torch_ext's native selective checkpointing (the
`save` option, decided in C++), the others are recomputed in backward; a block left unwrapped
keeps all its activations and costs no replay."""
from __future__ import annotations

import functools
import json
import math
import statistics
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .api import _CheckpointedForward, checkpoint
from .measuring import (_check_head, _check_parameter_bytes, _measure_head, _measure_once, _parameter_bytes,
                        _state_restored, _storage_bytes, _tensor_leaves)
from .op_choice import _choose, _gradient_bytes, _peak
from .op_recording import _KEPT_DRAWS, _record_ops
from .op_storage import _check_storage, _rounded_bytes, _rounding_seconds
from .planner import _check_gradients, _evaluate, _held_note, _surroundings_note
from .selective import saved_policy


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
    code, views, the other ops). storage[k]: how checkpointed block k keeps its input (torch_ext.
    checkpoint's storage: "keep", or a lossy "bf16" / "fp16" where storage_options allow it and no
    exact plan fits the budget; empty: "keep" everywhere); block_input_rounded_bytes[k] and
    block_rounding_seconds[k]: its input stored rounded, and the time to round it and widen it
    back. gradients: how the step holds parameter gradients, as plan_ops' option ("accumulated" or
    "held"); other_gradient_bytes: with "held", the gradients of parameters outside the chain
    counted as held through every block's backward. head_bytes: what follows the chain (a model's
    head and loss, forward and backward) needs above the blocks' keeps, as hf.checkpoint_layers and
    plan_ops(..., head=) measure it, what is around the blocks then included; None: counted as what
    the last block's backward needs. around_bytes: what a model holds around the blocks through
    their backward (masks, rotary tables, the embeddings' saved tensors, the head's gradients of
    tied weights; hf.checkpoint_layers measures it), counted in every block's figure. Bytes are
    activation bytes as plan_checkpoints counts them (parameters excluded; their gradients only as
    `gradients` says).
    Thread safety: a plan is not changed by its methods (with_budget returns a new one), and
    context_fn gives each checkpointed call a policy of its own, so planned layers may run in
    several threads."""

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
    storage: list[str] = field(default_factory=list)
    storage_options: list[str] = field(default_factory=lambda: ["keep"])
    block_input_rounded_bytes: list[int] = field(default_factory=list)
    block_rounding_seconds: list[float] = field(default_factory=list)
    gradients: str = "accumulated"
    other_gradient_bytes: int = 0
    head_bytes: Optional[int] = None
    around_bytes: int = 0

    def is_checkpointed(self, block: int) -> bool:
        """Whether apply() checkpoints block (else it leaves it unwrapped)."""
        self._check_block("is_checkpointed", block)
        return not self.checkpointed or self.checkpointed[block]

    @property
    def predicted_overhead(self) -> float:
        """Predicted recompute time as a fraction of the measured step (forward + backward)."""
        return self.predicted_recompute_seconds / self.step_seconds if self.step_seconds > 0 else 0.0

    def storage_of(self, block: int) -> str:
        """torch_ext.checkpoint's storage option for block: "keep" unless the plan rounds its input."""
        self._check_block("storage_of", block)
        return self.storage[block] if self.storage else "keep"

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
        (selective.saved_policy) and recomputes the others. Raises for a block the plan leaves
        unwrapped."""
        self._check_checkpointed("context_fn", block)
        return functools.partial(_plan_contexts, frozenset(self.saved_ops(block)))

    def _check_block(self, owner: str, block: int) -> None:
        if not 0 <= block < len(self.saved):
            raise IndexError(f"OpPlan.{owner}: block {block} is outside 0..{len(self.saved) - 1}")

    def _check_checkpointed(self, owner: str, block: int) -> None:
        self._check_block(owner, block)
        if not self.is_checkpointed(block):
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
                         "seconds": [self.step_seconds], "rounded": self.block_input_rounded_bytes,
                         "rounding": self.block_rounding_seconds}, budget_bytes, self.storage_options,
                        self.gradients, self.other_gradient_bytes, self.head_bytes, self.around_bytes)

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
        _check_parameter_bytes(layers, self.block_parameter_bytes, "OpPlan.apply")
        for index, layer in enumerate(layers):
            if not self.is_checkpointed(index):
                continue
            storage = self.storage_of(index)
            if self.saves_natively(index):
                checkpoint(layer, save=self.save_items(index) or None, storage=storage)
            else:
                checkpoint(layer, context_fn=self.context_fn(index), storage=storage)
        return layers

    def as_dict(self) -> dict:
        return {**asdict(self), "predicted_overhead": self.predicted_overhead}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "OpPlan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"OpPlan.from_json: not an OpPlan (not JSON: {error})") from None
        if not isinstance(data, dict):
            raise ValueError(f"OpPlan.from_json: not an OpPlan (a JSON {type(data).__name__}, not an object)")
        names = set(cls.__dataclass_fields__)
        unknown, missing = set(data) - names, {"saved", "budget_bytes"} - set(data)
        if unknown or missing:
            raise ValueError(f"OpPlan.from_json: not an OpPlan (unknown fields {sorted(unknown)}, "
                             f"missing {sorted(missing)})")
        _check_gradients(data.get("gradients", "accumulated"), "OpPlan.from_json")
        return cls(**data)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str) -> "OpPlan":
        with open(path) as f:
            text = f.read()
        try:
            return cls.from_json(text)
        except ValueError as error:
            raise ValueError(f"OpPlan.load: {path}: {error}") from None

    def __str__(self) -> str:
        mib = 2.0 ** 20
        checkpointed = sum(self.is_checkpointed(k) for k in range(len(self.saved)))
        rounded = sorted({s for s in self.storage if s != "keep"})
        return (f"OpPlan(blocks={len(self.saved)}, checkpointed={checkpointed}, "
                f"{'storage=' + '/'.join(rounded) + ', ' if rounded else ''}"
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
        keep = (name, index) in saved and name not in _KEPT_DRAWS
        return saved_policy(op) if keep else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def plan_ops(layers: Iterable[Callable], *sample_inputs: Any, budget_bytes: int, repeat: int = 3,
             progress: Optional[Callable] = None, storage: Sequence[str] = ("keep",),
             gradients: str = "held", head: Optional[Callable] = None, **kwargs: Any) -> OpPlan:
    """Measure a chain of blocks on sample inputs, op by op, and choose which blocks to checkpoint
    and the ops each checkpointed block saves so that the predicted peak activation memory stays
    within budget_bytes, keeping first what saves the most recompute seconds per byte. Each block
    runs on the previous one's output (RNG state and buffers
    restored afterwards): forward and backward `repeat` times (its saved and workspace bytes, as
    plan_checkpoints measures them) and `repeat` forwards under a dispatch mode that times every
    op and counts its output bytes; blocks with the same ops and bytes share their timings (the
    median over them), and once `repeat` such blocks were measured, the next ones run once each.
    storage: how checkpointed blocks may keep their inputs: "keep" (exact), and the lossy "bf16" /
    "fp16" (opt-in: gradients approximate), used only where no exact plan fits the budget (every
    checkpointed block then stores its input rounded, which lowers the minimum budget).
    gradients: how the training step holds the blocks' parameter gradients. "held" (the default):
    they stay until the whole backward ends, so block k's backward also holds the gradients of
    every block after it; this is so when .grad is None at the step's start (optimizer.zero_grad()'s
    default, and every loop's first step), or when the whole model is compiled as one graph (its
    backward returns every gradient together, before any is added into .grad). "accumulated":
    .grad is allocated before every step (zero_grad(set_to_none=False) after a first step) and
    each block's gradients are added into it as its backward makes them, eager or with each block
    compiled on its own; its minimum is lower, and a step that starts with .grad None runs over it
    by up to the gradients' bytes.
    head: what the step runs on the chain's output, a callable returning the loss, as
    plan_checkpoints' option: measured, the budget holds over the whole step (head_bytes); without
    it, what follows the chain is counted as needing what the last block's backward needs.
    Raises ValueError, stating the minimum, when no plan fits.
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
    options = _check_storage(storage)
    _check_gradients(gradients, "plan_ops")
    _check_head(head, "plan_ops")
    measured, output = _measure_blocks(layers, repeat, progress, options, sample_inputs, kwargs)
    head_bytes, head_gradient_bytes = _measure_head(head, output, layers, gradients, "plan_ops")
    return _op_plan(measured, budget_bytes, options, gradients, head_gradient_bytes, head_bytes)


def _check_budget(budget_bytes: Any) -> None:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, float)) or not budget_bytes > 0:
        raise ValueError(f"plan_ops: budget_bytes must be a positive number of bytes, got {budget_bytes!r}")


def _measure_blocks(layers: list, repeat: int, progress: Optional[Callable], storage_options: list[str],
                    inputs: tuple = (), kwargs: Optional[dict] = None,
                    recorded: Optional[Sequence[tuple[tuple, dict]]] = None) -> tuple[dict, Any]:
    """Per block: its candidate ops, input / output / activation / workspace / parameter bytes
    and seconds; and the last block's output, detached. A chain (inputs, kwargs for the first
    block; each block runs on the previous one's output) or, with recorded, the (args, kwargs)
    each block received in a real forward (its boundary is its first argument, as
    plan_recorded_layers counts it). With a lossy option among storage_options, also each
    block's input rounded to 16 bits and the time to round it."""
    progress = progress or (lambda iterable, desc: iterable)
    rounding = storage_options != ["keep"]
    leaves = _tensor_leaves(recorded[0] if recorded is not None else inputs)
    device = leaves[0].device if leaves else torch.device("cpu")
    m: dict = {key: [] for key in ("ops", "native", "inputs", "outputs", "activations", "workspace", "params",
                                   "replay", "seconds", "rounded", "rounding")}
    value: Any = inputs
    measured: Counter = Counter()
    with _state_restored(layers, leaves):
        for index in progress(range(len(layers)), desc="measuring ops"):
            first, layer = recorded is not None or index == 0, layers[index]
            if recorded is not None:
                value, kwargs = recorded[index]
            boundary = _tensor_leaves(value)[:1] if recorded is not None else _tensor_leaves(value)
            m["inputs"].append(_storage_bytes(boundary, set()))
            if rounding:
                m["rounded"].append(_rounded_bytes(boundary))
                m["rounding"].append(_rounding_seconds(boundary, repeat))
            ops, native, runs, tail = _record_ops(layer, value, kwargs, first, repeat, recorded is not None,
                                                  measured)
            m["ops"].append(ops)
            m["native"].append(native)
            samples = [_measure_once(layer, value, kwargs, first, device, recorded is not None)
                       for _ in range(runs)]
            m["seconds"].append(statistics.median(s[0] + s[1] for s in samples))
            forward = statistics.median(s[0] for s in samples)
            # The replay runs the block's forward but its candidates (counted apart) and its tail.
            m["replay"].append(max(0.0, forward - sum(op[3] for op in m["ops"][-1]) - tail))
            m["activations"].append(samples[-1][2])
            m["workspace"].append(samples[-1][3])
            out = _tensor_leaves(samples[-1][4])
            m["outputs"].append(_storage_bytes(out[:1] if recorded is not None else out, set()))
            m["params"].append(_parameter_bytes(layer))
            value = samples[-1][4]
    _pool_alike_blocks(m)
    return m, value


def _pool_alike_blocks(m: dict) -> None:
    """Blocks that run the same candidate ops with the same output bytes (a model's identical
    layers) take the median of their timings, op by op and for the replay. Timed layer by layer,
    identical layers got different timings and so different plans, following the noise of a
    shared machine (a Llama's replay estimates ranged from 0 to 3.8 ms)."""
    groups: dict = {}
    for k, ops in enumerate(m["ops"]):
        groups.setdefault(tuple((op[0], op[1], op[2]) for op in ops), []).append(k)
    for blocks in groups.values():
        if len(blocks) < 2:
            continue
        seconds = [statistics.median(m["ops"][k][i][3] for k in blocks) for i in range(len(m["ops"][blocks[0]]))]
        replay = statistics.median(m["replay"][k] for k in blocks)
        for k in blocks:
            m["ops"][k] = [op[:3] + [t] for op, t in zip(m["ops"][k], seconds)]
            m["replay"][k] = replay


def plan_recorded_ops(layers: Sequence[nn.Module], recorded: Sequence[tuple[tuple, dict]], budget_bytes: int,
                      repeat: int, progress: Optional[Callable] = None, storage: Sequence[str] = ("keep",),
                      gradients: str = "accumulated", other_gradient_bytes: int = 0,
                      head_bytes: Optional[int] = None, around_bytes: int = 0) -> OpPlan:
    """plan_ops over layers that a model calls one by one, each measured on the (args, kwargs)
    it received in a real forward (hf.checkpoint_layers(..., ops=True)). other_gradient_bytes:
    with gradients "held", those of the model's parameters outside the layers; head_bytes,
    around_bytes: OpPlan's."""
    _check_budget(budget_bytes)
    options = _check_storage(storage)
    measured, _ = _measure_blocks(list(layers), repeat, progress, options, recorded=recorded)
    return _op_plan(measured, budget_bytes, options, gradients, other_gradient_bytes, head_bytes, around_bytes)


def _op_plan(m: dict, budget_bytes: float, storage_options: Sequence[str] = ("keep",),
             gradients: str = "accumulated", other_gradient_bytes: int = 0, head_bytes: Optional[int] = None,
             around_bytes: int = 0) -> OpPlan:
    """The plan for budget_bytes: exact storage where "keep" is allowed and a plan with it fits,
    else every checkpointed block's input stored rounded (the first lossy option allowed)."""
    n = len(m["ops"])
    grads = _gradient_bytes(m["params"], gradients, other_gradient_bytes)
    shape = (m["inputs"], m["outputs"], m["activations"], m["workspace"], grads)
    rounded = m.get("rounded") or []
    lossy = next((option for option in storage_options if option != "keep"), None) if len(rounded) == n else None
    seen = {"head": head_bytes, "around": around_bytes}  # what follows and surrounds the chain
    minimum = {option: _peak([0] * n, *shape, rounded=None if option == "keep" else rounded, **seen)
               for option in storage_options if option in ("keep", lossy)}
    min_budget = min(minimum.values())
    if budget_bytes < min_budget:
        raise ValueError(f"plan_ops: budget_bytes={int(budget_bytes)} ({budget_bytes / 2**20:.2f} MiB) is below the "
                         f"minimum any op-level plan of these {n} blocks can meet: {min_budget} bytes "
                         f"({min_budget / 2**20:.2f} MiB, every block checkpointed, nothing saved"
                         f"{', inputs stored in ' + lossy if lossy else ''}; storage={list(storage_options)}"
                         f"{_surroundings_note(head_bytes, around_bytes)}{_held_note(grads, 'block')})")
    # Exact storage first: a lower budget then never predicts a higher peak (a rounded plan's peak
    # is below the exact minimum, which every exact plan's peak reaches).
    chosen = "keep" if budget_bytes >= minimum.get("keep", math.inf) else lossy
    rounds = chosen != "keep"
    saved, checkpointed, peak, _ = _choose(m["ops"], m["replay"], *shape, float(budget_bytes),
                                           rounded=rounded if rounds else None, **seen)
    kept = [{tuple(op) for op in block} for block in saved]
    rounding = m.get("rounding") or [0.0] * n
    recompute = sum(m["replay"][k] + (rounding[k] if rounds else 0.0)
                    + sum(op[3] for op in block if tuple(op[:2]) not in kept[k])
                    for k, block in enumerate(m["ops"]) if checkpointed[k])
    no_checkpoint = (_evaluate([(0, n, False)], m["activations"], m["outputs"], m["workspace"], grads, m["inputs"],
                               **seen) if gradients == "accumulated" else _peak(m["activations"], *shape, **seen))
    return OpPlan(saved=saved, budget_bytes=int(budget_bytes), predicted_peak_bytes=int(peak),
                  min_budget_bytes=int(min_budget), no_checkpoint_peak_bytes=int(no_checkpoint),
                  predicted_recompute_seconds=recompute, step_seconds=sum(m["seconds"]), ops=m["ops"],
                  block_input_bytes=m["inputs"], block_output_bytes=m["outputs"],
                  block_activation_bytes=m["activations"], block_workspace_bytes=m["workspace"],
                  block_parameter_bytes=m["params"], native_ops=m["native"], checkpointed=checkpointed,
                  block_replay_seconds=m["replay"],
                  storage=[chosen if rounds and checkpointed[k] else "keep" for k in range(n)],
                  storage_options=list(storage_options), block_input_rounded_bytes=list(rounded),
                  block_rounding_seconds=list(rounding), gradients=gradients,
                  other_gradient_bytes=int(other_gradient_bytes),
                  head_bytes=None if head_bytes is None else int(head_bytes), around_bytes=int(around_bytes))
