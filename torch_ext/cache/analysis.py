"""Graph analysis: the per-graph plan (_Step, _Plan: steps, sources, when values are released)
and, per pattern of varying and changed sources, which nodes form reusable subgraphs (_Analysis:
frontiers, closures, the compiled programs that run what a call needs)."""
from __future__ import annotations

import inspect
from typing import Any, Optional

from torch import fx, nn

from .classification import _MISS, STABLE, _function_kind, _is_plain, _is_shape_node, _random_in_training
from .codegen import _compile_arguments, _Segment
from .exporting import _check_exported_inputs
from .tracing import _resolve


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

    def value_status(self, value: Any, status: int) -> int:
        """A non-tensor output equal to the last one is as good as cached."""
        if not _is_plain(value):
            self.last_value = _MISS
            return status
        last = self.last_value
        self.last_value = value
        if last is not _MISS and type(last) is type(value) and last == value:
            return STABLE
        return status


class _Plan:
    """A graph prepared for running: a _Step per node (the output node's included), the sources,
    each node's users and source bits, and the analyses made for it so far."""

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
            self.steps.append(self._make_step(i, first_id + i, node, (root, graph_module), never_cache))
        self._set_releases(nodes)
        self.size = len(nodes)
        self.ids = [step.node_id for step in self.steps]
        self.users = [[index[u] for u in node.users] for node in nodes]
        self.feeds_output = [any(u.op == "output" for u in node.users) for node in nodes]
        self._find_sources(nodes)
        self.compute_steps = [step for step in self.steps if not self.is_source[step.index]]
        self.module_steps = [step for step in self.steps if step.op == "call_module"]
        self.analyses: dict = {}
        self.last_analysis = None
        self.epoch = 0  # bumped when a step's has_tensor changes: which frontier nodes are looked up

    def bind(self, args: tuple, kwargs: dict, signature: Optional[inspect.Signature], name: str) -> list:
        """The placeholders' values for a call (module is named in errors); for an exported graph,
        checked against its guards."""
        if kwargs:
            if signature is None:
                raise TypeError(f"LazyExecutor: {name} takes no keyword arguments")
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as error:
                raise TypeError(f"LazyExecutor({name}): {error}") from None
            bound.apply_defaults()
            args = tuple(bound.args) + tuple(bound.kwargs.values())
        if self.pytree_io:
            flat = list(self.codegen.process_inputs(*args))
            problem = _check_exported_inputs(self.graph_module, flat)
            if problem is not None:
                raise ValueError(f"LazyExecutor({name}): the arguments do not match the exported program: {problem}")
            return flat
        values = []
        positional = list(args)
        for step in self.placeholders:
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
                raise TypeError(f"LazyExecutor({name}): missing argument {step.target!r}")
        if positional:
            raise TypeError(f"LazyExecutor({name}): takes {len(self.placeholders)} arguments, got {len(args)}")
        return values

    def ids_covering(self, name: str) -> list[int]:
        """Node ids of the node called name and of the frontier nodes whose reused subgraph contains it."""
        ids = []
        for step in self.steps:
            if step.name == name:
                ids.append(step.node_id)
                for analysis in list(self.analyses.values()):
                    for frontier, closure in list(analysis.closures.items()):
                        if step.index in closure[3]:
                            ids.append(self.steps[frontier].node_id)
        return ids

    def _make_step(self, i: int, node_id: int, node: fx.Node, roots: tuple, never_cache: set) -> _Step:
        """node's step: its inputs, argument builder, kind, and what it reads (placeholder default,
        attribute owner, module state); the output node's builder becomes output_build."""
        step = _Step(i, node_id, node)
        step.inputs = [self.index[n] for n in node.all_input_nodes]
        step.never = node.name in never_cache or node.target in never_cache or any(
            kind in never_cache for _, kind in node.meta.get("nn_module_stack", {}).values())  # exported graphs
        if node.op == "placeholder":
            if node.args:
                step.placeholder_default = node.args[0]
            self.placeholders.append(step)
        elif node.op == "get_attr":
            step.parent, step.attr = _resolve(roots, node.target, node.name)
        elif node.op == "output":
            build = _compile_arguments(node.args, {}, self.index)
            self.output_build = lambda env, build=build: build(env)[0][0]
        else:
            step.build = _compile_arguments(node.args, node.kwargs, self.index)
            if node.op == "call_module":
                _describe_module_step(step, roots, never_cache)
            else:
                step.kind = _function_kind(node)
        return step

    def _set_releases(self, nodes: list) -> None:
        """Free each value after its last use, as eager execution does (the output node keeps its own)."""
        index = self.index
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

    def _find_sources(self, nodes: list) -> None:
        """Sources: placeholders, get_attr nodes and shape-like values of sources (x.shape, x.size(),
        x.shape[1], x.device), evaluated before anything else at every call; a bit each, and each
        node's mask of the source bits it depends on."""
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


