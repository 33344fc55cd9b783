"""Plans chosen from traffic: the PlanCache's traffic log, choose_buckets' search, plan_shapes='auto'
timed at the logged sizes, and PlanCache.from_traffic over TorchScript and exported programs."""
import collections
import copy
import itertools
import random

import numpy as np
import pytest
import torch
from torch.export import Dim

from torch_ext import Batcher, PlanCache
from torch_ext.plan import DriftStats
from torch_ext.plan.traffic import as_traffic, choose_buckets, predicted_seconds
from test_plan import Net as MLP, reference  # noqa: E402  (pytest puts this folder on sys.path)

FAST = {"aot_inductor.compile_wrapper_opt_level": "O0"}  # the wrapper at -O0: the kernels are unchanged


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    return MLP().eval()


@pytest.fixture(scope="module")
def scripted(mlp):
    return torch.jit.script(mlp)


def x(n: int) -> torch.Tensor:
    return torch.randn(n, 8)


def stream(seed: int, count: int = 300, largest: int = 16) -> list:
    rng = random.Random(seed)
    return [min(largest, max(1, int(rng.lognormvariate(1.0, 0.8)))) for _ in range(count)]


def test_the_log_counts_each_served_request_at_its_sizes(scripted):
    cache = PlanCache(scripted)
    sizes = [1, 3, 3, 5, 5, 5]
    for n in sizes:
        cache(x(n))
    assert cache.traffic() == {(1,): 1, (3,): 2, (5,): 3}
    s = cache.stats()
    assert (s.traffic_requests, s.traffic_sizes, s.traffic_dropped) == (6, 3, 0)
    calls = s.calls
    cache.infer_batch(x(7))  # run as 5 + 1 + 1 (the cached sizes), logged as it came
    assert cache.traffic() == {(1,): 1, (3,): 2, (5,): 3, (7,): 1} and cache.stats().calls == calls + 3
    cache.reset_stats()  # the statistics, not the log
    assert cache.traffic()[(5,)] == 3
    cache.clear_traffic()
    assert cache.traffic() == {} and cache.stats().traffic_requests == 0
    capped = PlanCache(scripted, max_batch_size=4)
    capped.infer_batch(x(10))  # in requests of at most max_batch_size
    assert capped.traffic() == {(4,): 2, (2,): 1}


def test_observed_traffic_is_added_and_bad_rows_are_refused_whole(scripted):
    cache = PlanCache(scripted)
    cache.observe_traffic({2: 4, (6,): 1})
    cache.observe_traffic([2, 9])  # a stream of requests' sizes
    other = PlanCache(scripted)
    other.observe_traffic({9: 2})
    cache.observe_traffic(other)
    assert cache.traffic() == {(2,): 5, (6,): 1, (9,): 3}
    with pytest.raises(ValueError, match="count of 3 must be > 0"):
        cache.script_object.observe_traffic([[4, 1], [3, 0]])
    with pytest.raises(ValueError, match=r"a size per dynamic dimension \(batch\) then a count; got 3"):
        cache.script_object.observe_traffic([[4, 4, 1]])
    with pytest.raises(ValueError, match="positive integer"):
        cache.observe_traffic({4: -1})
    assert cache.traffic() == {(2,): 5, (6,): 1, (9,): 3}  # nothing of a refused call was added


def test_save_keeps_the_traffic_log_and_a_restarted_cache_replans_from_it(scripted, tmp_path):
    cache = PlanCache(scripted, buckets=[[2, 8]], miss_mode="pad")
    for n in [1, 2, 2, 7, 7, 7, 8]:
        cache(x(n))
    cache.wait_for_builds()
    cache.save(tmp_path / "plans")
    assert "traffic 7 3" in (tmp_path / "plans" / "manifest.txt").read_text()
    restarted = PlanCache(scripted, buckets=[[2, 8]], miss_mode="pad")
    assert restarted.load(tmp_path / "plans") == 2
    assert restarted.traffic() == {(1,): 1, (2,): 2, (7,): 3, (8,): 1}
    # The learned traffic is what a re-plan chooses from: 7 of 8 requests need a bucket of 2 or 8.
    choice = restarted.replan(1)
    assert choice.plans == [(8,)] and choice.plan_requests == [7]


