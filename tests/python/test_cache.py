import copy
import operator
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch
from torch import fx, nn
from torch.nn import functional as F

import torch_ext
from torch_ext import LazyExecutor, NodeCache, lazy
from torch_ext.demos import GPT, GPTConfig


# ---- models ----
class Encoder(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 32), nn.Linear(32, 32)

    def forward(self, cond):
        return self.fc2(F.gelu(self.fc1(cond)))


class Denoiser(nn.Module):
    """A conditioning encoder and a denoiser: the diffusion sampler's shape."""

    def __init__(self, dim=16):
        super().__init__()
        self.encoder = Encoder(dim)
        self.inp, self.out = nn.Linear(dim, 32), nn.Linear(32, dim)

    def forward(self, x, cond):
        c = self.encoder(cond)
        return self.out(F.gelu(self.inp(x) + c))


class WeightNormLinear(nn.Module):
    """Weight normalisation written out, so the weight-only subgraph is visible to torch.fx."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.v = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)
        self.g = nn.Parameter(torch.ones(n_out, 1))
        self.b = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        w = self.g * self.v / self.v.norm(dim=1, keepdim=True)
        return F.linear(x, w, self.b)


class WeightNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = WeightNormLinear(8, 16), WeightNormLinear(16, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x * self.scale)))


class Stochastic(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        noise = torch.randn_like(x)
        return self.drop(self.fc(x)) + noise + F.dropout(x, 0.3, training=self.training)


def same(a, b):
    return torch.equal(a, b)


# ---- outputs and reuse ----
def test_repeated_inputs_are_reused_and_outputs_equal_the_plain_module():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16)).eval()
    executor = LazyExecutor(model)
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        first = executor(idx)
        assert executor.stats().nodes_reused == 0
        second = executor(idx)
        assert same(first, model(idx)) and same(second, model(idx))
    stats = executor.stats()
    # The whole graph is one reused subgraph: one lookup (its output) serves every node.
    assert stats.hits == 1 and stats.nodes_reused > stats.hits
    assert "wpe" in executor.cached_nodes()  # depends on idx's shape only: its own entry


def test_diffusion_loop_reuses_the_conditioning_and_recomputes_the_rest():
    torch.manual_seed(0)
    model = Denoiser().eval()
    executor = lazy(model)
    cond = torch.randn(4, 16)
    x = torch.randn(4, 16)
    with torch.no_grad():
        for _ in range(5):
            expected = model(x, cond)
            got = executor(x, cond)
            assert same(got, expected)
            x = x - 0.1 * got
    cached = executor.cached_nodes()
    assert "encoder_fc2" in cached  # the encoder's frontier: the one entry its subgraph needs
    assert not {"encoder_fc1", "gelu"} & set(cached)  # its interior is neither run nor held
    assert "inp" not in cached and "out" not in cached  # x varies: never stored after the second step
    stats = executor.stats()
    assert stats.hits == 4  # steps 2..5: one lookup serves the encoder's three nodes
    assert stats.nodes_reused == 4 * 3
    assert stats.misses == 0


class Arguments(nn.Module):
    """Nodes whose arguments are nested lists and tuples, slices, keywords, constants and methods."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, cond):
        c = self.fc(cond)
        y = torch.cat([x, c * 0.5], dim=1)[:, 1:-1:2]  # 7 columns
        parts = torch.split(y, [3, 4], 1)
        z = torch.stack((parts[0], parts[1][:, :3].clamp(min=-0.5, max=float("inf"))), 0).sum(dim=(0,))
        return {"out": z.transpose(0, 1).reshape(-1) + x.new_ones(1), "scale": y.shape[1]}


