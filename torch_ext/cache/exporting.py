"""The torch.export fallback of the lazy executor, for modules torch.fx cannot trace.

The module is exported (non-strict torch.export, every tensor dimension Dim.AUTO) with the
arguments of a call, and the exported graph runs through the same plans as a traced one. An
exported program is specialised to what it was exported with: the arguments' pytree structure,
their non-tensor values (constants of the graph), the tensors' dtype, device, layout and number
of dimensions, the dimensions export had to specialise (sizes 0 and 1, sizes the code branched
on) and the ranges of the others, the modules' training flags, grad mode, inference mode and
autocast. A call is run by the program whose signature and guards it matches; one that matches
none exports again. At most _LIMIT programs are held per executor, the least recently used
dropped first; the first time one is dropped, a warning says what the call changed.

Outputs: what torch.utils._pytree flattens (tuples, lists, dicts, Hugging Face ModelOutputs)
comes back as the module returns it. An object it cannot flatten (a Hugging Face DynamicCache)
is rebuilt at every call from a copy of the one the export saw, its tensors replaced by this
call's.
"""
from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.export.dynamic_shapes import _tree_map_with_path

from .classification import _is_plain

_LIMIT = 8


def _tensors_in(value: Any, where: str, found: list, seen: set) -> None:
    """The tensors (and symbolic sizes, while exporting) reachable from value through lists,
    tuples, sets, dicts and object attributes."""
    if isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        found.append(value)
        return
    if id(value) in seen or _is_plain(value) or isinstance(value, type):
        return
    seen.add(id(value))
    if isinstance(value, nn.Module):
        raise TypeError(f"LazyExecutor: {where} is a module ({type(value).__name__}), which an exported "
                        f"program cannot pass in or out")
    if isinstance(value, (list, tuple, set, frozenset)):
        for i, item in enumerate(value):
            _tensors_in(item, f"{where}[{i}]", found, seen)
    elif isinstance(value, dict):
        for key, item in value.items():
            _tensors_in(item, f"{where}[{key!r}]", found, seen)
    elif hasattr(value, "__dict__"):
        for key, item in vars(value).items():
            _tensors_in(item, f"{where}.{key}", found, seen)


def _holds_tensors(value: Any, where: str) -> bool:
    found: list = []
    _tensors_in(value, where, found, set())
    return bool(found)


class _Slot:
    __slots__ = ()


class _Opaque:
    """An output object that torch.utils._pytree cannot flatten, as a pytree node: its tensors are
    the children, a copy of it with a _Slot for each the context. Made while exporting: a symbolic
    size it holds becomes the number it is for these arguments, which adds a guard (the dimension
    is specialised) rather than a symbol the copy could not hold."""

    __slots__ = ("tensors", "context")

    def __init__(self, value: Any, where: str) -> None:
        found: list = []
        _tensors_in(value, where, found, set())
        memo, self.tensors, slots = {}, [], []
        for item in found:
            if isinstance(item, torch.Tensor):
                slots.append(memo.setdefault(id(item), _Slot()))
                self.tensors.append(item)
            else:
                memo[id(item)] = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(item)](item)
        self.context = (copy.deepcopy(value, memo), slots)


def _flatten_opaque(opaque: _Opaque) -> tuple[list, tuple]:
    return opaque.tensors, opaque.context


def _unflatten_opaque(values, context: tuple) -> Any:
    template, slots = context
    return copy.deepcopy(template, {id(s): v for s, v in zip(slots, values)})


pytree.register_pytree_node(_Opaque, _flatten_opaque, _unflatten_opaque)


