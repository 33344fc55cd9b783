import random
import threading
import warnings

import pytest
import torch

import torch_ext
from torch_ext import Batcher, PlanCache


def by_size(stats):
    """A PlanCacheStats' per-size figures, by batch size."""
    return {z.batch_size: z for z in stats.sizes}


class RowWise(torch.nn.Module):
    """Correctly rounded row-wise math (mul, add, relu): padding, splitting and plans at any size
    must give bit-identical rows."""

    def __init__(self, features: int = 8) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * self.scale + 0.5) * 2.0


class Net(torch.nn.Module):
    """Linear layers and a tuple output; plans agree with the module up to GEMM rounding."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor):
        y = self.fc2(torch.relu(self.fc1(x)))
        return y, y.sum(1)


def scripted(module: torch.nn.Module) -> torch.jit.ScriptModule:
    return torch.jit.script(module.eval())


@pytest.fixture
def rowwise():
    torch.manual_seed(0)
    return scripted(RowWise())


def x(n: int) -> torch.Tensor:
    return torch.randn(n, 8)


def run_in_threads(target, seeds) -> None:
    threads = [threading.Thread(target=target, args=(seed,)) for seed in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def reference(module, *inputs):
    with torch.no_grad():
        return module(*inputs)


@pytest.mark.parametrize("specialize", [False, True], ids=["one_module", "clone_per_size"])
@pytest.mark.parametrize("mode", ["exact", "pad", "split", "auto"])
def test_every_mode_equals_the_module_at_every_size(rowwise, mode, specialize):
    cache = PlanCache(rowwise, miss_mode=mode, warmup_calls=2, specialize_shapes=specialize)
    cache.preload([1, 4, 8], example_inputs=(x(2),), progress=False)
    for n in [1, 3, 5, 8, 11, 2, 3]:
        inputs = x(n)
        assert torch.equal(cache(inputs), reference(rowwise, inputs)), (mode, n)
    s = cache.stats()
    assert s.calls == 7
    if mode == "pad":
        assert s.padded_calls >= 3 and s.padded_elements > 0
    if mode == "split":
        assert s.split_calls >= 3


def test_tuple_outputs_pad_and_split_agree_with_the_module():
    torch.manual_seed(0)
    module = scripted(Net())
    for mode in ("pad", "split"):
        cache = PlanCache(module, miss_mode=mode, warmup_calls=2)
        cache.preload([2, 8], example_inputs=(x(1),), progress=False)
        inputs = x(6)
        got, want = cache(inputs), reference(module, inputs)
        # Rounding of the GEMMs depends on the batch size and on the frozen weights' layout.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_statistics_count_hits_misses_builds_and_padding(rowwise):
    cache = PlanCache(rowwise, miss_mode="pad", warmup_calls=2)
    cache(x(4))
    cache(x(4))
    cache(x(3))  # padded to 4
    s = cache.stats()
    assert (s.calls, s.hits, s.misses, s.builds) == (3, 1, 2, 1)
    assert (s.padded_calls, s.padded_elements) == (1, 1)
    assert s.build_seconds > 0 and s.plan_bytes > 0 and s.plans == 1
    assert by_size(s)[4].calls == 2 and by_size(s)[4].plan_runs == 3 and by_size(s)[4].cached
    assert by_size(s)[3].padded_elements == 1 and not by_size(s)[3].cached
    assert s.hit_lookup_seconds > 0
    cache.reset_stats()
    assert cache.stats().calls == 0


def test_background_builds_serve_by_pad_then_swap_in(rowwise):
    cache = PlanCache(rowwise, miss_mode="pad", background_builds=True, warmup_calls=2)
    cache.preload([8], example_inputs=(x(8),), progress=False)
    inputs = x(5)
    assert torch.equal(cache(inputs), reference(rowwise, inputs))
    assert cache.stats().padded_calls == 1
    cache.wait_for_builds()
    assert 5 in cache
    assert torch.equal(cache(inputs), reference(rowwise, inputs))
    assert by_size(cache.stats())[5].hits == 1


def test_admission_and_lru_bound(rowwise):
    cache = PlanCache(rowwise, admit_after=2, max_plans=2, warmup_calls=1)
    cache(x(1))
    assert 1 not in cache and cache.stats().fallback_calls == 1
    for n in (1, 2, 2, 1, 3, 3):
        cache(x(n))
    assert cache.cached_sizes() == [1, 3]  # 2 was the least recently used
    assert cache.stats().evictions == 1


def tensor_constants(module) -> set:
    """Data pointers of the tensor constants in a plan's graph (its frozen weights)."""
    return {node.output().toIValue().data_ptr() for node in module.forward.graph.nodes()
            if node.kind() == "prim::Constant" and node.output().type().kind() == "TensorType"}


