"""The planner: measure a chain of layers once, then choose checkpoint boundaries that meet a
byte budget at the least recompute (dynamic programming over the chain)."""
from __future__ import annotations

import statistics
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from .api import checkpoint_options
from .measuring import (_check_head, _measure_head, _measure_layers, _measure_once, _parameter_bytes, _state_restored,
                        _tensor_leaves)
from .op_choice import _gradient_bytes

_GRADIENTS = ("accumulated", "held")


@dataclass
class CheckpointPlan:
    """A checkpoint placement for a chain of layers, with what it predicts.

    segments: (start, end, checkpointed) covering layers [0, n); a checkpointed segment keeps its
    input and replays in backward, the others keep their activations. boundaries: the first layer
    of each checkpointed segment. Bytes are activation bytes (boundaries, saved activations and
    the largest backward workspace; parameters excluded) and parameter gradients as `gradients`
    says: "accumulated", only the one in flight in a backward's workspace; "held", every
    layer's from its backward to the step's end, with other_gradient_bytes (parameters outside
    the chain) held throughout (plan_checkpoints' option). layer_input_bytes[k]: the boundary a
    segment starting at layer k keeps (in a chain, layer k - 1's output). head_bytes: what follows
    the layers (a model's head and loss, forward and backward) needs above what they hold, as
    hf.checkpoint_layers and plan_checkpoints(..., head=) measure it (None: not measured,
    nothing counted beyond the last segment's backward); around_bytes: what the model holds
    around the layers through their backward (masks, rotary tables, the embeddings' saved
    tensors), counted in every segment's backward. Both as OpPlan's."""

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
    layer_input_bytes: list[int] = field(default_factory=list)
    gradients: str = "accumulated"
    other_gradient_bytes: int = 0
    head_bytes: Optional[int] = None
    around_bytes: int = 0

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