def test_steps_that_just_run_are_compiled_into_segments_that_equal_the_plain_module():
    torch.manual_seed(0)
    model = Arguments().eval()
    executor = lazy(model)
    cond = torch.randn(3, 8)
    with torch.no_grad():
        for step in range(6):  # from the third call on, x varies: its dependents run as segments
            x = torch.randn(3, 8)
            expected, got = model(x, cond), executor(x, cond)
            assert torch.equal(got["out"], expected["out"]) and got["scale"] == expected["scale"]
    plan = executor._plan()
    segments = [part for programs in (a.programs for a in plan.analyses.values())
                for program in programs.values() for part in program if hasattr(part, "count")]
    assert segments and max(part.count for part in segments) >= 5
    assert executor.stats().hits >= 4  # fc(cond) is looked up once per call and found


def test_in_place_edits_of_inputs_parameters_and_buffers_recompute_dependents():
    torch.manual_seed(0)
    model = WeightNormNet().eval()
    executor = LazyExecutor(model)
    x = torch.randn(5, 8)
    edits = [
        lambda: x.add_(1.0),                                      # an input
        lambda: model.l1.g.mul_(2.0),                             # a parameter
        lambda: model.scale.add_(0.25),                           # a buffer
        lambda: setattr(model.l2.v, "data", torch.randn(4, 16)),  # `.data =` swaps the storage
        lambda: model.l2.b.copy_(torch.randn(4)),
    ]
    with torch.no_grad():
        executor(x), executor(x)
        for edit in edits:
            edit()
            assert same(executor(x), model(x))
            assert same(executor(x), model(x))


def test_buffers_preprocessed_in_forward_are_traced_not_frozen():
    class Dequant(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("qweight", torch.randint(-127, 128, (4, 8), dtype=torch.int8))
            self.register_buffer("scale", torch.rand(4, 1))

        def forward(self, x):
            return F.linear(x, self.qweight.float() * self.scale)

    model = Dequant().eval()
    executor = LazyExecutor(model)
    x = torch.randn(3, 8)
    with torch.no_grad():
        executor(x), executor(x)
        assert "mul" in executor.cached_nodes() and "float_1" not in executor.cached_nodes()
        model.qweight.neg_()  # new weights loaded in place
        assert same(executor(x), model(x))


def test_a_random_tensor_frozen_by_tracing_is_refused():
    class FrozenNoise(nn.Module):
        def forward(self, x):
            return x + torch.randn(4, 8)

    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="differs between two traces"):
        LazyExecutor(FrozenNoise())
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random stream is untouched


def test_writes_through_data_are_not_seen_until_invalidate():
    model = WeightNormNet().eval()
    executor = LazyExecutor(model)
    x = torch.randn(5, 8)
    with torch.no_grad():
        before = executor(x)
        executor(x)
        model.l1.g.data.mul_(3.0)  # no version bump: the documented limitation
        stale = executor(x)
        assert same(stale, before) and not same(stale, model(x))
        executor.invalidate()
        assert same(executor(x), model(x))


def test_an_output_changed_in_place_by_the_caller_is_recomputed():
    model = Denoiser().eval()
    executor = LazyExecutor(model)
    x, cond = torch.randn(2, 16), torch.randn(2, 16)
    with torch.no_grad():
        executor(x, cond), executor(x, cond)
        out = executor(x, cond)
        out.mul_(0)
        assert same(executor(x, cond), model(x, cond))


def test_grad_mode_and_autocast_are_part_of_the_key():
    model = Denoiser()
    executor = LazyExecutor(model)
    x, cond = torch.randn(2, 16), torch.randn(2, 16)
    with torch.no_grad():
        executor(x, cond), executor(x, cond)
    out = executor(x, cond)  # grad enabled now: the no_grad outputs must not be reused
    assert out.requires_grad
    out.sum().backward()
    assert model.encoder.fc1.weight.grad is not None
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        expected = model(x, cond)
        got = executor(x, cond)
    assert got.dtype == expected.dtype == torch.bfloat16 and same(got, expected)
    with torch.no_grad():
        assert same(executor(x, cond), model(x, cond))


