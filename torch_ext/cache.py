"""Lazy node cache: run a torch.fx / torch.export graph node by node and reuse the outputs of
nodes whose inputs did not change since they were computed.

    executor = torch_ext.LazyExecutor(model)          # or torch_ext.lazy(model)
    out = executor(x, cond)                           # same results as model(x, cond)

Which nodes are reused. A node's cached output is returned only when the C++ NodeCache
(torch_ext._C.cache.NodeCache, csrc/torch_ext/cache/node_cache.h) finds every input the same
live tensor at the same version, data pointer, storage, sizes, strides, offset, dtype, device
and requires_grad (and the same values for non-tensors), the same grad / inference / autocast
mode, and the cached output tensors unchanged in place. For call_module nodes the module's
parameters, buffers and training flag are inputs too. Optimizer steps and other in-place
updates bump version counters, so everything that depends on the updated tensors recomputes.

Never cached: random nodes (dropout in training, torch.rand*/randn*/randint*/bernoulli/
multinomial/normal/poisson, random in-place methods, aten ops tagged nondeterministic_seeded,
scaled_dot_product_attention with dropout, modules of the Dropout family and RReLU in
training); nodes with side effects (in-place methods and operators, setitem, out= calls,
mutable aten ops, torch.empty*, modules holding buffers while in training mode: they may
update them, like BatchNorm's running statistics); nodes named in never_cache.

Reused subgraphs. Inputs, get_attr values and shapes of those (x.shape, x.size(), x.device)
are "sources". A source that changed on two calls in a row is treated as varying: nodes
depending on it are computed without looking them up or storing them (no overhead, no
memory), e.g. the noisy latent of a diffusion sampler or the tokens of a full-miss workload.
A node that is pure and depends only on pure nodes (nothing in its closure random, with side
effects, or written in place by such a node) is a function of its closure's sources and its
call_module nodes' parameters, buffers and training flags. Only the "frontier" of such a
subgraph is looked up and stored: nodes whose output is used by the graph output, by a node
that cannot be reused this call, or by a node that depends on a graph input or a changed
source the frontier node does not. Their key is those sources and that module state (checked
in C++ in one call), so an unchanged conditioning encoder costs one lookup, not one per
node, and its interior is neither run, looked up nor held. All lookups happen before any node
runs (the keys need no interior values); then only the nodes a missed frontier needs run, in
graph order. A frontier whose source changed this call is computed and stored without a
lookup. Nodes outside reusable subgraphs (downstream of random or side-effect nodes) keep the
per-node keys on their inputs. invalidate_node(name) drops the node's entry and every entry
whose subgraph contains the node, so that the node and what depends on it recompute.

Training and gradients. An output computed with grad enabled keeps its autograd graph and is
reused as is, so gradients flow through every use of it into the same parameters (summed by
autograd, as the plain module's per-use graphs are). Once a backward pass runs through it,
its graph's saved tensors are freed: a hook on its grad_fn then invalidates the entry, and
the next call recomputes it. Outputs computed under no_grad are never returned with grad
enabled, nor the other way round.

Limitations (documented, not detected): writes that bypass version counters (`p.data.copy_`,
`p.data.mul_`, NumPy views, writes to inference tensors) are invisible: call invalidate()
after them, or write through `with torch.no_grad(): p.copy_(...)`, which is seen.
Assignments like `p.data = t` are seen (the storage changes). Nodes whose inputs are
inference tensors (torch.inference_mode) are never reused: use torch.no_grad(). Graph outputs
served from the cache are the same tensor objects as on the call that computed them: do
not modify them in place (if you do, the cache notices and recomputes, but references kept
from earlier calls see the change). A traced module's structure is captured once per
combination of its submodules' training flags; attributes read by plain Python code at
trace time (not tensors) are constants of the graph, and tracing refuses a random tensor it
would freeze (torch.randn(4, 8) drawn without an input). Modules torch.fx treats as leaves
(torch.nn modules, parametrized ones included) are one node each: their internal weight
preprocessing is reused only together with their output. A subgraph is reused whole or not
at all: when one of its parameters changes (an optimizer step) the whole closure of the
frontier recomputes, including the part upstream of that parameter. The cost an entry
reports for eviction is its subgraph's compute time (shared inputs counted per use). Costs are host
seconds, which on CUDA measure the launch rather than the kernel; they only order evictions.
"""
from __future__ import annotations

import inspect
import operator
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import fx, nn
from torch.fx.node import map_aggregate
from torch.nn import functional as F

from . import _C

NodeCache = _C.cache.NodeCache

STABLE, FRESH, VARYING = 0, 1, 2
_MISS = object()
_training = operator.attrgetter("training")
_UNLIMITED = 2**63 - 1