def test_the_log_keeps_4096_sizes_and_counts_the_rest_as_dropped(scripted):
    cache = PlanCache(scripted)
    cache.script_object.observe_traffic([[n, 1] for n in range(1, 4100)])
    s = cache.stats()
    assert (s.traffic_sizes, s.traffic_requests, s.traffic_dropped) == (4096, 4096, 3)
    cache.script_object.observe_traffic([[1, 5]])  # a size it holds is still counted
    assert cache.traffic()[(1,)] == 6


def brute_force(traffic: dict, plans: int, cost) -> float:
    """The least total over every set of at most `plans` bounds in one dimension."""
    values = sorted({s[0] for s in traffic})
    best = float("inf")
    for k in range(plans):
        for inner in itertools.combinations(values[:-1], k):
            bounds = list(inner) + [values[-1]]
            total = sum(c * cost(np.array([[min(b for b in bounds if b >= s[0])]]))[0] for s, c in traffic.items())
            best = min(best, total)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_one_dimension_is_chosen_optimally(seed):
    traffic = as_traffic(stream(seed, largest=24))
    rng = np.random.default_rng(seed)
    per_call, per_row = rng.uniform(1e-5, 1e-3), rng.uniform(1e-6, 1e-4)

    def cost(points):
        return per_call + per_row * points[:, 0]

    requests = sum(traffic.values())
    for plans in (1, 2, 3, 4):
        choice = choose_buckets(traffic, plans, cost)
        assert len(choice.plans) <= plans and choice.buckets[0][-1] == max(s[0] for s in traffic)
        assert choice.predicted_seconds * requests == pytest.approx(brute_force(traffic, plans, cost), rel=1e-9)


def covering(choice, sizes: tuple) -> tuple:
    return tuple(min(b for b in bounds if b >= s) for bounds, s in zip(choice.buckets, sizes))


def test_two_dimensions_stay_within_the_budget_and_every_request_has_a_plan():
    rng = random.Random(3)
    traffic = collections.Counter((max(1, int(rng.lognormvariate(0.7, 0.8))), max(2, int(rng.lognormvariate(3, 0.6))))
                                  for _ in range(1000))

    def cost(points):  # a call's overhead, then work quadratic in the sequence
        return 2e-4 + 1e-8 * points[:, 0] * points[:, 1] ** 2

    for plans in (1, 2, 4, 8):
        choice = choose_buckets(traffic, plans, cost)
        assert len(choice.plans) <= plans and sum(choice.plan_requests) == 1000
        assert {covering(choice, s) for s in traffic} == set(choice.plans)
        assert choice.plan_kinds == ["static"] * len(choice.plans)  # no dynamic cost given
        assert choice.predicted_seconds >= choice.unpadded_seconds * (1 - 1e-12)
    # Enough plans and candidate bounds for every size: each runs unpadded.
    everything = choose_buckets(traffic, len(traffic), cost, max_candidates=1000)
    assert everything.padding == pytest.approx(0) and everything.predicted_seconds == pytest.approx(
        everything.unpadded_seconds)


def test_a_dynamic_plan_is_predicted_where_it_is_cheaper_than_padding():
    traffic = {(1,): 50, (16,): 1}

    def static(points):
        return 1e-4 * points[:, 0]

    one = choose_buckets(traffic, 1, static, lambda points: 1.2 * static(points))
    assert one.plans == [(16,)] and one.plan_kinds == ["dynamic"]  # 50 requests padded 16x cost more
    two = choose_buckets(traffic, 2, static, lambda points: 1.2 * static(points))
    assert two.plans == [(1,), (16,)] and two.plan_kinds == ["static", "static"]


