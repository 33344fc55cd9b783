import copy
import gc
import itertools
import os
import pickle
import threading
import weakref

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import torch_ext
from torch_ext import memory
from torch_ext.demos import GPT, GPTConfig, language_model_loss

MiB = 1 << 20


def tiny_gpt(dropout=0.1, n_layer=3):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_embd=32, n_head=4, vocab_size=64, block_size=16, dropout=dropout))


def gpt_step(model, idx, seed=1):
    torch.manual_seed(seed)
    loss = language_model_loss(model(idx[:, :-1]), idx[:, 1:])
    loss.backward()
    return loss


def assert_same_grads(a: nn.Module, b: nn.Module):
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name


def assert_same_backward(plain: nn.Module, ckpt: nn.Module, seed: int):
    """Forward and backward of both on the same input and RNG state: equal input and parameter grads."""
    x = torch.randn(4, 16, requires_grad=True)
    xc = x.detach().requires_grad_()
    torch.manual_seed(seed)
    plain(x).sum().backward()
    torch.manual_seed(seed)
    ckpt(xc).sum().backward()
    assert torch.equal(x.grad, xc.grad)
    assert_same_grads(plain, ckpt)


class Counted(nn.Module):
    """Linear + dropout that counts its forward calls."""

    def __init__(self, width=16, p=0.5):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(p)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.dropout(torch.tanh(self.linear(x)))


# ---- exact gradients ------------------------------------------------------------------------


def test_gpt_blocks_checkpointed_in_place_give_exact_gradients_with_dropout():
    plain = tiny_gpt(dropout=0.2)
    ckpt = copy.deepcopy(plain)
    for block in ckpt.blocks:
        assert torch_ext.checkpoint(block) is block
    idx = torch.randint(0, 64, (2, 16))
    loss_plain = gpt_step(plain, idx)
    rng_plain = torch.get_rng_state()
    loss_ckpt = gpt_step(ckpt, idx)
    rng_ckpt = torch.get_rng_state()
    assert torch.equal(loss_plain, loss_ckpt)
    assert_same_grads(plain, ckpt)
    # The replay restores the RNG afterwards: the random stream continues as without checkpointing.
    assert torch.equal(rng_plain, rng_ckpt)
    assert list(plain.state_dict()) == list(ckpt.state_dict())


def test_a_module_checkpointed_in_place_is_freed_without_the_cycle_collector():
    gc.collect()
    gc.disable()
    try:
        layer = torch_ext.checkpoint(nn.Linear(4, 4))
        weight = weakref.ref(layer.weight)
        layer(torch.randn(2, 4, requires_grad=True)).sum().backward()
        del layer
        assert weight() is None
    finally:
        gc.enable()


def test_a_module_checkpointed_in_place_deep_copies_and_pickles_with_its_forward():
    torch.manual_seed(0)
    plain = Counted()
    ckpt = torch_ext.checkpoint(copy.deepcopy(plain))
    for twin in (copy.deepcopy(ckpt), pickle.loads(pickle.dumps(ckpt))):
        assert twin.forward.module is twin  # not the module it was copied from
        twin.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        assert_same_backward(plain, twin, seed=0)
        assert twin.calls == 2 and ckpt.calls == 0  # forward and replay ran on the twin
        twin.calls = 0


def test_segment_runs_once_in_forward_and_once_more_in_backward():
    module = Counted()
    torch_ext.checkpoint(module)
    x = torch.randn(4, 16, requires_grad=True)
    out = module(x)
    assert module.calls == 1
    out.sum().backward()
    assert module.calls == 2


def test_class_decorator_checkpoints_every_instance():
    @torch_ext.checkpoint
    class Block(Counted):
        pass

    torch.manual_seed(0)
    a, b = Block(), Block()
    reference = Counted()
    reference.load_state_dict(a.state_dict())
    x = torch.randn(4, 16, requires_grad=True)
    torch.manual_seed(3)
    a(x).sum().backward()
    assert a.calls == 2
    b(x.detach()).sum()  # any instance is checkpointed
    xr = x.detach().requires_grad_()
    torch.manual_seed(3)
    reference(xr).sum().backward()
    assert torch.equal(x.grad, xr.grad)
    assert torch.equal(a.linear.weight.grad, reference.linear.weight.grad)
    assert isinstance(a, Counted) and list(a.state_dict()) == list(reference.state_dict())


def test_checkpointing_a_module_again_keeps_its_options_or_refuses_others():
    module = torch_ext.checkpoint(Counted())
    assert torch_ext.checkpoint(module) is module  # the same options: nothing changes
    with pytest.raises(ValueError, match=r"this Counted is already checkpointed with .*'save': None.*, not "
                                         r".*'save': \['matmul'\].*del module.forward undoes it"):
        torch_ext.checkpoint(module, save="matmul")
    x = torch.randn(4, 16, requires_grad=True)
    module(x).sum().backward()
    assert module.calls == 2  # still one checkpoint: one replay
    del module.forward
    torch_ext.checkpoint(module, save="matmul")
    assert module.forward.options.as_dict()["save"] == ["matmul"]

    @torch_ext.checkpoint
    class Block(Counted):
        pass

    assert torch_ext.checkpoint(Block) is Block
    for again in (lambda: torch_ext.checkpoint(storage="bf16")(Block),
                  lambda: torch_ext.checkpoint(Block(), storage="bf16")):
        with pytest.raises(ValueError, match="class Block is already checkpointed with .*'storage': 'keep'.*, not "
                                             ".*'storage': 'bf16'.*checkpoint instances, not the class"):
            again()