def _solve(n: int, seconds: list[float], saved: list[int], out_bytes: list[int], workspace: list[int],
           grads: Sequence[int], input_bytes: Sequence[int], budget: Optional[float], max_segment: Optional[int] = None,
           checkpointing: bool = True, head: Optional[int] = None, around: int = 0):
    """Dynamic programming over the chain. Each segment [p, q) is either checkpointed (holds its
    input; replays in backward at the cost of its forward time) or stored (holds its input and
    its activations). While segment j runs backward, memory is what segments before it hold plus
    its input, its activations, its largest backward workspace (measured with .grad allocated, so
    it counts the parameter gradient in flight before it is added) and the gradient of its output;
    the peak is the maximum of that over j, and a segment [p, q), stored or checkpointed, holds
    grads[p] of parameter gradients besides (_gradient_bytes: a constant of the segment, so the
    search is the same). input_bytes[k]: what a segment starting at layer k holds as its input (in
    a chain, layer k - 1's output; a model's layers may take other inputs, an encoder-decoder's
    decoder its own embeddings). around: bytes a model holds around the chain through every
    segment's backward (added to each); head: what follows the chain (a model's head and loss)
    needs above what the segments hold once the chain has run (None: nothing beyond the last
    segment's backward). Both as OpPlan's head_bytes and around_bytes.
    With budget=None, returns the plan of least peak; otherwise the least recompute time whose
    peak fits the budget (None if none does). Segments span at most max_segment layers (None: any);
    checkpointing=False: stored segments only.
    States on the frontier are Pareto-optimal in (held bytes, peak or cost)."""
    prefix_seconds, prefix_saved = (list(accumulate(values, initial=0)) for values in (seconds, saved))
    by_cost = budget is not None
    limit = budget if by_cost else _least_peak_bound(n, saved, out_bytes, workspace, grads, input_bytes,
                                                     max_segment, checkpointing, head, around)
    # frontier[q]: the states reaching boundary q, as chunks of columns (held, peak, cost, the
    # state at p it extends: p, its index there, checkpointed), vectorised over the states. A
    # boundary's chunks are pruned to their Pareto front before it is extended (its front is then
    # final: only boundaries before it extend into it) and whenever they have grown well past it.
    frontier: list[list[tuple]] = [[] for _ in range(n + 1)]
    fronts: list[Optional[tuple]] = [None] * (n + 1)  # each boundary's last front
    sizes = [0] * (n + 1)  # states in frontier[q]
    origin = np.zeros(1, dtype=np.int64)
    frontier[0] = [(origin, origin, np.zeros(1), origin, origin, np.zeros(1, dtype=bool))]

    def prune(q: int) -> tuple:
        fronts[q] = _front(frontier[q], by_cost)
        frontier[q], sizes[q] = [fronts[q]], len(fronts[q][0])
        return fronts[q]

    for p in range(n):
        kept, peak, cost = prune(p)[:3]
        if not len(kept):
            continue
        work = 0
        for q in range(p + 1, (n if max_segment is None else min(n, p + max_segment)) + 1):
            activations = prefix_saved[q] - prefix_saved[p]
            if around + kept[0] + input_bytes[p] + activations > limit:
                break  # no state fits a segment this long, nor a longer one (activations only grow)
            work = max(work, workspace[q - 1])
            base = around + input_bytes[p] + activations + work + out_bytes[q - 1] + grads[p]
            # Fronts are sorted by held bytes, so the states that fit are a prefix of the front
            # (the same for a stored and a checkpointed segment: both hold `base` in backward).
            fits = int(np.searchsorted(kept, limit - base, "right"))
            if not fits:
                continue
            for checkpointed in ((True,) if checkpointing else ()) + (False,):
                chunk = _undominated((kept[:fits] + input_bytes[p] + (0 if checkpointed else activations),
                                      np.maximum(peak[:fits], kept[:fits] + base),
                                      cost[:fits] + (prefix_seconds[q] - prefix_seconds[p] if checkpointed else 0.0),
                                      np.full(fits, p, dtype=np.int64), np.arange(fits, dtype=np.int64),
                                      np.full(fits, checkpointed)), fronts[q], by_cost)
                frontier[q].append(chunk)
                sizes[q] += len(chunk[0])
            if sizes[q] > 4 * (len(fronts[q][0]) if fronts[q] else 0) + 64:
                prune(q)
    kept, peak, cost = prune(n)[:3]
    if head is not None:  # the head runs after the chain, beside everything the segments hold
        peak = np.maximum(peak, kept + head)
    fits = np.flatnonzero(peak <= limit)
    if not len(fits):
        return None
    index = int(fits[np.lexsort((cost[fits], peak[fits]))[0] if budget is None
                     else np.lexsort((peak[fits], cost[fits]))[0]])
    result = (int(kept[index]), int(peak[index]), float(cost[index]))
    segments, q = [], n
    while q > 0:  # back along the links: each front is final once its boundary was extended
        parents, indices, checkpointed = fronts[q][3:]
        segments.append((int(parents[index]), q, bool(checkpointed[index])))
        q, index = int(parents[index]), int(indices[index])
    return result + (tuple(reversed(segments)),)


def _least_peak_bound(n: int, saved, out_bytes, workspace, grads, input_bytes, max_segment,
                      checkpointing: bool, head: Optional[int] = None, around: int = 0) -> float:
    """A peak some plan meets, which the search for the least peak may drop states above: the least
    of segments of 1, 2, 4, ... layers, checkpointed (stored where checkpointing is False)."""
    peaks, length = [], 1
    while length <= (n if max_segment is None else min(n, max_segment)):
        segments = [(p, min(n, p + length), checkpointing) for p in range(0, n, length)]
        peaks.append(_evaluate(segments, saved, out_bytes, workspace, grads, input_bytes, head, around))
        length *= 2
    return min(peaks)


