"""LazyExecutor: runs a graph node by node, looking up and storing node outputs in the C++
NodeCache (torch.classes.torch_ext.NodeCache, reached for Python values through
torch_ext._C.cache.PythonValues); see the torch_ext.cache package docstring."""
from __future__ import annotations

import inspect
import operator
import os
import threading
import time
import warnings
from typing import Any, Iterable, Optional, Union

import torch
from torch import fx, nn

from .. import _C
from .analysis import _Analysis, _KeyedStretch, _Plan, _Step
from .classification import _MISS, FRESH, STABLE, VARYING, _invalidation_hook, _tensors_of
from .codegen import _Segment
from .exporting import _Exports
from .store import NodeStore
from .tracing import _FxTraceError, _trace

_SAME, _RECURRING, _NEW = 0, 1, 2  # what NodeCache.observe saw (torch_ext::cache::Seen)

NodeCache = torch.classes.torch_ext.NodeCache

_training = operator.attrgetter("training")


class LazyExecutor(nn.Module):
    """Runs a module's graph node by node, reusing node outputs whose inputs are unchanged.

    module: an nn.Module (traced with torch.fx, once per training-mode setting; where torch.fx
    cannot trace it, exported with non-strict torch.export once per call signature, with a
    warning: see torch_ext.cache.exporting), a torch.fx.GraphModule (run as is), or a
    torch.export.ExportedProgram (its .module(), its guards checked at every call).
    Keyword options are the NodeCache's (capacity_bytes, content_keys, content_key_fraction);
    `cache` is that NodeCache (torch.classes.torch_ext). never_cache: node names, callables or
    module classes never to cache, for functions with effects the executor cannot see.
    store: a folder where outputs are also kept on disk, across processes (`store`, a NodeStore
    of store_budget_bytes on disk: see torch_ext.cache.store); None: memory only.

    Calls are serialised by a lock; the cache itself may be invalidated from any thread.
    See the torch_ext.cache package docstring for what is reused, what never is, and the limitations.
    """

    def __init__(self, module: Union[nn.Module, fx.GraphModule, "torch.export.ExportedProgram"],
                 never_cache: Iterable[Any] = (), store: Optional[Union[str, os.PathLike]] = None,
                 store_budget_bytes: Optional[int] = None, **options: Any) -> None:
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
        self.module = module
        self.cache = NodeCache(**options)
        self._recent = self.cache.entries_per_node
        self.store = None if store is None else NodeStore(store, store_budget_bytes)
        self._values = _C.cache.PythonValues(self.cache)
        self._never_cache = set(never_cache)  # and classes by qualified name, as exported graphs record them
        self._never_cache |= {f"{c.__module__}.{c.__qualname__}" for c in self._never_cache if isinstance(c, type)}
        self._lock = threading.Lock()
        self._plans: dict = {}
        self._names: dict[int, str] = {}
        self._next_id = 0
        self._all_modules = list(module.modules())
        # The weights a call reads, against which the NodeCache decides whether hashing inputs pays.
        self._weight_bytes = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
        try:
            self._signature = inspect.signature(module.forward)
        except (TypeError, ValueError):
            self._signature = None
        self._exports: Optional[_Exports] = None
        try:
            self._plan()  # trace now: errors surface at construction
        except _FxTraceError as error:
            self._fall_back(error)

    # ---- plans ----
    def _plan(self) -> _Plan:
        key = tuple(map(_training, self._all_modules)) if self._trace else None
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._new_plan(_trace(self.module) if self._trace else self.module, self.module)
        return plan

    def _new_plan(self, graph_module: fx.GraphModule, root: nn.Module) -> _Plan:
        plan = _Plan(graph_module, root, self._next_id, self._never_cache)
        self._next_id += plan.size
        for step in plan.steps:
            self._names[step.node_id] = step.name
            step.on_backward = _invalidation_hook(self.cache, step.node_id)
        return plan

    def _fall_back(self, error: _FxTraceError) -> None:
        self._exports = _Exports(self.module, error.__cause__, self._never_cache)
        warnings.warn(f"torch_ext.LazyExecutor: {self._exports.name} could not be fx-traced ({self._exports.fx_error}); "
                      f"running it through torch.export (non-strict) instead", UserWarning, stacklevel=3)

    def _exported_plan(self, args: tuple, kwargs: dict) -> tuple[_Plan, list]:
        """The plan of the program exported for this call's signature (exported now if none
        matches), and the call's flattened arguments."""
        exports = self._exports
        call = exports.bind(args, kwargs, self._all_modules)
        entry = exports.find(call)
        if entry is None:
            entry, evicted = exports.export(call)
            for old in evicted:
                plan = self._plans.pop(("export", old.serial))
                self.cache.invalidate_nodes(plan.ids)
                for node_id in plan.ids:
                    del self._names[node_id]
            # Parameters resolve on the user's module (through the wrapper) first: reassignments are seen.
            self._plans[("export", entry.serial)] = self._new_plan(entry.graph_module, exports.wrapper)
        return self._plans[("export", entry.serial)], call.flat

    # ---- running ----
    def _status(self, step: _Step, seen: int) -> int:
        """A source's status from what NodeCache.observe saw: STABLE when equal to the last call's, FRESH when
        changed, VARYING once new (none of the entries_per_node recent) more calls in a row than a node holds."""
        if seen == _SAME:
            step.streak = 0
            return STABLE
        step.streak = 0 if seen == _RECURRING else step.streak + 1
        return VARYING if step.streak > self._recent else FRESH

    def forward(self, *args, **kwargs):
        with self._lock:
            if self._exports is None:
                try:  # a retrace, for another training mode, can fail too
                    plan = self._plan()
                    values = plan.bind(args, kwargs, self._signature, type(self.module).__name__)
                except _FxTraceError as error:
                    self._fall_back(error)
            if self._exports is not None:
                plan, values = self._exported_plan(args, kwargs)
            return self._run(plan, values)

    def _run(self, plan: _Plan, placeholder_values: list):
        """One call, in four passes: 1. the sources' values and statuses; 2. the analysis of that
        pattern; 3. demand, from the output back, with every frontier lookup (a replay of the last
        call's when its lookups come out the same); 4. the program: what must run, in graph order."""
        env: list = [None] * plan.size
        status = [STABLE] * plan.size
        grad_enabled = torch.is_grad_enabled()
        varying, fresh, new = self._read_sources(plan, env, status, placeholder_values)
        analysis = self._analysis_for(plan, varying, fresh)
        keys: dict = {}  # frontier index -> (key, number of sources, number of graph inputs), for the misses
        looked_up: dict = {}  # frontier index -> what its lookup found
        with_training = not self._trace
        demand = self._replay_demand(plan, analysis, env, new, with_training, keys, looked_up)
        if demand is None:
            demand = self._walk_demand(plan, analysis, env, new, varying, with_training, keys, looked_up)
        program, n_run = demand
        computed, reused = self._execute(plan, analysis, program, env, status, keys, varying, grad_enabled)
        result = plan.output_build(env)
        self._values.record_call(computed, analysis.n_live - n_run + reused)  # not run: served, or in a served subgraph
        if plan.pytree_io:
            return plan.codegen.process_outputs(result)
        return result

    def _read_sources(self, plan: _Plan, env: list, status: list, placeholder_values: list) -> tuple[int, int, int]:
        """Sources (inputs, attributes, shapes of those): fills their env and status slots; returns the bits
        of the varying sources, the fresh (changed this call), and the new among those (no entry holds them)."""
        mask = plan.mask
        next_placeholder = iter(placeholder_values)
        varying = fresh = new = 0
        for step in plan.sources:
            i = step.index
            if step.op == "placeholder":
                value = next(next_placeholder)
            elif step.op == "get_attr":
                value = getattr(step.parent, step.attr)
            else:
                value = self._call(step, env, None)
            env[i] = value
            # A graph input may count as unchanged by content (the NodeCache's rule, against the weights).
            st = status[i] = self._status(step, seen := self._values.observe(
                step.node_id, [value], self._weight_bytes if step.op == "placeholder" else 0))
            if st == VARYING:
                varying |= mask[i]
            elif st == FRESH:
                fresh |= mask[i]
                if seen == _NEW:
                    new |= mask[i]
        return varying, fresh, new

    def _analysis_for(self, plan: _Plan, varying: int, fresh: int) -> _Analysis:
        """The analysis of this pattern of varying and fresh sources (and, for graphs not traced
        here, of the modules' training flags), made on its first use."""
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
                self.cache.invalidate_nodes(stale)
        return analysis

    def _replay_demand(self, plan: _Plan, analysis: _Analysis, env: list, new: int, with_training: bool,
                       keys: dict, looked_up: dict) -> Optional[tuple[list, int]]:
        """The last call's (program, steps in it) when this call's lookups, done in that call's
        order, come out as that call's did: they demand the same steps. None when one differs (the
        lookups done so far are in looked_up, the misses' keys in keys)."""
        memo = analysis.demand
        if memo is None or memo[0] != plan.epoch:
            return None
        for step, hit in memo[1]:
            value = looked_up[step.index] = self._look_up(plan, analysis, step, env, new, with_training, keys)
            if (value is not _MISS) != hit:
                return None
        return memo[2], memo[3]

    def _walk_demand(self, plan: _Plan, analysis: _Analysis, env: list, new: int, varying: int,
                     with_training: bool, keys: dict, looked_up: dict) -> tuple[list, int]:
        """Demand, from the output back: a frontier node found in the cache needs nothing of its
        closure; one that must be computed needs its inputs. Keys are closure sources and module
        state, all known now, so every lookup happens before anything runs (a failed replay's
        lookups are reused; the misses' keys go to keys). Returns the program (the steps to run in
        graph order, stretches that just run compiled into _Segments) and how many steps it runs,
        and remembers them and the lookups for the next call's replay."""
        frontier = analysis.frontier
        needed = analysis.roots[:]
        run = []  # the steps to run, last first
        lookups = []
        for step in reversed(plan.compute_steps):
            i = step.index
            if not needed[i]:
                continue
            if frontier[i] and step.has_tensor:
                value = looked_up[i] if i in looked_up else self._look_up(
                    plan, analysis, step, env, new, with_training, keys)
                lookups.append((step, value is not _MISS))
                if value is not _MISS:
                    continue
            run.append(step)
            for j in step.inputs:
                needed[j] = 1
        program, n_run = analysis.program(plan, run, varying), len(run)
        analysis.demand = (plan.epoch, lookups, program, n_run)
        return program, n_run

    def _execute(self, plan: _Plan, analysis: _Analysis, program: list, env: list, status: list, keys: dict,
                 varying: int, grad_enabled: bool) -> tuple[int, int]:
        """Run what is needed, in graph order. The others were served by the cache or lie inside
        a subgraph that was (values whose last use is skipped live until the call returns).
        Returns (nodes computed, nodes served by a per-node lookup)."""
        perf_counter = time.perf_counter
        mask = plan.mask
        computed = reused = 0
        costs = [0.0] * plan.size
        for step in program:
            kind = step.__class__
            if kind is _Segment:  # steps depending on a varying source: just run them
                step.run(env, status)
                computed += step.count
                continue
            if kind is _KeyedStretch:  # downstream of a random or side-effect node
                done, found = self._run_keyed(plan, step.steps, env, status, grad_enabled)
                computed += done
                reused += found
                continue
            # In a reusable subgraph: a frontier miss is stored under its closure key.
            i = step.index
            module = step.parent._modules[step.attr] if step.op == "call_module" else None
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
                st = self._store_frontier(plan, step, entry, value, cost, st, grad_enabled)
            env[i] = value
            status[i] = st
            for j in step.release:
                env[j] = None
        return computed, reused

    def _store_frontier(self, plan: _Plan, step: _Step, entry: tuple, value: Any, cost: float, st: int,
                        grad_enabled: bool) -> int:
        """Store a computed frontier node under its closure key, entry = (key, number of sources, number
        of graph inputs among them); returns its status, VARYING where its module state changes at
        every call (training)."""
        key, n_sources, n_inputs, on_disk = entry
        module_state = key[n_sources:]
        if module_state and self._status(step, self._values.observe(step.node_id, module_state, 0)) == VARYING:
            st = VARYING  # parameters that change at every call (training)
        if self._store(plan, step, key, value, cost, st == VARYING, grad_enabled, n_inputs) and on_disk and step.cached:
            self.store.put(*on_disk, value)
        return st

    def _run_keyed(self, plan: _Plan, steps: list, env: list, status: list, grad_enabled: bool) -> tuple[int, int]:
        """A stretch of steps outside the reusable subgraphs (downstream of a random or side-effect
        node), each looked up on its own inputs and module state, or run. Sets their env and
        status slots; returns (nodes computed, nodes served by a lookup)."""
        values = self._values
        perf_counter = time.perf_counter
        computed = reused = 0
        for step in steps:
            i = step.index
            st = STABLE
            for j in step.inputs:
                if status[j] > st:
                    st = status[j]
            kind = step.kind
            module = key_extra = None
            if step.op == "call_module":
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
                    self.cache.invalidate_node(step.node_id)
                    step.cached = False
                value = self._call(step, env, module)
                computed += 1
                if kind == "random":
                    st = VARYING
                elif kind == "side_effect" and st == STABLE:
                    st = FRESH
                elif kind == "pure" and not step.has_tensor:
                    st = step.value_status(value, st)
                    if _tensors_of(value):
                        step.has_tensor = True  # learned wrong once: look it up from now on
                        plan.epoch += 1
            else:
                key = [env[j] for j in step.inputs]
                if key_extra is not None:
                    key.extend(key_extra)
                value = values.get(step.node_id, key, _MISS) if st == STABLE else _MISS
                if value is not _MISS:
                    reused += 1
                    step.streak = 0  # the module's state is in the key: unchanged
                else:
                    if key_extra is not None:
                        source = self._status(step, self._values.observe(step.node_id, key_extra, 0))
                        if source > st:
                            st = source
                    start = perf_counter()
                    value = self._call(step, env, module)
                    cost = perf_counter() - start
                    computed += 1
                    if not self._store(plan, step, key, value, cost, st == VARYING, grad_enabled):
                        st = step.value_status(value, max(st, FRESH))
                    elif st != VARYING:  # VARYING: its parameters change at every call (training)
                        st = FRESH
            env[i] = value
            status[i] = st
            for j in step.release:
                env[j] = None
        return computed, reused

    def _store(self, plan: _Plan, step: _Step, key: list, value: Any, cost: float, varies: bool,
               grad_enabled: bool, content_inputs: int = 0) -> bool:
        """Put a computed value in the cache under key (its first content_inputs items graph inputs,
        which the NodeCache may key by content), or, where its key varies, drop the entry it held.
        False when the value holds no tensor: the step is not looked up from now on."""
        tensors = _tensors_of(value)
        if not tensors:
            step.has_tensor = False
            plan.epoch += 1
            return False
        if varies:
            if step.cached:
                self.cache.invalidate_node(step.node_id)
                step.cached = False
        else:
            step.cached = self._values.put(step.node_id, key, value, cost, content_inputs)
            if step.cached and grad_enabled:
                for tensor in tensors:
                    if tensor.grad_fn is not None:
                        tensor.grad_fn.register_hook(step.on_backward)
        return True

    def _look_up(self, plan: _Plan, analysis: _Analysis, step: _Step, env: list, new: int, with_training: bool,
                 keys: dict) -> Any:
        """A frontier node's cached value (also put in env), or _MISS with its key put in keys."""
        i = step.index
        sources, pairs, modules, _, n_inputs = analysis.closure(plan, i, with_training)
        key = [env[j] for j in sources]
        if pairs:
            key.extend([d[k] for d, k in pairs])
        if modules:
            key.extend([parent._modules[attr].training for parent, attr in modules])
        if not plan.mask[i] & new:  # a source with a value no entry can hold: not worth a lookup
            value = self._values.get(step.node_id, key, _MISS)
            if value is not _MISS:
                env[i] = value
                step.streak = 0  # its module state is in the key: unchanged
                return value
        # Not in memory: on disk (if keyable there: no grad, hashable inputs, the module's weights)?
        on_disk = self.store and self.store.key(self.module, plan.graph_module, step.name, key, n_inputs, self.cache)
        if on_disk and (value := self.store.get(*on_disk)) is not None:
            self._values.put(step.node_id, key, value, 0.0, n_inputs)
            env[i] = value
            return value
        keys[i] = (key, len(sources), n_inputs, on_disk)
        return _MISS

    @staticmethod
    def _call(step: _Step, env: list, module: Optional[nn.Module]) -> Any:
        args, kwargs = step.build(env)
        if module is not None:
            return module(*args, **kwargs)
        if step.op == "call_method":
            return getattr(args[0], step.target)(*args[1:], **kwargs)
        return step.target(*args, **kwargs)

    # ---- inspection and control ----
    def stats(self) -> torch.ScriptObject:
        """The NodeCache's CacheStats (see docs/cache.md): its counters and this executor's (calls,
        nodes_computed, nodes_reused, hit_rate; counted when a call ends). hits + misses counts
        lookups: one per frontier node of a reused subgraph. The store's: store.stats()."""
        return self.cache.stats()

    def reset_stats(self) -> None:
        self.cache.reset_stats()

    def invalidate(self) -> None:
        """Drop every cached output: the next call recomputes every node."""
        self.cache.invalidate()

    def invalidate_node(self, name: str) -> None:
        """Drop the cached output of the node called name (in every traced plan), and of every
        node whose reused subgraph contains it: the next call recomputes the node and what depends
        on it. Interior nodes of a reused subgraph hold no entry of their own (only its frontier
        nodes do), so invalidating one drops the frontier entries that cover it."""
        ids = [node_id for plan in list(self._plans.values()) for node_id in plan.ids_covering(name)]
        if not ids:
            known = sorted(set(self._names.values()))
            raise ValueError(f"LazyExecutor: no node named {name!r}; nodes are {known[:20]}"
                             f"{' ...' if len(known) > 20 else ''}")
        self.cache.invalidate_nodes(ids)

    def cached_nodes(self) -> list[str]:
        """Names of the nodes whose outputs are cached now, in graph order."""
        return [self._names[node_id] for node_id in self.cache.cached_node_ids()]

    def memory_estimate(self) -> int:
        """Bytes the cacheable nodes' outputs took when last stored (an upper bound on what caching
        all of them holds: storages shared between nodes count per node)."""
        return self.cache.memory_estimate(list(self._names))

    @property
    def capacity_bytes(self) -> Optional[int]:
        return self.cache.capacity_bytes

    @capacity_bytes.setter
    def capacity_bytes(self, value: Optional[int]) -> None:
        self.cache.set_capacity_bytes(value)

    @property
    def graph_module(self) -> fx.GraphModule:
        """The graph run for the module's current training mode (run through torch.export: the
        graph of the last call)."""
        with self._lock:
            if self._exports is None:
                return self._plan().graph_module
            if not self._exports.entries:
                raise RuntimeError(f"LazyExecutor: {self._exports.name} is run through torch.export, which "
                                   f"needs a call's arguments: call the executor before asking for its graph")
            return self._plans[("export", self._exports.entries[-1].serial)].graph_module

    @property
    def exported_programs(self) -> list:
        """The torch.export programs held for a module torch.fx could not trace, least recently
        used first (empty for traced modules and given graphs)."""
        with self._lock:
            return [] if self._exports is None else [entry.program for entry in self._exports.entries]