def test_each_bucket_is_predicted_at_its_cheapest_kind_script_included():
    """TorchScript plans run each request at its own sizes, like dynamic ones, at their own cost:
    cheaper on small batches here, dearer on large ones."""
    traffic = {(1,): 40, (2,): 40, (16,): 20}

    def static(points):
        return 1e-4 * points[:, 0]

    def script(points):
        return np.where(points[:, 0] <= 2, 0.5, 2.0) * static(points)

    one = choose_buckets(traffic, 2, static, lambda points: 1.1 * static(points), script_cost=script)
    assert one.plans == [(2,), (16,)] and one.plan_kinds == ["script", "static"]
    assert one.predicted_seconds == pytest.approx((40 * 0.5e-4 + 40 * 1e-4 + 20 * 16e-4) / 100)
    assert predicted_seconds(traffic, one.buckets, static, lambda points: 1.1 * static(points),
                             script_cost=script) == pytest.approx(one.predicted_seconds, rel=1e-12)
    without = choose_buckets(traffic, 2, static, lambda points: 1.1 * static(points))
    assert "script" not in without.plan_kinds and without.predicted_seconds > one.predicted_seconds


@pytest.mark.parametrize("dims", [1, 2])
def test_dynamic_buckets_that_save_nothing_are_merged_into_one_plan(dims):
    """A dynamic plan costs each request at its own sizes, so more dynamic buckets over the same
    requests predict the same time, up to rounding: the choice takes the fewest plans."""
    rng = random.Random(5)
    traffic = collections.Counter(tuple(rng.randint(1, 128) for _ in range(dims)) for _ in range(2000))

    def dynamic(points):
        return 1e-4 + 1e-7 * np.prod(points.astype(np.float64), axis=1) ** 1.1

    for plans in (1, 2, 4):
        choice = choose_buckets(traffic, plans, lambda points: 3 * dynamic(points), dynamic)
        assert choice.plan_kinds == ["dynamic"] and len(choice.plans) == 1
        assert choice.predicted_seconds == pytest.approx(choice.unpadded_seconds, rel=1e-9)


def test_bad_traffic_is_refused():
    with pytest.raises(ValueError, match="no requests"):
        as_traffic({})
    with pytest.raises(ValueError, match="every request has a size per dynamic dimension"):
        as_traffic([(1, 2), (3,)])
    for sizes in ([0], [1.5, 2], [(2.0,)], [True, 2], ["12"]):
        with pytest.raises(ValueError, match="positive integers"):
            as_traffic(sizes)
    with pytest.raises(ValueError, match="max_plans must be a positive integer"):
        choose_buckets({1: 1}, 0, lambda p: p[:, 0] * 1.0)


def test_traffic_given_as_a_tensor_or_array_counts_one_request_a_row():
    assert as_traffic(torch.tensor([3, 1, 3])) == {(3,): 2, (1,): 1}
    assert as_traffic(np.array([[2, 16], [2, 16], [4, 8]])) == {(2, 16): 2, (4, 8): 1}


def test_from_traffic_on_torchscript_builds_the_chosen_plans_and_serves_the_traffic(mlp, scripted):
    traffic = stream(5)
    cache = PlanCache.from_traffic(scripted, traffic, 3, (x(2),), miss_mode="pad", progress=False)
    choice = cache.bucket_choice
    assert 1 <= len(choice.plans) <= 3 and cache.buckets == choice.buckets
    assert cache.cached_buckets() == [list(p) for p in choice.plans]
    assert cache.traffic() == as_traffic(traffic)
    for n in sorted(set(traffic)):
        inputs = x(n)
        with torch.no_grad():
            torch.testing.assert_close(cache(inputs), mlp(inputs))
    assert cache.stats().builds == len(choice.plans)  # every request served by a chosen plan
    with pytest.raises(TypeError, match="needs example_inputs"):
        PlanCache.from_traffic(scripted, traffic, 3)
    with pytest.raises(TypeError, match="chooses the buckets"):
        PlanCache.from_traffic(scripted, traffic, 3, (x(2),), buckets=[[4]])
    with pytest.raises(ValueError, match="plan_budget must be a positive integer, got 0"):
        PlanCache.from_traffic(scripted, traffic, 0, (x(2),))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_from_traffic_on_cuda_times_the_device_and_runs_each_learned_bucket_as_a_cuda_graph(mlp, monkeypatch):
    module = torch.jit.script(copy.deepcopy(mlp).cuda())
    waits = []
    synchronize = torch.accelerator.synchronize
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: waits.append(device) or synchronize(device))
    traffic = stream(5)
    cache = PlanCache.from_traffic(module, traffic, 3, (x(2).cuda(),), miss_mode="pad", cuda_graphs=True,
                                   progress=False)
    assert waits and all(torch.device(d).type == "cuda" for d in waits)  # each timed run waited for its kernels
    for n in sorted(set(traffic)):
        inputs = x(n).cuda()
        torch.testing.assert_close(cache(inputs), reference(module, inputs), rtol=1e-5, atol=1e-5)
    s = cache.stats()
    assert s.plans == len(cache.bucket_choice.plans) and s.cuda_graphs == s.plans and s.graph_capture_failures == 0
    assert sum(z.graph_replays for z in s.sizes) == len(set(traffic))  # every request replayed its bucket's graph


