"""PlanCache: plans per bucket of input sizes (torch.classes.torch_ext.PlanCache).

Two kinds of plan, one cache:
- a TorchScript module: each plan is the module frozen, optimised for inference and warmed at one
  batch size (a clone specialised to it where TorchScript fuses on the device);
- a torch.export program (an ExportedProgram, a .pt2 file torch.export.save wrote, or an
  nn.Module with example inputs, exported here): each plan is an AOTInductor package for one
  bucket of sizes, compiled static or over a dynamic range (plan_shapes), loaded and run by the C++
  core, which serves a saved cache with no Python and no compile.
A bucket is a box of sizes per dynamic dimension: the batch, and for an exported program each
other dynamic dimension it has (e.g. sequence length), so variable-length requests are bucketed
on a 2-D grid. The cache keeps plans bounded and LRU-evicted, and serves a miss by building the
plan, by padding or splitting onto cached ones, or by the source while the plan builds in the
background. Thread-safe: many threads may call infer() at once; hits take a reader lock only.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
import torch.utils._pytree as pytree

from .. import _C
from .._script import ScriptObjectFace, construct
from . import _planning
from . import export as _export
from . import traffic as _traffic

__all__ = ["PlanCache"]

Source = Union[torch.jit.ScriptModule, torch.export.ExportedProgram, torch.nn.Module, str, os.PathLike]


def _is_saved_folder(source: Any) -> bool:
    """A saved cache's folder: its plans serve, and it holds no program to compile other buckets with."""
    return isinstance(source, (str, os.PathLike)) and os.path.isdir(source)


def _is_export_path(path: str) -> bool:
    return _is_saved_folder(path) or path.endswith(".pt2")


def _is_scripted(module: Any) -> bool:
    """A TorchScript module or the path of a saved one (not an exported program's file or folder)."""
    if isinstance(module, (str, os.PathLike)):
        return not _is_export_path(os.fspath(module))
    return isinstance(module, torch.jit.ScriptModule)


