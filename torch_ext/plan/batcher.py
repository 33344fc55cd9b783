"""Batcher: a dynamic batcher in front of a PlanCache (torch.classes.torch_ext.Batcher).

Concurrent callers submit single requests; they are gathered into batches of up to
max_batch_size rows, or for at most max_delay_ms after the oldest arrived; each batch runs through
the cache (padding the other dynamic dimensions to the batch's longest where the cache pads them)
and hands every caller its own rows (a concurrent.futures-style future, or the output of infer()).
The queue is bounded: submit() raises at once when max_queue requests wait.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import numbers
import os
import threading
import weakref
from concurrent.futures._base import CANCELLED_AND_NOTIFIED, FINISHED, PENDING  # Future's states
from typing import Any, Callable, Generator, Optional, Sequence

import torch

from .. import _C
from .._script import ScriptObjectFace
from .cache import PlanCache

__all__ = ["Batcher"]


class BatchFuture(concurrent.futures.Future):
    """A request's result: a concurrent.futures.Future (result(timeout), exception(timeout), done(),
    cancel(), cancelled(), running(), add_done_callback(fn); concurrent.futures.wait and
    as_completed, asyncio.wrap_future take it), and awaitable in an asyncio event loop. Waiting
    happens in C++ with the GIL released, and the thread that runs the batch never needs the GIL
    unless a callback is added, or the future is handed to concurrent.futures' wait or as_completed
    (their bookkeeping is set up, and kept by a callback, only for a future that is)."""

    __slots__ = ("_handle", "_structure", "_timeout", "_cancel")  # one is made per request

    def __init__(self, handle: Any, structure: Any, timeout_seconds: float, cancel: Callable[[Any], bool]) -> None:
        # Future.__init__ is not called: its condition and state are made on first use (__getattr__).
        self._handle, self._structure, self._timeout, self._cancel = handle, structure, timeout_seconds, cancel

    def __getattr__(self, name: str) -> Any:
        """The Future fields concurrent.futures.wait and as_completed read (_condition, _state,
        _waiters): made on first use, then kept by a callback when the request completes."""
        if name not in _FUTURE_FIELDS:
            raise AttributeError(f"'BatchFuture' object has no attribute {name!r}")
        with _BRIDGE_LOCK:
            if "_state" not in self.__dict__:
                fields = dict(_condition=threading.Condition(), _state=PENDING, _waiters=[])
                self.__dict__.update(fields)  # all at once: another thread sees none of them or all
                self.add_done_callback(BatchFuture._settle)  # at once if the request is done
        return self.__dict__[name]

    def _settle(self) -> None:
        """Future's fields and waiters told that the request completed (the callback __getattr__ adds)."""
        with self._condition:
            if self._state in (CANCELLED_AND_NOTIFIED, FINISHED):
                return
            if self.cancelled():
                self._state = CANCELLED_AND_NOTIFIED
                for waiter in self._waiters:
                    waiter.add_cancelled(self)
            else:
                failed = self.exception(0) is not None
                self._state = FINISHED
                for waiter in self._waiters:
                    (waiter.add_exception if failed else waiter.add_result)(self)
            self._condition.notify_all()

    def __repr__(self) -> str:
        state = ("cancelled" if self.cancelled() else "finished" if self.done() else
                 "running" if self.running() else "pending")
        return f"<BatchFuture at {id(self):#x} state={state}>"

    def set_running_or_notify_cancel(self) -> bool:
        raise RuntimeError("BatchFuture: its batcher runs the request; set_running_or_notify_cancel is an executor's")

    def set_result(self, result: Any) -> None:
        raise RuntimeError("BatchFuture: its batcher sets the result; set_result is an executor's")

    def set_exception(self, exception: Optional[BaseException]) -> None:
        raise RuntimeError("BatchFuture: its batcher sets the result; set_exception is an executor's")

    def result(self, timeout: Optional[float] = None) -> Any:
        """The output; raises the batch's error, concurrent.futures.CancelledError once cancelled,
        or concurrent.futures.TimeoutError after timeout seconds (default: the batcher's
        timeout_seconds)."""
        wait = self._timeout if timeout is None else timeout
        return self._structure(_waiting(self._handle.result, wait))

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        try:
            self.result(timeout)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            raise
        except Exception as error:  # noqa: BLE001 - that is what is asked for
            return error
        return None

    def done(self) -> bool:
        return bool(self._handle.done())

    def cancel(self) -> bool:
        """Takes the request out of the batcher's queue if no batch has taken it yet (then it never
        runs, result() raises CancelledError and the callbacks run here); False once its batch runs
        or has run. True again for a request already cancelled, as concurrent.futures answers."""
        return self._handle.cancelled() or self._cancel(self._handle)

    def cancelled(self) -> bool:
        return bool(self._handle.cancelled())

    def running(self) -> bool:
        """Whether its batch runs now (false while it is queued, and once it is done)."""
        return bool(self._handle.running())

    def add_done_callback(self, fn: Callable[["BatchFuture"], Any]) -> None:
        """fn(self) once the result is in: at once if it is, else on the batcher's thread."""
        self._handle.future().add_done_callback(lambda _: fn(self))

    def __await__(self) -> Generator[Any, None, Any]:
        """`await future` in an asyncio event loop: the loop goes on while the request waits. A
        task cancelled while it awaits takes its request out of the queue if no batch has taken it.
        (The submit() that fills a batch runs it on the loop's thread unless submit_runs_batch=False.)"""
        if not self.done():
            loop = asyncio.get_running_loop()
            awaited = _AwaitedRequests.of(loop)
            key, waiter = awaited.wait(loop, self._handle)
            try:
                yield from waiter.__await__()
            except asyncio.CancelledError:
                awaited.forget(key)
                self.cancel()
                raise
        return self.result(0)