def _undominated(chunk: tuple, front: Optional[tuple], by_cost: bool) -> tuple:
    """The states of chunk that no state of front (a _front, or None) dominates strictly: less or
    equal held bytes and less cost (by_cost) or peak. The states dropped would not be on the next
    front either, and no tie is decided here."""
    if front is None or not len(front[0]):
        return chunk
    column = 2 if by_cost else 1
    # A front's second column falls as its held bytes rise: the last state holding no more is the best.
    at = np.searchsorted(front[0], chunk[0], "right") - 1
    dominated = (at >= 0) & (front[column][np.maximum(at, 0)] < chunk[column])
    if not dominated.any():
        return chunk
    return tuple(values[~dominated] for values in chunk)


def _front(chunks: list[tuple], by_cost: bool) -> tuple:
    """The states of chunks not dominated in (held, cost) (by_cost) or (held, peak), sorted by
    held bytes: of states equal in held bytes, the least cost (peak) is kept, ties by the other and
    then by the order they came in."""
    if not chunks:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0), empty, empty, np.zeros(0, dtype=bool)
    columns = [np.concatenate(column) for column in zip(*chunks)] if len(chunks) > 1 else list(chunks[0])
    # Each chunk is sorted by held bytes already, so a stable sort merges runs (no full lexsort).
    order = np.argsort(columns[0], kind="stable")
    kept, peak, cost = (column[order] for column in columns[:3])
    second, third = (cost, peak) if by_cost else (peak, cost)
    # Of each run of equal held bytes, the state of least (second, third), the first of equals.
    starts = np.flatnonzero(np.concatenate(([True], kept[1:] != kept[:-1])))
    sizes = np.diff(np.append(starts, len(kept)))
    least = second == np.repeat(np.minimum.reduceat(second, starts), sizes)
    masked = np.where(least, third, np.inf)
    least &= masked == np.repeat(np.minimum.reduceat(masked, starts), sizes)
    firsts = np.minimum.reduceat(np.where(least, np.arange(len(kept)), len(kept)), starts)
    ranked = second[firsts]
    keep = np.empty(len(firsts), dtype=bool)
    keep[:1] = True
    keep[1:] = ranked[1:] < np.minimum.accumulate(ranked)[:-1]
    chosen = order[firsts[keep]]
    return tuple(column[chosen] for column in columns)


def plan_checkpoints(layers: Iterable[Callable], *sample_inputs: Any, budget_bytes: int, storage: Optional[str] = None,
                     repeat: int = 3, progress: Optional[Callable] = None, gradients: str = "held",
                     head: Optional[Callable] = None, **kwargs: Any) -> CheckpointPlan:
    """Measure one step of a chain of layers and choose checkpoint boundaries for a memory budget.

    Each layer runs forward and backward `repeat` times on the outputs of the previous one
    (RNG state and module buffers are restored afterwards): its forward and backward seconds,
    the bytes it saves for backward, its output bytes and its backward workspace are measured
    (torch_ext.memory). A dynamic program over the chain then picks the segments that minimise
    recompute time while the predicted peak activation memory stays within budget_bytes.
    gradients: how the training step holds the layers' parameter gradients, as plan_ops' option:
    "held" (the default: every layer's gradients stay until the backward ends, as they do when
    .grad is None at the step's start or the whole chain is compiled as one graph) or
    "accumulated" (.grad allocated before every step, each gradient added into it as backward
    makes it: a lower minimum, for loops that keep .grad allocated).
    head: what the step runs on the chain's output, a callable returning the loss (the model's head
    and loss, an nn.Module or a function); measured on the chain's output (_measure_head), the
    plan's budget then holds over the whole step, not the chain's backward alone.
    Raises ValueError, stating the minimum, when no plan fits. kwargs go to the first layer.
    """
    layers = list(layers.values() if isinstance(layers, (dict, OrderedDict)) else layers)
    if not layers:
        raise ValueError("plan_checkpoints: the chain has no layers")
    if not sample_inputs:
        raise ValueError("plan_checkpoints: give sample inputs for the first layer")
    if not isinstance(budget_bytes, (int, float)) or budget_bytes <= 0:
        raise ValueError(f"plan_checkpoints: budget_bytes must be a positive number of bytes, got {budget_bytes!r}")
    storage = checkpoint_options("plan_checkpoints", **({} if storage is None else {"storage": storage})).script.storage
    if repeat < 1:
        raise ValueError(f"plan_checkpoints: repeat must be >= 1, got {repeat}")
    _check_gradients(gradients, "plan_checkpoints")
    progress = progress or (lambda iterable, desc: iterable)
    _check_head(head, "plan_checkpoints")
    measured, output = _measure_layers(layers, sample_inputs, kwargs, repeat, storage, progress)
    head_bytes, head_gradient_bytes = _measure_head(head, output, layers, gradients, "plan_checkpoints")
    return _plan(layers, measured, budget_bytes, None, "plan_checkpoints", gradients, head_gradient_bytes, head_bytes)