def test_function_with_kwargs_pytrees_non_tensors_and_inputs_without_grad():
    linear = nn.Linear(8, 8)

    def segment(inputs, scale, *, mask, tag):
        a, b = inputs["a"], inputs["pair"][1]
        y = linear(a) * scale + b * mask
        return {"y": y, "tag": tag, "parts": (y.sum(), 7)}

    wrapped = torch_ext.checkpoint(segment)
    a = torch.randn(3, 8, requires_grad=True)
    b = torch.randn(3, 8, requires_grad=True)
    mask = torch.randn(3, 8)  # does not require grad
    args = ({"a": a, "pair": (None, b)}, 2.5)
    out = wrapped(*args, mask=mask, tag="hello", )
    assert out["tag"] == "hello" and out["parts"][1] == 7
    ref = segment(*args, mask=mask, tag="hello")
    assert torch.equal(out["y"], ref["y"])
    # The function reads `linear` through its closure: its parameters get their gradients too.
    grads_ref = torch.autograd.grad(ref["y"].sum() + ref["parts"][0], [a, b, linear.weight])
    grads = torch.autograd.grad(out["y"].sum() + out["parts"][0], [a, b, linear.weight])
    for g, r in zip(grads, grads_ref):
        assert torch.equal(g, r)

    def segment_with_module(inputs, scale, layer, *, mask, tag):
        a, b = inputs["a"], inputs["pair"][1]
        y = layer(a) * scale + b * mask
        return {"y": y, "tag": tag, "parts": (y.sum(), 7)}

    wrapped = torch_ext.checkpoint(segment_with_module)
    out = wrapped(*args, linear, mask=mask, tag="hello")
    grads = torch.autograd.grad(out["y"].sum() + out["parts"][0], [a, b, linear.weight])
    ref = segment_with_module(*args, linear, mask=mask, tag="hello")
    grads_ref = torch.autograd.grad(ref["y"].sum() + ref["parts"][0], [a, b, linear.weight])
    for g, r in zip(grads, grads_ref):
        assert torch.equal(g, r)


def test_nested_checkpoints_give_exact_gradients():
    torch.manual_seed(0)
    inner = Counted()
    outer_linear = nn.Linear(16, 16)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner
            self.linear = outer_linear

        def forward(self, x):
            return self.linear(self.inner(x)).relu()

    plain = Outer()
    ckpt = copy.deepcopy(plain)
    torch_ext.checkpoint(ckpt.inner)
    torch_ext.checkpoint(ckpt)
    assert_same_backward(plain, ckpt, seed=5)
    assert ckpt.inner.calls == 3  # forward, outer replay, inner replay


def test_autograd_grad_and_backward_inputs_see_params_through_the_graph():
    plain = Counted(p=0.0)
    ckpt = copy.deepcopy(plain)
    torch_ext.checkpoint(ckpt)
    x = torch.randn(4, 16, requires_grad=True)
    g_plain = torch.autograd.grad(plain(x).pow(2).sum(), list(plain.parameters()))
    g_ckpt = torch.autograd.grad(ckpt(x).pow(2).sum(), list(ckpt.parameters()))
    for a, b in zip(g_plain, g_ckpt):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in ckpt.parameters())
    assert x.grad is None
    # backward(inputs=...) accumulates only into the named tensors.
    ckpt(x).sum().backward(inputs=[ckpt.linear.weight])
    assert ckpt.linear.weight.grad is not None and ckpt.linear.bias.grad is None and x.grad is None


def test_tensor_and_module_hooks_fire_as_without_checkpointing():
    def run(checkpointed):
        torch.manual_seed(0)
        module = Counted(p=0.0)
        if checkpointed:
            torch_ext.checkpoint(module)
        seen = []
        module.linear.weight.register_hook(lambda g: seen.append(("weight", g.clone())))
        module.register_full_backward_hook(lambda m, gin, gout: seen.append(("module", gout[0].clone())))
        x = torch.randn(4, 16, requires_grad=True)
        x.register_hook(lambda g: seen.append(("x", g.clone())))
        module(x).sum().backward()
        return seen

    plain, ckpt = run(False), run(True)
    assert [name for name, _ in plain] == [name for name, _ in ckpt]
    for (_, a), (_, b) in zip(plain, ckpt):
        assert torch.equal(a, b)


def test_no_grad_and_inference_mode_run_the_segment_plainly():
    module = torch_ext.checkpoint(Counted())
    x = torch.randn(4, 16, requires_grad=True)
    with torch.no_grad():
        out = module(x)
    assert out.grad_fn is None and module.calls == 1
    with torch.inference_mode():
        out = module(torch.randn(4, 16))
    assert out.is_inference() and module.calls == 2
    # Nothing requires grad: no node, no replay.
    module.requires_grad_(False)
    out = module(torch.randn(4, 16))
    assert out.grad_fn is None and module.calls == 3


