"""Type stubs for torch_ext._C, the pybind11 module: what torch.ops and torch.classes cannot carry
(Python callables as checkpoint segments and as a plan cache's compiler, Python objects as cached
values, the paging hooks' acquire). Internal: use the
torch_ext package. tests/python/test_layout.py checks that these stubs name every attribute."""
from typing import Any, Callable, Sequence

import torch

build_info: dict[str, Any]  # cuda (bool), cplusplus (int), compiler (str), torch_version (str)

class CheckpointError(RuntimeError):
    """A replay that does not match its forward."""

class _CheckpointModule:
    CheckpointError: type[CheckpointError]

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any] | None, options: Any,
            name: str) -> Any:
        """fn(*args, **kwargs) checkpointed (saved-tensor hooks); options: native_options(...);
        name: the segment's, for errors."""

    def native_options(self, options: torch.ScriptObject) -> Any:
        """The C++ options of a torch.classes.torch_ext.CheckpointOptions, for run()."""

    def save_rules(self, items: list[str]) -> list[tuple[str, int, int, list[int]]]:
        """The `save` option's rules: (op as 'aten::mm.default', group, every, occurrences) per op."""

    def mark_hooks_transparent(self) -> None:
        """Marks the saved-tensor hooks just pushed on this thread as returning every tensor as it
        is (torch_ext.memory.track's): checkpoints under them keep what they keep without them."""

    def unmark_hooks_transparent(self) -> None:
        """Undoes mark_hooks_transparent, before those hooks are popped."""

    def probe(self, fn: Callable[[], Any], items: list[str]) -> list[tuple[str, int, int]]:
        """Runs fn() listing each call of the ops items name as the native policy counts them:
        (op, occurrence in its item's group, bytes of its outputs' storages; -1 where a later op
        of fn changed the output in place)."""

checkpoint: _CheckpointModule

class PythonValues:
    """get / put / observe of Python values on a torch.classes.torch_ext.NodeCache."""

    def __init__(self, cache: torch.ScriptObject) -> None: ...
    def get(self, node_id: int, inputs: list[Any] | tuple[Any, ...], default: Any = None) -> Any: ...
    def put(self, node_id: int, inputs: list[Any] | tuple[Any, ...], value: Any, cost_seconds: float = 0.0,
            content_inputs: int = 0) -> bool: ...
    def observe(self, source_id: int, inputs: list[Any] | tuple[Any, ...], work_bytes: int = 0) -> int: ...
    def record_call(self, nodes_computed: int, nodes_reused: int) -> None: ...

class _CacheModule:
    PythonValues: type[PythonValues]

    def digest(self, tensor: torch.Tensor) -> bytes:
        """The NodeCache's content digest (XXH3 128-bit) of a contiguous CPU tensor's bytes, as 16 bytes."""

cache: _CacheModule

class Pager:
    """acquire / acquire_many of a torch.classes.torch_ext.LayerPager, for the paging hooks (the GIL
    released while the pager works)."""

    def __init__(self, pager: torch.ScriptObject) -> None: ...
    def acquire(self, key: str) -> torch.Tensor:
        """The pager's acquire(key): the tensor, held against eviction while it is alive."""
    def acquire_many(self, keys: Sequence[str]) -> tuple[torch.Tensor, ...]:
        """The pager's acquire_many(keys), as a tuple."""

class _PagingModule:
    Pager: type[Pager]

paging: _PagingModule

class _BatchHandle:
    """A batcher request's result (a torch_ext BatchResult)."""
    def result(self, timeout_seconds: float) -> Any:
        """The output, waiting at most timeout_seconds with the GIL released."""
    def done(self) -> bool: ...
    def running(self) -> bool: ...
    def cancelled(self) -> bool: ...
    def future(self) -> torch.futures.Future:
        """A torch.futures.Future completed with the result."""

class _Completions:
    """Which awaited requests are done, for an event loop woken by a pipe (plan::Completions)."""
    def __init__(self, fd: int) -> None:
        """fd: the write end of a non-blocking pipe, which the caller closes."""
    def watch(self, handle: _BatchHandle, key: int) -> None:
        """Lists key once the request is done (at once if it is)."""
    def take(self) -> list[int]:
        """The keys listed since the last take()."""
    def close(self) -> None:
        """No more writes to fd (then it may be closed)."""

class _PlanModule:
    BatchHandle: type[_BatchHandle]
    Completions: type[_Completions]
    def set_compiler(
        self,
        cache: torch.ScriptObject,
        compiler: Callable[[list[int], list[int], bool, list[torch.Tensor], str, bool, Callable[[], bool]], None],
    ) -> None:
        """compiler(upper, lower, dynamic, example, package_path, background, cancelled) writes one bucket's
        AOTInductor package; cache: a torch.classes.torch_ext.PlanCache of an exported program."""
    def set_source(self, cache: torch.ScriptObject, source: Callable[..., Any]) -> None:
        """source(*inputs) runs a request no plan serves: a tensor or a tuple of tensors."""
    def set_script_module(self, cache: torch.ScriptObject, module: torch.jit.ScriptModule) -> None:
        """The module an exported program's cache was exported from, scripted and in eval mode: plans of
        kind 'script' are it, frozen."""
    def cache_infer(self, cache: torch.ScriptObject) -> Callable[[list[torch.Tensor]], Any]:
        """cache.infer_tensors(inputs) called directly, without TorchScript's method dispatch; the GIL is
        released while it runs."""
    def cache_preload(self, cache: torch.ScriptObject) -> Callable[[list[int], list[torch.Tensor], bool], None]:
        """cache.preload(sizes, example_inputs) (bucket=False) or cache.preload_buckets([sizes],
        example_inputs) (bucket=True) called directly; the GIL is released while it builds."""
    def batcher_infer(
        self, batcher: torch.ScriptObject
    ) -> Callable[[Sequence[torch.Tensor], float, float], Any]:
        """batcher.infer_tensors(inputs, timeout_seconds=-1, deadline_ms=-1) for tensor inputs (a tuple or
        list) called directly, without TorchScript's method dispatch; the GIL is released while it waits."""
    def batcher_submit(
        self, batcher: torch.ScriptObject
    ) -> Callable[[Sequence[Any], float], _BatchHandle | None]:
        """batcher.submit(inputs, deadline_ms=-1) for tensor inputs (a tuple or list) called directly, without
        TorchScript's method dispatch; the GIL is released while it runs batches. Returns the request's
        BatchHandle, or None (nothing queued) when an input is not exactly a torch.Tensor."""
    def batcher_cancel(self, batcher: torch.ScriptObject) -> Callable[[_BatchHandle], bool]:
        """batcher.cancel(handle), holding the batcher weakly (False once it is gone)."""
    def batch_handle(self, result: torch.ScriptObject) -> _BatchHandle:
        """The BatchHandle of a torch.classes.torch_ext.BatchResult."""

plan: _PlanModule
