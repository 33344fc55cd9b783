"""Measuring layers for the planners: one forward and backward of each (seconds, bytes saved for
backward, backward workspace) and what a chain's head needs, with the state measuring disturbs
(buffers, random state, .grad) restored."""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .. import memory


def _trainable_parameters(module: nn.Module) -> list[torch.Tensor]:
    """module.parameters() that require grad (each once)."""
    seen, params = set(), []
    for p in module.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params


def _parameter_bytes(layer: Callable) -> int:
    """The bytes of a layer's trainable parameters (0 for a function): what its gradients hold."""
    return sum(p.nbytes for p in _trainable_parameters(layer)) if isinstance(layer, nn.Module) else 0


def _check_parameter_bytes(layers: Sequence[Callable], measured: Sequence[int], owner: str) -> None:
    """Raises ValueError naming the first layer whose trainable parameter bytes differ from those a
    plan measured for it: a plan saved for other layers (another size, dtype or set of trainable
    weights) would apply without error and miss its budget unseen. measured may be empty (a plan
    from an older file): nothing to check."""
    for index, (layer, held) in enumerate(zip(layers, measured)):
        holds = _parameter_bytes(layer)
        if holds != held:
            raise ValueError(
                f"{owner}: layer {index} ({type(layer).__name__}) holds {holds:,} bytes of trainable parameters "
                f"where the plan's layer {index} held {held:,}: the plan was made for other layers (another size, "
                f"dtype or set of trainable weights); plan these layers")


def _call(layer: Callable, value: Any, kwargs: Optional[dict] = None, first: bool = False) -> Any:
    if first:
        return layer(*value, **(kwargs or {}))
    return layer(value)


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _device_clock(*values: Any) -> Callable[[], float]:
    """time.perf_counter, read once the device's queued work is done where values hold tensors on an
    accelerator (or are modules with parameters there): a kernel runs after the call that queues
    it returns, and a plan weighs what ops cost the device, not what queuing them costs."""
    tensors = [t for v in values for t in (_trainable_parameters(v) if isinstance(v, nn.Module) else _tensor_leaves(v))]
    device = next((t.device for t in tensors if t.device.type != "cpu"), None)
    if device is None:
        return time.perf_counter

    def clock() -> float:
        torch.accelerator.synchronize(device)
        return time.perf_counter()
    return clock


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


def _detach_like(value: Any, recorded: bool = False) -> Any:
    """value's tensors detached; chained inputs require grad when they can, recorded ones (a
    layer's real inputs) only where they did."""
    def detach(leaf):
        if isinstance(leaf, torch.Tensor):
            return leaf.detach().requires_grad_(leaf.requires_grad or (not recorded and leaf.is_floating_point()))
        return leaf
    return pytree.tree_map(detach, value)