def test_measuring_builds_a_plan_at_each_timed_size_whatever_the_caches_miss_mode(scripted):
    from torch_ext.plan.traffic import measure_plans
    probes = []

    def make(**options):  # the cache serving the traffic pads its misses in the background
        probes.append(PlanCache(scripted, **{"miss_mode": "pad", "background_builds": True, "max_plans": 1,
                                             **options}))
        return probes[-1]

    measure_plans(make, as_traffic(range(1, 17)), (x(2),), exported=False)
    (probe,) = probes
    timed = {z.batch_size: z for z in probe.stats().sizes}
    # Sizes 1, 5, 8, 12 and 16 (5 spread over the traffic's range), each built and served as its own
    # plan: padded onto the plan of 16, every size would time as 16.
    assert sorted(timed) == [1, 5, 8, 12, 16]
    assert all(z.builds == 1 and z.padded_calls == 0 and z.hits > 0 for z in timed.values())


SHAPES = ({0: Dim("batch", max=16)},)


def test_auto_times_a_bucket_at_the_sizes_its_traffic_brings(mlp):
    cache = PlanCache(mlp, (x(2),), SHAPES, buckets=[[8, 16]], plan_shapes="auto", inductor_configs=FAST,
                      warmup_calls=1)
    cache.observe_traffic({3: 5, 5: 2, 12: 7})
    cache.preload([8], progress=False)  # sizes 1..8: 3 and 5 logged
    cache.clear_traffic()
    cache.preload([16], progress=False)  # nothing logged: the bucket's smallest, middle and largest
    probes = {z.batch_size: z.probe_sizes for z in cache.stats().sizes}
    assert probes == {8: 2, 16: 0}