def test_autocast_state_is_restored_for_the_replay():
    plain = Counted(p=0.0)
    ckpt = torch_ext.checkpoint(copy.deepcopy(plain))
    x = torch.randn(4, 16, requires_grad=True)
    xc = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_plain = plain(x)
        out_ckpt = ckpt(xc)
    assert out_ckpt.dtype == torch.bfloat16
    out_plain.float().sum().backward()
    out_ckpt.float().sum().backward()  # backward outside autocast: the replay must re-enter it
    assert torch.equal(x.grad, xc.grad)
    assert_same_grads(plain, ckpt)


def test_threads_checkpoint_concurrently():
    model = tiny_gpt(dropout=0.0, n_layer=2)
    reference = copy.deepcopy(model)
    for block in model.blocks:
        torch_ext.checkpoint(block)
    idx = torch.randint(0, 64, (2, 16))
    ref_grads = torch.autograd.grad(language_model_loss(reference(idx[:, :-1]), idx[:, 1:]), list(reference.parameters()))

    def grads():
        return torch.autograd.grad(language_model_loss(model(idx[:, :-1]), idx[:, 1:]), list(model.parameters()))

    results, errors = [], []

    def work():
        try:
            for _ in range(5):
                results.append(grads())
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 15
    for result in results:
        for a, b in zip(result, ref_grads):
            assert torch.equal(a, b)


# ---- errors ---------------------------------------------------------------------------------


def test_a_replay_of_another_shape_raises_naming_the_segment_and_the_tensor():
    calls = []

    def changing(x):
        calls.append(1)
        return x[: len(calls)].exp()  # exp saves its output: the replay's is another shape

    out = torch_ext.checkpoint(changing)(torch.randn(4, requires_grad=True))
    with pytest.raises(torch_ext.checkpointing.CheckpointError,
                       match=r"the replay of .*changing produced saved tensor 0 \(made by ExpBackward0, "
                             r"Float\[2\] on cpu\) where its forward produced saved tensor 0 \(made by "
                             r"ExpBackward0, Float\[1\] on cpu\)"):
        out.sum().backward()


def test_a_replay_that_saves_fewer_tensors_raises():
    calls = []

    def fewer(x):
        calls.append(1)
        return x.exp() if len(calls) == 1 else x * 2  # the replay saves nothing

    out = torch_ext.checkpoint(fewer)(torch.randn(4, requires_grad=True))
    with pytest.raises(torch_ext.checkpointing.CheckpointError, match="saved 0 tensors .* its forward saved 1"):
        out.sum().backward()


def test_error_for_unknown_storage_policy():
    with pytest.raises(ValueError, match="unknown storage policy 'zip'"):
        torch_ext.checkpoint(nn.Linear(2, 2), storage="zip")
    with pytest.raises(ValueError, match="unknown storage policy"):
        torch_ext.CheckpointedSequential([nn.Linear(2, 2)], storage="int8")
    with pytest.raises(ValueError, match="unknown storage policy 'int8'"):
        torch.ops.torch_ext.checkpoint_boundary_bytes([torch.ones(2)], "int8")


def test_unknown_options_are_refused_naming_the_options():
    with pytest.raises(TypeError, match="torch_ext.checkpoint: unknown option.*stroage.*the options are storage, "
                                        "preserve_rng_state, early_stop"):
        torch_ext.checkpoint(nn.Linear(2, 2), stroage="bf16")
    with pytest.raises(TypeError, match="CheckpointedSequential: unknown option.*every_k"):
        torch_ext.CheckpointedSequential([nn.Linear(2, 2)], every_k=1)
    # A known option of the wrong type is named with its type, not with torch's whole constructor schema.
    with pytest.raises(TypeError, match=r"^torch_ext.checkpoint: option early_stop takes bool, got 'yes' \(str\)$"):
        torch_ext.checkpoint(nn.Linear(2, 2), early_stop="yes")


def test_error_for_bad_targets():
    with pytest.raises(TypeError, match="not an nn.Module subclass"):
        torch_ext.checkpoint(int)
    with pytest.raises(TypeError, match="expected an nn.Module subclass"):
        torch_ext.checkpoint(3)


def test_an_input_written_in_place_during_the_forward_is_refused_naming_the_segment():
    def scale_in_place(x):
        x.mul_(2)
        return x.sin()

    with pytest.raises(torch_ext.checkpointing.CheckpointError, match="scale_in_place wrote its input 0 in place"):
        torch_ext.checkpoint(scale_in_place)(torch.randn(4, requires_grad=True) * 1)


def test_in_place_change_of_a_kept_input_is_detected():
    x = torch.randn(4, requires_grad=True)
    y = x * 1
    out = torch_ext.checkpoint(lambda t: t.sin())(y)
    with torch.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# ---- storage policies -----------------------------------------------------------------------