def _check_gradients(gradients: Any, owner: str) -> None:
    if gradients not in _GRADIENTS:
        raise ValueError(f"{owner}: gradients must be one of {', '.join(map(repr, _GRADIENTS))}, got {gradients!r}")


def _planning_gradients(gradients: Optional[str], budget_bytes: Any, owner: str) -> str:
    """The gradients option of a wrapper that plans only when given budget_bytes: None is "held"
    (the planners' default); given without a budget it is an error, not ignored."""
    if gradients is not None and budget_bytes is None:
        raise ValueError(f"{owner}: gradients={gradients!r} is an option of planning under a budget; give "
                         f"budget_bytes")
    gradients = "held" if gradients is None else gradients
    _check_gradients(gradients, owner)
    return gradients


def _surroundings_note(head: Optional[int], around: int) -> str:
    """A budget error's word on what a model needs beyond its layers (hf.checkpoint_layers measures
    both; a chain's planner given head= the first)."""
    parts = ([f"the model's head and loss need {head / 2**20:.2f} MiB after them"] if head is not None else []) + \
        ([f"{around / 2**20:.2f} MiB is held around them through their backward"] if around else [])
    return f"; counted with the layers: {', and '.join(parts)}" if parts else ""


def _held_note(grads: Sequence[int], unit: str) -> str:
    """A budget error's word on held gradients (_gradient_bytes): what they add to the first block's backward."""
    if not any(grads):
        return ""
    return (f"; gradients='held': {unit} 0's backward holds {grads[0] / 2**20:.2f} MiB of parameter "
            f"gradients, those of every {unit} and of the parameters outside the chain")


def plan_recorded_layers(layers: Sequence[nn.Module], recorded: Sequence[tuple[tuple, dict]], budget_bytes: int,
                         storage: str, repeat: int, progress: Optional[Callable] = None, gradients: str = "accumulated",
                         other_gradient_bytes: int = 0, head_bytes: Optional[int] = None,
                         around_bytes: int = 0) -> CheckpointPlan:
    """A plan over layers that a model calls one by one (a Hugging Face decoder stack): each layer
    is measured on the (args, kwargs) it received in a real forward (recorded), and every
    segment is one layer, checkpointed or not. The boundary a checkpointed layer keeps is its own
    first argument as recorded (an encoder-decoder's first decoder layer takes the decoder's
    embeddings, not the last encoder layer's output); arguments shared by all layers (masks, rotary
    embeddings, the encoder's output) are counted once.
    other_gradient_bytes: with gradients "held", those of the model's parameters outside the layers;
    head_bytes, around_bytes: CheckpointPlan's."""
    progress = progress or (lambda iterable, desc: iterable)
    device = next((t.device for t in _tensor_leaves(recorded[0])), torch.device("cpu"))
    fwd, bwd, saved, out_bytes, workspace = [], [], [], [], []
    with _state_restored(layers, _tensor_leaves(recorded[0])):
        for index in progress(range(len(layers)), desc="measuring layers"):
            args, kwargs = recorded[index]
            samples = [_measure_once(layers[index], args, kwargs, True, device, recorded=True) for _ in range(repeat)]
            fwd.append(statistics.median(s[0] for s in samples))
            bwd.append(statistics.median(s[1] for s in samples))
            saved.append(samples[-1][2])
            workspace.append(samples[-1][3])
            out_bytes.append(int(torch.ops.torch_ext.checkpoint_boundary_bytes(
                _tensor_leaves(samples[-1][4])[:1], storage)))
            del samples
    input_bytes = [int(torch.ops.torch_ext.checkpoint_boundary_bytes(_tensor_leaves(args)[:1], storage))
                   for args, _ in recorded]
    return _plan(list(layers), (fwd, bwd, saved, out_bytes, workspace, input_bytes), budget_bytes, 1,
                 "checkpoint_layers", gradients, other_gradient_bytes, head_bytes, around_bytes)


