"""Selective checkpointing on a CUDA device (skipped without one): torch's policies through
torch_ext, the native policy and the op-level planner, checked as the CPU tests check them but with
the device's kernels, random number generator and memory. CUDA kernels may sum in another order
than a replay's, so gradients are compared within float32's tolerance, not bit for bit."""
import copy

import pytest
import torch
from torch import nn

import torch_ext
from torch_ext.checkpointing import hf
from test_checkpoint_native import MLP, compute_ops
from test_checkpoint_op_plan import peak_and_grads
from test_checkpoint_selective import SAVE_ATTENTION, OpCounter, qwen2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def assert_close(a, b):
    assert len(a) == len(b)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q)


def cuda_step(model, seed=3):
    """(the matrix products one training step ran, parameter gradients), every random op drawn from
    seed. Products, not attention calls: with grouped-query attention in float32, CUDA's sdpa runs
    its math path, whose products the policy sees (and saves) one by one."""
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(seed)).to(CUDA)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with OpCounter() as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    return sum(counter.counts[op] for op in ("mm", "addmm", "bmm")), [p.grad for p in model.parameters()]


def with_torchs_policy(model, context_fn):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": context_fn})
    return model


def test_cuda_torchs_policy_through_torch_ext_saves_what_torch_saves_and_gives_its_gradients():
    torch_products, torch_grads = cuda_step(with_torchs_policy(qwen2().to(CUDA), SAVE_ATTENTION))
    model = qwen2().to(CUDA)
    hf.gradient_checkpointing_enable(model, context_fn=SAVE_ATTENTION)
    products, grads = cuda_step(model)
    full = qwen2().to(CUDA)
    hf.gradient_checkpointing_enable(full)
    full_products, _ = cuda_step(full)
    assert products == torch_products < full_products  # saved products do not run again in backward
    assert_close(grads, torch_grads)


def gpt2_with_dropout():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                     attn_implementation="sdpa")
    assert config.attn_pdrop > 0 and config.resid_pdrop > 0  # the defaults: dropout in attention and after it
    return transformers.GPT2LMHeadModel(config).to(CUDA).train()


@pytest.mark.parametrize("options", [{}, {"save": "torchtitan"}, {"context_fn": SAVE_ATTENTION}],
                         ids=["per layer", "native torchtitan", "torch policy"])
def test_cuda_dropout_replays_draw_the_forwards_numbers(options):
    # torch's policy saves CUDA's attention, which draws its dropout inside: the replay does not run
    # it, and the dropout after it draws the forward's numbers only because torch_ext sets the
    # generator as the forward had it (replay_draws.py; torch's own selective checkpointing gives
    # gradients 0.6-1.2x their size off here, measured on an H200 with torch 2.11).
    _, plain = cuda_step(gpt2_with_dropout())
    model = gpt2_with_dropout()
    hf.gradient_checkpointing_enable(model, **options)
    _, grads = cuda_step(model)
    assert_close(grads, plain)
    _, other_seed = cuda_step(gpt2_with_dropout(), seed=4)
    assert not torch.allclose(other_seed[0], plain[0])  # the comparison sees the masks drawn


def mlp_blocks(n_blocks, **options):
    torch.manual_seed(0)
    blocks = [MLP().to(CUDA) for _ in range(n_blocks)]
    for block in blocks:
        if options:
            torch_ext.checkpoint(block, **options)
    return blocks


def backward_ops(blocks, x):
    """The ops backward ran, and the input's and parameters' gradients."""
    x = x.detach().requires_grad_()
    with OpCounter() as counter:  # through the forward too: a replay is served under its forward's mode
        h = x
        for block in blocks:
            h = block(h)
        loss = h.sum()
        counter.counts.clear()
        loss.backward()
    return counter.counts, [x.grad] + [p.grad for block in blocks for p in block.parameters()]


def test_cuda_native_policy_does_not_run_saved_matmuls_again_and_gives_the_unwrapped_gradients():
    x = torch.randn(8, 16, device=CUDA)
    _, plain = backward_ops(mlp_blocks(2), x)
    full_counts, _ = backward_ops(mlp_blocks(2, save=[]), x)
    counts, grads = backward_ops(mlp_blocks(2, save="matmul"), x)
    assert full_counts["addmm"] > 0 and counts["addmm"] == 0
    assert counts["tanh"] == full_counts["tanh"] > 0  # the rest is recomputed
    assert compute_ops(counts) != compute_ops(full_counts)
    assert_close(grads, plain)


def test_cuda_op_plans_stay_within_their_budgets_monotonic_with_the_unwrapped_gradients():
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)).to(CUDA) for _ in range(16)]
    x = torch.randn(128, 128, device=CUDA)
    loose = torch_ext.plan_ops(layers, x, budget_bytes=1 << 40, repeat=1, gradients="accumulated")
    assert all(seconds > 0 for block in loose.ops for *_, seconds in block)
    plain_peak, plain = peak_and_grads(copy.deepcopy(layers), x)
    span = loose.no_checkpoint_peak_bytes - loose.min_budget_bytes
    peaks = []
    for fraction in (0.0, 0.5, 1.0):
        plan = loose.with_budget(int(loose.min_budget_bytes + fraction * span))
        peak, grads = peak_and_grads(plan.apply(copy.deepcopy(layers)), x)
        assert peak <= plan.budget_bytes, (fraction, peak, plan.budget_bytes)
        assert_close(grads, plain)
        peaks.append(peak)
    assert peaks == sorted(peaks) and peaks[0] <= 0.4 * plain_peak


def compiled_step(save):
    """(bytes a compiled forward of a checkpointed MLP keeps for backward, its gradients): Inductor's
    own kernels on the device, measured on the second step (the first compiles)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = torch_ext.checkpoint(MLP(64).to(CUDA), save=save)
    x = torch.randn(256, 64, device=CUDA, requires_grad=True)
    step = torch.compile(block, fullgraph=True)
    for _ in range(2):
        x.grad = None
        block.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        out = step(x)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - start
        out.sum().backward()
    torch._dynamo.reset()
    return kept, [x.grad] + [p.grad for p in block.parameters()]


def test_cuda_compiled_with_inductor_a_policy_keeps_what_it_saves_and_the_eager_gradients():
    torch.manual_seed(0)
    eager = torch_ext.checkpoint(MLP(64).to(CUDA), save="matmul")
    x = torch.randn(256, 64, device=CUDA, requires_grad=True)
    eager(x).sum().backward()
    nothing, _ = compiled_step([])
    matmuls, grads = compiled_step("matmul")
    # The three matmul outputs (256 x 128, 256 x 128, 256 x 64 floats) are kept only when saved.
    assert matmuls - nothing >= (2 * 128 + 64) * 256 * 4
    assert_close(grads, [x.grad] + [p.grad for p in eager.parameters()])