class PlanCache(ScriptObjectFace):
    """Plans per bucket of input sizes of a TorchScript module or a torch.export program.

    module: a torch.jit.ScriptModule in eval mode or the path of a saved one; or, for plans compiled
    by AOTInductor, a torch.export.ExportedProgram, the path of a .pt2 file torch.export.save wrote,
    an nn.Module with example_inputs (and dynamic_shapes, as torch.export.export takes them: a
    torch.export.Dim per dynamic dimension), or the folder a saved export cache is in (loaded with
    no compile). The batch is the first input's first dynamic dimension.
    inductor_configs: passed to torch._inductor.aoti_compile_and_package for each package.
    Keyword options are those of the C++ PlanCacheOptions (torch_ext/plan/plan_cache.h), with its
    defaults and checks (see `torch.classes.torch_ext.PlanCache.__init__.__doc__`); each is also a
    property. For an exported program the layout options (batch_dims, dims, size_ranges, ...)
    come from the program. The object is torch.classes.torch_ext.PlanCache (`script_object`,
    which scripted code takes): select_batch_size(n), cached_sizes(), cached_buckets(), stats()
    (a PlanCacheStats whose `sizes` lists a SizeStats per bucket), reset_stats(), clear(),
    wait_for_builds() and kind() are its own.
    """

    bucket_choice: Optional[_traffic.BucketChoice] = None  # set by from_traffic and replan
    _drift: Optional[_planning.Drift] = None  # set by replan_on_drift

    def __init__(self, module: Source, example_inputs: Optional[Sequence[Any]] = None, dynamic_shapes: Any = None, *,
                 inductor_configs: Optional[dict] = None, **options: Any) -> None:
        self._in_spec = self._out_spec = None
        # An exported program's cache made from an nn.Module that scripts: plans may be its frozen
        # TorchScript module (plan_shapes 'script', and 'auto' weighs them with the compiled kinds).
        self.has_script_module = False
        path = os.fspath(module) if isinstance(module, (str, os.PathLike)) else None
        # What replan() makes a cache of other buckets from.
        self._made_from = None if _is_saved_folder(module) else (
            module.source if isinstance(module, _export.Exported) else module, example_inputs, dynamic_shapes,
            inductor_configs, options)
        if _is_scripted(module):
            if example_inputs is not None or dynamic_shapes is not None or inductor_configs is not None:
                raise TypeError("PlanCache: example_inputs, dynamic_shapes and inductor_configs are for exported "
                                "programs; a TorchScript module's cache takes neither")
            if path is not None and not os.path.isfile(path):
                raise FileNotFoundError(f"PlanCache: no saved scripted module at {path}")
            self.script_object = construct("PlanCache", torch.classes.torch_ext.PlanCache,
                                           path if path is not None else module, **options)
        elif isinstance(module, (torch.export.ExportedProgram, torch.nn.Module, _export.Exported)) or path is not None:
            self._init_export(module, path, example_inputs, dynamic_shapes, inductor_configs, options)
        else:
            raise TypeError(f"PlanCache: expected a torch.jit.ScriptModule, a torch.export.ExportedProgram, an "
                            f"nn.Module with example_inputs, or a path, got {type(module).__name__}")
        # Bound once: looking a method up on a ScriptObject costs about 1 us a call, and calling it
        # through TorchScript's dispatch about 15 us, with the GIL held; infer_tensors is called directly.
        self._infer, self._infer_tensors = self.script_object.infer, _C.plan.cache_infer(self.script_object)

    def _init_export(self, module: Any, path: Optional[str], example_inputs: Optional[Sequence[Any]],
                     dynamic_shapes: Any, inductor_configs: Optional[dict], options: dict) -> None:
        derived = [name for name in _export.DERIVED_OPTIONS if name in options]
        if derived:
            raise TypeError(f"PlanCache: {', '.join(derived)} come from the exported program's dynamic dimensions; "
                            "export it with the torch.export.Dim you want instead")
        folder = path if _is_saved_folder(module) else None
        if folder is not None:
            # A saved cache: its packages serve with no need for the program, loaded only to compile
            # a new bucket or run a request no plan serves.
            program = _export.Program(os.path.join(folder, "program.pt2"))
            if not os.path.isfile(program.path):
                raise FileNotFoundError(f"PlanCache: {folder} holds no program.pt2: not a saved cache of an exported "
                                        "program")
            self.script_object = construct("PlanCache", torch.classes.torch_ext.PlanCache, folder, **options)
            example = None
        else:
            if path is not None and not os.path.isfile(path):
                raise FileNotFoundError(f"PlanCache: no exported program at {path}")
            exported = _export.as_exported(path if path is not None else module, example_inputs, dynamic_shapes)
            program, example = _export.Program(exported.path(), exported), exported.example
            options = {**program.layout().options(), "fingerprint": exported.fingerprint(), **options}
            self.script_object = construct("PlanCache", torch.classes.torch_ext.PlanCache, program.path, **options)
        _C.plan.set_compiler(self.script_object, _export.Compiler(program, inductor_configs))
        specs = self.script_object.call_spec()
        if specs:
            self._in_spec, self._out_spec = (pytree.treespec_loads(spec) for spec in specs)
        else:
            self._in_spec, self._out_spec = program.get().call_spec.in_spec, program.get().call_spec.out_spec
        _C.plan.set_source(self.script_object, _export.Source(program, self._in_spec))
        self._program, self._example = program, example
        self._positional = self._in_spec == pytree.tree_flatten((tuple([0] * self._in_spec.num_leaves), {}))[1]
        plan_shapes = options.get("plan_shapes", _option_default("plan_shapes"))
        if folder is None and plan_shapes in ("auto", "script"):
            scripted = self._scripted_module(required=plan_shapes == "script")
            if scripted is not None:
                _C.plan.set_script_module(self.script_object, scripted)
                self.has_script_module = True

    def _scripted_module(self, required: bool) -> Optional[torch.jit.ScriptModule]:
        """The module the program was exported from, scripted, where its frozen TorchScript can be a
        plan, whatever this cache's plan_shapes (None where not; required: raise why)."""
        return _export.scripted_module(self._program.eager_given(), self._example, self._positional,
                                       self._out_spec.num_leaves, required=required)

    def _example_inputs(self) -> list:
        if self._example is None:
            self._example = _export.example_inputs(self._program.get(), self._program.layout())
        return self._example

    def infer(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the model on inputs whose dynamic dimensions have one size each."""
        try:
            if self._in_spec is not None:
                return self._infer_program(inputs, kwargs)
            inputs = self._positional_inputs(inputs, kwargs)
            # Tensors skip TorchScript's dispatch and the type inference of an Any argument (~20 us a call).
            if all(type(value) is torch.Tensor for value in inputs):
                return self._infer_tensors(list(inputs))
            return self._infer(tuple(inputs))
        finally:  # counted once served, so a drift check's window holds the request that made it due
            self._count_request()

    __call__ = infer

    @staticmethod
    def _positional_inputs(inputs: tuple, kwargs: dict) -> tuple:
        """A TorchScript model's inputs, which are passed by position only (never dropped silently)."""
        if kwargs:
            raise TypeError(f"PlanCache: a TorchScript model takes its inputs by position; got keyword(s) "
                            f"{', '.join(sorted(kwargs))}")
        return tuple(inputs)

    def _flat(self, inputs: tuple, kwargs: dict) -> list:
        if self._positional and not kwargs and len(inputs) == self._in_spec.num_leaves:
            return list(inputs)
        flat, spec = pytree.tree_flatten((tuple(inputs), kwargs))
        if spec != self._in_spec:
            raise TypeError(f"PlanCache: the inputs' structure {spec} is not the exported program's {self._in_spec}")
        return flat

    def _structured(self, out: Any) -> Any:
        """A plan's output in the program's output structure (TorchScript: as it is)."""
        if self._out_spec is None:
            return out
        return pytree.tree_unflatten([out] if isinstance(out, torch.Tensor) else list(out), self._out_spec)

    def _infer_program(self, inputs: tuple, kwargs: dict) -> Any:
        return self._structured(self._infer_tensors(self._flat(inputs, kwargs)))

    def infer_batch(self, *inputs: Any, **kwargs: Any) -> Any:
        """Any number of elements: split into calls of select_batch_size(remaining), outputs
        concatenated. The traffic log counts the batch as given (in requests of at most max_batch_size)."""
        try:
            if self._in_spec is None:
                return self.script_object.infer_batch(self._positional_inputs(inputs, kwargs))
            return self._structured(self.script_object.infer_batch(self._flat(inputs, kwargs)))
        finally:
            self._count_request()

    def preload(self, sizes: Iterable[Union[int, Sequence[int]]], example_inputs: Optional[Sequence[Any]] = None,
                progress: bool = True) -> None:
        """Build plans up front. sizes: batch sizes, or buckets (a size per dynamic dimension, batch first).
        example_inputs (any sizes) give the other dimensions; default: an earlier call's inputs (an
        exported program: its example inputs)."""
        sizes = [int(n) if isinstance(n, int) else tuple(int(d) for d in n) for n in sizes]
        if example_inputs is not None:
            example = tuple(self._flat(tuple(example_inputs), {}) if self._in_spec is not None else example_inputs)
        else:
            example = tuple(self._example_inputs()) if self._in_spec is not None else None
        iterator: Iterable = sizes
        if progress:
            from tqdm import tqdm
            iterator = tqdm(sizes, desc="PlanCache.preload", unit="plan", leave=False, disable=None)
        released = example is None or all(type(value) is torch.Tensor for value in example)
        preload = _C.plan.cache_preload(self.script_object)  # builds with the GIL released: others keep serving
        for n in iterator:
            if released:
                preload([n] if isinstance(n, int) else list(n), list(example or ()), not isinstance(n, int))
            elif isinstance(n, int):
                self.script_object.preload([n], example)
            else:
                self.script_object.preload_buckets([list(n)], example)

    def traffic(self) -> dict:
        """The traffic log: {sizes: requests} for each size served (sizes: a tuple, a size per dynamic
        dimension, batch first), as infer() and infer_batch()'s calls brought them (a Batcher's: its batches)."""
        return {tuple(row[:-1]): row[-1] for row in self.script_object.traffic()}

    def observe_traffic(self, traffic: Any) -> None:
        """Adds requests to the traffic log: {sizes: requests}, another PlanCache, or an iterable of
        requests' sizes (torch_ext.plan.traffic.as_traffic)."""
        self.script_object.observe_traffic([[*sizes, count] for sizes, count in _traffic.as_traffic(traffic).items()])

    @classmethod
    def from_traffic(cls, module: Source, traffic: Any, plan_budget: Optional[int] = None,
                     example_inputs: Optional[Sequence[Any]] = None, dynamic_shapes: Any = None, *,
                     compile_seconds: Optional[float] = None, inductor_configs: Optional[dict] = None,
                     progress: bool = True, **options: Any) -> "PlanCache":
        """A cache whose buckets are chosen for `traffic` ({sizes: requests}, a PlanCache whose log has
        it, or requests' sizes): at most plan_budget plans, at the least predicted time over that
        traffic, padding included, by costs measured on this machine (torch_ext.plan.traffic:
        measure_plans, choose_buckets). An exported program's measurement compiles three packages
        besides the plans (one dynamic, two static), and plan_shapes='auto' (the default) compiles
        two a plan; TorchScript compiles nothing. compile_seconds (instead of plan_budget, or with
        it): the plans fit in that many seconds of builds, the measurement's included, each plan
        predicted at the measurement's seconds per build. The cache gets the traffic, so 'auto'
        keeps, per bucket, the plan kind faster at the sizes that bucket serves. Its plans are built
        before it returns; `bucket_choice` says what was chosen and predicted, stats() what each
        bucket measures once it serves."""
        if "buckets" in options:
            raise TypeError("PlanCache.from_traffic chooses the buckets; pass traffic, not buckets")
        budget = _planning.Budget("PlanCache.from_traffic", plan_budget, compile_seconds)
        scripted = _is_scripted(module)
        if scripted and example_inputs is None:
            raise TypeError("PlanCache.from_traffic: a TorchScript module's cache needs example_inputs (any sizes) "
                            "to time the model at the traffic's sizes")

        make = _maker(cls, module, example_inputs if not scripted else None, dynamic_shapes, inductor_configs, options)
        return _planning.planned(make, _traffic.as_traffic(traffic), budget, example_inputs, not scripted, progress)[1]

    def replan(self, plan_budget: Optional[int] = None, traffic: Any = None, *,
               compile_seconds: Optional[float] = None, example_inputs: Optional[Sequence[Any]] = None,
               background: bool = False, progress: bool = False) -> Any:
        """Choose this cache's buckets again, as from_traffic does (within plan_budget plans and/or
        compile_seconds of builds), for `traffic` (default: its own traffic log: what it was
        planned on and every request served since), and serve from plans built for them. The model
        is measured again only where the traffic reaches past the sizes measured before
        (from_traffic's or the last re-plan's costs serve otherwise, so the same traffic gives the
        same choice). The new plans are built beside the current ones, which serve every request
        meanwhile; then one step swaps them in (stats() start afresh, the traffic log carries on
        from the traffic planned on, save() keeps the new buckets). Buckets equal to the current
        ones build nothing. A Batcher made earlier keeps the plans it was made with. Returns the
        BucketChoice (also `bucket_choice`); with background=True, at once, a
        concurrent.futures.Future of it, the work done on this cache's re-plan thread (one re-plan
        at a time, in order). example_inputs: any sizes (default: the cache's example, kept from a
        request it served; an exported program's own)."""
        budget = _planning.Budget("PlanCache.replan", plan_budget, compile_seconds)
        self._check_replannable("PlanCache.replan")
        traffic = _traffic.as_traffic(self if traffic is None else traffic)
        _planning.refuse_traffic_the_cache_cannot_take(self, traffic)
        example_inputs = self._replan_example(traffic, example_inputs)

        def keep(choice: _traffic.BucketChoice, _: _planning.Costs, current: list) -> bool:
            return choice.buckets == current

        if not background:
            return self._replan(budget, traffic, example_inputs, progress, keep)
        return self._on_replan_thread(self._replan, budget, traffic, example_inputs, progress, keep)

    def replan_on_drift(self, plan_budget: Optional[int] = None, *, compile_seconds: Optional[float] = None,
                        every: Optional[int] = 1000, tolerance: float = 0.1,
                        example_inputs: Optional[Sequence[Any]] = None) -> None:
        """Re-plan by itself when the traffic drifts. After every `every` requests served through
        infer() or infer_batch(), the re-plan thread takes the requests served since the last check
        (the window) and predicts, by the measured costs, what the current buckets cost over them
        and what the best choice within the budget would (torch_ext.plan.traffic: predicted_seconds,
        choose_buckets; the model is measured first where the costs do not reach the window's
        sizes). When the current buckets cost more than (1 + tolerance) times the best, or some
        request of the window has no bucket, it re-plans on the window (as replan(traffic=window)
        in the background), and requests keep being served by the current plans until the swap.
        A cache made with no buckets learns them this way at its first check. The checks count
        requests, not time, and never run on a request's thread. drift_stats() says what the
        checks found; every=None stops them. A Batcher's requests count; requests made through
        the script_object (TorchScript, C++) are logged but not counted."""
        if every is None:
            self._drift = None
            return
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"PlanCache.replan_on_drift: every must be a positive number of requests, got {every!r}")
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < float("inf"):
            raise ValueError(f"PlanCache.replan_on_drift: tolerance must be a non-negative fraction, got {tolerance!r}")
        budget = _planning.Budget("PlanCache.replan_on_drift", plan_budget, compile_seconds)
        self._check_replannable("PlanCache.replan_on_drift")
        self._drift = _planning.Drift(budget, every, float(tolerance), example_inputs, self.traffic())

    def drift_stats(self) -> Optional[_planning.DriftStats]:
        """What replan_on_drift's checks found so far (None when it is off)."""
        drift = self._drift
        return None if drift is None else drift.stats()

    def wait_for_replans(self, timeout: Optional[float] = None) -> None:
        """Wait until every re-plan and drift check asked for so far has finished."""
        if self.__dict__.get("_replan_pid") == os.getpid():
            self._replanner.submit(lambda: None).result(timeout)

    def _check_replannable(self, owner: str) -> None:
        if self._made_from is None:
            raise ValueError(f"{owner}: this cache was loaded from a saved folder, which holds no program to build "
                             "other buckets from; make it from the module or program instead")

    def _replan_example(self, traffic: dict, example_inputs: Any) -> Any:
        if example_inputs is not None:
            return example_inputs
        if self._in_spec is None:  # TorchScript: inputs by position, as the cache keeps its example
            return tuple(self.script_object.example_inputs(list(next(iter(traffic)))))
        return self._made_from[1]

    def _on_replan_thread(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """fn(*args) on this cache's re-plan thread (one at a time, in order)."""
        with _replan_lock:
            if self.__dict__.get("_replan_pid") != os.getpid():  # none yet, or the parent's in a forked child
                self._replanner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="PlanCache.replan")
                self._replan_pid = os.getpid()
            return self._replanner.submit(fn, *args)

    def _replan(self, budget: _planning.Budget, traffic: dict, example_inputs: Any, progress: bool,
                keep: Callable[[_traffic.BucketChoice, _planning.Costs, list], bool]) -> _traffic.BucketChoice:
        """Choose for `traffic`; unless keep(choice, costs, the current buckets), build a cache with
        the chosen buckets and swap it in."""
        module, example, dynamic_shapes, inductor_configs, options = self._made_from
        unbucketed = {k: v for k, v in options.items() if k != "buckets"}  # the probes' and the new cache's own
        make = _maker(type(self), module, example, dynamic_shapes, inductor_configs, unbucketed)
        with self.__dict__.setdefault("_replanning", threading.Lock()):
            current = [list(b) for b in self.buckets]  # read here: an earlier re-plan may have swapped
            choice, new, costs = _planning.planned(make, traffic, budget, example_inputs, self._in_spec is not None,
                                                   progress, self.__dict__.get("_costs"),
                                                   lambda choice, costs: keep(choice, costs, current))
            if new is None:
                self.bucket_choice, self._costs = choice, costs
                return choice
            with _swap_lock:
                self.__dict__.update(new.__dict__)  # one step: a request reads the old cache's attributes or the new one's
                for batcher in self.__dict__.get("_batchers", ()):
                    batcher.follow(self.script_object)
            return choice

    def _batcher(self, options: dict) -> Any:
        """A torch.classes.torch_ext.Batcher in front of this cache, whose later batches run on each
        re-plan's new cache."""
        with _swap_lock:
            batcher = construct("Batcher", torch.classes.torch_ext.Batcher, self.script_object, **options)
            self.__dict__.setdefault("_batchers", weakref.WeakSet()).add(batcher)
            return batcher

    def _count_request(self) -> None:
        """One request served toward the next drift check (replan_on_drift; nothing when it is off)."""
        drift = self._drift
        if drift is None:
            return
        drift.countdown -= 1  # a count lost to a race only delays the check by a request
        if drift.countdown <= 0:
            with _replan_lock:
                if drift.countdown > 0:
                    return
                drift.countdown = drift.every
            self._on_replan_thread(self._check_drift, drift)

    def _check_drift(self, drift: _planning.Drift) -> None:
        log = self.traffic()
        window = {sizes: n - drift.seen.get(sizes, 0) for sizes, n in log.items() if n > drift.seen.get(sizes, 0)}
        drift.seen = log
        if not window or drift is not self._drift:
            return
        drift.checks += 1

        def keep(choice: _traffic.BucketChoice, costs: _planning.Costs, current: list) -> bool:
            now = (_traffic.predicted_seconds(window, current, costs.cost, costs.dynamic_cost,
                                              script_cost=costs.script_cost) if current
                   else float("inf"))  # no buckets yet: learn them
            drift.found(now, choice.predicted_seconds)
            return choice.buckets == current or now <= choice.predicted_seconds * (1 + drift.tolerance)

        plans = self.script_object
        try:
            self._replan(drift.budget, window, self._replan_example(window, drift.example_inputs), False, keep)
        except Exception as error:  # noqa: BLE001 - kept for drift_stats and said once; requests go on
            drift.failed(error)
            return
        if self.script_object is not plans:  # swapped: the new cache's log starts at the window
            drift.replans += 1
            drift.seen = dict(window)

    def __contains__(self, batch_size: int) -> bool:
        return int(batch_size) in self.script_object

    def plan_module(self, batch_size: int) -> Optional[torch.jit.ScriptModule]:
        """TorchScript: the plan's frozen, optimised module for batch_size, or None when not cached."""
        module = self.script_object.plan_module(int(batch_size))
        if module is None:
            return None
        return torch.jit._recursive.wrap_cpp_module(module._c if hasattr(module, "_c") else module)

    def save(self, directory: Union[str, os.PathLike]) -> None:
        """Write the plans and a manifest (every file's SHA-256, the traffic log) to directory:
        TorchScript, the frozen module and an example row; an exported program, its packages and
        the program."""
        self.script_object.save(os.fspath(directory))

    def load(self, directory: Union[str, os.PathLike]) -> int:
        """Load the plans a save() wrote to directory (checked against this cache's source and layout);
        returns how many were loaded, and adds the saved traffic log to this cache's. TorchScript
        plans are re-optimised and warmed; an exported program's packages load with no compile."""
        directory = os.fspath(directory)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"PlanCache.load: {directory} is not a directory")
        return int(self.script_object.load(directory))

    def __repr__(self) -> str:
        return (f"PlanCache(kind={self.kind()!r}, miss_mode={self.miss_mode!r}, plans={self.stats().plans}, "
                f"buckets={self.cached_buckets()})")