def _plan(layers: list, measured: tuple, budget_bytes: float, max_segment: Optional[int], owner: str,
          gradients: str = "accumulated", other_gradient_bytes: int = 0, head_bytes: Optional[int] = None,
          around_bytes: int = 0) -> CheckpointPlan:
    fwd, bwd, saved, out_bytes, workspace, input_bytes = measured
    n = len(layers)
    param_bytes = [_parameter_bytes(layer) for layer in layers]
    shape = (saved, out_bytes, workspace, _gradient_bytes(param_bytes, gradients, other_gradient_bytes), input_bytes)
    seen = {"head": head_bytes, "around": around_bytes}  # what follows and surrounds the chain
    least = _solve(n, fwd, *shape, None, max_segment, **seen)
    min_budget = least[1]
    # The least peak of stored segments only (one stored segment over the whole chain would count
    # every activation beside every held gradient, which no backward holds at once).
    unwrapped = _solve(n, fwd, *shape, None, max_segment, checkpointing=False, **seen)
    no_checkpoint = unwrapped[1]
    if budget_bytes < min_budget:
        raise ValueError(f"{owner}: budget_bytes={int(budget_bytes)} ({budget_bytes / 2**20:.2f} MiB) is below "
                         f"the minimum any plan of these {n} layers can meet: {min_budget} bytes "
                         f"({min_budget / 2**20:.2f} MiB); without checkpointing the peak is {no_checkpoint} bytes"
                         f"{_surroundings_note(head_bytes, around_bytes)}{_held_note(shape[3], 'layer')}")
    if no_checkpoint <= budget_bytes:  # no recompute needed: the stored-only plan of least peak
        _, peak, cost, segments = unwrapped
    else:
        _, peak, cost, segments = _solve(n, fwd, *shape, float(budget_bytes), max_segment, **seen)
    return CheckpointPlan(segments=[tuple(s) for s in segments], budget_bytes=int(budget_bytes),
                          predicted_peak_bytes=int(peak), min_budget_bytes=int(min_budget),
                          no_checkpoint_peak_bytes=int(no_checkpoint), predicted_recompute_seconds=cost,
                          step_seconds=sum(fwd) + sum(bwd), layer_forward_seconds=fwd, layer_backward_seconds=bwd,
                          layer_saved_bytes=saved, layer_output_bytes=out_bytes, layer_workspace_bytes=workspace,
                          layer_parameter_bytes=param_bytes, layer_input_bytes=input_bytes, gradients=gradients,
                          other_gradient_bytes=int(other_gradient_bytes),
                          head_bytes=None if head_bytes is None else int(head_bytes), around_bytes=int(around_bytes))


def _evaluate(segments, saved, out_bytes, workspace, grads, input_bytes, head: Optional[int] = None,
              around: int = 0) -> int:
    """The peak _solve predicts for these segments."""
    kept, peak = 0, 0
    for p, q, checkpointed in segments:
        activations = sum(saved[p:q])
        peak = max(peak, around + kept + input_bytes[p] + activations + max(workspace[p:q]) + out_bytes[q - 1]
                   + grads[p])
        kept += input_bytes[p] + (0 if checkpointed else activations)
    return peak if head is None else max(peak, kept + head)