def test_plans_share_their_weights_and_the_byte_budget_counts_them_once(rowwise):
    probe = PlanCache(rowwise, warmup_calls=1)
    probe(x(1))
    one = probe.stats().plan_bytes
    assert one > 0
    cache = PlanCache(rowwise, warmup_calls=1)
    for n in (1, 2, 3, 4):
        cache(x(n))
    s = cache.stats()
    assert s.plans == 4 and s.plan_bytes == one
    assert all(size.plan_bytes == one for size in s.sizes)
    weights = [tensor_constants(cache.plan_module(n)) for n in (1, 2, 3, 4)]
    assert weights[0] and all(w == weights[0] for w in weights)
    # A budget below the shared weights keeps only the most recent plan.
    tight = PlanCache(rowwise, max_bytes=one - 1, warmup_calls=1)
    for n in (1, 2, 3, 4):
        tight(x(n))
    s = tight.stats()
    assert tight.cached_sizes() == [4] and s.evictions == 3 and s.plan_bytes == one


def test_select_batch_size_and_infer_batch(rowwise):
    cache = PlanCache(rowwise, max_batch_size=8, warmup_calls=1)
    cache.preload([4, 8], example_inputs=(x(1),), progress=False)
    assert cache.select_batch_size(100) == 8
    assert cache.select_batch_size(7) == 4
    assert cache.select_batch_size(2) == 2
    inputs = x(29)
    assert torch.equal(cache.infer_batch(inputs), reference(rowwise, inputs))
    with pytest.raises(RuntimeError, match="above max_batch_size 8"):
        cache(inputs)


