"""What a PlanCache of an exported program needs from Python.

The C++ core loads and runs AOTInductor packages; Python knows the program. From a
torch.export.ExportedProgram this module reads the layout the core needs (which input and
output dimensions are dynamic, in which ranges), a fingerprint of the program, the example
inputs builds start from, and provides the compiler (torch._inductor, in this process for
builds a request waits for, in a separate one for background builds) and the source that runs
a request no plan serves.
"""
from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.utils._pytree as pytree

from . import _compile

# The options an exported program determines: passing them too would say the layout twice.
DERIVED_OPTIONS = ("batch_dims", "output_batch_dims", "dims", "output_dims", "size_ranges")


def _symbol(size: Any) -> Optional[str]:
    """The symbol of a dynamic size (None for a static one); derived sizes (2*s0) are refused."""
    if isinstance(size, int):
        return None
    expr = size.node.expr
    if not expr.is_Symbol:
        raise ValueError(f"PlanCache: a dimension of size {expr} depends on other dynamic sizes; the cache pads and "
                         "slices each dynamic dimension on its own, so sizes must be plain Dims")
    return str(expr)


@dataclass
class ProgramLayout:
    """The program's dynamic dimensions, batch first, and where they are in inputs and outputs."""

    symbols: list            # the dynamic dimensions' symbols, batch first
    input_dims: list         # per flat input: {tensor dim: dynamic dimension}
    output_dims: list        # per flat output: {tensor dim: dynamic dimension}
    ranges: list             # per dynamic dimension: [min, max] (max 0: no limit)

    def options(self) -> dict:
        """The layout as PlanCacheOptions keywords."""
        def per_position(maps: list, k: int) -> list:
            return [next((d for d, kk in m.items() if kk == k), -1) for m in maps]

        rank = len(self.symbols)
        return dict(batch_dims=per_position(self.input_dims, 0), output_batch_dims=per_position(self.output_dims, 0),
                    dims=[per_position(self.input_dims, k) for k in range(1, rank)],
                    output_dims=[per_position(self.output_dims, k) for k in range(1, rank)],
                    size_ranges=self.ranges)


def program_layout(program: torch.export.ExportedProgram) -> ProgramLayout:
    """Reads the dynamic dimensions from the program's placeholders and outputs: the batch is the
    dynamic dimension of the first input that has one (its first dynamic tensor dimension), the
    others follow in order of first appearance."""
    user_inputs = set(program.graph_signature.user_inputs)
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in user_inputs]
    output_node = next(n for n in program.graph.nodes if n.op == "output")
    user_outputs = output_node.args[0][-len(program.graph_signature.user_outputs):]
    symbols: list = []

    def dims_of(values: Sequence, what: str) -> list:
        out = []
        for i, value in enumerate(values):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"PlanCache: {what} {i} of the exported program is a {type(value).__name__}; "
                                "a plan takes and returns tensors")
            found = {}
            for d, size in enumerate(value.shape):
                symbol = _symbol(size)
                if symbol is None:
                    continue
                if symbol not in symbols:
                    if what == "output":
                        raise ValueError(f"PlanCache: output {i}'s dimension {d} has a size ({symbol}) no input has")
                    symbols.append(symbol)
                found[d] = symbols.index(symbol)
            out.append(found)
        return out

    inputs = dims_of([n.meta["val"] for n in placeholders], "input")
    if not symbols:
        raise ValueError("PlanCache: the exported program has no dynamic dimension; export it with dynamic_shapes "
                         "(torch.export.Dim) for the batch and any other dimension the cache should bucket")
    outputs = dims_of([n.meta["val"] for n in user_outputs], "output")
    for j, found in enumerate(outputs):
        if 0 not in found.values():
            raise ValueError(f"PlanCache: output {j} of the exported program has no batch dimension "
                             f"({symbols[0]}); the cache slices and joins outputs along it")
    ranges = []
    by_name = {str(s): r for s, r in program.range_constraints.items()}
    for symbol in symbols:
        r = by_name.get(symbol)
        lower = max(1, int(r.lower)) if r is not None else 1
        # torch.export's unbounded max is int_oo, which sympy calls finite: ask float.
        upper = int(r.upper) if r is not None and math.isfinite(float(r.upper)) else 0
        ranges.append([lower, upper])
    return ProgramLayout(symbols, inputs, outputs, ranges)