@contextlib.contextmanager
def _state_restored(modules: Iterable[Any], tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """Measuring runs forwards that a step would not: afterwards the modules' buffers (running
    statistics) and the random state of the CPU and of the CUDA devices of `tensors` are as they
    were before."""
    buffers = [(b, b.detach().clone()) for m in modules if isinstance(m, nn.Module) for b in m.buffers()]
    devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, copy in buffers:
                    buffer.copy_(copy)


def _measure_layers(layers: Sequence[Callable], inputs: tuple, kwargs: dict, repeat: int, storage: str,
                    progress) -> tuple[tuple, Any]:
    """Per layer: forward and backward seconds (median of `repeat`), bytes saved for backward
    (excluding parameters and the layer's input), output bytes, and backward workspace bytes;
    and the chain's output, detached. The RNG state and the layers' buffers are restored
    afterwards."""
    device = next((t.device for t in _tensor_leaves(inputs)), torch.device("cpu"))
    fwd, bwd, saved, out_bytes, workspace = [], [], [], [], []
    first_input = int(torch.ops.torch_ext.checkpoint_boundary_bytes(_tensor_leaves(inputs), storage))
    value: Any = inputs
    with _state_restored(layers, _tensor_leaves(inputs)):
        for index in progress(range(len(layers)), desc="measuring layers"):
            samples = [_measure_once(layers[index], value, kwargs, index == 0, device) for _ in range(repeat)]
            fwd.append(statistics.median(s[0] for s in samples))
            bwd.append(statistics.median(s[1] for s in samples))
            saved.append(samples[-1][2])
            workspace.append(samples[-1][3])
            value = samples[-1][4]
            out_bytes.append(int(torch.ops.torch_ext.checkpoint_boundary_bytes(_tensor_leaves(value), storage)))
            del samples
    input_bytes = [first_input] + out_bytes[:-1]  # a chain: each input the output before
    return (fwd, bwd, saved, out_bytes, workspace, input_bytes), value


def _measure_once(layer: Callable, value: Any, kwargs: dict, first: bool, device: torch.device,
                  recorded: bool = False) -> tuple:
    """One forward and backward of layer on (a detached copy of) value: (forward seconds, backward
    seconds, bytes saved for backward, backward workspace bytes, the output detached)."""
    params = _trainable_parameters(layer) if isinstance(layer, nn.Module) else []
    x = _detach_like(value, recorded)
    x_leaves = _tensor_leaves(x)
    exclude = _storage_keys(params) | _storage_keys(x_leaves)
    packed: list[torch.Tensor] = []
    clock = _device_clock(x, params)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        start = clock()
        out = _call(layer, x, kwargs, first)
        forward_seconds = clock() - start
    out_leaves = [t for t in _tensor_leaves(out) if t.requires_grad]
    saved_bytes = _storage_bytes(packed + _tensor_leaves(out), exclude | _storage_keys(_tensor_leaves(kwargs)))
    packed.clear()
    targets = [t for t in x_leaves if t.requires_grad] + params
    backward_seconds, workspace_bytes = 0.0, 0
    if out_leaves and targets:
        # Backward as in training: parameter gradients accumulate into existing .grad buffers, so
        # what is measured is the transient working memory (intermediate gradients, the input's
        # gradient, one parameter gradient before it is added).
        grads_out = [torch.ones_like(t) for t in out_leaves]
        kept_grads = [p.grad for p in params]
        for p in params:
            p.grad = torch.zeros_like(p)
        try:
            with memory.track(device) as tracked:
                start = clock()
                torch.autograd.backward(out_leaves, grads_out, inputs=targets)
                backward_seconds = clock() - start
        finally:
            for p, g in zip(params, kept_grads):
                p.grad = g
        workspace_bytes = max(0, tracked.peak_delta_bytes)
    detached = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
    return forward_seconds, backward_seconds, saved_bytes, workspace_bytes, detached


def _check_head(head: Optional[Callable], owner: str) -> None:
    if head is not None and not callable(head):
        raise TypeError(f"{owner}: head must be a callable that takes the chain's output and returns the loss, "
                        f"got {type(head).__name__}")


def _measure_head(head: Optional[Callable], output: Any, layers: Sequence[Callable], gradients: str,
                  owner: str) -> tuple[Optional[int], int]:
    """What a chain's head needs, as (head_bytes, the gradient bytes it leaves held); (None, 0)
    without one. output: the chain's output, as measuring its layers left it. head_bytes: that
    output and the peak above it from the head's call until its backward has brought the
    output's gradient back (the planners' head term, as hf.checkpoint_layers measures it in a
    model). The head's parameters are the leaves its loss's graph reaches (found by a first
    call): with gradients "accumulated" their .grad is allocated beforehand; with "held" it
    starts as None, and the gradients of those outside the chain are held through the chain's
    backward too. The parameters' .grad, the random state and a Module head's buffers are as
    they were."""
    if head is None:
        return None, 0
    output = _detach_like(output)
    output_leaves = [t for t in _tensor_leaves(output) if t.requires_grad]
    device = next((t.device for t in output_leaves), torch.device("cpu"))
    with _state_restored([head], output_leaves):
        with torch.enable_grad():
            params = [p for p in _graph_leaves(_head_loss(head, output, owner))
                      if all(p is not t for t in output_leaves)]
        kept_grads = [p.grad for p in params]
        try:
            for p in params:
                p.grad = torch.zeros_like(p) if gradients == "accumulated" else None
            with torch.enable_grad(), memory.track(device) as tracked:
                _head_loss(head, output, owner).backward()
        finally:
            for p, g in zip(params, kept_grads):
                p.grad = g
    in_chain = {id(p) for layer in layers if isinstance(layer, nn.Module) for p in layer.parameters()}
    held = sum(p.nbytes for p in params if id(p) not in in_chain) if gradients == "held" else 0
    return _storage_bytes(output_leaves, set()) + max(0, tracked.peak_delta_bytes), held


def _head_loss(head: Callable, output: Any, owner: str) -> torch.Tensor:
    loss = head(output)
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad):
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
        raise ValueError(f"{owner}: head must return the loss, a one-element tensor that requires grad, got "
                         f"{type(loss).__name__}{shape}")
    return loss


def _graph_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose gradients loss.backward() would accumulate (its graph's AccumulateGrad nodes)."""
    found, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found