class _Flattening(nn.Module):
    """The user's module (as .module), called with (args, kwargs); the objects in its output that
    pytree cannot flatten are wrapped in _Opaque so that export can return them."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, call_args: tuple, call_kwargs: dict) -> Any:
        out = self.module(*call_args, **call_kwargs)
        leaves, spec = pytree.tree_flatten(out)
        where = f"the output of {type(self.module).__name__}"
        leaves = [leaf if isinstance(leaf, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)) or _is_plain(leaf)
                  else _Opaque(leaf, where) for leaf in leaves]
        return pytree.tree_unflatten(leaves, spec)


class _Call:
    """One call's arguments, bound to the module's signature (defaults filled in), flattened, and
    keyed on what an export is specialised to besides what its guards check."""

    __slots__ = ("args", "kwargs", "flat", "key", "pinned")

    def __init__(self, args: tuple, kwargs: dict, flat: list, key: tuple, pinned: list) -> None:
        self.args, self.kwargs, self.flat, self.key, self.pinned = args, kwargs, flat, key, pinned


class _Export:
    __slots__ = ("key", "pinned", "program", "graph_module", "serial")

    def __init__(self, call: _Call, program: "torch.export.ExportedProgram", serial: int) -> None:
        self.key, self.pinned, self.program, self.serial = call.key, call.pinned, program, serial
        self.graph_module = program.module()


def _check_exported_inputs(graph_module: nn.Module, flat: list) -> Optional[str]:
    """Why flat (a call's flattened arguments) does not satisfy the exported graph's guards
    (number of inputs, specialised sizes, size ranges and relations, constants), or None."""
    placeholders = graph_module.graph.find_nodes(op="placeholder")
    if len(flat) != len(placeholders):
        return f"{len(flat)} inputs where the exported graph takes {len(placeholders)}"
    try:
        guards = getattr(graph_module, "_guards_fn", None)
        if guards is not None:
            guards(*flat)
        else:
            from torch._export.utils import _check_input_constraints_for_graph
            _check_input_constraints_for_graph(placeholders, [((), v) for v in flat],
                                               getattr(graph_module, "range_constraints", {}))
    except Exception as error:  # AssertionError from the guards; anything else is no match either
        return (str(error).strip().splitlines() or [type(error).__name__])[0]
    return None


def _mode_state(modules: list) -> tuple:
    """What tracing reads besides the arguments: training flags, grad, inference and autocast modes."""
    return (tuple(m.training for m in modules), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")))


class _Exports:
    """The programs exported from one module, looked up per call. Not thread-safe: the executor
    calls it under its lock."""

    def __init__(self, module: nn.Module, fx_error: BaseException, never_cache: set) -> None:
        self.module = module
        self.name = type(module).__name__
        functions = [f for f in never_cache if callable(f) and not isinstance(
            f, (type, torch._ops.OpOverload, torch._ops.OpOverloadPacket))]
        if functions:
            raise TypeError(f"LazyExecutor: torch.fx could not trace {self.name}, and the torch.export graph that "
                            f"replaces its trace calls torch operators, not never_cache's "
                            f"{', '.join(getattr(f, '__name__', repr(f)) for f in functions)}: name the module "
                            f"classes that call them, or operators (torch.ops.aten.*), instead")
        self.fx_error = str(fx_error).strip().splitlines()[0] if str(fx_error).strip() else type(fx_error).__name__
        self.wrapper = _Flattening(module)
        self.entries: list[_Export] = []  # least recently used first
        self._serial = 0
        self._warned = False
        try:
            self._signature = inspect.signature(module.forward)
        except (TypeError, ValueError):
            self._signature = None
        self._positional = [] if self._signature is None else [
            p.name for p in self._signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def bind(self, args: tuple, kwargs: dict, modules: list) -> _Call:
        if self._signature is not None:
            try:
                bound = self._signature.bind(*args, **kwargs)
            except TypeError as error:
                raise TypeError(f"LazyExecutor({self.name}): {error}") from None
            bound.apply_defaults()
            args, kwargs = bound.args, bound.kwargs
        leaves, spec = pytree.tree_flatten((args, kwargs))
        described, pinned = [], []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                described.append(("tensor", type(leaf), leaf.dtype, leaf.device, leaf.layout, leaf.dim()))
            elif _is_plain(leaf):
                described.append(("value", type(leaf), leaf))
            elif _holds_tensors(leaf, f"argument {i} of {self.name}"):
                raise TypeError(
                    f"LazyExecutor: {self.name} is run through torch.export, and one of its arguments is a "
                    f"{type(leaf).__name__} holding tensors that torch.utils._pytree cannot flatten: register "
                    f"{type(leaf).__name__} as a pytree node, or pass a torch.fx.GraphModule")
            else:
                described.append(("object", type(leaf), id(leaf)))  # a constant of the export: the same object
                pinned.append(leaf)
        return _Call(args, kwargs, leaves, (_mode_state(modules), spec, described), pinned)

    def find(self, call: _Call) -> Optional[_Export]:
        for i in range(len(self.entries) - 1, -1, -1):
            entry = self.entries[i]
            if entry.key == call.key and _check_exported_inputs(entry.graph_module, call.flat) is None:
                self.entries.append(self.entries.pop(i))
                return entry
        return None

    def export(self, call: _Call) -> tuple[_Export, list[_Export]]:
        """A new program for call's signature, and the ones dropped to make room for it."""
        program = self._export(call)
        self._serial += 1
        entry = _Export(call, program, self._serial)
        problem = _check_exported_inputs(entry.graph_module, call.flat)
        if problem is not None:
            raise RuntimeError(f"LazyExecutor: the program exported from {self.name} rejects the arguments it "
                               f"was exported with: {problem}")
        if len(self.entries) >= _LIMIT and not self._warned:
            self._warned = True
            warnings.warn(f"torch_ext.LazyExecutor: {self.name} has been exported for more than {_LIMIT} call "
                          f"signatures; this call differs from the last in {self._difference(call, self.entries[-1])}. "
                          f"Each new signature exports again, which takes seconds: pass values that change between "
                          f"calls as tensors", UserWarning, stacklevel=6)
        self.entries.append(entry)
        evicted = self.entries[:-_LIMIT]
        del self.entries[:-_LIMIT]
        return entry, evicted

    def _difference(self, call: _Call, last: _Export) -> str:
        """What call changed from what last was exported with, in words."""
        (state, spec, described), (last_state, last_spec, last_described) = call.key, last.key
        if state != last_state:
            names = ("the modules' training flags", "grad mode", "inference mode", "autocast")
            return ", ".join(name for name, a, b in zip(names, state, last_state) if a != b)
        if spec != last_spec:
            return "the structure of its arguments (which are given, their containers, keys and lengths)"
        paths = [path for path, _ in pytree.tree_flatten_with_path((call.args, call.kwargs))[0]]
        for path, now, before in zip(paths, described, last_described):
            if now != before:
                where = self._argument_name(path)
                if now[:2] != before[:2]:
                    return f"the type of {where} ({before[1].__name__}, now {now[1].__name__})"
                if now[0] == "tensor":
                    return f"the dtype, device, layout or number of dimensions of {where}"
                if now[0] == "value":
                    return f"the value of {where} ({before[2]!r}, now {now[2]!r})"
                return f"the object passed as {where}"
        problem = _check_exported_inputs(last.graph_module, call.flat)
        return f"sizes its export does not cover ({problem})"

    def _argument_name(self, path: tuple) -> str:
        position = path[1].idx if path[0].idx == 0 else None
        if position is None:
            name = path[1].key
        elif position < len(self._positional):
            name = self._positional[position]
        else:
            name = f"positional argument {position}"
        return name + pytree.keystr(path[2:])

    def _export(self, call: _Call) -> "torch.export.ExportedProgram":
        # Sizes 0 and 1 would be specialised anyway (and logged as such): only the others are Dim.AUTO.
        # torch.export's own mapping: a registered pytree class (a Hugging Face cache) takes its
        # children's shapes as a list, since it cannot hold them itself.
        dynamic = _tree_map_with_path(
            lambda _, v: {i: torch.export.Dim.AUTO for i, n in enumerate(v.shape) if n > 1}
            if isinstance(v, torch.Tensor) else None, (call.args, call.kwargs))
        try:
            return torch.export.export(self.wrapper, (call.args, call.kwargs), dynamic_shapes=dynamic, strict=False)
        except Exception as error:
            lines = str(error).strip().splitlines()
            raise RuntimeError(
                f"LazyExecutor: torch.fx could not trace {self.name} ({self.fx_error}) and torch.export "
                f"(non-strict) could not export it with these arguments ({lines[0] if lines else type(error).__name__}); "
                f"pass a torch.fx.GraphModule or a torch.export.ExportedProgram instead") from error