@pytest.mark.parametrize("storage,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_compressed_storage_holds_fewer_bytes_and_bounds_the_gradient_error(storage, dtype):
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    x = torch.randn(512, 256, requires_grad=True)
    keep = torch_ext.checkpoint(copy.deepcopy(layer))
    reference = copy.deepcopy(layer)
    wrapped = torch_ext.checkpoint(layer, storage=storage)
    assert torch.ops.torch_ext.checkpoint_boundary_bytes([x], storage) == x.numel() * dtype.itemsize

    def held_after_forward(wrapped_layer):
        # Earlier tests' checkpointed modules (a module and its forward refer to each other) are
        # freed by the garbage collector: not inside the window measured here.
        gc.collect()
        gc.disable()
        try:
            before = memory.stats().current_bytes
            h = x * 1.5  # a boundary that only the checkpoint would keep alive
            out = wrapped_layer(h)
            del h
            return out, memory.stats().current_bytes - before
        finally:
            gc.enable()

    _, held_keep = held_after_forward(keep)
    out, held = held_after_forward(wrapped)
    # Instead of the float32 boundary, only its rounded copy stays alive.
    assert held_keep - held == x.nbytes - x.numel() * dtype.itemsize
    out.pow(2).sum().backward()
    grad = x.grad.clone()

    x.grad = None
    reference(x * 1.5).pow(2).sum().backward()
    # The replay sees the inputs rounded to 8 (bf16) or 11 (fp16) mantissa bits: the relative
    # gradient error stays within a few roundings.
    bound = {"bf16": 2e-2, "fp16": 4e-3}[storage]
    assert (grad - x.grad).norm() / x.grad.norm() < bound
    assert not torch.equal(grad, x.grad)


def test_replay_outputs_no_node_saved_are_freed_before_the_segments_backward():
    x = torch.randn(256, 1024, requires_grad=True)  # 1 MiB
    loss = torch_ext.checkpoint(lambda t: t * 2.0)(x).sum()
    with memory.track() as tracked:
        loss.backward()
    # The replay's output (1 MiB; mul by a scalar saves nothing) is gone before x's gradient
    # (1 MiB) is computed: the backward peaks at one of them, not both.
    assert x.nbytes <= tracked.peak_delta_bytes < 1.5 * x.nbytes
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def test_offload_on_cpu_inputs_is_exact():
    plain = Counted()
    ckpt = torch_ext.checkpoint(copy.deepcopy(plain), storage="offload")
    assert_same_backward(plain, ckpt, seed=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_moves_boundaries_to_pinned_cpu_memory_on_cuda():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(512, 512), nn.GELU()).cuda()
    ckpt = torch_ext.checkpoint(copy.deepcopy(plain), storage="offload")
    x = torch.randn(1024, 512, device="cuda", requires_grad=True)
    with torch.no_grad():
        plain(x)  # cuBLAS allocates its workspace at the first matmul: not part of what is measured
    h = x * 2
    h_bytes = h.nbytes
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = ckpt(h)
    del h
    torch.cuda.synchronize()
    # Nothing on the device holds the boundary h any more: its copy lives in pinned CPU memory.
    assert torch.cuda.memory_allocated() - before == out.nbytes - h_bytes
    out.sum().backward()
    xr = x.detach().requires_grad_()
    plain(xr * 2).sum().backward()
    assert torch.equal(x.grad, xr.grad)


# ---- CheckpointedSequential, checkpoint_sequential, planner ---------------------------------


def mlp_chain(n=6, width=32, dropout=0.25):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(dropout)) for _ in range(n)]


def test_checkpointed_sequential_every_k_matches_plain_and_accounts_memory():
    layers = mlp_chain()
    plain = nn.Sequential(*copy.deepcopy(layers))
    chain = torch_ext.CheckpointedSequential(layers, every=2)
    assert list(chain.state_dict()) == list(plain.state_dict())
    assert chain.boundaries == [0, 2, 4] and chain.num_checkpoints() == 3
    assert [chain.is_checkpoint_layer(i) for i in range(6)] == [True, False, True, False, True, False]
    x = torch.randn(8, 32, requires_grad=True)
    xc = x.detach().requires_grad_()
    torch.manual_seed(4)
    out_plain = plain(x)
    out_plain.sum().backward()
    torch.manual_seed(4)
    out = chain(xc)
    assert torch.equal(out, out_plain)
    layer_bytes = 8 * 32 * 4
    assert chain.memory_bytes() == 3 * layer_bytes
    assert chain.full_memory_bytes() == 6 * layer_bytes
    assert chain.memory_saved_bytes() == 3 * layer_bytes
    assert chain.memory_savings() == pytest.approx(0.5)
    # recompute(i) replays from the nearest checkpoint with the forward's RNG: same dropout masks.
    torch.manual_seed(4)
    expected = x.detach()
    outputs = []
    for layer in plain:
        expected = layer(expected)
        outputs.append(expected)
    for i in range(6):
        assert torch.equal(chain.recompute(i), outputs[i])
    out.sum().backward()
    assert torch.equal(x.grad, xc.grad)
    assert_same_grads(plain, chain)


