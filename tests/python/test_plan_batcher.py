"""The dynamic batcher in front of a PlanCache: concurrent single requests gathered into batches,
each caller handed its own rows; a bounded queue; errors that stay with their requests.
(test_plan_export.py runs it over an exported program's batch x sequence buckets.)"""
import asyncio
import concurrent.futures
import gc
import os
import threading
import time

import pytest
import torch

from torch_ext import Batcher, PlanCache

# Long enough that a batch only runs when it is full (or the batcher closes): batch counts do not
# depend on how fast this machine is.
NEVER_MS = 600_000


class RowWise(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * self.scale + 0.5) * 2.0


class Poisoned(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x > 1000.0).any()):
            raise RuntimeError("poisoned row")
        return x * 2.0


@pytest.fixture
def cache():
    torch.manual_seed(0)
    module = torch.jit.script(RowWise().eval())
    return module, PlanCache(module, miss_mode="pad", max_batch_size=16, warmup_calls=1)


def test_eight_threads_of_single_requests_are_batched_and_each_gets_its_rows(cache):
    module, plans = cache
    rounds, threads = 6, 8
    errors = []
    with Batcher(plans, max_batch_size=threads, max_delay_ms=NEVER_MS) as batcher:
        def client(seed: int) -> None:
            generator = torch.Generator().manual_seed(seed)
            try:
                for _ in range(rounds):
                    x = torch.randn(1, 8, generator=generator)
                    if not torch.equal(batcher(x), module(x)):  # row-wise math: exact
                        errors.append(f"client {seed}: wrong rows")
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        workers = [threading.Thread(target=client, args=(seed,)) for seed in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        s = batcher.stats()
    assert not errors, errors[:3]
    # Each round, every client waits for its answer before it asks again: 8 requests, one batch.
    assert s.requests == rounds * threads and s.batches == rounds and s.max_batch_rows == threads
    assert s.rows == rounds * threads and s.failed == 0 and s.queued == 0
    assert plans.stats().calls == rounds  # the cache saw the batches, not the requests


def test_futures_and_requests_of_several_rows_keep_their_rows(cache):
    module, plans = cache
    inputs = [torch.randn(n, 8) for n in (1, 3, 2, 2)]
    with Batcher(plans, max_batch_size=8, max_delay_ms=NEVER_MS) as batcher:
        called = []
        futures = [batcher.submit(x) for x in inputs[:3]]
        futures[0].add_done_callback(lambda f: called.append(f.result(0)))
        assert not any(f.done() for f in futures)  # 6 rows of 8: the batch waits
        with pytest.raises(concurrent.futures.TimeoutError):
            futures[0].result(timeout=0.1)
        futures.append(batcher.submit(inputs[3]))  # 8 rows: one batch
        for x, future in zip(inputs, futures):
            assert torch.equal(future.result(timeout=60), module(x)) and future.exception() is None
        assert batcher.stats().batches == 1
        deadline = time.monotonic() + 60
        while not called and time.monotonic() < deadline:  # the callback runs on the thread that ran the batch
            time.sleep(0.01)
        assert len(called) == 1 and torch.equal(called[0], module(inputs[0]))


def test_a_queued_request_can_be_cancelled_and_never_runs(cache):
    module, plans = cache
    with Batcher(plans, max_batch_size=4, max_delay_ms=NEVER_MS) as batcher:
        kept, dropped = batcher.submit(torch.randn(2, 8)), batcher.submit(torch.randn(1, 8))
        seen = []
        dropped.add_done_callback(lambda f: seen.append(f.cancelled()))
        assert not dropped.running() and not dropped.cancelled()  # queued: 3 rows of 4
        assert dropped.cancel() and dropped.cancel()  # True again once cancelled, as concurrent.futures says
        assert dropped.cancelled() and dropped.done() and not dropped.running() and seen == [True]
        with pytest.raises(concurrent.futures.CancelledError, match="cancelled before a batch took it"):
            dropped.result()
        with pytest.raises(concurrent.futures.CancelledError):
            dropped.exception()
        assert batcher.stats().cancelled == 1 and batcher.stats().queued == 1
        # TorchScript's face of the same: Batcher.cancel(BatchResult)
        result = batcher.script_object.submit((torch.randn(1, 8),))
        assert batcher.script_object.cancel(result) and result.cancelled() and result.done()
        x = torch.randn(2, 8)
        last = batcher.submit(x)  # 4 rows: the batch fills and runs; the cancelled requests left no rows
        assert torch.equal(last.result(60), module(x)) and kept.done()
        assert not kept.cancel() and not kept.cancelled() and not kept.running()
        stats = batcher.stats()
        assert (stats.batches, stats.rows, stats.cancelled, stats.requests) == (1, 4, 2, 4)


def test_futures_are_concurrent_futures_that_wait_as_completed_and_wrap_future_take(cache):
    module, plans = cache
    xs = [torch.randn(1, 8) for _ in range(3)] + [torch.randn(2, 8)]
    with Batcher(plans, max_batch_size=4, max_delay_ms=NEVER_MS) as batcher:
        futures = [batcher.submit(x) for x in xs[:3]]  # 3 rows of 4: the batch waits
        assert all(isinstance(f, concurrent.futures.Future) for f in futures)
        done, pending = concurrent.futures.wait(futures, timeout=0)
        assert not done and len(pending) == 3
        assert futures[1].cancel()  # a cancelled request is done for wait()
        done, pending = concurrent.futures.wait(futures, timeout=0, return_when=concurrent.futures.FIRST_COMPLETED)
        assert done == {futures[1]} and pending == {futures[0], futures[2]}

        waited = []
        waiter = threading.Thread(target=lambda: waited.append(concurrent.futures.wait(futures, timeout=60)))
        waiter.start()
        deadline = time.monotonic() + 60
        while not futures[0]._waiters and time.monotonic() < deadline:  # its waiter is installed
            time.sleep(0.001)
        assert futures[0]._waiters and waiter.is_alive()
        last = batcher.submit(xs[3])  # 4 rows: the batch runs here, and the waiting thread hears of it
        waiter.join(60)
        assert not waiter.is_alive() and len(waited[0].done) == 3 and not waited[0].not_done

        completed = list(concurrent.futures.as_completed(futures + [last], timeout=60))
        assert len(completed) == 4 and set(completed) == set(futures) | {last}
        for x, future in zip(xs, futures + [last]):
            assert future.cancelled() if future is futures[1] else torch.equal(future.result(0), module(x))

        async def awaited() -> torch.Tensor:
            return await asyncio.wrap_future(batcher.submit(xs[3]))
        slow = batcher.submit(torch.randn(2, 8))  # with the wrapped request's 2 rows: one batch
        assert torch.equal(asyncio.run(awaited()), module(xs[3])) and slow.done()

        untouched = batcher.submit(torch.randn(4, 8))
        untouched.result(60)  # a future only waited on keeps none of Future's fields, nor a callback for them
        assert not untouched.__dict__ and "finished" in repr(untouched)
        with pytest.raises(RuntimeError, match="its batcher sets the result"):
            untouched.set_result(None)


def test_wait_first_exception_returns_at_a_failed_request():
    plans = PlanCache(torch.jit.script(Poisoned().eval()), max_batch_size=4, warmup_calls=1)
    plans(torch.randn(2, 8))
    with Batcher(plans, max_batch_size=2, max_delay_ms=NEVER_MS) as batcher:
        queued = batcher.submit(torch.randn(1, 8))
        bad, neighbour = batcher.submit(torch.full((1, 8), 5000.0)), batcher.submit(torch.randn(1, 8))
        done, pending = concurrent.futures.wait([queued, bad, neighbour], timeout=60,
                                                return_when=concurrent.futures.FIRST_EXCEPTION)
        # queued and bad made one batch, which failed; neighbour waits alone for a second row
        assert done == {queued, bad} and pending == {neighbour}
        assert "poisoned row" in str(bad.exception(0))


def test_an_event_loop_awaits_its_requests_and_a_cancelled_task_takes_its_request_out(cache):
    module, plans = cache
    xs = [torch.randn(1, 8) for _ in range(8)]

    async def serve(batcher: Batcher) -> None:
        # Eight requests from one loop, none blocking it: the eighth fills the batch, which the
        # batcher's thread runs.
        outputs = await asyncio.gather(*(batcher.submit(x) for x in xs))
        assert all(torch.equal(out, module(x)) for out, x in zip(outputs, xs))
        alone = batcher.submit(torch.randn(1, 8))  # its batch waits for 7 more rows

        async def client() -> torch.Tensor:
            return await alone

        task = asyncio.ensure_future(client())
        await asyncio.sleep(0)  # the task now awaits the request
        task.cancel()  # a client that went away
        with pytest.raises(asyncio.CancelledError):
            await task
        assert alone.cancelled()

    with Batcher(plans, max_batch_size=8, max_delay_ms=NEVER_MS, submit_runs_batch=False) as batcher:
        asyncio.run(serve(batcher))
        stats = batcher.stats()
        assert (stats.batches, stats.client_batches, stats.cancelled, stats.queued) == (1, 0, 1, 0)


def test_a_batch_run_on_the_loops_thread_hands_its_awaited_requests_in_and_wakes_the_loop_once(cache, monkeypatch):
    from torch_ext.plan import batcher as batcher_module
    module, plans = cache
    wakes = []
    wake = batcher_module._AwaitedRequests._wake
    monkeypatch.setattr(batcher_module._AwaitedRequests, "_wake", lambda self: wakes.append(1) or wake(self))
    xs = [torch.randn(1, 8) for _ in range(8)]

    async def client(x: torch.Tensor) -> torch.Tensor:
        return await batcher.submit(x)

    async def serve() -> list:
        # The eighth task's submit fills the batch and runs it on the loop's thread, while the
        # other seven await: their results are listed together and the pipe written once.
        return await asyncio.gather(*(client(x) for x in xs))

    with Batcher(plans, max_batch_size=8, max_delay_ms=NEVER_MS) as batcher:
        outputs = asyncio.run(serve())
        assert batcher.stats().client_batches == 1
    assert all(torch.equal(out, module(x)) for out, x in zip(outputs, xs))
    assert len(wakes) == 1


def test_two_event_loops_in_two_threads_each_get_their_rows_of_one_batch(cache):
    module, plans = cache
    xs = [torch.randn(1, 8) for _ in range(8)]
    results, errors = {}, []
    started = threading.Barrier(2)

    def loop_thread(part: int) -> None:
        async def serve() -> list:
            futures = [batcher.submit(x) for x in xs[part::2]]  # the second thread's last one fills the batch
            return await asyncio.gather(*futures)

        try:
            started.wait(60)
            if part == 1:
                give_up = time.monotonic() + 60
                while batcher.stats().queued < 4 and time.monotonic() < give_up:  # the first loop's are in
                    time.sleep(0.001)
            results[part] = asyncio.run(serve())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    with Batcher(plans, max_batch_size=8, max_delay_ms=NEVER_MS) as batcher:
        threads = [threading.Thread(target=loop_thread, args=(part,)) for part in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert batcher.stats().batches == 1
    assert not errors
    for part in (0, 1):
        assert all(torch.equal(out, module(x)) for out, x in zip(results[part], xs[part::2]))


def test_the_pipe_an_event_loop_is_woken_by_is_closed_with_the_loop(cache):
    _, plans = cache
    with Batcher(plans, max_batch_size=2, max_delay_ms=NEVER_MS, submit_runs_batch=False) as batcher:
        async def serve() -> None:
            await asyncio.gather(batcher.submit(torch.randn(1, 8)), batcher.submit(torch.randn(1, 8)))

        asyncio.run(serve())
        gc.collect()
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            asyncio.run(serve())
        gc.collect()
        assert len(os.listdir("/proc/self/fd")) <= before


def test_loops_closed_but_still_referenced_give_their_pipes_back_when_another_loop_awaits(cache):
    _, plans = cache
    with Batcher(plans, max_batch_size=2, max_delay_ms=NEVER_MS, submit_runs_batch=False) as batcher:
        async def serve() -> None:
            await asyncio.gather(batcher.submit(torch.randn(1, 8)), batcher.submit(torch.randn(1, 8)))

        def served_loop() -> asyncio.AbstractEventLoop:
            loop = asyncio.new_event_loop()
            loop.run_until_complete(serve())
            loop.close()
            return loop

        served_loop()  # warm-up; this loop is collected, its pipe closed by its finalizer
        gc.collect()
        before = len(os.listdir("/proc/self/fd"))
        kept = [served_loop() for _ in range(10)]  # each closed, none collected
        assert len(os.listdir("/proc/self/fd")) <= before + 2  # the last one's pipe is still open
        assert all(loop.is_closed() for loop in kept)


def test_awaiting_in_a_loop_that_cannot_watch_a_file_descriptor_says_how_to_wait_instead(cache):
    _, plans = cache

    class NoReaders(asyncio.SelectorEventLoop):
        def add_reader(self, fd, callback, *args):
            raise NotImplementedError

    with Batcher(plans, max_batch_size=2, max_delay_ms=NEVER_MS) as batcher:
        future = batcher.submit(torch.randn(1, 8))

        async def wait() -> None:
            await future

        loop = NoReaders()
        try:
            with pytest.raises(TypeError, match="run_in_executor"):
                loop.run_until_complete(wait())
        finally:
            loop.close()
        assert future.cancel()


@pytest.mark.parametrize("max_delay_ms", [0.0, 5.0])
def test_cancels_racing_batches_from_many_threads_lose_no_request_and_run_none_cancelled(cache, max_delay_ms):
    # Which requests a batch takes first depends on timing; what must hold does not: every request
    # either ran with its own rows or was cancelled (and then its cancel() said True), never both.
    module, plans = cache
    outcomes, lock = [], threading.Lock()

    def client(seed: int) -> None:
        for i in range(100):
            x = torch.randn(1 + (seed + i) % 3, 8)
            future = batcher.submit(x)
            said = (seed + i) % 2 == 0 and future.cancel()
            with lock:
                outcomes.append((x, future, said))

    with Batcher(plans, max_batch_size=8, max_delay_ms=max_delay_ms) as batcher:
        threads = [threading.Thread(target=client, args=(seed,)) for seed in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    ran = [(x, future) for x, future, said in outcomes if not said]
    assert all(future.cancelled() for _, future, said in outcomes if said)
    for x, future in ran:
        assert not future.cancelled() and torch.equal(future.result(60), module(x))
    stats = batcher.stats()
    assert (stats.requests, stats.cancelled, stats.failed) == (600, 600 - len(ran), 0)
    assert stats.rows == sum(x.shape[0] for x, _ in ran)


class Scaled(torch.nn.Module):
    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale


def test_requests_with_a_plain_value_are_batched_with_requests_of_the_same_value():
    # Tensor-only requests take a direct path into C++; a request with a plain value takes TorchScript's.
    plans = PlanCache(torch.jit.script(Scaled().eval()), miss_mode="pad", max_batch_size=4)
    rows, scales = [torch.randn(1, 8) for _ in range(4)], (2.0, 2.0, 3.0, 3.0)
    with Batcher(plans, max_batch_size=2, max_delay_ms=NEVER_MS) as batcher:
        futures = [batcher.submit(x, scale) for x, scale in zip(rows, scales)]
        for x, scale, future in zip(rows, scales, futures):
            assert torch.equal(future.result(timeout=60), x * scale)
        assert batcher.stats().batches == 2 and batcher.stats().max_batch_rows == 2


def test_a_full_queue_raises_at_once_and_close_runs_what_was_queued(cache):
    module, plans = cache
    batcher = Batcher(plans, max_batch_size=16, max_delay_ms=NEVER_MS, max_queue=4)
    inputs = [torch.randn(1, 8) for _ in range(4)]
    futures = [batcher.submit(x) for x in inputs]  # 4 rows of 16: the batch waits
    with pytest.raises(RuntimeError, match=r"the queue is full \(4 requests waiting, max_queue=4\)"):
        batcher.submit(torch.randn(1, 8))
    assert batcher.stats().rejected == 1 and batcher.stats().queued == 4
    batcher.close()
    for x, future in zip(inputs, futures):
        assert torch.equal(future.result(timeout=0), module(x))
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(torch.randn(1, 8))


def test_bad_requests_fail_at_submit_and_never_join_a_batch(cache):
    module, plans = cache
    plans(torch.randn(2, 8))  # the cache's inputs are now known: [batch, 8] floats
    with Batcher(plans, max_batch_size=4, max_delay_ms=NEVER_MS) as batcher:
        with pytest.raises(RuntimeError, match=r"input 0 has shape \[1, 9\]"):
            batcher.submit(torch.randn(1, 9))
        with pytest.raises(RuntimeError, match="batch size 5 is above max_batch_size 4"):
            batcher.submit(torch.randn(5, 8))
        for call in (batcher.submit, batcher.infer):
            with pytest.raises(ValueError, match="input 0 requires grad, but plans serve inference"):
                call(torch.randn(1, 8, requires_grad=True))
        assert batcher.stats().requests == 0


def test_keyword_inputs_to_a_scripted_cache_raise_instead_of_being_dropped(cache):
    # A TorchScript plan takes its inputs by position: a keyword one was silently left out before.
    module, plans = cache
    x = torch.randn(2, 8)
    for call in (lambda: plans(x=x), lambda: plans.infer_batch(x=x)):
        with pytest.raises(TypeError, match="by position; got keyword.s. x"):
            call()
    with Batcher(plans, max_batch_size=4, max_delay_ms=NEVER_MS) as batcher:
        for call in (lambda: batcher(x=x), lambda: batcher.submit(x=x)):
            with pytest.raises(TypeError, match="by position; got keyword.s. x"):
                call()
        assert batcher.stats().requests == 0


def test_a_batch_that_raises_fails_its_requests_only():
    plans = PlanCache(torch.jit.script(Poisoned().eval()), max_batch_size=4, warmup_calls=1)
    plans(torch.randn(2, 8))
    with Batcher(plans, max_batch_size=2, max_delay_ms=NEVER_MS) as batcher:
        bad, neighbour = batcher.submit(torch.full((1, 8), 5000.0)), batcher.submit(torch.randn(1, 8))
        for future in (bad, neighbour):
            with pytest.raises(RuntimeError, match="poisoned row"):
                future.result(timeout=60)
            assert "poisoned row" in str(future.exception())
        x = torch.randn(2, 8)
        assert torch.equal(batcher(x), x * 2.0)
        assert batcher.stats().failed == 2 and batcher.stats().batches == 2


def test_infer_waits_at_most_timeout(cache):
    _, plans = cache
    with Batcher(plans, max_batch_size=16, max_delay_ms=NEVER_MS) as batcher:
        with pytest.raises(concurrent.futures.TimeoutError, match="still waited in the queue .* taken out of it"):
            batcher.infer(torch.randn(1, 8), timeout=0.2)  # alone, its batch waits for 16 rows
        # Nobody could collect it: it left the queue and never runs.
        assert (batcher.stats().queued, batcher.stats().cancelled) == (0, 1)
    assert batcher.stats().batches == 0


def test_a_forked_child_gets_an_error_and_destroys_the_batcher_without_joining(cache):
    module, plans = cache
    holder = [Batcher(plans, max_batch_size=4, max_delay_ms=NEVER_MS)]
    x = torch.randn(1, 8)
    pending = holder[0].submit(x)  # the parent's, queued
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            try:
                holder[0].submit(torch.randn(1, 8))
            except RuntimeError as e:
                status = 0 if "forked" in str(e) else 2
            holder.clear()
            gc.collect()
        finally:
            os._exit(status)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0
    holder[0].script_object.close()
    assert torch.equal(pending.result(timeout=60), module(x))


@pytest.mark.parametrize("filled_by", ["infer", "submit", "submit leaving it"])
def test_the_call_that_fills_a_batch_runs_it_on_its_thread_unless_a_submit_leaves_it_to_the_batchers(cache, filled_by):
    module, plans = cache
    by_caller = filled_by != "submit leaving it"
    with Batcher(plans, max_batch_size=4, max_delay_ms=NEVER_MS, submit_runs_batch=by_caller) as batcher:
        xs = [torch.randn(1, 8) for _ in range(4)]
        futures = [batcher.submit(x) for x in xs[:3]]
        ran_on, called = [], threading.Event()

        def record(_):
            ran_on.append(threading.get_ident())
            called.set()

        futures[0].add_done_callback(record)
        assert not any(f.done() for f in futures)
        if filled_by == "infer":
            out = batcher.infer(xs[3])  # runs the batch here, before returning
            assert torch.equal(out, module(xs[3]))
        else:
            futures.append(batcher.submit(xs[3]))  # full (no 10-minute delay): runs here, or on the batcher's thread
        assert all(f.done() for f in futures[:3]) or not by_caller
        for f, x in zip(futures, xs):
            assert torch.equal(f.result(timeout=60), module(x))
        # Results are stored before callbacks run: on the batcher's thread the callback may still be
        # on its way when result() returns.
        assert called.wait(timeout=60)
        assert len(ran_on) == 1 and (ran_on[0] == threading.get_ident()) == by_caller
        s = batcher.stats()
        assert (s.batches, s.client_batches, s.max_batch_rows) == (1, int(by_caller), 4)


@pytest.mark.parametrize("submit_runs_batch", [True, False])
def test_clients_that_submit_without_waiting_each_get_their_own_rows(cache, submit_runs_batch):
    # Full batches run on the clients' threads (the GIL released), or on the batcher's thread while
    # the clients hold the GIL in submit().
    module, plans = cache
    xs = [torch.randn(1, 8) for _ in range(8 * 40)]
    results: list = [None] * len(xs)
    with Batcher(plans, max_batch_size=8, max_delay_ms=NEVER_MS, max_queue=len(xs),
                 submit_runs_batch=submit_runs_batch) as batcher:
        def client(k: int) -> None:
            futures = {i: batcher.submit(xs[i]) for i in range(k, len(xs), 8)}
            for i, future in futures.items():
                results[i] = future.result(timeout=60)

        workers = [threading.Thread(target=client, args=(k,)) for k in range(8)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        s = batcher.stats()
    assert all(torch.equal(out, module(x)) for out, x in zip(results, xs))
    assert (s.batches, s.rows, s.client_batches) == (40, len(xs), 40 if submit_runs_batch else 0)


@pytest.mark.parametrize("limit", [1, 2])
def test_at_most_max_running_batches_run_at_once_and_the_first_runner_to_finish_runs_the_next(cache, limit):
    # Batch 1 runs on `runner` and is held there (its first request's callback waits) while this
    # thread fills batch 2: below the limit this thread runs it at once; at the limit it waits, and
    # the runner runs it once batch 1 is done (no hand-off to the batcher's thread).
    module, plans = cache
    xs = [torch.randn(1, 8) for _ in range(4)]
    first_running, release = threading.Event(), threading.Event()
    second_ran_on = []
    with Batcher(plans, max_batch_size=2, max_delay_ms=NEVER_MS, max_running_batches=limit) as batcher:
        assert batcher.max_running_batches == limit

        def runner() -> None:
            batcher.submit(xs[0]).add_done_callback(lambda _: (first_running.set(), release.wait(60)))
            batcher.submit(xs[1])  # fills batch 1, which runs here

        thread = threading.Thread(target=runner)
        thread.start()
        assert first_running.wait(60)
        third = batcher.submit(xs[2])
        third.add_done_callback(lambda _: second_ran_on.append(threading.get_ident()))
        fourth = batcher.submit(xs[3])  # fills batch 2
        assert third.done() == (limit == 2)  # at the limit nothing may run batch 2 yet
        release.set()
        thread.join()
        assert torch.equal(third.result(timeout=60), module(xs[2]))
        assert torch.equal(fourth.result(timeout=60), module(xs[3]))
        assert second_ran_on == [threading.get_ident() if limit == 2 else thread.ident]
        s = batcher.stats()
        assert (s.batches, s.client_batches) == (2, 2)


def test_a_request_with_an_input_that_is_not_a_tensor_takes_torchscripts_path_and_gets_its_rows():
    # The scale is not batched: requests join a batch only where they agree on it.
    module = torch.jit.script(Scaled().eval())
    xs = [torch.randn(1, 3) for _ in range(4)]
    scales = [2.0, 2.0, 3.0, 3.0]
    with Batcher(PlanCache(module, miss_mode="pad", max_batch_size=4), max_batch_size=2,
                 max_delay_ms=NEVER_MS) as batcher:
        futures = [batcher.submit(x, scale) for x, scale in zip(xs, scales)]
        assert all(torch.equal(f.result(timeout=60), module(x, scale)) for f, x, scale in zip(futures, xs, scales))
        s = batcher.stats()
    assert (s.batches, s.client_batches, s.max_batch_rows) == (2, 2, 2)


def test_a_deadline_that_cannot_be_met_fails_at_once_saying_so(cache):
    module, plans = cache
    with Batcher(plans, max_batch_size=2, max_delay_ms=NEVER_MS) as batcher:
        with pytest.raises(RuntimeError, match="deadline of 0 ms cannot be met: it has already passed"):
            batcher.infer(torch.randn(1, 8), deadline_ms=0)
        for bad in (-1, float("nan"), "5", True):
            with pytest.raises(ValueError, match="deadline_ms must be >= 0"):
                batcher.submit(torch.randn(1, 8), deadline_ms=bad)
        x, y = torch.randn(1, 8), torch.randn(1, 8)
        first = batcher.submit(x, deadline_ms=NEVER_MS)
        assert torch.equal(batcher.infer(y), module(y)) and torch.equal(first.result(0), module(x))
        # A batch has run: no batch runs in a nanosecond, so that deadline is refused before queueing.
        with pytest.raises(RuntimeError, match="cannot be met: no batch has run in under"):
            batcher.submit(torch.randn(1, 8), deadline_ms=1e-6)
        s = batcher.stats()
        assert (s.expired, s.requests, s.queued) == (2, 2, 0)


def test_follow_moves_later_batches_to_another_cache_and_refuses_one_that_cannot_take_them(cache):
    module, plans = cache
    other = PlanCache(module, miss_mode="pad", max_batch_size=16)
    with Batcher(plans, max_batch_size=4, max_delay_ms=NEVER_MS) as batcher:
        x = torch.randn(4, 8)
        assert torch.equal(batcher(x), module(x)) and plans.stats().calls == 1
        batcher.script_object.follow(other.script_object)
        assert torch.equal(batcher(x), module(x))
        assert (plans.stats().calls, other.stats().calls) == (1, 1)
        with pytest.raises(ValueError, match="batches of at most 2 rows, below this batcher's max_batch_size 4"):
            batcher.script_object.follow(PlanCache(module, max_batch_size=2).script_object)
        assert torch.equal(batcher(x), module(x)) and other.stats().calls == 2  # still the one it follows


def _thread_names() -> list:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended while listing
            pass
    return names


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from Linux's /proc")
def test_the_batchers_thread_is_named_so_that_top_and_perf_can_tell_it_apart(cache):
    _, plans = cache
    gc.collect()  # an earlier test's batcher left to the collector would otherwise end its thread mid-test
    before = _thread_names().count("torch_ext batch")
    with Batcher(plans, max_batch_size=1, max_delay_ms=NEVER_MS, submit_runs_batch=False) as batcher:
        batcher.submit(torch.ones(1, 8)).result()  # a full batch, left to the thread: it has started and run it
        assert _thread_names().count("torch_ext batch") == before + 1
    assert _thread_names().count("torch_ext batch") == before