# ---- training ----
def test_training_outputs_gradients_and_parameters_equal_the_plain_module():
    torch.manual_seed(0)
    plain = WeightNormNet()
    lazy_model = copy.deepcopy(plain)
    executor = LazyExecutor(lazy_model)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt_lazy = torch.optim.SGD(executor.parameters(), lr=0.1, momentum=0.9)
    x, target = torch.randn(6, 8), torch.randn(6, 4)
    for _ in range(4):
        loss_plain = F.mse_loss(plain(x), target)
        loss_lazy = F.mse_loss(executor(x), target)
        assert same(loss_plain, loss_lazy)
        loss_plain.backward()
        loss_lazy.backward()
        for p, q in zip(plain.parameters(), lazy_model.parameters()):
            assert same(p.grad, q.grad)
        opt_plain.step(), opt_lazy.step()
        opt_plain.zero_grad(), opt_lazy.zero_grad()
    for p, q in zip(plain.parameters(), lazy_model.parameters()):
        assert same(p, q)
    # x * scale depends on the input and a buffer only: reused at every step after the first.
    assert executor.stats().hits >= 3
    # Parameters changed at every step: their dependents are no longer stored.
    assert executor.cached_nodes() == ["mul"]


def test_under_inference_mode_nothing_is_reused_and_outputs_stay_exact():
    model = Denoiser().eval()
    executor = LazyExecutor(model)
    x, cond = torch.randn(2, 16), torch.randn(2, 16)
    with torch.inference_mode():
        for _ in range(3):
            assert same(executor(x, cond), model(x, cond))
    assert executor.stats().hits == 0


def test_the_executor_is_freed_with_grad_outputs_cached():
    import gc
    import weakref

    executor = LazyExecutor(Denoiser())
    x, cond = torch.randn(2, 16), torch.randn(2, 16)
    out = executor(x, cond)
    out = executor(x, cond)  # cached outputs with autograd graphs and backward hooks
    ref = weakref.ref(executor)
    del executor
    gc.collect()
    assert ref() is None
    out.sum().backward()  # the hooks of a freed executor do nothing


def test_gradient_accumulation_reuses_nothing_whose_graph_a_backward_freed():
    torch.manual_seed(0)
    plain = WeightNormNet()
    lazy_model = copy.deepcopy(plain)
    executor = LazyExecutor(lazy_model)
    x = torch.randn(6, 8)
    for _ in range(3):  # no optimizer step: parameters stay, backward frees the graphs
        plain(x).square().sum().backward()
        executor(x).square().sum().backward()  # would raise "backward through the graph a second time"
    for p, q in zip(plain.parameters(), lazy_model.parameters()):
        assert same(p.grad, q.grad)