def test_checkpointed_sequential_boundaries_and_errors():
    chain = torch_ext.CheckpointedSequential(mlp_chain(dropout=0.0), boundaries=[2, 5])
    assert chain.boundaries == [2, 5] and not chain.is_checkpoint_layer(0)
    with pytest.raises(RuntimeError, match="no forward with grad"):
        chain.recompute(0)
    x = torch.randn(4, 32, requires_grad=True)
    chain(x)
    assert chain.memory_bytes() == 2 * 4 * 32 * 4
    assert 0 <= chain.memory_savings() < 1
    with pytest.raises(IndexError, match="outside 0..5"):
        chain.recompute(6)
    with pytest.raises(ValueError, match="boundary 9 is outside"):
        torch_ext.CheckpointedSequential(mlp_chain(), boundaries=[0, 9])
    with pytest.raises(ValueError, match="strictly increasing"):
        torch_ext.CheckpointedSequential(mlp_chain(), boundaries=[3, 1])
    with pytest.raises(ValueError, match="give one of every, boundaries or budget_bytes"):
        torch_ext.CheckpointedSequential(mlp_chain(), every=2, budget_bytes=10)
    with pytest.raises(ValueError, match="every must be a positive int"):
        torch_ext.CheckpointedSequential(mlp_chain(), every=0)


def test_chain_is_collected_after_a_forward():
    import gc
    import weakref

    chain = torch_ext.CheckpointedSequential(mlp_chain(dropout=0.0), every=2)
    chain(torch.randn(2, 32, requires_grad=True))
    ref = weakref.ref(chain)
    del chain
    gc.collect()
    assert ref() is None  # the autograd graph the chain's records keep does not hold the chain


class Recording(nn.Linear):
    """A Linear that records a weak reference to each input it is called with."""

    def __init__(self, in_features: int, out_features: int, seen: list) -> None:
        super().__init__(in_features, out_features)
        self.seen = seen

    def forward(self, x):
        self.seen.append(weakref.ref(x))
        return super().forward(x)


def test_chain_keeps_no_boundary_alive_after_backward():
    seen = []

    chain = torch_ext.CheckpointedSequential([Recording(32, 32, seen) for _ in range(4)], every=1)
    out = chain(torch.randn(4, 32, requires_grad=True))
    boundaries = seen[:4]  # the forward's inputs of the four segments (the replays add more)
    assert all(ref() is not None for ref in boundaries)  # the autograd graph holds them
    chain.recompute(2)  # between forward and backward the boundaries can be replayed
    out.sum().backward()
    del out
    assert chain.memory_bytes() == 4 * 4 * 32 * 4  # the accounting outlives the boundaries
    assert all(ref() is None for ref in boundaries[1:])  # backward freed them; the chain held none
    with pytest.raises(RuntimeError, match="input of layer 2 .* is no longer alive"):
        chain.recompute(2)


def test_chain_with_compressed_storage_frees_the_full_precision_boundaries_after_the_forward():
    seen = []

    chain = torch_ext.CheckpointedSequential([Recording(32, 32, seen) for _ in range(4)], every=1, storage="bf16")
    out = chain(torch.randn(4, 32, requires_grad=True))
    # Only their bf16 copies are kept for backward: the float32 inputs of segments 1..3 are gone.
    assert all(ref() is None for ref in seen[1:4])
    assert chain.memory_bytes() == 4 * 4 * 32 * 2
    out.sum().backward()


def test_recompute_detects_a_replay_with_different_shapes():
    class Growing(nn.Module):
        def __init__(self):
            super().__init__()
            self.n = 2

        def forward(self, x):
            self.n += 1
            return x[:, : self.n]

    chain = torch_ext.CheckpointedSequential([nn.Linear(8, 8), Growing()], every=1)
    out = chain(torch.randn(2, 8, requires_grad=True))
    assert out.grad_fn is not None  # the graph holds the boundaries recompute() replays
    with pytest.raises(RuntimeError, match="replay of layer 1 \\(Growing\\)"):
        chain.recompute(1)


def test_checkpoint_sequential_is_a_drop_in_with_several_inputs_and_kwargs():
    class Mix(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(16, 16)

        def forward(self, a, b, *, scale):
            return self.linear(a) + b * scale

    layers = [Mix()] + [nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4)]
    plain = nn.ModuleList(copy.deepcopy(layers))
    a = torch.randn(4, 16, requires_grad=True)
    b = torch.randn(4, 16, requires_grad=True)
    out = torch_ext.checkpoint_sequential(nn.Sequential(*layers), 2, a, b, scale=0.5, use_reentrant=False)
    ga = torch.autograd.grad(out.sum(), [a, b] + [p for m in layers for p in m.parameters()])
    ref = plain[0](a, b, scale=0.5)
    for m in plain[1:]:
        ref = m(ref)
    gr = torch.autograd.grad(ref.sum(), [a, b] + [p for m in plain for p in m.parameters()])
    assert torch.equal(out, ref)
    for x, y in zip(ga, gr):
        assert torch.equal(x, y)
    # Same result as torch's own for a single input.
    seq = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    x = torch.randn(2, 16, requires_grad=True)
    ours = torch_ext.checkpoint_sequential(seq, 2, x)
    theirs = torch.utils.checkpoint.checkpoint_sequential(seq, 2, x, use_reentrant=False)
    assert torch.equal(ours, theirs)
    assert torch.equal(torch.autograd.grad(ours.sum(), x)[0], torch.autograd.grad(theirs.sum(), x)[0])
    with pytest.raises(ValueError, match="segments=7"):
        torch_ext.checkpoint_sequential(seq, 7, x)


