"""The op-level planner's choice (torch_ext.plan_ops): which blocks of a chain to checkpoint and
which ops each checkpointed block saves, from measured bytes and seconds, so that the predicted
peak fits a byte budget at the least predicted recompute time (greedy: the exact choice is a
knapsack problem).

Each block's choices form a curve of recompute seconds against bytes kept: nothing saved, then
its ops in order of seconds per byte, then the block left unwrapped (its activations kept, its
replay's fixed cost saved too); the steps of the curve's lower convex hull are the items. The
choice is O(N log N) in the number N of candidate ops: a heap of all blocks' steps by seconds
saved per byte, each step taken when the predicted peak with it fits (a segment tree over the
blocks keeps the peak, O(log n) a step). The plans are monotonic: a lower budget never predicts
a higher peak."""
from __future__ import annotations

import heapq
import math
from typing import Optional, Sequence


def _peak(kept_per_block: Sequence[int], inputs: Sequence[int], outputs: Sequence[int], activations: Sequence[int],
          workspace: Sequence[int], grads: Sequence[int], rounded: Optional[Sequence[int]] = None,
          head: Optional[int] = None, around: int = 0) -> int:
    """Predicted peak with block i keeping kept_per_block[i] bytes for backward (a checkpointed
    block: the outputs it saves; an unwrapped one: its activations): while block k runs backward,
    the blocks before it hold their inputs and what they keep, block k its input, its activations
    (recomputed or kept), its backward workspace, the gradient of its output and grads[k], the
    parameter gradients held beyond the workspace (_gradient_bytes).
    After the last block, what consumes the chain's output (a model's head, the loss) runs while
    every block holds its input and what it keeps, needing `head` bytes above them (measured by
    hf.checkpoint_layers, what is around the blocks then included) or, where None, what the last
    block's backward needs. around: bytes a model holds around its blocks through their backward
    (hf.checkpoint_layers: masks, rotary tables, the embeddings' saved tensors, tied weights'
    gradients from the head), added to every block's figure. rounded: every block
    checkpointed with its input stored rounded to 16 bits, rounded[k] bytes, held until its
    backward ends (which also holds the input widened back). O(number of blocks)."""
    return max(_figures(kept_per_block, inputs, outputs, activations, workspace, grads, rounded, head, around),
               default=0)


def _figures(kept_per_block, inputs, outputs, activations, workspace, grads, rounded, head, around) -> list[int]:
    """_peak's figures: one per block (while its backward runs), then the one after the chain."""
    held, figures = 0, []
    for k in range(len(inputs)):
        stored = rounded[k] if rounded is not None else 0
        figures.append(around + held + inputs[k] + stored + activations[k] + workspace[k] + outputs[k] + grads[k])
        held += (stored if rounded is not None else inputs[k]) + kept_per_block[k]
    if inputs:
        figures.append(held + (around + activations[-1] + workspace[-1] + outputs[-1] + grads[-1]
                               if head is None else head))
    return figures


def _gradient_bytes(params: Sequence[int], gradients: str, other_bytes: int = 0) -> list[int]:
    """Per block, the parameter-gradient bytes held by the end of its backward beyond its
    workspace. "accumulated": none (each gradient is added into .grad, allocated before the step,
    as the backward makes it; the workspace, measured with .grad allocated, counts the one in
    flight). "held": its own, every later block's (their backward ran first) and other_bytes
    (parameters outside the chain whose gradients are made before the chain's backward: a model's
    head), kept until the whole backward ends: .grad None when the step starts
    (optimizer.zero_grad()'s default), or the whole model compiled as one graph, whose backward
    returns every gradient together. A segment of blocks p..q holds grads[p]."""
    if gradients == "accumulated":
        return [0] * len(params)
    held, after = [], other_bytes
    for nbytes in reversed(params):
        after += nbytes
        held.append(after)
    return held[::-1]


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


def _choose(ops: Sequence[Sequence[list]], replay, inputs, outputs, activations, workspace, grads, budget: float,
            rounded: Optional[Sequence[int]] = None, head: Optional[int] = None, around: int = 0):
    """Every block's steps (_steps), in order of recompute seconds saved per byte kept (highest
    first), each taken when the predicted peak (_peak's) with it fits budget. A block whose step
    does not fit takes none of its later steps (they build on it), except that a block that cannot be
    unwrapped goes on with the op steps its unwrapping replaced. A checkpointed block therefore
    saves a prefix of its ops in order of seconds per byte. Returns (saved per block, checkpointed
    per block, peak, steps): steps counts the heap's comparisons and the peak updates' tree
    nodes, O(N log N). A higher budget never predicts a lower peak: at the first step the two
    budgets take differently, the higher one takes a step the lower one could not fit. rounded:
    checkpointed blocks store their inputs rounded (_peak's), and unwrapping a block also keeps
    its input whole again. head, around: _peak's."""
    count = [0]
    blocks = len(ops)

    def entry(k: int, j: int, step: tuple) -> tuple:
        _, nbytes, seconds = step
        return (_Counted((-seconds / nbytes if nbytes > 0 else -math.inf, k, j), count), k, step)

    heap, replaced = [], []
    held_input = rounded if rounded is not None else inputs
    for k in range(blocks):
        steps, rest = _steps(ops[k], activations[k] + inputs[k] - held_input[k], replay[k])
        heap += [entry(k, j, step) for j, step in enumerate(steps)]
        replaced.append([entry(k, len(steps) + j, step) for j, step in enumerate(rest)])
    heapq.heapify(heap)
    peaks = _Peaks(_figures([0] * blocks, inputs, outputs, activations, workspace, grads, rounded, head, around), count)
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