def fingerprint(program: torch.export.ExportedProgram) -> str:
    """SHA-256 of what the program computes: its graph's code, call structure and every tensor it holds."""
    h = hashlib.sha256()
    h.update(program.graph_module.code.encode())
    h.update(str(program.call_spec.in_spec).encode())
    h.update(str(program.call_spec.out_spec).encode())
    tensors = dict(program.state_dict)
    tensors.update({f"constant:{k}": v for k, v in program.constants.items() if isinstance(v, torch.Tensor)})
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def example_inputs(program: torch.export.ExportedProgram, layout: ProgramLayout) -> list:
    """Inputs at each dynamic dimension's smallest size (other sizes as the program has them), all
    ones: valid token ids, attention masks that attend, finite floats."""
    user_inputs = set(program.graph_signature.user_inputs)
    values = [n.meta["val"] for n in program.graph.nodes if n.op == "placeholder" and n.name in user_inputs]
    out = []
    for value, dims in zip(values, layout.input_dims):
        shape = [layout.ranges[dims[d]][0] if d in dims else int(size) for d, size in enumerate(value.shape)]
        out.append(torch.ones(shape, dtype=value.dtype, device=value.device))
    return out


class Program:
    """An exported program, loaded from its file on first use (a saved cache serves with no need
    for it: its packages' call specs give the inputs' and outputs' structure). Thread-safe."""

    def __init__(self, path: str, exported: Optional[Exported] = None) -> None:
        # Holding `exported` keeps the folder its file is in for as long as this cache's builds may read it.
        self.path, self._exported = path, exported
        self._program = exported.program if exported is not None else None
        self._unlifted: Optional[torch.nn.Module] = None  # program.module(), made where no module was given
        self._layout: Optional[ProgramLayout] = None
        self._lock = threading.Lock()

    def get(self) -> torch.export.ExportedProgram:
        with self._lock:
            if self._program is None:
                self._program = torch.export.load(self.path)
            return self._program

    def layout(self) -> ProgramLayout:
        program = self.get()
        with self._lock:
            if self._layout is None:
                self._layout = program_layout(program)
            return self._layout

    def eager_given(self) -> Optional[torch.nn.Module]:
        """The nn.Module the program was exported from here, if it was."""
        return self._exported.module if self._exported is not None else None

    def module(self) -> torch.nn.Module:
        """The eager module given, else the program's."""
        given = self.eager_given()
        if given is not None:
            return given
        program = self.get()
        with self._lock:
            if self._unlifted is None:
                self._unlifted = program.module()
            return self._unlifted


def scripted_module(module: Optional[torch.nn.Module], example: Optional[list], positional: bool, outputs: int, *,
                    required: bool) -> Optional[torch.jit.ScriptModule]:
    """The module the program was exported from, scripted, where its frozen TorchScript can be a plan:
    it scripts, is in eval mode, takes the program's inputs as positional tensors and returns a tensor
    or a tuple of `outputs` tensors (checked on the example). None where not; required: raise why."""
    def refuse(why: str) -> None:
        if required:
            raise ValueError(f"PlanCache: plan_shapes='script' needs {why}")
        return None

    if module is None or example is None:
        return refuse("the nn.Module the program is exported from (pass it with example_inputs)")
    if module.training:
        return refuse(f"the module ({type(module).__name__}) in eval mode; call .eval() on it first")
    if not positional:
        return refuse("a program whose inputs are positional tensors; this one takes keywords or nested inputs")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript's deprecation, once per script
            scripted = torch.jit.script(module)
        with torch.no_grad():
            out = scripted(*example)
    except Exception as error:  # whatever TorchScript cannot compile or run: no script plans
        return refuse(f"a module torch.jit.script takes ({type(module).__name__}: {type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''})")
    flat = (out,) if isinstance(out, torch.Tensor) else out
    if not isinstance(flat, tuple) or len(flat) != outputs or not all(isinstance(t, torch.Tensor) for t in flat):
        return refuse(f"a scripted module that returns the program's {outputs} output tensor(s) as a tensor or a tuple; "
                      f"{type(module).__name__} returns {type(out).__name__}")
    return scripted