def wide_chain(n=8, width=256):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(n)]


def measured_peak(chain, x, grads_preallocated=True):
    for p in chain.parameters():
        # Preallocated, gradients accumulate in place: only activations count.
        p.grad = torch.zeros_like(p) if grads_preallocated else None
    with memory.track() as tracked:
        chain(x).sum().backward()
    return tracked.peak_delta_bytes


def test_planner_meets_its_budget_and_prefers_no_recompute_when_memory_allows():
    layers = wide_chain()
    x = torch.randn(256, 256, requires_grad=True)
    # measured_peak preallocates .grad: gradients added in place.
    loose = torch_ext.plan_checkpoints(layers, x, budget_bytes=1 << 40, repeat=1, gradients="accumulated")
    assert loose.boundaries == [] and loose.predicted_recompute_seconds == 0
    assert loose.predicted_peak_bytes == loose.no_checkpoint_peak_bytes
    budget = (loose.min_budget_bytes + loose.no_checkpoint_peak_bytes) // 2
    plan = torch_ext.plan_checkpoints(layers, x, budget_bytes=budget, repeat=1, gradients="accumulated")
    assert plan.predicted_peak_bytes <= budget and plan.boundaries
    assert 0 < plan.predicted_overhead < 1
    chain = torch_ext.CheckpointedSequential(copy.deepcopy(layers), boundaries=plan)
    plain = nn.Sequential(*copy.deepcopy(layers))
    peak_plain = measured_peak(plain, x)
    peak_plan = measured_peak(chain, x)
    assert peak_plan <= budget < peak_plain
    assert_same_grads(plain, chain)
    halved = copy.deepcopy(layers)
    halved[3].half()  # the plan's bytes no longer hold for these layers
    with pytest.raises(ValueError, match=rf"CheckpointedSequential: layer 3 \(\w+\) holds "
                                         rf"{sum(p.nbytes for p in layers[3].parameters()) // 2:,} bytes .* the plan was "
                                         rf"made for other layers"):
        torch_ext.CheckpointedSequential(halved, boundaries=plan)
    # budget_bytes=B plans on the first forward with grad.
    auto = torch_ext.CheckpointedSequential(copy.deepcopy(layers), budget_bytes=budget, gradients="accumulated")
    auto(x)
    assert auto.plan is not None and auto.plan.predicted_peak_bytes <= budget


def test_planner_does_not_count_gradients_added_as_made_twice():
    """With .grad allocated, a segment's backward (its replay too, on the Python front doors)
    holds one parameter gradient at a time, which the measured workspace counts: the minimum's
    prediction lies within one layer's parameter bytes of the measured peak (counting a
    checkpointed segment's gradients again overestimated it by more)."""
    layers = wide_chain()
    x = torch.randn(256, 256, requires_grad=True)
    loose = torch_ext.plan_checkpoints(layers, x, budget_bytes=1 << 40, repeat=1, gradients="accumulated")
    plan = torch_ext.plan_checkpoints(layers, x, budget_bytes=loose.min_budget_bytes, repeat=1,
                                      gradients="accumulated")
    peak = measured_peak(torch_ext.CheckpointedSequential(copy.deepcopy(layers), boundaries=plan), x)
    layer_params = sum(p.nbytes for p in layers[0].parameters())
    assert peak <= plan.predicted_peak_bytes < peak + layer_params


def test_planner_states_the_minimum_budget():
    layers = wide_chain(n=4)
    x = torch.randn(64, 256, requires_grad=True)
    plan = torch_ext.plan_checkpoints(layers, x, budget_bytes=1 << 40, repeat=1)
    with pytest.raises(ValueError, match=f"minimum any plan of these 4 layers can meet: {plan.min_budget_bytes} bytes"):
        torch_ext.plan_checkpoints(layers, x, budget_bytes=plan.min_budget_bytes - 1, repeat=1)
    with pytest.raises(ValueError, match="positive number of bytes"):
        torch_ext.plan_checkpoints(layers, x, budget_bytes=0)