_FUTURE_FIELDS = frozenset(("_condition", "_state", "_waiters"))
_BRIDGE_LOCK = threading.Lock()


class _AwaitedRequests:
    """The requests one event loop awaits, and how it hears they are done: the thread that runs a
    batch lists their keys (in C++, without the GIL) and writes one byte to a pipe the loop reads
    when the list was empty, so the results a batch completes together wake the loop once."""

    _of_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _AwaitedRequests]" = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "_AwaitedRequests":
        awaited = cls._of_loop.get(loop)
        if awaited is None:
            with cls._lock:
                awaited = cls._of_loop.get(loop)
                if awaited is None:
                    cls._forget_closed_loops()
                    awaited = cls._of_loop[loop] = cls(loop)
        return awaited

    @classmethod
    def _forget_closed_loops(cls) -> None:
        """Closes the pipes of loops that were closed but are still referenced (asyncio has no hook
        for close(); a collected loop's pipe is closed by its finalizer)."""
        for loop in [loop for loop in cls._of_loop.keys() if loop.is_closed()]:
            cls._of_loop.pop(loop)._close()

    @classmethod
    def settle_running_loop(cls) -> None:
        """Hands the running loop's completed requests in, if it awaits any: a batch the caller just
        ran on the loop's thread resumes its awaiting tasks without the loop reading its pipe first."""
        loop = asyncio._get_running_loop()
        if loop is not None and (awaited := cls._of_loop.get(loop)) is not None:
            awaited.settle()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Holds no reference to the loop (the loop is this object's key in _of_loop).
        self._read, write = os.pipe()
        for fd in (self._read, write):
            os.set_blocking(fd, False)
        self._completions = _C.plan.Completions(write)
        self._waiters: dict[int, asyncio.Future] = {}
        self._keys = itertools.count()
        try:
            loop.add_reader(self._read, self._wake)
        except NotImplementedError:
            _close_pipe(self._completions, self._read, write)
            raise TypeError(f"BatchFuture: awaiting needs an event loop that watches file descriptors "
                            f"(loop.add_reader); {type(loop).__name__} does not. Wait in a thread instead: "
                            f"await loop.run_in_executor(None, future.result)") from None
        self._close = weakref.finalize(loop, _close_pipe, self._completions, self._read, write)

    def wait(self, loop: asyncio.AbstractEventLoop, handle: Any) -> tuple[int, asyncio.Future]:
        key = next(self._keys)
        waiter = loop.create_future()
        self._waiters[key] = waiter
        self._completions.watch(handle, key)  # lists the key at once if the request is done
        return key, waiter

    def forget(self, key: int) -> None:
        self._waiters.pop(key, None)

    def _wake(self) -> None:
        try:
            os.read(self._read, 4096)
        except BlockingIOError:
            pass
        self.settle()

    def settle(self) -> None:
        """Hands the results in to their waiters (their tasks resume in the loop's next round)."""
        for key in self._completions.take():
            waiter = self._waiters.pop(key, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)


def _close_pipe(completions: Any, read: int, write: int) -> None:
    completions.close()  # nothing is written to the pipe after this
    os.close(read)
    os.close(write)


def _waiting(call: Callable[..., Any], *args: Any) -> Any:
    """call(*args), a wait that ran out raised as concurrent.futures.TimeoutError, a cancelled
    request's result as concurrent.futures.CancelledError."""
    try:
        return call(*args)
    except RuntimeError as error:
        if "Batcher: no result after" in str(error):
            raise concurrent.futures.TimeoutError(str(error)) from None
        if "Batcher: the request was cancelled" in str(error):
            raise concurrent.futures.CancelledError(str(error)) from None
        raise


def _deadline(deadline_ms: Optional[float]) -> float:
    if deadline_ms is None:
        return -1.0  # none
    if not isinstance(deadline_ms, numbers.Real) or isinstance(deadline_ms, bool) or not deadline_ms >= 0:
        raise ValueError(f"Batcher: deadline_ms must be >= 0 (or None: no deadline), got {deadline_ms!r}")
    return float(deadline_ms)


class Batcher(ScriptObjectFace):
    """Dynamic batching for a PlanCache (TorchScript or exported program).

    Keyword options are those of the C++ BatcherOptions (torch_ext/plan/batcher.h): max_batch_size
    (0: the cache's), max_delay_ms, max_queue, timeout_seconds, group_by_bucket, submit_runs_batch,
    max_running_batches (0: one per core for torch's intra-op threads); each is also a property. stats() is a
    BatcherStats; close() stops taking requests, runs those queued and joins the thread.
    The call whose request fills a batch runs that batch on its own thread (the GIL released) before it
    returns: an infer() always, a submit() unless submit_runs_batch=False (then it returns at once and the
    batch runs on the batcher's thread, as does a batch that does not fill, after max_delay_ms). A batch
    filled while max_running_batches run waits, and the first of their runners to finish runs it next,
    before it returns. deadline_ms (submit, infer):
    the request must be served within that many milliseconds; one that cannot be (not positive, or
    shorter than the fastest batch run so far) raises at once, one whose deadline passes in the queue
    fails without running. When the cache re-plans (replan, replan_on_drift), later batches run on
    its new plans; requests submitted here count toward its drift checks.
    """

    def __init__(self, cache: PlanCache, **options: Any) -> None:
        if not isinstance(cache, PlanCache):
            raise TypeError(f"Batcher: expected a torch_ext.PlanCache, got {type(cache).__name__}")
        self.cache = cache
        self.script_object = cache._batcher(options)  # follows the cache's re-plans
        # Bound once: looking a method up on a ScriptObject costs about 1 us a call, and calling it
        # through TorchScript's dispatch about 15 us, with the GIL held; requests of tensors (infer and
        # submit) and a future's result are called directly.
        self._submit, self._infer_tensors = self.script_object.submit, _C.plan.batcher_infer(self.script_object)
        self._submit_tensors = _C.plan.batcher_submit(self.script_object)
        self._cancel = _C.plan.batcher_cancel(self.script_object)
        self._timeout = self.script_object.timeout_seconds
        self._scripted = cache._in_spec is None  # inputs by position, outputs as they are
        self._structure = cache._structured

    def _flat(self, inputs: tuple, kwargs: dict) -> Sequence[Any]:
        if self._scripted:
            return self.cache._positional_inputs(inputs, kwargs)
        return self.cache._flat(inputs, kwargs)

    def submit(self, *inputs: Any, deadline_ms: Optional[float] = None, **kwargs: Any) -> BatchFuture:
        """Queue one request (the model's arguments, any batch size up to max_batch_size); returns a
        future of its output. A batch the request fills runs here before it returns (and those that
        fill meanwhile while max_running_batches run), unless submit_runs_batch=False. Raises
        RuntimeError at once when the queue is full or deadline_ms cannot be met."""
        flat = self._flat(inputs, kwargs)
        deadline = _deadline(deadline_ms)
        handle = self._submit_tensors(flat, deadline)
        if handle is None:  # not all tensors. A tuple: TorchScript infers a list of mixed values as no type at all
            handle = _C.plan.batch_handle(self._submit(tuple(flat), deadline))
        self.cache._count_request()
        _AwaitedRequests.settle_running_loop()
        return BatchFuture(handle, self._structure, self._timeout, self._cancel)

    def infer(self, *inputs: Any, timeout: Optional[float] = None, deadline_ms: Optional[float] = None,
              **kwargs: Any) -> Any:
        """submit() and wait for the output, at most timeout seconds (default: timeout_seconds)."""
        flat = self._flat(inputs, kwargs)
        wait = self._timeout if timeout is None else timeout
        deadline = _deadline(deadline_ms)
        if all(type(value) is torch.Tensor for value in flat):
            out = _waiting(self._infer_tensors, flat, wait, deadline)
        else:
            out = _waiting(self.script_object.infer, tuple(flat), wait, deadline)
        self.cache._count_request()
        return self._structure(out)

    __call__ = infer

    def __enter__(self) -> "Batcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.script_object.close()
