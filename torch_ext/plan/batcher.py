"""Batcher: a dynamic batcher in front of a PlanCache (torch.classes.torch_ext.Batcher).

Concurrent callers submit single requests; one C++ thread gathers them into batches of up to
max_batch_size rows, or for at most max_delay_ms after the oldest arrived, runs each batch through
the cache (padding the other dynamic dimensions to the batch's longest where the cache pads them)
and hands every caller its own rows, as a concurrent.futures.Future. The queue is bounded:
submit() raises at once when max_queue requests wait.
"""
from __future__ import annotations

import concurrent.futures
from typing import Any, Optional

import torch

from .._script import ScriptObjectFace
from .cache import PlanCache

__all__ = ["Batcher"]


class Batcher(ScriptObjectFace):
    """Dynamic batching for a PlanCache (TorchScript or exported program).

    Keyword options are those of the C++ BatcherOptions (torch_ext/plan/batcher.h): max_batch_size
    (0: the cache's), max_delay_ms, max_queue, timeout_seconds; each is also a property. stats()
    is a BatcherStats; close() stops taking requests, runs those queued and joins the thread.
    """

    def __init__(self, cache: PlanCache, **options: Any) -> None:
        if not isinstance(cache, PlanCache):
            raise TypeError(f"Batcher: expected a torch_ext.PlanCache, got {type(cache).__name__}")
        self.cache = cache
        self.script_object = torch.classes.torch_ext.Batcher(cache.script_object, **options)
        self._submit = self.script_object.submit

    def submit(self, *inputs: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Queue one request (the model's arguments, any batch size up to max_batch_size); returns a
        Future of its output. Raises RuntimeError at once when the queue is full."""
        flat = self.cache._flat(inputs, kwargs) if self.cache._in_spec is not None else list(inputs)
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        structure = self.cache._structured

        def done(result: torch.futures.Future) -> None:  # on the batcher's thread
            try:
                future.set_result(structure(result.value()))
            except Exception as error:  # noqa: BLE001 - the caller's future carries it
                future.set_exception(error)

        self._submit(flat).add_done_callback(done)
        return future

    def infer(self, *inputs: Any, timeout: Optional[float] = None, **kwargs: Any) -> Any:
        """submit() and wait for the output, at most timeout seconds (default: timeout_seconds)."""
        return self.submit(*inputs, **kwargs).result(self.timeout_seconds if timeout is None else timeout)

    __call__ = infer

    def __enter__(self) -> "Batcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.script_object.close()
