"""torch.fx tracing for the lazy executor: refuses random tensors baked into the graph as
constants, and resolves a node's qualified attribute name to its owner."""
from __future__ import annotations

import torch
from torch import fx, nn


class _FxTraceError(RuntimeError):
    """torch.fx could not trace the module (its error is the __cause__): the executor exports it instead."""


class _Tracer(fx.Tracer):
    # Buffers become get_attr nodes even where forward calls their methods (self.qweight.float()),
    # instead of being evaluated once at trace time into a constant that in-place edits never reach.
    proxy_buffer_attributes = True


def _trace_once(module: nn.Module) -> fx.GraphModule:
    tracer = _Tracer()
    graph = tracer.trace(module)
    return fx.GraphModule(tracer.root, graph, type(module).__name__)


def _trace(module: nn.Module) -> fx.GraphModule:
    """Trace module with torch.fx, and refuse graphs into which tracing baked a random tensor.

    A tensor created in forward from constants alone (torch.randn(4, 8)) is evaluated at trace
    time and stored as a constant: the plain module draws a new one at every call, the graph
    would not. Tracing twice under different seeds (the caller's RNG state is restored) tells
    such constants from real ones."""
    name = type(module).__name__
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0x1A2B)
            first = _trace_once(module)
            torch.manual_seed(0x3C4D)
            second = _trace_once(module)
    except Exception as error:
        raise _FxTraceError(f"LazyExecutor: torch.fx could not trace {name}: {error}; pass a torch.fx.GraphModule "
                            f"or a torch.export.ExportedProgram instead") from error
    own = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    for node in first.graph.nodes:
        if node.op == "get_attr" and node.target not in own:
            a, b = getattr(first, node.target, None), getattr(second, node.target, None)
            if isinstance(a, torch.Tensor) and not (isinstance(b, torch.Tensor) and a.shape == b.shape
                                                    and torch.equal(a, b)):
                raise RuntimeError(
                    f"LazyExecutor: tracing {name} turned a tensor created in forward into the constant "
                    f"{node.target} (used by {', '.join(u.name for u in node.users)}), and it differs between "
                    f"two traces: a random tensor drawn without an input (like torch.randn(4, 8)) would be "
                    f"frozen. Derive it from an input (torch.randn_like(x), torch.randn(x.shape)) or pass a "
                    f"torch.export.ExportedProgram.")
    return first


def _resolve(roots: tuple, target: str, node_name: str):
    """(owner, attribute) for a qualified attribute name: on the user's module first, so that
    reassigned parameters are seen, then on the graph module (constants tracing created)."""
    prefix, _, attr = target.rpartition(".")
    for root in roots:
        try:
            owner = root.get_submodule(prefix) if prefix else root
        except AttributeError:
            continue
        if hasattr(owner, attr):
            return owner, attr
    raise ValueError(f"LazyExecutor: node {node_name} refers to {target!r}, which {type(roots[0]).__name__} "
                     f"does not have")