_RANDOM_FUNCTIONS = {
    torch.rand, torch.rand_like, torch.randn, torch.randn_like, torch.randint, torch.randint_like,
    torch.randperm, torch.bernoulli, torch.multinomial, torch.normal, torch.poisson, torch.rrelu,
    F.gumbel_softmax, F.rrelu,
}
# Dropout-like functions: random unless p is the constant 0 or training the constant False.
# name -> (position of p, position of training, keyword of training)
_DROPOUT_FUNCTIONS = {
    F.dropout: (1, 2, "training"), F.dropout1d: (1, 2, "training"), F.dropout2d: (1, 2, "training"),
    F.dropout3d: (1, 2, "training"), F.alpha_dropout: (1, 2, "training"),
    F.feature_alpha_dropout: (1, 2, "training"), torch.dropout: (1, 2, "train"),
    torch.alpha_dropout: (1, 2, "train"), torch.feature_dropout: (1, 2, "train"),
    torch.feature_alpha_dropout: (1, 2, "train"),
}
_SIDE_EFFECT_FUNCTIONS = {
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior,
    operator.ixor, operator.ilshift, operator.irshift, torch.empty, torch.empty_like, torch.empty_strided,
    print,
}
_RANDOM_METHODS = {"bernoulli", "multinomial", "random_", "uniform_", "normal_", "bernoulli_", "exponential_",
                   "geometric_", "cauchy_", "log_normal_"}
_SIDE_EFFECT_METHODS = {"backward", "register_hook", "retain_grad", "new_empty", "new_empty_strided", "record_stream",
                        "__setitem__", "__delitem__"}
_RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
                   nn.RReLU)
_PLAIN_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _is_plain(value: Any) -> bool:
    if isinstance(value, _PLAIN_TYPES):
        return True
    if type(value) in (tuple, list, torch.Size):
        return all(isinstance(v, _PLAIN_TYPES) for v in value)
    return False