def test_gradients_through_an_output_reused_within_one_graph():
    torch.manual_seed(0)
    plain = Denoiser()
    lazy_model = copy.deepcopy(plain)
    executor = LazyExecutor(lazy_model)
    cond = torch.randn(3, 16)
    x_plain = x_lazy = torch.randn(3, 16)
    for _ in range(4):
        x_plain = x_plain - 0.1 * plain(x_plain, cond)
        x_lazy = x_lazy - 0.1 * executor(x_lazy, cond)
    assert executor.stats().hits > 0
    x_plain.sum().backward()
    x_lazy.sum().backward()
    # The reused encoder output gets its four uses' gradients summed before one backward;
    # the plain module backpropagates each use: the same sum in another order, so rounding
    # may differ in the last bits.
    for p, q in zip(plain.parameters(), lazy_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_an_unchanged_subgraph_costs_one_lookup_and_trains_exactly():
    """The encoder's interior is neither looked up nor held: the lookups per call are O(frontier),
    not O(nodes), while outputs and gradients equal the plain module's, also after an optimizer
    step on a parameter inside the reused subgraph."""

    class DeepEncoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.ModuleList(nn.Linear(16, 16) for _ in range(8))
            self.inp, self.out = nn.Linear(16, 16), nn.Linear(16, 16)

        def encode(self, cond):
            for layer in self.encoder:
                cond = torch.tanh(layer(cond))
            return cond

        def head(self, x, c):
            return self.out(F.gelu(self.inp(x) + c))

        def forward(self, x, cond):
            return self.head(x, self.encode(cond))

    torch.manual_seed(0)
    plain = DeepEncoder()
    lazy_model = copy.deepcopy(plain)
    executor = LazyExecutor(lazy_model)
    cond = torch.randn(3, 16)
    with torch.no_grad():
        x = torch.randn(3, 16)
        for _ in range(3):  # warm-up: x is seen to vary
            x = x + 0.1 * executor(x, cond)
        before = executor.stats()
        for _ in range(5):
            expected = plain(x, cond)
            got = executor(x, cond)
            assert same(got, expected)
            x = x + 0.1 * got
        after = executor.stats()
    lookups = (after.hits + after.misses) - (before.hits + before.misses)
    assert lookups == 5 and after.hits - before.hits == 5  # one per call: the encoder's output
    assert after.nodes_reused - before.nodes_reused == 5 * 16  # its 16 nodes were not run
    cached = executor.cached_nodes()
    assert cached == ["tanh_7"], cached  # the interior is not held

    interior = lazy_model.encoder[3].weight  # a parameter in the middle of the reused subgraph
    opt_plain = torch.optim.SGD([plain.encoder[3].weight], lr=0.1)
    opt_lazy = torch.optim.SGD([interior], lr=0.1)
    for step in range(3):
        x1, x2 = torch.randn(3, 16), torch.randn(3, 16)
        # The plain reference encodes once and uses the result twice, as the executor's reuse
        # does, so that gradients are summed in the same order and compare exactly.
        c = plain.encode(cond)
        out_plain = plain.head(x1, c) + plain.head(x2, c)
        hits = executor.stats().hits
        out_lazy = executor(x1, cond) + executor(x2, cond)
        assert same(out_plain, out_lazy)
        assert executor.stats().hits == hits + 1  # the second call reuses the encoder (with its graph)
        out_plain.square().sum().backward()
        out_lazy.square().sum().backward()
        for p, q in zip(plain.parameters(), lazy_model.parameters()):
            assert same(p.grad, q.grad)
        opt_plain.step(), opt_lazy.step()
        opt_plain.zero_grad(), opt_lazy.zero_grad()
        assert same(plain.encoder[3].weight, interior)
    with torch.no_grad():  # after the last step: recomputed, not the stale encoder output
        assert same(executor(x, cond), plain(x, cond))


# ---- never cached ----
def test_random_nodes_are_never_cached_and_consume_rng_like_the_plain_module():
    model = Stochastic().train()
    executor = LazyExecutor(model)
    x = torch.randn(4, 8)
    outputs = []
    for seed in range(3):
        torch.manual_seed(seed)
        expected = model(x)
        torch.manual_seed(seed)
        got = executor(x)
        assert same(got, expected)
        outputs.append(got)
    assert not same(outputs[0], outputs[1])
    cached = executor.cached_nodes()
    assert not {"randn_like", "drop", "dropout"} & set(cached)
    model.eval()  # dropout is deterministic in eval, randn_like is not
    with torch.no_grad():
        torch.manual_seed(5)
        expected = model(x)
        torch.manual_seed(5)
        assert same(executor(x), expected)
        torch.manual_seed(6)
        executor(x)
    assert "drop" in executor.cached_nodes() and "randn_like" not in executor.cached_nodes()


def test_nodes_with_side_effects_are_never_cached():
    class Effects(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(8)
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            y = self.fc(x)
            y.add_(1.0)
            return self.bn(y)

    model = Effects().train()
    reference = copy.deepcopy(model)
    executor = LazyExecutor(model)
    x = torch.randn(6, 8)
    with torch.no_grad():
        for _ in range(3):
            assert same(executor(x), reference(x))
    assert same(model.bn.running_mean, reference.bn.running_mean)
    assert model.bn.num_batches_tracked.item() == 3
    assert not {"add_", "bn"} & set(executor.cached_nodes())


def test_setitem_and_empty_in_a_graph_module_are_side_effects_that_always_run():
    # A hand-built graph: y = x * 2; y[0] = 0 (operator.setitem); out = y + nan_to_num(empty_like(y) * 0).
    # empty_like's garbage times 0 is 0 or NaN (inf * 0), which nan_to_num makes 0: out is y exactly.
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(operator.mul, (x, 2))
    graph.call_function(operator.setitem, (y, 0, 0.0))
    scratch = graph.call_function(torch.empty_like, (y,))
    zeros = graph.call_function(torch.nan_to_num, (graph.call_function(operator.mul, (scratch, 0)),))
    graph.output(graph.call_function(operator.add, (y, zeros)))
    module = fx.GraphModule(nn.Module(), graph)
    executor = LazyExecutor(module)
    inputs = torch.arange(1.0, 5.0)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(executor(inputs), torch.tensor([0.0, 4.0, 6.0, 8.0]))
            assert torch.equal(module(inputs), torch.tensor([0.0, 4.0, 6.0, 8.0]))
    assert not {"setitem", "empty_like"} & set(executor.cached_nodes())


def test_in_place_activations_are_never_cached():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            a = F.relu(self.fc1(x), inplace=True)
            b = self.act(self.fc2(a))
            c = torch.relu_(self.fc3(b))
            return F.leaky_relu(c, 0.1, True) + x

    model = InPlace().eval()
    executor = LazyExecutor(model)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(3):
            assert same(executor(x), model(x))
    assert not {"relu", "act", "relu_", "leaky_relu"} & set(executor.cached_nodes())


def test_never_cache_names_nodes_and_callables():
    model = Denoiser().eval()
    executor = LazyExecutor(model, never_cache={"encoder_fc1", F.gelu})
    x, cond = torch.randn(2, 16), torch.randn(2, 16)
    with torch.no_grad():
        for _ in range(3):
            assert same(executor(x, cond), model(x, cond))
    assert not {"encoder_fc1", "gelu", "gelu_1"} & set(executor.cached_nodes())


# ---- graph inputs ----
def test_graph_modules_and_exported_programs_run_with_reuse():
    torch.manual_seed(0)
    model = Denoiser().eval()
    x, cond = torch.randn(2, 16), torch.randn(2, 16)
    for source in (fx.symbolic_trace(model), torch.export.export(model, (x, cond))):
        executor = LazyExecutor(source)
        with torch.no_grad():
            for step in range(3):
                x = x + 0.01
                assert same(executor(x, cond=cond), model(x, cond))
        assert executor.stats().hits > 0, type(source)


def test_an_exported_programs_guards_are_checked_and_its_attention_is_reused():
    torch.manual_seed(0)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).reshape(2, -1, 3, 16).unbind(2)  # sizes baked in: the export is static
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    model = Attention().eval()
    x = torch.randn(2, 8, 16)
    executor = LazyExecutor(torch.export.export(model, (x,)))
    with torch.no_grad():
        assert same(executor(x), model(x))
        computed = executor.stats().nodes_computed
        assert same(executor(x), model(x))
        # aten.scaled_dot_product_attention without dropout is pure: nothing reruns.
        assert executor.stats().nodes_computed == computed
        with pytest.raises(ValueError, match="do not match the exported program"):
            executor(torch.randn(3, 8, 16))


def test_keyword_arguments_and_argument_errors():
    model = Denoiser().eval()
    executor = LazyExecutor(model)
    x, cond = torch.randn(2, 16), torch.randn(2, 16)
    with torch.no_grad():
        assert same(executor(cond=cond, x=x), model(x, cond))
    with pytest.raises(TypeError, match="Denoiser"):
        executor(x)
    with pytest.raises(TypeError, match="Denoiser"):
        executor(x, cond, x)


# ---- control and budget ----
def test_invalidate_node_invalidate_and_stats():
    model = Denoiser().eval()
    executor = LazyExecutor(model)
    x, cond = torch.randn(2, 16), torch.randn(2, 16)
    with torch.no_grad():
        executor(x, cond), executor(x, cond)
        assert {"encoder_fc2", "inp", "out"} <= set(executor.cached_nodes())
        executor.invalidate_node("encoder_fc2")
        # out's entry covers encoder_fc2 (its subgraph contains it): dropped too.
        assert not {"encoder_fc2", "out"} & set(executor.cached_nodes()) and "inp" in executor.cached_nodes()
        before = executor.stats()
        assert same(executor(x, cond), model(x, cond))
        after = executor.stats()
        assert after.misses == before.misses + 2  # out, then encoder_fc2; inp hits
        assert after.tensors_recomputed == before.tensors_recomputed + 2
        # An interior node (gelu, inside encoder_fc2's subgraph) holds no entry: invalidating it
        # drops the entries that cover it, and the next call recomputes it.
        assert "gelu" not in executor.cached_nodes()
        executor.invalidate_node("gelu")
        assert not {"encoder_fc2", "out"} & set(executor.cached_nodes())
        assert same(executor(x, cond), model(x, cond))
        executor.invalidate()
        assert executor.cached_nodes() == []
        assert executor.stats().cached_bytes == 0
    assert executor.memory_estimate() > 0
    with pytest.raises(ValueError, match="no node named 'nope'"):
        executor.invalidate_node("nope")
    executor.reset_stats()
    assert executor.stats().hits == 0 and executor.stats().calls == 0


def test_capacity_bytes_bounds_what_is_held_and_results_stay_exact():
    torch.manual_seed(0)
    model = WeightNormNet().eval()
    unlimited = LazyExecutor(model)
    x = torch.randn(64, 8)
    with torch.no_grad():
        unlimited(x), unlimited(x)
    need = unlimited.stats().cached_bytes
    executor = LazyExecutor(model, capacity_bytes=need // 2)
    with torch.no_grad():
        for _ in range(4):
            assert same(executor(x), model(x))
            assert executor.stats().cached_bytes <= need // 2
    assert 0 < len(executor.cached_nodes()) < len(unlimited.cached_nodes())
    executor.capacity_bytes = 0
    assert executor.stats().cached_bytes == 0 and executor.capacity_bytes == 0
    executor.capacity_bytes = None
    assert executor.capacity_bytes is None


def test_bad_arguments_are_rejected_with_clear_errors():
    with pytest.raises(TypeError, match="got int"):
        LazyExecutor(3)
    with pytest.raises(ValueError, match="capacity_bytes"):
        LazyExecutor(Denoiser(), capacity_bytes=-1)
    with pytest.raises(RuntimeError, match="Unknown keyword argument 'capacity'"):
        LazyExecutor(Denoiser(), capacity=1)

    class Untraceable(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    with pytest.warns(UserWarning, match="Untraceable could not be fx-traced"):
        executor = LazyExecutor(Untraceable())
    # Data-dependent control flow defeats torch.export too: the first call says both.
    with pytest.raises(RuntimeError, match=r"could not trace Untraceable \(.*\) and torch.export"):
        executor(torch.ones(2))
    cache = NodeCache()
    with pytest.raises(RuntimeError, match="cost_seconds"):
        cache.put(0, [torch.ones(1)], torch.ones(1), -1.0)
    with pytest.raises(ValueError, match="capacity_bytes"):
        NodeCache(capacity_bytes=-1)


def test_concurrent_calls_are_serialised_and_exact():
    torch.manual_seed(0)
    model = Denoiser().eval()
    executor = LazyExecutor(model)
    cond = torch.randn(2, 16)
    inputs = [torch.randn(2, 16) for _ in range(8)]
    expected = [model(x, cond).detach() for x in inputs]
    errors = []

    def work(k):
        with torch.no_grad():
            for i in range(20):
                j = (i + k) % len(inputs)
                if not same(executor(inputs[j], cond), expected[j]):
                    errors.append(j)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert executor.stats().calls == 80


# ---- the NodeCache itself, from Python and TorchScript ----
def test_node_cache_keys_by_identity_version_and_value():
    cache = NodeCache()
    x = torch.randn(4)
    y = x * 2
    assert cache.put(7, (x, 3, (1, 2), "s"), y, 0.5)
    assert cache._type().qualified_name() == "__torch__.torch.classes.torch_ext.NodeCache"  # one class for all
    assert cache.get(7, (x, 3, (1, 2), "s")) is y
    assert cache.get(7, (x, 3, (1, 2), "t")) is None
    cache.put(7, [x, x], y, 0.5)
    assert cache.get(7, [x.clone(), x]) is None
    cache.put(7, [x, x], y, 0.5)
    x.add_(1)
    assert cache.get(7, [x, x]) is None
    stats = cache.stats()
    assert stats.fields() == ["hits", "misses", "tensors_recomputed", "evictions", "invalidations", "entries",
                              "cached_bytes", "capacity_bytes", "calls", "nodes_computed", "nodes_reused", "hit_rate"]
    assert stats.hits == 1 and stats.misses == 3 and stats.capacity_bytes is None


def test_torchscript_uses_the_registered_class():
    @torch.jit.script
    def cached_double(cache: torch.classes.torch_ext.NodeCache, x: torch.Tensor) -> torch.Tensor:
        hit, value = cache.lookup(0, [x])
        if hit:
            assert isinstance(value, torch.Tensor)  # refines Any
            return value
        y = x * 2
        cache.put(0, [x], y, 0.001)
        return y

    cache = torch.classes.torch_ext.NodeCache(1 << 20)
    x = torch.randn(8)
    first = cached_double(cache, x)
    second = cached_double(cache, x)
    assert same(first, x * 2) and first.data_ptr() == second.data_ptr()
    assert cache.stats().hits == 1 and cache.cached_bytes() == x.nbytes
    x.add_(1)
    assert same(cached_double(cache, x), x * 2)
    assert cache.get(0, [torch.randn(8)]) is None


def test_a_scripted_module_with_a_cache_saves_and_loads_in_a_fresh_process(tmp_path):
    script = tmp_path / "scripted_cache.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        torch.ops.load_library({torch_ext.library_path()!r})
        assert "torch_ext" not in sys.modules

        class Table(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.cache = torch.classes.torch_ext.NodeCache(4096)
                self.weight = torch.nn.Parameter(torch.randn(4, 4))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                hit, cached = self.cache.lookup(0, [self.weight])
                if hit:
                    assert isinstance(cached, torch.Tensor)
                    w = cached
                else:
                    w = self.weight.softmax(dim=1)
                    self.cache.put(0, [self.weight], w, 0.0)
                return x @ w

        path = {str(tmp_path / "table.pt")!r}
        torch.jit.script(Table()).save(path)
        loaded = torch.jit.load(path)
        x = torch.randn(2, 4)
        with torch.no_grad():
            a, b = loaded(x), loaded(x)
        assert torch.equal(a, x @ loaded.weight.softmax(dim=1)) and torch.equal(a, b)
        assert loaded.cache.capacity_bytes == 4096 and loaded.cache.stats().hits == 1
        print("ok")
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ---- the torch.export fallback, for modules torch.fx cannot trace ----
class Branchy(nn.Module):
    """Python control flow on its arguments: torch.fx cannot trace it; torch.export specialises it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("shift", torch.linspace(-1, 1, 8))

    def forward(self, x, mode="add", extras=None, scale=1.0):
        y = self.drop(self.fc(x)) * scale
        y = y + self.shift if mode == "add" else y * self.shift
        if extras is not None:
            for value in extras.values():
                y = y + value
        return y


def fallback_warnings(caught) -> list:
    return [str(w.message) for w in caught if "could not be fx-traced" in str(w.message)]


def test_a_module_fx_cannot_trace_is_exported_per_signature_and_never_answers_stale():
    torch.manual_seed(0)
    model = Branchy().eval()
    x = torch.randn(4, 8)
    exported = lambda: len(executor.exported_programs)  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        executor = LazyExecutor(model)
        with torch.no_grad():
            for args, kwargs, count in [
                ((x,), {}, 1), ((x,), {}, 1), ((x, "add"), {}, 1),  # defaults bound: the same signature
                ((x,), {"mode": "mul"}, 2),  # a new constant: exported again, not the "add" graph's result
                ((x,), {"extras": {"a": torch.ones(8)}}, 3),  # a new pytree structure
                ((x,), {"extras": {"a": torch.ones(8), "b": torch.ones(8)}}, 4),
                ((torch.randn(7, 8),), {}, 4),  # sizes are dynamic (Dim.AUTO)
                ((x,), {}, 4),
            ]:
                assert same(executor(*args, **kwargs), model(*args, **kwargs)), (args, kwargs)
                assert exported() == count, (args, kwargs)
            assert executor.stats().hits > 0
        assert same(executor(x), model(x)) and exported() == 5  # grad mode on: its own export
        model.train()
        with torch.no_grad():
            torch.manual_seed(1)
            got = executor(x)
            torch.manual_seed(1)
            assert same(got, model(x)) and exported() == 6  # training flags: dropout draws
        model.eval()
        assert len(fallback_warnings(caught)) == 1
        with torch.no_grad():
            for i in range(4):
                assert same(executor(x, scale=2.0 + i), model(x, scale=2.0 + i))
    assert exported() == 8  # the least recently used dropped
    limit = [str(w.message) for w in caught if "exported for more than 8" in str(w.message)]
    assert len(limit) == 1 and "Branchy" in limit[0] and "the value of scale (3.0, now 4.0)" in limit[0]
    assert len(fallback_warnings(caught)) == 1


class Box:
    """An object pytree cannot flatten, holding a tensor and a size."""

    def __init__(self, tensor, rows):
        self.tensor, self.rows = tensor, rows


class Boxed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, box=None):
        if box is not None:
            x = x + box.tensor
        y = self.fc(x)
        return {"y": y, "box": Box(y.relu(), y.shape[0])}


def test_outputs_pytree_cannot_flatten_come_back_rebuilt_and_such_arguments_are_refused():
    torch.manual_seed(0)
    model = Boxed().eval()
    with pytest.warns(UserWarning, match="Boxed could not be fx-traced"):
        executor = LazyExecutor(model)
    with pytest.raises(RuntimeError, match="call the executor before"):
        executor.graph_module
    with torch.no_grad():
        for rows in (3, 3, 5):
            x = torch.randn(rows, 8)
            got, expected = executor(x), model(x)
            assert same(got["y"], expected["y"]) and same(got["box"].tensor, expected["box"].tensor)
            assert type(got["box"]) is Box and got["box"].rows == rows
        # Box.rows is a size the export saw as a number: that size is specialised, exported per value.
        assert len(executor.exported_programs) == 2
        with pytest.raises(TypeError, match="Boxed is run through torch.export.*Box holding tensors"):
            executor(x, Box(torch.ones(8), 1))


def test_random_nodes_inside_an_exported_no_grad_region_are_never_cached():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            if x.dim() == 2:  # Python control flow: torch.fx cannot trace it
                with torch.no_grad():  # exported as a higher-order operator around a subgraph
                    noise = torch.randn_like(x)
                return self.fc(x) + noise
            return self.fc(x)

    model = Noisy()
    with pytest.warns(UserWarning, match="Noisy could not be fx-traced"):
        executor = LazyExecutor(model)
    x = torch.randn(4, 8)
    outputs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        outputs.append(executor(x))
        torch.manual_seed(seed)
        assert same(outputs[-1], model(x))
    assert not same(outputs[0], outputs[1])


def test_never_cache_reaches_exported_graphs_through_module_classes_and_refuses_functions():
    torch.manual_seed(0)
    model = Branchy().eval()
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = LazyExecutor(model)
        executor = LazyExecutor(model, never_cache={nn.Linear})
    with torch.no_grad():
        for run in (plain, executor):
            run(x)
            before = run.stats().nodes_computed
            assert same(run(x), model(x))
            computed = run.stats().nodes_computed - before
            assert (computed == 0) == (run is plain), computed  # the Linear's node (and what follows it) runs
    with pytest.raises(TypeError, match="not never_cache's gelu: name the module classes"):
        LazyExecutor(model, never_cache={F.gelu})