class Compiler:
    """The compiler a cache calls for each package: in this process for builds a request waits for,
    in a separate process for background builds. Holds nothing of the cache (no reference cycle)."""

    def __init__(self, program: Program, inductor_configs: Optional[dict]) -> None:
        self.program, self.inductor_configs = program, dict(inductor_configs or {})

    def __call__(self, upper, lower, dynamic, example, package_path, background, cancelled) -> None:
        dim_of = self.program.layout().input_dims
        if background:
            _compile.compile_in_subprocess(self.program.path, dim_of, upper, lower, dynamic, example, package_path,
                                           self.inductor_configs, torch.get_num_threads(), cancelled)
        else:
            _compile.compile_bucket(self.program.get(), dim_of, upper, lower, dynamic, example, package_path,
                                    self.inductor_configs)


class Source:
    """Runs a request no plan serves on the eager module (or the program's), flat in and flat out."""

    def __init__(self, program: Program, in_spec: pytree.TreeSpec) -> None:
        self.program, self.in_spec = program, in_spec

    def __call__(self, *flat: torch.Tensor) -> Any:
        args, kwargs = pytree.tree_unflatten(list(flat), self.in_spec)
        with torch.no_grad():
            outputs = pytree.tree_leaves(self.program.module()(*args, **kwargs))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


class _Folder:
    """A temporary folder, removed when this object goes by the process that made it only: a forked
    child that exits normally runs its copy's finalizer too, and must not remove its parent's files."""

    def __init__(self, prefix: str) -> None:
        self.name = tempfile.mkdtemp(prefix=prefix)
        weakref.finalize(self, _remove_in, os.getpid(), self.name)


def _remove_in(pid: int, path: str) -> None:
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


class Exported:
    """A program to make caches of, with what it was made from: the nn.Module and the flat example
    inputs when exported here. Its file (written once, into a folder removed with this object) and
    its fingerprint are made once and shared by every cache made of it, as PlanCache.from_traffic
    and replan make several of one module (probes, then the cache). Thread-safe."""

    def __init__(self, source: Any, program: torch.export.ExportedProgram, module: Optional[torch.nn.Module] = None,
                 example: Optional[list] = None, path: Optional[str] = None) -> None:
        # source: what it was made from (what a re-plan makes its caches of: an nn.Module is exported afresh)
        self.source, self.program, self.module, self.example = source, program, module, example
        self._path, self._folder, self._fingerprint = path, None, None
        self._lock = threading.Lock()

    def path(self) -> str:
        """The program's file: the one it was loaded from, else one written here once."""
        with self._lock:
            if self._path is None:
                self._folder = _Folder("torch_ext_program_")
                path = os.path.join(self._folder.name, "program.pt2")
                torch.export.save(self.program, path)
                self._path = path
            return self._path

    def fingerprint(self) -> str:
        with self._lock:
            if self._fingerprint is None:
                self._fingerprint = fingerprint(self.program)
            return self._fingerprint


def export_module(module: torch.nn.Module, example_inputs: Sequence, dynamic_shapes: Any) -> Exported:
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    try:
        program = torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
    except Exception as error:
        hint = ""
        if "in output, which is not a known type" in str(error):
            hint = ("; PlanCache serves outputs that are tensors (or tuples, lists and dicts of them): a Hugging "
                    "Face model called with use_cache=True also returns its key/value cache, so serve a module "
                    "that calls it with use_cache=False")
        raise RuntimeError(f"PlanCache: torch.export could not export {type(module).__name__} with the example "
                           f"inputs and dynamic_shapes given{hint}. torch.export said: {error}") from error
    return Exported(module, program, module, pytree.tree_leaves(args))


def as_exported(source: Any, example_inputs: Optional[Sequence], dynamic_shapes: Any) -> Exported:
    """The program of a .pt2 file, an ExportedProgram, an Exported, or an nn.Module exported here."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        return Exported(source, torch.export.load(path), path=path)
    if isinstance(source, torch.export.ExportedProgram):
        return Exported(source, source)
    if isinstance(source, Exported):
        return source
    if example_inputs is None:
        raise TypeError(f"PlanCache: {type(source).__name__} is not scripted; pass torch.jit.script(module), or "
                        "example_inputs (and dynamic_shapes) to export it")
    return export_module(source, example_inputs, dynamic_shapes)