def _tensors_of(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_of(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_of(v)]
    return []


def _argument(node: fx.Node, position: int, keyword: str, default: Any) -> Any:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(keyword, default)


def _function_kind(node: fx.Node) -> str:
    """'pure', 'random' or 'side_effect' for a call_function / call_method node."""
    target = node.target
    if node.op == "call_method":
        if target in _RANDOM_METHODS:
            return "random"
        if (target in _SIDE_EFFECT_METHODS or (target.endswith("_") and not target.endswith("__"))
                or (target.startswith("__i") and target.endswith("__")) or node.kwargs.get("inplace") is not None
                and node.kwargs.get("inplace") is not False):
            return "side_effect"
        return "pure"
    if "out" in node.kwargs or _writes_in_place(node):
        return "side_effect"
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        overloads = ([target] if isinstance(target, torch._ops.OpOverload)
                     else [getattr(target, name) for name in target.overloads()])
        if any(op._schema.is_mutable for op in overloads):
            return "side_effect"
        if any(torch.Tag.nondeterministic_seeded in op.tags for op in overloads):
            if any(op.__name__.split(".")[0] in ("dropout", "native_dropout", "feature_dropout", "alpha_dropout")
                   for op in overloads) and _argument(node, 2, "train", True) is False:
                return "pure"
            return "random"
        name = target.__name__.split(".")[0]
        if name.startswith("empty") or name.startswith("new_empty"):
            return "side_effect"
        return "pure"
    if target in _RANDOM_FUNCTIONS:
        return "random"
    if target in _DROPOUT_FUNCTIONS:
        p_position, training_position, training_keyword = _DROPOUT_FUNCTIONS[target]
        if _argument(node, 3, "inplace", False) is not False:
            return "side_effect"
        p = _argument(node, p_position, "p", 0.5)
        training = _argument(node, training_position, training_keyword, True)
        return "pure" if training is False or (isinstance(p, (int, float)) and p == 0) else "random"
    if target is F.scaled_dot_product_attention:
        p = _argument(node, 4, "dropout_p", 0.0)
        return "pure" if isinstance(p, (int, float)) and p == 0 else "random"
    return "pure"


def _writes_in_place(node: fx.Node) -> bool:
    """torch.relu_-style functions, and functions called with inplace=True (or an inplace
    argument that is not the constant False)."""
    target = node.target
    name = getattr(target, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        return True
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False
    if "inplace" not in parameters:
        return False
    position = list(parameters).index("inplace")
    value = node.args[position] if len(node.args) > position else node.kwargs.get("inplace", False)
    return value is not False


def _random_in_training(module: nn.Module) -> bool:
    for m in module.modules():
        if isinstance(m, _RANDOM_MODULES):
            return True
        dropout = getattr(m, "dropout", None)
        if isinstance(dropout, float) and dropout > 0:
            return True
    return False


def _compile_arguments(args: tuple, kwargs: dict, index: dict) -> Callable[[list], tuple]:
    """A function env -> (args, kwargs) with each node replaced by its value."""
    def flat(value):
        return isinstance(value, fx.Node) or not isinstance(value, (tuple, list, dict, slice))

    if all(flat(a) for a in args) and all(flat(v) for v in kwargs.values()):
        arg_refs = [(i, index[a]) for i, a in enumerate(args) if isinstance(a, fx.Node)]
        kw_refs = [(k, index[v]) for k, v in kwargs.items() if isinstance(v, fx.Node)]
        arg_template, kw_template = list(args), dict(kwargs)
        if not kw_refs:
            if len(arg_refs) == 1 and len(args) == 1:
                (_, only), = arg_refs
                return lambda env: ((env[only],), kw_template)
            def build(env):
                a = arg_template.copy()
                for position, ref in arg_refs:
                    a[position] = env[ref]
                return a, kw_template
            return build

        def build_with_kwargs(env):
            a = arg_template.copy()
            for position, ref in arg_refs:
                a[position] = env[ref]
            kw = kw_template.copy()
            for key, ref in kw_refs:
                kw[key] = env[ref]
            return a, kw
        return build_with_kwargs

    def build_nested(env):
        lookup = lambda n: env[index[n]] if isinstance(n, fx.Node) else n  # noqa: E731
        return map_aggregate(args, lookup), map_aggregate(kwargs, lookup)
    return build_nested


class _Segment:
    """Consecutive steps that just run (pure, depending on a varying source: never looked up nor
    stored), compiled into one Python function so they cost what the module's own forward does
    rather than an interpreter iteration each."""

    __slots__ = ("run", "count")

    def __init__(self, steps: list, index: dict) -> None:
        namespace: dict = {}

        def constant(value) -> str:
            if value is None or isinstance(value, (bool, int, str)) or (
                    isinstance(value, float) and value == value and abs(value) != float("inf")):
                return repr(value)
            name = f"c{len(namespace)}"
            namespace[name] = value
            return name

        def expression(value) -> str:
            if isinstance(value, fx.Node):
                return f"env[{index[value]}]"
            if isinstance(value, tuple):
                items = "".join(expression(v) + ", " for v in value)
                return f"{constant(type(value))}({items})" if hasattr(value, "_fields") else f"({items})"
            if isinstance(value, list):  # fx's immutable_list too: the module received a list
                return "[" + ", ".join(expression(v) for v in value) + "]"
            if isinstance(value, dict):
                return "{" + ", ".join(f"{constant(k)}: {expression(v)}" for k, v in value.items()) + "}"
            if isinstance(value, slice):
                return f"slice({expression(value.start)}, {expression(value.stop)}, {expression(value.step)})"
            return constant(value)

        lines = ["def run(env, status):"]
        for step in steps:
            node = step.node
            args = [expression(a) for a in node.args]
            args += [f"{k}={expression(v)}" if k.isidentifier() else f"**{{{k!r}: {expression(v)}}}"
                     for k, v in node.kwargs.items()]
            if step.op == "call_module":
                callee = f"{constant(step.parent._modules)}[{step.attr!r}]"
            elif step.op == "call_method":
                callee = f"{args[0]}.{step.target}" if step.target.isidentifier() else \
                    f"getattr({args[0]}, {step.target!r})"
                args = args[1:]
            else:
                callee = constant(step.target)
            lines.append(f"    env[{step.index}] = {callee}({', '.join(args)})  # {step.name}")
            lines.append(f"    status[{step.index}] = {VARYING}")
            lines.extend(f"    env[{j}] = None" for j in step.release)
        exec(compile("\n".join(lines), "<torch_ext.LazyExecutor segment>", "exec"), namespace)
        self.run = namespace["run"]
        self.count = len(steps)


class _Step:
    """One node of a plan, with everything the run loop needs precomputed."""

    __slots__ = ("index", "node_id", "node", "name", "op", "target", "build", "inputs", "kind", "parent", "attr",
                 "state", "random_in_training", "buffers", "streak", "has_tensor", "last_value", "cached",
                 "on_backward", "placeholder_default", "never", "release")

    def __init__(self, index: int, node_id: int, node: fx.Node) -> None:
        self.index, self.node_id, self.node = index, node_id, node
        self.name, self.op, self.target = node.name, node.op, node.target
        self.build = None
        self.inputs: list[int] = []
        self.kind = "pure"
        self.parent = self.attr = None
        self.state: list = []  # (dict, key) pairs of a call_module's parameters and buffers
        self.random_in_training = self.buffers = False
        self.streak = 0
        self.has_tensor = True
        self.last_value = _MISS
        self.cached = False
        self.on_backward = None
        self.placeholder_default = _MISS
        self.never = False
        self.release: list[int] = []  # env slots whose last use is this node


class _Plan:
    def __init__(self, graph_module: fx.GraphModule, root: nn.Module, first_id: int, never_cache: set) -> None:
        self.graph_module = graph_module
        graph = graph_module.graph
        nodes = list(graph.nodes)
        self.index = index = {node: i for i, node in enumerate(nodes)}
        self.steps: list[_Step] = []
        self.placeholders: list[_Step] = []
        self.output_build = None
        self.codegen = graph._codegen
        self.pytree_io = type(self.codegen).__name__ == "_PyTreeCodeGen"
        for i, node in enumerate(nodes):
            step = _Step(i, first_id + i, node)
            step.inputs = [index[n] for n in node.all_input_nodes]
            step.never = node.name in never_cache or node.target in never_cache
            if node.op == "placeholder":
                if node.args:
                    step.placeholder_default = node.args[0]
                self.placeholders.append(step)
            elif node.op == "get_attr":
                step.parent, step.attr = _resolve((root, graph_module), node.target, node.name)
            elif node.op == "output":
                build = _compile_arguments(node.args, {}, index)
                self.output_build = lambda env, build=build: build(env)[0][0]
            else:
                step.build = _compile_arguments(node.args, node.kwargs, index)
                if node.op == "call_module":
                    step.parent, step.attr = _resolve((root, graph_module), node.target, node.name)
                    module = step.parent._modules.get(step.attr)
                    if not isinstance(module, nn.Module):
                        raise TypeError(f"LazyExecutor: node {node.name} calls {node.target}, which is not an nn.Module")
                    step.never = step.never or type(module) in never_cache
                    for owner in module.modules():
                        step.state.extend((owner._parameters, k) for k in owner._parameters)
                        step.state.extend((owner._buffers, k) for k in owner._buffers)
                    step.random_in_training = _random_in_training(module)
                    if getattr(module, "inplace", False) is True:  # nn.ReLU(inplace=True) and the like
                        step.kind = "side_effect"
                    step.buffers = any(True for _ in module.buffers())
                else:
                    step.kind = _function_kind(node)
            self.steps.append(step)
        # Free each value after its last use, as eager execution does (the output node keeps its own).
        last_use: dict[int, int] = {}
        for i, node in enumerate(nodes):
            for n in node.all_input_nodes:
                last_use[index[n]] = i
        for producer, consumer in last_use.items():
            if nodes[consumer].op != "output":
                self.steps[consumer].release.append(producer)
        for i, node in enumerate(nodes):
            if not node.users and node.op not in ("output", "placeholder"):
                self.steps[i].release.append(i)
        self.size = len(nodes)
        self.ids = [step.node_id for step in self.steps]
        # Subgraph analysis. Sources: placeholders, get_attr nodes and shape-like values of sources
        # (x.shape, x.size(), x.shape[1], x.device), evaluated before anything else at every call.
        self.users = [[index[u] for u in node.users] for node in nodes]
        self.feeds_output = [any(u.op == "output" for u in node.users) for node in nodes]
        self.is_source = [False] * self.size
        self.mask = [0] * self.size  # bit per source this node depends on
        self.placeholder_bits = 0
        self.sources: list[_Step] = []
        for i, node in enumerate(nodes):
            step = self.steps[i]
            if node.op in ("placeholder", "get_attr") or (
                    node.op != "output" and node.all_input_nodes
                    and all(self.is_source[j] for j in step.inputs) and _is_shape_node(node)):
                bit = 1 << len(self.sources)
                self.is_source[i] = True
                self.mask[i] = bit
                self.sources.append(step)
                if node.op == "placeholder":
                    self.placeholder_bits |= bit
            else:
                m = 0
                for j in step.inputs:
                    m |= self.mask[j]
                self.mask[i] = m
        self.compute_steps = [step for step in self.steps if not self.is_source[step.index]]
        self.module_steps = [step for step in self.steps if step.op == "call_module"]
        self.n_nodes = sum(1 for step in self.compute_steps if step.op != "output")
        self.analyses: dict = {}
        self.last_analysis = None
        self.epoch = 0  # bumped when a step's has_tensor changes: which frontier nodes are looked up


_SHAPE_ATTRIBUTES = {"shape", "ndim", "dtype", "device", "is_cuda", "layout"}


def _is_shape_node(node: fx.Node) -> bool:
    """x.shape, x.size(), x.dim(), x.numel(), x.shape[1], x.device ...: values that say what a
    tensor is, not what it holds (torch.fx and torch.export spell them these ways)."""
    if node.op == "call_method":
        return node.target in ("size", "dim", "numel")
    if node.op == "call_function":
        if node.target is getattr:
            return len(node.args) == 2 and node.args[1] in _SHAPE_ATTRIBUTES
        if node.target is operator.getitem:
            return isinstance(node.args[0], fx.Node) and _is_shape_node(node.args[0])
    return False


class _Analysis:
    """Which nodes of a plan form reusable subgraphs, for one pattern of varying and changed
    sources (and, for untraced graphs, one setting of the modules\' training flags).

    closure_ok[i]: node i and everything it depends on (back to the sources) are pure, and
    nothing in that closure is written by a node with side effects: its output is a function of
    its closure\'s sources, its call_module nodes\' parameters, buffers and training flags.
    frontier[i]: such a node whose output is needed by something outside the reusable part: the
    graph output, a node that cannot be reused this call, or a node that depends on a graph input
    or a changed source that i does not. Only frontier nodes are looked up and stored, keyed on
    their closure\'s sources and module state; the interior of a reused subgraph is not run, not
    looked up and not held."""

    __slots__ = ("closure_ok", "frontier", "roots", "closures", "interior", "programs", "demand")

    def __init__(self, plan: "_Plan", varying: int, fresh: int) -> None:
        n = plan.size
        steps = plan.steps
        effective = [None] * n
        for step in plan.compute_steps:
            kind = step.kind
            if step.op == "call_module":
                module = step.parent._modules[step.attr]
                if module.training and (step.random_in_training or step.buffers):
                    kind = "random" if step.random_in_training else "side_effect"
            if step.never and kind == "pure":
                kind = "side_effect"
            effective[step.index] = kind
        tainted = [any(effective[u] == "side_effect" for u in plan.users[i]) for i in range(n)]
        # Lookups happen before anything runs: a node after a side effect in graph order may read
        # what it wrote (through a view, a buffer, an attribute), so from there on nodes keep the
        # per-node keys checked in graph order.
        first_effect = next((i for i in range(n) if effective[i] == "side_effect"), n)
        closure_ok = [False] * n
        for step in plan.steps:
            i = step.index
            if i > first_effect:
                continue
            if plan.is_source[i]:
                closure_ok[i] = not tainted[i]
            elif step.op != "output":
                closure_ok[i] = (effective[i] == "pure" and not tainted[i]
                                 and all(closure_ok[j] for j in step.inputs))
        mask = plan.mask
        now = [closure_ok[i] and not plan.is_source[i] and not (mask[i] & varying) for i in range(n)]
        boundary = fresh | plan.placeholder_bits
        frontier = [False] * n
        roots = bytearray(n)
        for step in plan.compute_steps:
            i = step.index
            if step.op == "output":
                for j in step.inputs:
                    roots[j] = 1
                continue
            if not closure_ok[i]:
                roots[i] = 1  # never skipped: run (or looked up node by node) as before
            if now[i]:
                frontier[i] = plan.feeds_output[i] or any(
                    steps[u].op != "output" and (not now[u] or mask[u] & boundary & ~mask[i])
                    for u in plan.users[i])
        self.closure_ok, self.frontier, self.roots = closure_ok, frontier, roots
        self.closures: dict[int, tuple] = {}
        self.programs: dict[tuple, list] = {}  # steps to run (last first) -> what runs them
        # (plan.epoch, [(frontier step, found)] in lookup order, program, steps in it) of the last call
        self.demand: Optional[tuple] = None
        self.interior = [step for step in plan.compute_steps
                         if step.op != "output" and closure_ok[step.index] and not frontier[step.index]]

    def program(self, plan: "_Plan", run: list, varying: int) -> list:
        """The steps of `run` (last first) in graph order, each maximal stretch of steps that just
        run compiled into one _Segment; cached per run list, since a failed replay often comes back
        to one seen before."""
        key = tuple(step.index for step in run)
        found = self.programs.get(key)
        if found is None:
            if len(self.programs) >= 16:
                self.programs.clear()
            found, stretch = [], []
            for step in reversed(run):
                i = step.index
                if self.closure_ok[i] and plan.mask[i] & varying:
                    stretch.append(step)
                    continue
                if stretch:
                    found.append(_Segment(stretch, plan.index))
                    stretch = []
                found.append(step)
            if stretch:
                found.append(_Segment(stretch, plan.index))
            self.programs[key] = found
        return found

    def closure(self, plan: "_Plan", i: int, with_training: bool) -> tuple:
        """(source indices, (dict, key) state pairs, modules, all indices) of node i\'s closure."""
        found = self.closures.get(i)
        if found is None:
            seen, stack = {i}, [i]
            while stack:
                j = stack.pop()
                if not plan.is_source[j]:
                    for k in plan.steps[j].inputs:
                        if k not in seen:
                            seen.add(k)
                            stack.append(k)
            ordered = sorted(seen)
            sources = [j for j in ordered if plan.is_source[j]]
            pairs, modules = [], []
            for j in ordered:
                step = plan.steps[j]
                if step.op == "call_module":
                    pairs.extend(step.state)
                    if with_training:
                        modules.append((step.parent, step.attr))
            found = self.closures[i] = (sources, pairs, modules, frozenset(ordered))
        return found


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
        raise RuntimeError(f"LazyExecutor: torch.fx could not trace {name}: {error}; pass a torch.fx.GraphModule "
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


class LazyExecutor(nn.Module):
    """Runs a module's graph node by node, reusing node outputs whose inputs are unchanged.

    module: an nn.Module (traced with torch.fx, once per training-mode setting), a
    torch.fx.GraphModule (run as is), or a torch.export.ExportedProgram (its .module()).
    capacity_bytes: the most bytes of cached outputs to hold (None: no limit).
    never_cache: node names, callables or module classes never to cache, for functions with
    effects the executor cannot see.

    Calls are serialised by a lock; the cache itself may be invalidated from any thread.
    See the module docstring for what is reused, what never is, and the limitations.
    """

    def __init__(self, module: Union[nn.Module, fx.GraphModule, "torch.export.ExportedProgram"],
                 capacity_bytes: Optional[int] = None, never_cache: Iterable[Any] = ()) -> None:
        super().__init__()
        if isinstance(module, torch.export.ExportedProgram):
            module = module.module()
            self._trace = False
        elif isinstance(module, fx.GraphModule):
            self._trace = False
        elif isinstance(module, nn.Module):
            self._trace = True
        else:
            raise TypeError(f"LazyExecutor: expected an nn.Module, torch.fx.GraphModule or torch.export."
                            f"ExportedProgram, got {type(module).__name__}")
        if capacity_bytes is not None and (not isinstance(capacity_bytes, int) or capacity_bytes < 0):
            raise ValueError(f"LazyExecutor: capacity_bytes must be None or an int >= 0, got {capacity_bytes!r}")
        self.module = module
        self._cache = NodeCache(_UNLIMITED if capacity_bytes is None else capacity_bytes)
        self._never_cache = set(never_cache)
        self._lock = threading.Lock()
        self._plans: dict = {}
        self._names: dict[int, str] = {}
        self._next_id = 0
        self._all_modules = list(module.modules())
        self._calls = self._computed = self._reused = 0
        try:
            self._signature = inspect.signature(module.forward)
        except (TypeError, ValueError):
            self._signature = None
        self._plan()  # trace now: errors surface at construction

    # ---- plans ----
    def _plan(self) -> _Plan:
        key = tuple(map(_training, self._all_modules)) if self._trace else None
        plan = self._plans.get(key)
        if plan is None:
            if self._trace:
                graph_module = _trace(self.module)
            else:
                graph_module = self.module
            plan = _Plan(graph_module, self.module, self._next_id, self._never_cache)
            self._next_id += plan.size
            for step in plan.steps:
                self._names[step.node_id] = step.name
                step.on_backward = self._backward_hook(step)
            self._plans[key] = plan
        return plan

    def _backward_hook(self, step: _Step):
        cache_ref = weakref.ref(self._cache)
        node_id = step.node_id

        def on_backward(grad_inputs, grad_outputs):
            # The graph behind the cached output is being freed (or was used once): recompute.
            cache = cache_ref()
            if cache is not None:
                cache.invalidate_node(node_id)
        return on_backward

    def _bind(self, plan: _Plan, args: tuple, kwargs: dict) -> list:
        if kwargs:
            if self._signature is None:
                raise TypeError(f"LazyExecutor: {type(self.module).__name__} takes no keyword arguments")
            try:
                bound = self._signature.bind(*args, **kwargs)
            except TypeError as error:
                raise TypeError(f"LazyExecutor({type(self.module).__name__}): {error}") from None
            bound.apply_defaults()
            args = tuple(bound.args) + tuple(bound.kwargs.values())
        if plan.pytree_io:
            return list(plan.codegen.process_inputs(*args))
        values = []
        positional = list(args)
        for step in plan.placeholders:
            if step.target.startswith("**"):
                values.append({})
            elif step.target.startswith("*"):
                values.append(tuple(positional))
                positional = []
            elif positional:
                values.append(positional.pop(0))
            elif step.placeholder_default is not _MISS:
                values.append(step.placeholder_default)
            else:
                raise TypeError(f"LazyExecutor({type(self.module).__name__}): missing argument {step.target!r}")
        if positional:
            raise TypeError(f"LazyExecutor({type(self.module).__name__}): takes {len(plan.placeholders)} "
                            f"arguments, got {len(args)}")
        return values

    # ---- running ----
    def _source_status(self, step: _Step, inputs: list) -> int:
        if not self._cache.observe(step.node_id, inputs):
            step.streak = 0
            return STABLE
        step.streak += 1
        return VARYING if step.streak >= 2 else FRESH

    def forward(self, *args, **kwargs):
        with self._lock:
            plan = self._plan()
            return self._run(plan, self._bind(plan, args, kwargs))

    def _run(self, plan: _Plan, placeholder_values: list):
        cache = self._cache
        env: list = [None] * plan.size
        status = [STABLE] * plan.size
        next_placeholder = iter(placeholder_values)
        computed = reused = 0
        grad_enabled = torch.is_grad_enabled()
        perf_counter = time.perf_counter
        mask = plan.mask
        # 1. Sources (inputs, attributes, shapes of those): their values and whether they changed.
        varying = fresh = 0
        for step in plan.sources:
            i = step.index
            if step.op == "placeholder":
                value = next(next_placeholder)
            elif step.op == "get_attr":
                value = getattr(step.parent, step.attr)
            else:
                value = self._call(step, env, None)
            env[i] = value
            st = status[i] = self._source_status(step, [value])
            if st == VARYING:
                varying |= mask[i]
            elif st == FRESH:
                fresh |= mask[i]
        with_training = not self._trace
        key = (varying, fresh) if self._trace else (
            varying, fresh, tuple(s.parent._modules[s.attr].training for s in plan.module_steps))
        analysis = plan.analyses.get(key)
        if analysis is None:
            if len(plan.analyses) >= 64:
                plan.analyses.clear()
            analysis = plan.analyses[key] = _Analysis(plan, varying, fresh)
        if analysis is not plan.last_analysis:
            # Nodes that are now interior (or vary) hold no entry: drop what earlier calls stored.
            plan.last_analysis = analysis
            stale = [s.node_id for s in analysis.interior if s.cached]
            for s in analysis.interior:
                s.cached = False
            if stale:
                cache.invalidate_nodes(stale)
        closure_ok, frontier = analysis.closure_ok, analysis.frontier
        # 2. Demand, from the output back: a frontier node found in the cache needs nothing of its
        # closure; one that must be computed needs its inputs. Keys are closure sources and module
        # state, all known now, so every lookup happens before anything runs.
        # Lookups that come out as the last call's did (same analysis) demand the same steps: replay
        # them and reuse that call's run list rather than walking the whole graph again.
        keys: dict = {}  # frontier index -> (key, number of sources), for the misses
        looked_up: dict = {}  # frontier index -> what its lookup found
        program = None
        memo = analysis.demand
        if memo is not None and memo[0] == plan.epoch:
            program, n_run = memo[2], memo[3]
            for step, hit in memo[1]:
                value = looked_up[step.index] = self._look_up(plan, analysis, step, env, fresh, with_training, keys)
                if (value is not _MISS) != hit:
                    program = None
                    break
        if program is None:
            needed = analysis.roots[:]
            run = []  # the steps to run, last first
            lookups = []
            for step in reversed(plan.compute_steps):
                i = step.index
                if not needed[i]:
                    continue
                if frontier[i] and step.has_tensor:
                    value = looked_up[i] if i in looked_up else self._look_up(
                        plan, analysis, step, env, fresh, with_training, keys)
                    lookups.append((step, value is not _MISS))
                    if value is not _MISS:
                        continue
                run.append(step)
                for j in step.inputs:
                    needed[j] = 1
            program, n_run = analysis.program(plan, run, varying), len(run)
            analysis.demand = (plan.epoch, lookups, program, n_run)
        # 3. Run what is needed, in graph order. The others were served by the cache or lie inside
        # a subgraph that was (values whose last use is skipped live until the call returns).
        reused = plan.n_nodes - n_run
        costs = [0.0] * plan.size
        for step in program:
            if step.__class__ is _Segment:  # steps depending on a varying source: just run them
                step.run(env, status)
                computed += step.count
                continue
            i = step.index
            op = step.op
            if closure_ok[i]:
                module = step.parent._modules[step.attr] if op == "call_module" else None
                start = perf_counter()
                value = self._call(step, env, module)
                cost = perf_counter() - start
                for j in step.inputs:
                    cost += costs[j]
                costs[i] = cost
                computed += 1
                st = VARYING if mask[i] & varying else FRESH
                entry = keys.get(i)
                if entry is not None:
                    key, n_sources = entry
                    if len(key) > n_sources and self._source_status(step, key[n_sources:]) == VARYING:
                        st = VARYING  # parameters that change at every call (training)
                    tensors = _tensors_of(value)
                    if not tensors:
                        step.has_tensor = False
                        plan.epoch += 1
                    elif st == VARYING:
                        if step.cached:
                            cache.invalidate_node(step.node_id)
                            step.cached = False
                    else:
                        step.cached = cache.put(step.node_id, key, value, cost)
                        if step.cached and grad_enabled:
                            for tensor in tensors:
                                if tensor.grad_fn is not None:
                                    tensor.grad_fn.register_hook(step.on_backward)
                env[i] = value
                status[i] = st
            else:
                st = STABLE
                for j in step.inputs:
                    if status[j] > st:
                        st = status[j]
                kind = step.kind
                module = key_extra = None
                if op == "call_module":
                    module = step.parent._modules[step.attr]  # what getattr finds, without its slow path
                    if module.training and (step.random_in_training or step.buffers):
                        kind = "random" if step.random_in_training else "side_effect"
                    elif st != VARYING:
                        # The module's parameters, buffers and mode are inputs of the node too.
                        key_extra = [d[k] for d, k in step.state]
                        key_extra.append(module.training)
                if step.never and kind == "pure":
                    kind = "side_effect"

                if (kind == "pure" and st == STABLE and not step.has_tensor and step.last_value is not _MISS
                        and module is None):  # a module's result may depend on its state, which st does not cover
                    value = step.last_value  # a shape or size of unchanged inputs: as it was
                elif kind != "pure" or st == VARYING or not step.has_tensor:
                    if step.cached:
                        cache.invalidate_node(step.node_id)
                        step.cached = False
                    value = self._call(step, env, module)
                    computed += 1
                    if kind == "random":
                        st = VARYING
                    elif kind == "side_effect" and st == STABLE:
                        st = FRESH
                    elif kind == "pure" and not step.has_tensor:
                        st = self._value_status(step, value, st)
                        if _tensors_of(value):
                            step.has_tensor = True  # learned wrong once: look it up from now on
                            plan.epoch += 1
                else:
                    key = [env[j] for j in step.inputs]
                    if key_extra is not None:
                        key.extend(key_extra)
                    value = cache.get(step.node_id, key, _MISS) if st == STABLE else _MISS
                    if value is not _MISS:
                        reused += 1
                        step.streak = 0  # the module's state is in the key: unchanged
                    else:
                        if key_extra is not None:
                            source = self._source_status(step, key_extra)
                            if source > st:
                                st = source
                        start = perf_counter()
                        value = self._call(step, env, module)
                        cost = perf_counter() - start
                        computed += 1
                        tensors = _tensors_of(value)
                        if not tensors:
                            step.has_tensor = False
                            plan.epoch += 1
                            st = self._value_status(step, value, max(st, FRESH))
                        elif st == VARYING:  # its parameters change at every call (training)
                            if step.cached:
                                cache.invalidate_node(step.node_id)
                                step.cached = False
                        else:
                            st = FRESH
                            step.cached = cache.put(step.node_id, key, value, cost)
                            if step.cached and grad_enabled:
                                for tensor in tensors:
                                    if tensor.grad_fn is not None:
                                        tensor.grad_fn.register_hook(step.on_backward)
                env[i] = value
                status[i] = st
            for j in step.release:
                env[j] = None
        result = plan.output_build(env)
        self._calls += 1
        self._computed += computed
        self._reused += reused
        if plan.pytree_io:
            return plan.codegen.process_outputs(result)
        return result

    def _look_up(self, plan: _Plan, analysis: _Analysis, step: _Step, env: list, fresh: int, with_training: bool,
                 keys: dict) -> Any:
        """A frontier node's cached value (also put in env), or _MISS with its key put in keys."""
        i = step.index
        sources, pairs, modules, _ = analysis.closure(plan, i, with_training)
        key = [env[j] for j in sources]
        if pairs:
            key.extend([d[k] for d, k in pairs])
        if modules:
            key.extend([parent._modules[attr].training for parent, attr in modules])
        if not plan.mask[i] & fresh:
            value = self._cache.get(step.node_id, key, _MISS)
            if value is not _MISS:
                env[i] = value
                step.streak = 0  # its module state is in the key: unchanged
                return value
        keys[i] = (key, len(sources))
        return _MISS

    @staticmethod
    def _call(step: _Step, env: list, module: Optional[nn.Module]) -> Any:
        args, kwargs = step.build(env)
        if module is not None:
            return module(*args, **kwargs)
        if step.op == "call_method":
            return getattr(args[0], step.target)(*args[1:], **kwargs)
        return step.target(*args, **kwargs)

    @staticmethod
    def _value_status(step: _Step, value: Any, status: int) -> int:
        """A non-tensor output equal to the last one is as good as cached."""
        if not _is_plain(value):
            step.last_value = _MISS
            return status
        last = step.last_value
        step.last_value = value
        if last is not _MISS and type(last) is type(value) and last == value:
            return STABLE
        return status

    # ---- inspection and control ----
    def stats(self) -> dict:
        """The NodeCache's counters (hits, misses, tensors_recomputed, evictions, invalidations,
        entries, cached_bytes, capacity_bytes) and the executor's: calls, nodes_computed,
        nodes_reused (nodes not run: served by a lookup, or inside a subgraph whose frontier was),
        hit_rate (nodes_reused / (nodes_reused + nodes_computed)). hits + misses counts lookups:
        one per frontier node of a reused subgraph, not one per node."""
        stats = dict(self._cache.stats())
        # No lock: a forward hook may ask mid-call; the counters are updated once per call.
        stats.update(calls=self._calls, nodes_computed=self._computed, nodes_reused=self._reused)
        done = stats["nodes_reused"] + stats["nodes_computed"]
        stats["hit_rate"] = stats["nodes_reused"] / done if done else 0.0
        return stats

    def reset_stats(self) -> None:
        self._cache.reset_stats()
        with self._lock:
            self._calls = self._computed = self._reused = 0

    def invalidate(self) -> None:
        """Drop every cached output: the next call recomputes every node."""
        self._cache.invalidate()

    def invalidate_node(self, name: str) -> None:
        """Drop the cached output of the node called name (in every traced plan), and of every
        node whose reused subgraph contains it: the next call recomputes the node and what depends
        on it. Interior nodes of a reused subgraph hold no entry of their own (only its frontier
        nodes do), so invalidating one drops the frontier entries that cover it."""
        ids = [node_id for node_id, node_name in self._names.items() if node_name == name]
        for plan in list(self._plans.values()):
            for step in plan.steps:
                if step.name != name:
                    continue
                for analysis in list(plan.analyses.values()):
                    for frontier, closure in list(analysis.closures.items()):
                        if step.index in closure[3]:
                            ids.append(plan.steps[frontier].node_id)
        if not ids:
            known = sorted(set(self._names.values()))
            raise ValueError(f"LazyExecutor: no node named {name!r}; nodes are {known[:20]}"
                             f"{' ...' if len(known) > 20 else ''}")
        self._cache.invalidate_nodes(ids)

    def cached_nodes(self) -> list[str]:
        """Names of the nodes whose outputs are cached now, in graph order."""
        return [self._names[node_id] for node_id in self._cache.cached_node_ids()]

    def memory_estimate(self) -> int:
        """Bytes the cacheable nodes' outputs took when last stored (an upper bound on what caching
        all of them holds: storages shared between nodes count per node)."""
        return self._cache.memory_estimate(list(self._names))

    @property
    def capacity_bytes(self) -> Optional[int]:
        capacity = self._cache.capacity_bytes
        return None if capacity == _UNLIMITED else capacity

    @capacity_bytes.setter
    def capacity_bytes(self, value: Optional[int]) -> None:
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"LazyExecutor: capacity_bytes must be None or an int >= 0, got {value!r}")
        self._cache.capacity_bytes = _UNLIMITED if value is None else value

    @property
    def graph_module(self) -> fx.GraphModule:
        """The graph run for the module's current training mode."""
        with self._lock:
            return self._plan().graph_module


def lazy(module, capacity_bytes: Optional[int] = None, never_cache: Iterable[Any] = ()) -> LazyExecutor:
    """Shorthand for LazyExecutor(module, capacity_bytes, never_cache)."""
    return LazyExecutor(module, capacity_bytes=capacity_bytes, never_cache=never_cache)