@pytest.mark.parametrize("surroundings", [{}, {"head": 150, "around": 9}], ids=["chain", "model"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gradients", ["accumulated", "held"])
def test_planner_dynamic_program_is_optimal_against_brute_force(gradients, seed, surroundings):
    # "model": a head that needs more than any layer after the chain, and bytes held around it.
    from torch_ext.checkpointing.op_choice import _gradient_bytes
    from torch_ext.checkpointing.planner import _evaluate, _solve

    torch.manual_seed(seed)
    n = 7
    seconds = torch.rand(n).tolist()
    # Seed 2 draws from few values, so many plans tie in bytes or time (the pruning's tie rules).
    saved = torch.randint(10, 100, (n,)).tolist() if seed < 2 else torch.randint(1, 3, (n,)).mul(40).tolist()
    out_bytes = torch.randint(1, 20, (n,)).tolist()
    workspace = torch.randint(0, 30, (n,)).tolist()
    params = torch.randint(0, 40, (n,)).tolist()
    grads = _gradient_bytes(params, gradients, other_bytes=7)
    inputs = torch.randint(1, 20, (n,)).tolist()  # each layer's own: a model's layers need not chain
    shape = (saved, out_bytes, workspace, grads, inputs)
    plans = []
    for cuts in itertools.product([False, True], repeat=n - 1):
        starts = [0] + [i + 1 for i, c in enumerate(cuts) if c]
        ends = starts[1:] + [n]
        for modes in itertools.product([False, True], repeat=len(starts)):
            segs = list(zip(starts, ends, modes))
            cost = sum(sum(seconds[p:q]) for p, q, m in segs if m)
            plans.append((_evaluate(segs, *shape, **surroundings), cost, max(q - p for p, q, _ in segs), any(modes)))

    def check(result, segments_allowed):
        # the segments returned are a plan of the peak and recompute the search states
        _, peak, cost, segs = result
        assert [p for p, _, _ in segs] == [0] + [q for _, q, _ in segs[:-1]] and segs[-1][1] == n
        assert segments_allowed(segs)
        assert _evaluate(list(segs), *shape, **surroundings) == peak
        assert sum(sum(seconds[p:q]) for p, q, m in segs if m) == pytest.approx(cost)
        return peak, cost

    for max_segment in (None, 2):
        def allowed(segs, stored_only=False):
            return ((max_segment is None or all(q - p <= max_segment for p, q, _ in segs))
                    and not (stored_only and any(m for _, _, m in segs)))

        fitting = [plan for plan in plans if max_segment is None or plan[2] <= max_segment]
        min_peak = min(p for p, *_ in fitting)
        if gradients == "held":  # the first segment's backward holds every gradient, whatever the plan
            assert min_peak > sum(params) + 7
        assert check(_solve(n, seconds, *shape, None, max_segment, **surroundings), allowed)[0] == min_peak
        stored = _solve(n, seconds, *shape, None, max_segment, checkpointing=False, **surroundings)
        assert check(stored, lambda segs: allowed(segs, True))[0] == min(p for p, _, _, m in fitting if not m)
        peaks = sorted({p for p, *_ in fitting})
        assert _solve(n, seconds, *shape, peaks[0] - 1, max_segment, **surroundings) is None
        for budget in peaks[::max(1, len(peaks) // 40)] + peaks[-1:]:
            best = min(c for p, c, *_ in fitting if p <= budget)
            peak, cost = check(_solve(n, seconds, *shape, budget, max_segment, **surroundings), allowed)
            assert peak <= budget and cost == pytest.approx(best)


def test_a_plan_for_held_gradients_stays_within_its_budget_when_grad_starts_none():
    # With .grad None at the step's start (optimizer.zero_grad()'s default) every layer's gradients
    # stay until the backward ends: a plan made for gradients added in place runs over a budget
    # below them; planned for held gradients, that budget is refused, and those it takes hold.
    layers = wide_chain()
    x = torch.randn(256, 256, requires_grad=True)
    loose = torch_ext.plan_checkpoints(layers, x, budget_bytes=1 << 40, repeat=1, gradients="accumulated")
    held = torch_ext.plan_checkpoints(layers, x, budget_bytes=1 << 40, repeat=1)  # "held" is the default
    assert held.gradients == "held" and loose.gradients == "accumulated"
    # With nothing to recompute, the plan is the no-checkpointing peak: the least over stored
    # segments, not one segment holding every activation beside every gradient.
    assert held.boundaries == [] and held.predicted_peak_bytes == held.no_checkpoint_peak_bytes
    assert torch_ext.plan_checkpoints(layers, x, budget_bytes=held.no_checkpoint_peak_bytes - 1, repeat=1).boundaries
    assert measured_peak(nn.Sequential(*copy.deepcopy(layers)), x, grads_preallocated=False) <= held.no_checkpoint_peak_bytes
    weights = sum(p.nbytes for layer in layers for p in layer.parameters())
    assert held.min_budget_bytes > weights > loose.min_budget_bytes
    low = (loose.min_budget_bytes + held.min_budget_bytes) // 2
    over = torch_ext.plan_checkpoints(layers, x, budget_bytes=low, repeat=1, gradients="accumulated")
    chain = torch_ext.CheckpointedSequential(copy.deepcopy(layers), boundaries=over)
    assert measured_peak(chain, x, grads_preallocated=False) > low
    with pytest.raises(ValueError, match="gradients='held': layer 0's backward holds"):
        torch_ext.plan_checkpoints(layers, x, budget_bytes=low, repeat=1)
    plain = nn.Sequential(*copy.deepcopy(layers))
    measured_peak(plain, x)
    for fraction in (0.0, 0.5):
        budget = int(held.min_budget_bytes + fraction * (held.no_checkpoint_peak_bytes - held.min_budget_bytes))
        chain = torch_ext.CheckpointedSequential(copy.deepcopy(layers), budget_bytes=budget)  # held: the default
        chain(x)  # plans on the first forward with grad
        assert chain.plan.gradients == "held" and (chain.plan.boundaries or fraction > 0)
        assert measured_peak(chain, x, grads_preallocated=False) <= budget
        assert_same_grads(plain, chain)
    with pytest.raises(ValueError, match="gradients must be one of 'accumulated', 'held', got 'kept'"):
        torch_ext.plan_checkpoints(layers, x, budget_bytes=1 << 40, gradients="kept")
    with pytest.raises(ValueError, match="gradients='held' is an option of planning under a budget; give budget_bytes"):
        torch_ext.CheckpointedSequential(copy.deepcopy(layers), every=2, gradients="held")


# ---- TorchScript, opcheck, torch.compile, DDP ------------------------------------------------


class ScriptedParent(nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.block = torch.jit.script(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)))
        self.head = nn.Linear(16, 1)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            h = torch.ops.torch_ext.checkpoint_module(self.block, [x])[0]
        else:
            h = self.block(x)
        return self.head(h)


def test_scripted_code_checkpoints_a_scripted_submodule(tmp_path):
    plain = torch.jit.script(ScriptedParent(False))
    ckpt = torch.jit.script(ScriptedParent(True))
    x = torch.randn(4, 16, requires_grad=True)
    grads = []
    for model in (plain, ckpt):
        x.grad = None
        model(x).sum().backward()
        grads.append([x.grad.clone()] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    path = tmp_path / "ckpt.pt"
    torch.jit.save(ckpt, str(path))
    loaded = torch.jit.load(str(path))
    assert torch.equal(loaded(x), ckpt(x))
    with pytest.raises(RuntimeError, match="expected a TorchScript module"):
        torch.ops.torch_ext.checkpoint_module(3, [x])


def test_fullgraph_compile_traces_the_checkpoints_and_matches_eager_gradients():
    plain = tiny_gpt(dropout=0.0)
    ckpt = copy.deepcopy(plain)
    for block in ckpt.blocks:
        torch_ext.checkpoint(block)
    graphs = []

    def inductor_recording_graphs(graph_module, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        graphs.append(graph_module)
        return compile_fx(graph_module, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(ckpt, fullgraph=True, backend=inductor_recording_graphs)
    idx = torch.randint(0, 64, (2, 16))
    loss_plain = gpt_step(plain, idx)
    loss_compiled = gpt_step(compiled, idx)
    # One graph, with each block traced as torch.utils.checkpoint's region (recomputed in backward).
    (graph,) = graphs
    regions = [node for node in graph.graph.nodes if node.target is torch.ops.higher_order.tag_activation_checkpoint]
    assert len(regions) == len(ckpt.blocks)
    torch.testing.assert_close(loss_compiled, loss_plain)
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.mark.parametrize("options", [{}, {"preserve_rng_state": False, "use_reentrant": False}, {"save": ("matmul",)}])
def test_checkpoint_call_inside_a_compiled_forward_is_one_graph(options):
    """The drop-in as Hugging Face's checkpointing calls it, once per layer inside the forward that
    torch.compile traces: reading the option names from the C++ options there was a graph break,
    which split the model's compiled backward in two."""
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    reference = copy.deepcopy(layer)
    x = torch.randn(4, 8)
    torch._dynamo.reset()
    step = torch.compile(lambda x: torch_ext.checkpoint_call(layer, x, **options).sum(), fullgraph=True,
                         backend="aot_eager")
    step(x).backward()
    reference(x).sum().backward()
    for (name, p), q in zip(layer.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def _ddp_worker(rank, world_size, port, results):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    try:
        plain = tiny_gpt(dropout=0.0, n_layer=2)
        ckpt = copy.deepcopy(plain)
        for block in ckpt.blocks:
            torch_ext.checkpoint(block)
        torch.manual_seed(100 + rank)
        idx = torch.randint(0, 64, (2, 16))
        grads = []
        for model in (plain, ckpt):
            ddp = DDP(model)
            language_model_loss(ddp(idx[:, :-1]), idx[:, 1:]).backward()
            grads.append([p.grad for p in model.parameters()])
        results[rank] = [i for i, (a, b) in enumerate(zip(*grads)) if not torch.equal(a, b)]
    finally:
        dist.destroy_process_group()


def _fsdp2_worker(rank, world_size, port, results):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    try:
        plain = tiny_gpt(dropout=0.0, n_layer=2)
        sharded = copy.deepcopy(plain)
        mesh = init_device_mesh("cpu", (world_size,))
        for block in sharded.blocks:
            torch_ext.checkpoint(block)
            fully_shard(block, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        torch.manual_seed(100 + rank)
        idx = torch.randint(0, 64, (2, 16))
        for model in (plain, sharded):
            language_model_loss(model(idx[:, :-1]), idx[:, 1:]).backward()
        for p in plain.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        results[rank] = [name for (name, p), q in zip(sharded.named_parameters(), plain.parameters())
                         if not torch.equal(p.grad.full_tensor(), q.grad)]
    finally:
        dist.destroy_process_group()


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("worker", [_ddp_worker, _fsdp2_worker], ids=["ddp", "fsdp2"])
def test_two_cpu_processes_give_the_unwrapped_models_gradients(worker):
    results = mp.Manager().dict()
    mp.spawn(worker, args=(2, free_port(), results), nprocs=2, join=True)
    assert dict(results) == {0: [], 1: []}


# ---- demo -----------------------------------------------------------------------------------


def test_demo_section_runs(capsys):
    from torch_ext.demos import demo_checkpoint as demo

    demo(lambda iterable, desc: iterable, quick=True)
    out = capsys.readouterr().out
    assert "no checkpointing" in out and "planned" in out and "boundaries" in out