_replan_lock = threading.Lock()  # makes each cache's re-plan thread once
_swap_lock = threading.Lock()  # a re-plan's swap, or a Batcher made in front of a cache


def _maker(cls: type, module: Any, example_inputs: Any, dynamic_shapes: Any, inductor_configs: Any,
           options: dict) -> Callable[..., PlanCache]:
    """A cache of the module as given, with its options and the keywords' on top. A program is
    exported (an nn.Module) or loaded (a .pt2 file) on the first call only, and every cache made
    shares it. make.size_ranges(): an exported program's [min, max] per dynamic dimension, read
    before any cache is made (None for TorchScript, whose cache says)."""
    exported = None
    program = not _is_scripted(module) and not _is_saved_folder(module)

    def source() -> Any:
        nonlocal exported
        if exported is None:
            exported = _export.as_exported(module, example_inputs, dynamic_shapes)
        return exported

    def make(**overrides: Any) -> PlanCache:
        if not program:
            return cls(module, **{**options, **overrides})
        return cls(source(), example_inputs, dynamic_shapes, inductor_configs=inductor_configs,
                   **{**options, **overrides})

    def size_ranges() -> Optional[list]:
        return _export.program_layout(source().program).ranges if program else None

    make.plan_shapes = options.get("plan_shapes", _option_default("plan_shapes"))  # type: ignore[attr-defined]
    make.size_ranges = size_ranges  # type: ignore[attr-defined]
    make.dim_names = list(options.get("dim_names", []))  # type: ignore[attr-defined]
    return make


def _option_default(name: str) -> Any:
    """The default of a PlanCacheOptions field, as the C++ constructor's schema has it."""
    for schema in torch._C._jit_get_custom_class_schemas():
        if schema.name == "__init__" and str(schema.arguments[0].type).endswith("torch_ext.PlanCache"):
            return next(a.default_value for a in schema.arguments if a.name == name)
    raise LookupError(f"torch.classes.torch_ext.PlanCache has no constructor option {name}")