def test_batch_dims_per_input():
    @torch.jit.script
    def _unused(a: torch.Tensor) -> torch.Tensor:
        return a

    class TwoInputs(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b.t()

    module = scripted(TwoInputs())
    cache = PlanCache(module, batch_dims=[0, 1], miss_mode="split", warmup_calls=1)
    cache.preload([1, 2], example_inputs=(torch.randn(1, 3), torch.randn(3, 1)), progress=False)
    a, b = torch.randn(5, 3), torch.randn(3, 5)
    assert torch.equal(cache(a, b), a + b.t())
    assert cache.stats().split_calls == 1


class Scaled(torch.nn.Module):
    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale


def test_non_tensor_arguments_pass_through():
    module = scripted(Scaled())
    cache = PlanCache(module, batch_dims=[0, -1], miss_mode="pad", warmup_calls=1)
    cache.preload([4], example_inputs=(x(1), 3.0), progress=False)
    inputs = x(3)
    assert torch.equal(cache(inputs, 3.0), inputs * 3.0)
    assert cache.stats().padded_calls == 1


def test_bad_inputs_get_clear_errors_and_the_cache_stays_usable(rowwise):
    cache = PlanCache(rowwise, warmup_calls=1)
    with pytest.raises(RuntimeError, match="building the plan for batch size 4 failed"):
        cache(torch.randn(4, 9))
    assert cache.stats().build_failures == 1 and 4 not in cache
    good = x(4)
    assert torch.equal(cache(good), reference(rowwise, good))
    with pytest.raises(RuntimeError, match=r"input 0 has shape \[4, 7\]"):
        cache(torch.randn(4, 7))
    with pytest.raises(RuntimeError, match="empty batch"):
        cache(torch.randn(0, 8))
    with pytest.raises(RuntimeError, match="dtype"):
        cache(good.double())
    with pytest.raises(RuntimeError, match="different batch sizes"):
        PlanCache(scripted(TwoAdd()))(torch.randn(3, 2), torch.randn(4, 2))
    assert torch.equal(cache(good), reference(rowwise, good))
    # An option of the wrong type is named with its type (the buckets are a list per dynamic dimension).
    with pytest.raises(TypeError, match=r"^PlanCache: option buckets takes List\[List\[int\]\], got \[2, 4\] \(list\)$"):
        PlanCache(rowwise, buckets=[2, 4])
    with pytest.raises(TypeError, match=r"^Batcher: option max_batch_size takes int, got 2.5 \(float\)$"):
        Batcher(cache, max_batch_size=2.5)


def test_an_input_that_requires_grad_is_refused_where_grad_mode_would_expect_a_gradient(rowwise):
    # Plans record no autograd: served with grad mode on, such an input would silently get no gradient.
    cache = PlanCache(rowwise, warmup_calls=1, miss_mode="pad")
    wants_grad = x(3).requires_grad_()
    for call in (cache, cache.infer_batch, lambda t: cache.script_object.infer([t])):
        with pytest.raises(ValueError, match="input 0 requires grad, but plans serve inference"):
            call(wants_grad)
    assert cache.stats().calls == 0
    with torch.no_grad():
        assert torch.equal(cache(wants_grad), reference(rowwise, wants_grad))
    with torch.inference_mode():
        assert torch.equal(cache(wants_grad), reference(rowwise, wants_grad))
    assert torch.equal(cache(wants_grad.detach()), reference(rowwise, wants_grad))


class TwoAdd(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b


def test_modules_that_cannot_be_used_are_rejected(tmp_path):
    with pytest.raises(RuntimeError, match="training mode"):
        PlanCache(torch.jit.script(RowWise().train()))
    with pytest.raises(TypeError, match="not scripted"):
        PlanCache(RowWise().eval())
    with pytest.raises(ValueError, match="unknown miss_mode"):
        PlanCache(scripted(RowWise()), miss_mode="sometimes")
    with pytest.raises(FileNotFoundError):
        PlanCache(tmp_path / "missing.pt")


def test_accepts_a_path(rowwise, tmp_path):
    path = tmp_path / "rowwise.pt"
    rowwise.save(str(path))
    cache = PlanCache(path, warmup_calls=1)
    inputs = x(3)
    assert torch.equal(cache(inputs), reference(rowwise, inputs))
    plan = cache.plan_module(3)
    assert plan is not None and cache.plan_module(5) is None
    assert torch.equal(reference(plan, inputs), reference(rowwise, inputs))


def test_save_and_load_skip_rebuilding(rowwise, tmp_path):
    cache = PlanCache(rowwise, warmup_calls=1)
    cache.preload([2, 6], example_inputs=(x(1),), progress=False)
    cache.save(tmp_path / "plans")
    restarted = PlanCache(rowwise, warmup_calls=1)
    assert restarted.load(tmp_path / "plans") == 2
    assert restarted.cached_sizes() == [2, 6]
    inputs = x(6)
    assert torch.equal(restarted(inputs), reference(rowwise, inputs))
    assert restarted.stats().misses == 0
    other = PlanCache(scripted(RowWise()), warmup_calls=1)
    with pytest.raises(RuntimeError, match="different module"):
        other.load(tmp_path / "plans")
    with pytest.raises(FileNotFoundError):
        other.load(tmp_path / "nowhere")


@pytest.mark.parametrize("mode", ["exact", "pad", "split", "auto"])
@pytest.mark.parametrize("background", [False, True])
def test_concurrent_stress_with_evictions(rowwise, mode, background):
    # Pad, split and auto serve most sizes from cached ones: a single plan forces evictions.
    max_plans = 2 if mode == "exact" else 1
    cache = PlanCache(rowwise, miss_mode=mode, background_builds=background, max_plans=max_plans, warmup_calls=1)
    cache.preload([8], example_inputs=(x(8),), progress=False)
    wrong = []
    errors = []

    def work(seed):
        rng = random.Random(seed)
        try:
            for _ in range(25):
                n = rng.randint(1, 10)
                inputs = x(n)
                if not torch.equal(cache(inputs), reference(rowwise, inputs)):
                    wrong.append(n)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    run_in_threads(work, range(4))
    cache.wait_for_builds()
    s = cache.stats()
    assert not errors and not wrong
    assert s.calls == 100 and s.hits + s.misses == 100
    assert s.plans <= max_plans and s.evictions > 0


def test_torchscript_code_uses_the_class(rowwise):
    cache = PlanCache(rowwise, miss_mode="pad", warmup_calls=1)
    cache.preload([4], example_inputs=(x(4),), progress=False)

    @torch.jit.script
    def serve(plans: torch.classes.torch_ext.PlanCache, inputs: torch.Tensor) -> torch.Tensor:
        out = plans.infer(inputs)
        assert isinstance(out, torch.Tensor)
        return out

    inputs = x(3)
    assert torch.equal(serve(cache.script_object, inputs), reference(rowwise, inputs))
    assert cache.stats().padded_calls == 1


def test_static_runtime_plans_equal_the_module(rowwise):
    cache = PlanCache(rowwise, static_runtime=True, warmup_calls=1)
    for n in (1, 5, 1):
        inputs = x(n)
        assert torch.equal(cache(inputs), reference(rowwise, inputs))
    assert cache.stats().hits == 1


def executed_graph(cache: PlanCache, n: int) -> torch._C.Graph:
    with torch.no_grad():
        return cache.plan_module(n).graph_for(x(n))


def is_profiled(graph: torch._C.Graph) -> bool:
    """Whether the profiling executor compiled the graph: it carries complete tensor types (the
    simple executor runs the frozen graph with its generic ones)."""
    return any(isinstance(v.type(), torch._C.TensorType) and v.type().sizes() is not None
               for node in graph.nodes() for v in node.outputs())


@pytest.mark.parametrize("specialize", [None, True, False])
def test_plans_are_clones_specialised_to_their_size_only_where_torchscript_fuses_unless_told(rowwise, specialize):
    fuses_on_cpu, needs_llvm = torch._C._jit_can_fuse_on_cpu(), torch._C._jit_get_te_must_use_llvm_cpu()
    torch._C._jit_set_te_must_use_llvm_cpu(False)  # the CPU wheel has no LLVM: NNC interprets
    try:
        for cpu_fusion in (False, True):
            torch._C._jit_override_can_fuse_on_cpu(cpu_fusion)
            cache = PlanCache(rowwise, specialize_shapes=specialize)
            for n in (3, 3, 6, 6):
                inputs = x(n)
                assert torch.equal(cache(inputs), reference(rowwise, inputs)), (cpu_fusion, n)
            clones = cpu_fusion if specialize is None else specialize
            types = {cache.plan_module(n)._c._type().qualified_name() for n in (3, 6)}
            assert len(types) == (2 if clones else 1), cpu_fusion
            graphs = [executed_graph(cache, n) for n in (3, 6)]
            if clones:
                assert all(is_profiled(graph) for graph in graphs), cpu_fusion
            else:
                # One graph for every size: profiled once where nothing fuses (no shape guards),
                # else run by the simple executor (a fusion group would guard on the first size).
                assert str(graphs[0]) == str(graphs[1]), cpu_fusion
                assert is_profiled(graphs[0]) == (not cpu_fusion), cpu_fusion
    finally:
        torch._C._jit_override_can_fuse_on_cpu(fuses_on_cpu)
        torch._C._jit_set_te_must_use_llvm_cpu(needs_llvm)


def test_exported_from_the_package():
    assert torch_ext.PlanCache is PlanCache
    assert "PlanCache" in torch_ext.__all__


class Warns(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        warnings.warn("the plan warned")
        return x * 2.0


def test_a_plans_warnings_reach_pythons_warnings_module():
    cache = PlanCache(scripted(Warns()), warmup_calls=1)
    with pytest.warns(UserWarning, match="the plan warned"):  # built and run in this call
        cache(torch.randn(4, 8))


def test_cuda_graphs_are_ignored_on_cpu_inputs(rowwise):
    cache = PlanCache(rowwise, cuda_graphs=True, warmup_calls=1)
    inputs = x(4)
    assert torch.equal(cache(inputs), reference(rowwise, inputs))
    s = cache.stats()
    assert s.cuda_graphs == 0 and s.graph_capture_failures == 0
    assert not by_size(s)[4].cuda_graph and by_size(s)[4].graph_replays == 0


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class CudaNet(torch.nn.Module):
    """Two inputs (one unbatched), a tuple output, and a non-tensor argument."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.fc2 = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, scale: float):
        y = self.fc2(torch.relu(self.fc1(x))) + bias
        return y * scale, y.sum(1)


@needs_cuda
@pytest.mark.parametrize("mode", ["exact", "pad", "split"])
def test_cuda_graph_plans_equal_the_module_on_fresh_inputs_every_call(mode):
    torch.manual_seed(0)
    module = scripted(CudaNet().cuda())
    cache = PlanCache(module, miss_mode=mode, cuda_graphs=True, batch_dims=[0, -1, -1], warmup_calls=2)
    bias = torch.randn(8, device="cuda")
    cache.preload([1, 4, 8], example_inputs=(torch.randn(2, 8, device="cuda"), bias, 0.5), progress=False)
    held = []
    for n in [4, 4, 1, 8, 3, 5, 8, 2, 4]:
        inputs = (torch.randn(n, 8, device="cuda"), torch.randn(8, device="cuda"), 0.5)
        got, want = cache(*inputs), reference(module, *inputs)
        # The graph replays the plan's kernels; the eager module may pick other GEMM kernels.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        held.append((got, want))
    # Outputs are copies: later replays of the same graph did not overwrite earlier results.
    for got, want in held:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    s = cache.stats()
    assert s.cuda_graphs == s.plans and s.graph_capture_failures == 0
    assert all(by_size(s)[n].cuda_graph and by_size(s)[n].graph_bytes > 0 for n in (1, 4, 8))
    assert by_size(s)[4].graph_replays >= 3
    # A different non-tensor argument was not captured: the plan runs without its graph.
    replays = by_size(s)[4].graph_replays
    inputs = (torch.randn(4, 8, device="cuda"), bias, 2.0)
    torch.testing.assert_close(cache(*inputs), reference(module, *inputs), rtol=1e-5, atol=1e-5)
    assert by_size(cache.stats())[4].graph_replays == replays


class Synchronizing(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.sum() > 1e9):  # a host read of a device value cannot be captured
            return x
        return x * 2.0


@needs_cuda
def test_cuda_graph_capture_failure_runs_the_plan_without_a_graph():
    module = scripted(Synchronizing().cuda())
    cache = PlanCache(module, cuda_graphs=True, warmup_calls=1)
    inputs = torch.randn(4, 8, device="cuda")
    with pytest.warns(UserWarning, match="batch size 4 runs without a CUDA graph"):
        got = cache(inputs)
    assert torch.equal(got, inputs * 2.0)
    s = cache.stats()
    assert s.graph_capture_failures == 1 and s.cuda_graphs == 0 and s.plans == 1
    # The failed capture left the device, its random number generator and the cache usable.
    assert torch.equal(cache(inputs), inputs * 2.0)
    assert torch.randn(4, device="cuda").isfinite().all()
    torch.cuda.synchronize()


@needs_cuda
def test_cuda_graph_replays_from_many_threads_and_streams():
    torch.manual_seed(0)
    module = scripted(Net().cuda())
    cache = PlanCache(module, miss_mode="pad", cuda_graphs=True, max_plans=4, warmup_calls=1)
    cache.preload([1, 2, 4, 8, 16], example_inputs=(torch.randn(1, 8, device="cuda"),), progress=False)
    errors = []

    def serve(seed: int) -> None:
        rng = random.Random(seed)
        stream = torch.cuda.Stream()
        try:
            with torch.cuda.stream(stream):
                for _ in range(60):
                    inputs = torch.randn(rng.randint(1, 16), 8, device="cuda")
                    got, want = cache(inputs), reference(module, inputs)
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    run_in_threads(serve, range(6))
    assert not errors, errors[0]
    s = cache.stats()
    assert s.plans <= 4 and s.evictions >= 1
    assert sum(z.graph_replays for z in s.sizes) > 0


@needs_cuda
def test_cuda_graphs_with_background_builds_serve_misses_while_capturing():
    torch.manual_seed(0)
    module = scripted(Net().cuda())
    cache = PlanCache(module, miss_mode="pad", background_builds=True, cuda_graphs=True, warmup_calls=1)
    cache.preload([4, 16], example_inputs=(torch.randn(1, 8, device="cuda"),), progress=False)
    rng = random.Random(0)
    for _ in range(200):
        inputs = torch.randn(rng.randint(1, 16), 8, device="cuda")
        torch.testing.assert_close(cache(inputs)[0], reference(module, inputs)[0], rtol=1e-5, atol=1e-5)
        # Device-wide: it would fail if the background thread were capturing a graph right now.
        torch.cuda.synchronize()
    cache.wait_for_builds()
    for n in range(1, 17):  # a plan built in the background is captured by its first run
        inputs = torch.randn(n, 8, device="cuda")
        torch.testing.assert_close(cache(inputs)[0], reference(module, inputs)[0], rtol=1e-5, atol=1e-5)
    s = cache.stats()
    assert s.plans == 16 and s.cuda_graphs == 16 and s.graph_capture_failures == 0
    assert s.padded_calls > 0


@needs_cuda
def test_static_runtime_refuses_cuda_inputs_and_the_cache_stays_usable():
    module = scripted(RowWise().cuda())
    cache = PlanCache(module, static_runtime=True, warmup_calls=1)
    inputs = torch.randn(4, 8, device="cuda")
    with pytest.raises(RuntimeError, match="static runtime runs CPU modules only"):
        cache(inputs)
    assert cache.stats().build_failures == 1 and cache.stats().plans == 0