def test_from_traffic_on_a_module_exports_it_once_builds_within_its_budget_and_equals_eager(mlp, monkeypatch):
    exports = []
    export = torch.export.export

    def counted(module, *args, **kwargs):
        exports.extend([module] if module is mlp else [])
        return export(module, *args, **kwargs)

    saves = []
    save = torch.export.save

    def counted_save(program, path, *args, **kwargs):
        saves.append(path)
        return save(program, path, *args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    monkeypatch.setattr(torch.export, "save", counted_save)
    traffic = stream(7, count=200)
    cache = PlanCache.from_traffic(mlp, traffic, 2, (x(2),), SHAPES, inductor_configs=FAST, warmup_calls=1,
                                   miss_mode="pad", progress=False)
    # The probes that measure each plan kind and the cache share one export of the module, and its file.
    assert len(exports) == 1 and len(saves) == 1
    choice = cache.bucket_choice
    s = cache.stats()
    assert 1 <= len(choice.plans) <= 2
    # 'auto' compiles two a bucket of several sizes (timed at its logged sizes), one a bucket of one.
    lowers = dict(zip(choice.buckets[0], [1] + [b + 1 for b in choice.buckets[0][:-1]]))
    ranged = {(n,) for n, lower in lowers.items() if lower < n}
    assert s.compiles == sum(2 if p in ranged else 1 for p in choice.plans)
    # The MLP scripts, so even a bucket of one size has two kinds to time (static and TorchScript),
    # and the buckets were chosen weighing its frozen TorchScript too (measured on a probe of its own).
    assert all(z.probe_sizes > 0 and z.script_seconds > 0 for z in s.sizes)
    assert cache._costs.script_cost is not None
    for n in sorted(set(traffic)):
        inputs = x(n)
        with torch.no_grad():
            torch.testing.assert_close(cache(inputs), mlp(inputs), rtol=1e-4, atol=1e-5)
    assert cache.stats().compiles == s.compiles  # the traffic needed no other plan


def test_traffic_above_the_programs_largest_size_is_refused_before_anything_compiles(mlp, monkeypatch):
    from torch_ext.plan import _compile
    compiles = []
    for name in ("compile_bucket", "compile_in_subprocess"):
        monkeypatch.setattr(_compile, name, lambda *args, **kwargs: compiles.append(args))
    # SHAPES accepts batches up to 16; a recorded stream may hold larger ones the cache would refuse.
    with pytest.raises(ValueError, match=r"PlanCache: 5 of the traffic's requests have a batch above 16, the largest "
                                         r"the program accepts \(up to 21\); leave them out"):
        PlanCache.from_traffic(mlp, [3] * 10 + [20] * 4 + [21], 2, (x(2),), SHAPES, inductor_configs=FAST,
                               progress=False)
    assert compiles == []


def test_traffic_with_a_size_per_dimension_the_program_lacks_is_refused_before_anything_compiles(
        mlp, scripted, monkeypatch):
    from torch_ext.plan import _compile
    compiles = []
    for name in ("compile_bucket", "compile_in_subprocess"):
        monkeypatch.setattr(_compile, name, lambda *args, **kwargs: compiles.append(args))
    # (batch, length) pairs for a model with a batch dimension alone: before, the probe's constructor
    # refused "buckets" the user never passed.
    message = (r"PlanCache: the traffic's requests have 2 size\(s\) each, and the program has 1 dynamic "
               r"dimension\(s\); give one size per dynamic dimension, the batch first")
    with pytest.raises(ValueError, match=message):
        PlanCache.from_traffic(mlp, [(3, 20), (5, 7)], 2, (x(2),), SHAPES, inductor_configs=FAST, progress=False)
    with pytest.raises(ValueError, match=message):
        PlanCache.from_traffic(scripted, [(3, 20), (5, 7)], 2, (x(2),), progress=False)
    with pytest.raises(ValueError, match=message):  # before: "PlanCache.example_inputs: expected a size per ..."
        PlanCache(scripted).replan(2, traffic=[(3, 20), (5, 7)])
    assert compiles == []


def test_a_child_forked_while_threads_log_traffic_serves_and_logs_without_hanging(scripted):
    import os
    import threading
    import time
    cache = PlanCache(scripted)
    cache.preload([2, 3], example_inputs=(x(1),), progress=False)
    stop = threading.Event()

    two, three = x(2), x(3)  # made here: torch.randn takes the generator's lock, which a fork may copy held

    def serve():
        while not stop.is_set():
            cache(two)

    threads = [threading.Thread(target=serve) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(20):  # forks land while the threads hold the log's lock, some of the time
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    cache(three)
                    code = 0 if cache.traffic()[(3,)] >= 1 else 1
                finally:
                    os._exit(code)
            deadline = time.monotonic() + 60
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    assert os.waitstatus_to_exitcode(status) == 0
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    pytest.fail("the forked child hung")
                time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_replan_chooses_buckets_for_the_logged_traffic_and_serves_from_them(mlp, scripted):
    # One plan for traffic of one size, then one for requests that drifted past it: with a budget of
    # one plan the choice is the largest size, whatever the measured costs.
    cache = PlanCache.from_traffic(scripted, {2: 50}, 1, (x(2),), miss_mode="pad", progress=False)
    assert cache.buckets == [[2]]
    for _ in range(30):
        cache(x(12))
    choice = cache.replan(1)
    assert choice is cache.bucket_choice and choice.buckets == cache.buckets == [[12]]
    assert cache.cached_buckets() == [[12]] and choice.plan_requests == [80]  # the whole log: 50 + 30
    assert (cache.stats().builds, cache.stats().calls) == (1, 0)  # the new cache's: built before the swap
    assert cache.traffic() == {(2,): 50, (12,): 30}
    for n in (1, 5, 12):
        inputs = x(n)
        with torch.no_grad():
            torch.testing.assert_close(cache(inputs), mlp(inputs))
    assert cache.stats().builds == 1  # the chosen plan serves every size
    # The same traffic within the sizes measured before: the same costs, the same buckets, nothing built.
    plans = cache.script_object
    assert cache.replan(1, {2: 1, 12: 1}).buckets == [[12]] and cache.script_object is plans


def test_a_background_replan_leaves_requests_to_the_current_plans_until_it_swaps(mlp, scripted, monkeypatch):
    import threading
    cache = PlanCache.from_traffic(scripted, {2: 50}, 1, (x(2),), miss_mode="pad", progress=False)
    old = cache.script_object
    building, release = threading.Event(), threading.Event()
    preload = PlanCache.preload

    def held_preload(self, *args, **kwargs):  # the new cache's plans: held until the test has served
        building.set()
        assert release.wait(60)
        return preload(self, *args, **kwargs)

    monkeypatch.setattr(PlanCache, "preload", held_preload)
    future = cache.replan(1, {12: 5}, background=True)
    assert building.wait(60)
    inputs = x(2)
    with torch.no_grad():  # served while the re-plan builds: by the current plan, at once
        torch.testing.assert_close(cache(inputs), mlp(inputs))
    assert not future.done() and cache.script_object is old and cache.buckets == [[2]]
    release.set()
    choice = future.result(timeout=60)
    assert cache.script_object is not old and cache.buckets == choice.buckets == [[12]]
    inputs = x(12)
    with torch.no_grad():
        torch.testing.assert_close(cache(inputs), mlp(inputs))


def test_a_queued_background_replan_compares_with_the_buckets_it_finds_when_it_runs(scripted, monkeypatch):
    import threading
    cache = PlanCache.from_traffic(scripted, {2: 50}, 1, (x(2),), miss_mode="pad", progress=False)
    release = threading.Event()
    preload = PlanCache.preload

    def held_preload(self, *args, **kwargs):  # the first re-plan's build waits until the second is queued
        assert release.wait(60)
        return preload(self, *args, **kwargs)

    monkeypatch.setattr(PlanCache, "preload", held_preload)
    first = cache.replan(1, {12: 5}, background=True)
    second = cache.replan(1, {2: 5}, background=True)  # queued while the buckets are still [[2]]
    release.set()
    assert first.result(timeout=60).buckets == [[12]]
    # By the time it runs the cache holds [[12]]: choosing [[2]] is a change, and it is built.
    assert second.result(timeout=60).buckets == [[2]] and cache.buckets == [[2]] and cache.cached_buckets() == [[2]]


def test_replan_refuses_what_it_cannot_plan(scripted):
    cache = PlanCache(scripted)
    with pytest.raises(ValueError, match="plan_budget must be a positive integer, got 0"):
        cache.replan(0)
    with pytest.raises(ValueError, match="no requests"):
        cache.replan(2)  # an empty log: nothing to plan for
    cache.observe_traffic({4: 3})
    with pytest.raises(RuntimeError, match="example"):
        cache.replan(2)  # nothing served yet: no example inputs to time the model with
    assert cache.buckets == [] and cache.replan(2, example_inputs=(x(1),)).buckets == [[4]]
    assert cache.cached_buckets() == [[4]]


def test_a_compile_budget_in_seconds_bounds_the_plans_or_is_refused(scripted):
    traffic = stream(5)
    roomy = PlanCache.from_traffic(scripted, traffic, example_inputs=(x(2),), compile_seconds=1e9, miss_mode="pad",
                                   progress=False)
    assert roomy.bucket_choice.max_plans == len(set(traffic))  # seconds to spare: as many plans as sizes
    both = PlanCache.from_traffic(scripted, traffic, 2, (x(2),), compile_seconds=1e9, progress=False)
    assert both.bucket_choice.max_plans == 2 and len(both.bucket_choice.plans) <= 2
    # No build takes a nanosecond: not even one plan fits, and the error says what the budget left.
    with pytest.raises(ValueError, match=r"compile_seconds=1e-09 leaves 0.00 s after measuring the model \(.* s of "
                                         r"builds\), less than one plan's predicted"):
        PlanCache.from_traffic(scripted, traffic, example_inputs=(x(2),), compile_seconds=1e-9, progress=False)
    plans = roomy.script_object
    with pytest.raises(ValueError, match=r"PlanCache.replan: compile_seconds=1e-09 leaves 0.00 s after measuring "
                                         r"the model \(0.00 s of builds\)"):
        roomy.replan(compile_seconds=1e-9)  # the costs measured before serve: no build spent
    assert roomy.script_object is plans
    with pytest.raises(TypeError, match=r"give plan_budget \(plans\), compile_seconds \(seconds of builds\), or both"):
        PlanCache.from_traffic(scripted, traffic, example_inputs=(x(2),))
    for bad in (0.0, -1, float("inf"), float("nan"), "10", True):
        with pytest.raises(ValueError, match="compile_seconds must be a positive number of seconds"):
            PlanCache.from_traffic(scripted, traffic, example_inputs=(x(2),), compile_seconds=bad)


def test_predicted_seconds_of_the_chosen_buckets_is_what_the_choice_predicted():
    traffic = as_traffic(stream(11))
    cost = lambda s: 1e-4 + 1e-5 * np.asarray(s, dtype=np.float64).prod(axis=1)  # noqa: E731
    dynamic = lambda s: 1.3e-4 + 1e-5 * np.asarray(s, dtype=np.float64).prod(axis=1)  # noqa: E731
    for costs in ((cost, None), (cost, dynamic)):
        choice = choose_buckets(traffic, 3, *costs)
        assert predicted_seconds(traffic, choice.buckets, *costs) == pytest.approx(choice.predicted_seconds, rel=1e-12)
        # One bucket holding everything pads every request to the largest size: never cheaper.
        assert predicted_seconds(traffic, [[max(choice.buckets[0])]], *costs) >= choice.predicted_seconds
    assert predicted_seconds(traffic, [[4]], cost) == float("inf")  # requests past 4 have no bucket
    with pytest.raises(ValueError, match="the traffic has 1 dynamic dimension"):
        predicted_seconds(traffic, [[4], [8]], cost)


def serve(cache, sizes):
    for n in sizes:
        cache(x(n))


def test_a_cache_with_no_buckets_learns_them_at_its_first_drift_check(mlp, scripted):
    cache = PlanCache(scripted, miss_mode="pad")
    cache.replan_on_drift(1, every=20)
    assert cache.drift_stats() == DriftStats(0, 0, float("inf"), cache.drift_stats().best_seconds, None)
    serve(cache, [3, 7, 5, 2] * 5)  # 20 requests: the check is due
    cache.wait_for_replans(60)
    stats = cache.drift_stats()
    assert (stats.checks, stats.replans, stats.error) == (1, 1, None)
    assert stats.current_seconds == float("inf")  # nothing planned yet: any choice is better
    # A budget of one plan: the largest size, whatever the measured costs; the log restarts at the window.
    assert cache.buckets == cache.bucket_choice.buckets == [[7]] and cache.cached_buckets() == [[7]]
    assert cache.traffic() == {(3,): 5, (7,): 5, (5,): 5, (2,): 5}
    for n in (1, 6):
        inputs = x(n)
        with torch.no_grad():
            torch.testing.assert_close(cache(inputs), mlp(inputs))


def test_drift_past_the_buckets_replans_and_traffic_they_serve_well_does_not(mlp, scripted):
    cache = PlanCache.from_traffic(scripted, {2: 50}, 1, (x(2),), miss_mode="pad", progress=False)
    cache.replan_on_drift(1, every=10)
    serve(cache, [1, 2] * 5)  # within the plan of 2, which is the best single plan for them
    cache.wait_for_replans(60)
    stats = cache.drift_stats()
    assert (stats.checks, stats.replans) == (1, 0) and stats.current_seconds == stats.best_seconds
    plans = cache.script_object
    assert cache.buckets == [[2]]
    serve(cache, [12] * 10)  # past every bucket: re-planned on this window
    cache.wait_for_replans(60)
    stats = cache.drift_stats()
    assert (stats.checks, stats.replans) == (2, 1) and stats.current_seconds == float("inf")
    assert cache.script_object is not plans and cache.buckets == [[12]] and cache.traffic() == {(12,): 10}
    inputs = x(9)
    with torch.no_grad():
        torch.testing.assert_close(cache(inputs), mlp(inputs))
    cache.replan_on_drift(every=None)  # off: no check however many requests come
    serve(cache, [20] * 15)
    cache.wait_for_replans(60)
    assert cache.drift_stats() is None and cache.buckets == [[12]]


def test_a_batchers_requests_count_toward_drift_and_its_batches_follow_the_replan(mlp, scripted):
    cache = PlanCache.from_traffic(scripted, {2: 50}, 1, (x(2),), miss_mode="pad", progress=False)
    cache.replan_on_drift(1, every=10)
    planned = cache.script_object
    with Batcher(cache, max_batch_size=12, max_delay_ms=0) as batcher:
        for _ in range(10):  # each fills a batch of 12 rows: past every bucket
            batcher(x(12))
        cache.wait_for_replans(60)
        stats = cache.drift_stats()
        assert (stats.checks, stats.replans) == (1, 1) and cache.buckets == [[12]]
        assert cache.script_object is not planned
        served_before = planned.stats().calls
        with torch.no_grad():
            for n in (12, 5):  # the second waits for max_delay_ms (0) on the batcher's thread
                inputs = x(n)
                torch.testing.assert_close(batcher.submit(inputs).result(), mlp(inputs))
        assert (cache.stats().calls, planned.stats().calls) == (2, served_before)  # the new plans served them


def test_a_drift_check_is_never_run_by_a_request(mlp, scripted, monkeypatch):
    import threading
    cache = PlanCache.from_traffic(scripted, {2: 50}, 1, (x(2),), miss_mode="pad", progress=False)
    cache.replan_on_drift(1, every=5)
    checking, release = threading.Event(), threading.Event()
    check = PlanCache._check_drift

    def held_check(self, drift):  # the check is held until the requests after it were served
        assert threading.current_thread().name.startswith("PlanCache.replan")
        checking.set()
        assert release.wait(60)
        return check(self, drift)

    monkeypatch.setattr(PlanCache, "_check_drift", held_check)
    serve(cache, [12] * 5)
    assert checking.wait(60)
    inputs = x(2)
    for _ in range(20):  # served at once by the current plans while the check waits (and counted)
        with torch.no_grad():
            torch.testing.assert_close(cache(inputs), mlp(inputs))
    assert cache.buckets == [[2]] and cache.drift_stats().checks == 0
    release.set()
    cache.wait_for_replans(60)
    # The held check's window (5 of 12, 20 of 2) and four more that found nothing left to choose.
    assert cache.buckets == [[12]] and cache.drift_stats().replans == 1


def test_replan_on_drift_refuses_bad_settings_and_reports_a_failed_check(scripted):
    cache = PlanCache(scripted)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="every must be a positive number of requests"):
            cache.replan_on_drift(1, every=bad)
    with pytest.raises(ValueError, match="tolerance must be a non-negative fraction"):
        cache.replan_on_drift(1, tolerance=-0.1)
    with pytest.raises(TypeError, match="PlanCache.replan_on_drift: give plan_budget"):
        cache.replan_on_drift()
    cache.replan_on_drift(compile_seconds=1e-9, every=3)  # no plan fits: the check fails, requests go on
    with pytest.warns(RuntimeWarning, match="replan_on_drift: the check failed"):
        serve(cache, [4, 4, 4])
        cache.wait_for_replans(60)
    assert "compile_seconds=1e-09" in cache.drift_stats().error and cache.buckets == []