def _describe_module_step(step: _Step, roots: tuple, never_cache: set) -> None:
    """A call_module step's module (owner and attribute), its parameters and buffers (inputs of
    the node too), and whether it is random in training, writes in place or holds buffers."""
    node = step.node
    step.parent, step.attr = _resolve(roots, node.target, node.name)
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

    __slots__ = ("closure_ok", "frontier", "roots", "closures", "interior", "programs", "demand", "n_live")

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
        # Nodes a call may need; the others (dead code, as exported graphs have) never run nor count as reused.
        live = bytearray(roots)
        for step in reversed(plan.compute_steps):
            if live[step.index]:
                for j in step.inputs:
                    live[j] = 1
        self.n_live = sum(live[step.index] for step in plan.compute_steps if step.op != "output")
        self.closures: dict[int, tuple] = {}
        self.programs: dict[tuple, list] = {}  # steps to run (last first) -> what runs them
        # (plan.epoch, [(frontier step, found)] in lookup order, program, steps in it) of the last call
        self.demand: Optional[tuple] = None
        self.interior = [step for step in plan.compute_steps
                         if step.op != "output" and closure_ok[step.index] and not frontier[step.index]]

    def program(self, plan: "_Plan", run: list, varying: int) -> list:
        """The steps of `run` (last first) in graph order: each maximal stretch of steps that just
        run compiled into one _Segment, each maximal stretch of steps outside the reusable
        subgraphs (keyed on their own inputs) gathered into one _KeyedStretch, the other steps (in
        a reusable subgraph, looked up or stored as its frontier) as they are. Cached per run list,
        since a failed replay often comes back to one seen before."""
        key = tuple(step.index for step in run)
        found = self.programs.get(key)
        if found is None:
            if len(self.programs) >= 16:
                self.programs.clear()
            found, stretch, stretch_kind = [], [], None
            for step in reversed(run):
                i = step.index
                if not self.closure_ok[i]:
                    kind = _KeyedStretch
                elif plan.mask[i] & varying:
                    kind = _Segment
                else:
                    kind = None
                if stretch and kind is not stretch_kind:
                    found.append(_stretch(stretch_kind, stretch, plan))
                    stretch = []
                if kind is None:
                    found.append(step)
                else:
                    stretch.append(step)
                stretch_kind = kind
            if stretch:
                found.append(_stretch(stretch_kind, stretch, plan))
            self.programs[key] = found
        return found

    def closure(self, plan: "_Plan", i: int, with_training: bool) -> tuple:
        """(source indices, graph inputs first; (dict, key) state pairs; modules; all indices; number of
        graph inputs among the sources) of node i\'s closure."""
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
            # Graph inputs first: the NodeCache may key them by content (the rest are weights).
            inputs = [j for j in ordered if plan.is_source[j] and plan.steps[j].op == "placeholder"]
            sources = inputs + [j for j in ordered if plan.is_source[j] and plan.steps[j].op != "placeholder"]
            pairs, modules = [], []
            for j in ordered:
                step = plan.steps[j]
                if step.op == "call_module":
                    pairs.extend(step.state)
                    if with_training:
                        modules.append((step.parent, step.attr))
            found = self.closures[i] = (sources, pairs, modules, frozenset(ordered), len(inputs))
        return found


class _KeyedStretch:
    """Consecutive steps outside the reusable subgraphs (downstream of a random or side-effect
    node), each looked up on its own inputs or run: one item of a program, so that the executor
    runs them in one loop."""

    __slots__ = ("steps",)

    def __init__(self, steps: list) -> None:
        self.steps = steps


def _stretch(kind: type, steps: list, plan: _Plan):
    return _Segment(steps, plan.index) if kind is _Segment else _KeyedStretch(steps)
