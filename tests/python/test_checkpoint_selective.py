"""torch's selective activation checkpointing (context_fn, create_selective_checkpoint_contexts)
through every torch_ext entry point, compared with torch.utils.checkpoint's own result: the same
gradients (torch.equal, CPU) and the same ops skipped in backward (counted with a dispatch mode)."""
import copy
import functools
import pickle
from collections import Counter

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import torch_ext
from torch_ext.checkpointing import hf

aten = torch.ops.aten


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that run (by overload packet name)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def backward_counts(loss_fn, *leaves):
    """Runs loss_fn() (forward), then its backward under an OpCounter: the ops backward ran."""
    loss = loss_fn()
    with OpCounter() as counter:
        loss.backward()
    return counter.counts, [leaf.grad for leaf in leaves]


def save_mm(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op == aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


SAVE_MM = functools.partial(create_selective_checkpoint_contexts, save_mm)


def fn(x, w):
    return torch.sigmoid(torch.mm(torch.mm(x, w).relu(), w)) * w.sum()


def inputs(seed=0, n=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, n, generator=g, requires_grad=True), torch.randn(n, n, generator=g, requires_grad=True))


def run_both(function, context_fn, *, make=inputs, **ours):
    """(counts, grads) of torch's checkpoint and of torch_ext's checkpoint_call on fresh inputs."""
    results = []
    for call in (tuc.checkpoint, torch_ext.checkpoint_call):
        leaves = make()
        kw = ours if call is torch_ext.checkpoint_call else {}
        results.append(backward_counts(
            lambda: call(function, *leaves, use_reentrant=False, context_fn=context_fn, **kw).sum(), *leaves))
    return results


def assert_same(a, b):
    assert len(a) == len(b)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


@pytest.mark.parametrize("early_stop", [True, False])
def test_saved_ops_do_not_run_in_backward_and_gradients_equal_torchs(early_stop):
    (torch_counts, torch_grads), (our_counts, our_grads) = run_both(fn, SAVE_MM, early_stop=early_stop)
    assert_same(torch_grads, our_grads)
    # Backward's own gradient matmuls: the saved forward matmuls never run again.
    plain_counts, _ = backward_counts(lambda: fn(*inputs()).sum(), *inputs())
    assert our_counts["mm"] == torch_counts["mm"] == plain_counts["mm"]
    assert our_counts["relu"] == torch_counts["relu"] == 1  # recomputed (PREFER_RECOMPUTE)


def test_without_a_policy_the_matmuls_are_recomputed():
    context_fn = functools.partial(create_selective_checkpoint_contexts, lambda *a, **k: CheckpointPolicy.MUST_RECOMPUTE)
    (torch_counts, torch_grads), (our_counts, our_grads) = run_both(fn, context_fn, early_stop=False)
    assert_same(torch_grads, our_grads)
    plain_counts, _ = backward_counts(lambda: fn(*inputs()).sum(), *inputs())
    assert our_counts["mm"] == torch_counts["mm"] == plain_counts["mm"] + 2


def test_a_list_of_ops_saves_them_as_must_save():
    context_fn = functools.partial(create_selective_checkpoint_contexts, [aten.mm.default])
    (_, torch_grads), (our_counts, our_grads) = run_both(fn, context_fn)
    (_, _), (policy_counts, _) = run_both(fn, SAVE_MM)
    assert_same(torch_grads, our_grads)
    assert our_counts["mm"] == policy_counts["mm"]


def test_the_policy_sees_each_forward_op_once_with_is_recompute_false_as_torchs_does():
    calls = {tuc.checkpoint: [], torch_ext.checkpoint_call: []}
    for call, seen in calls.items():
        def policy(ctx, op, *args, seen=seen, **kwargs):
            seen.append((op, ctx.is_recompute))
            return CheckpointPolicy.PREFER_SAVE if op == aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE
        x, w = inputs()
        call(fn, x, w, use_reentrant=False, context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                                          policy)).sum().backward()
    assert calls[tuc.checkpoint] == calls[torch_ext.checkpoint_call]
    assert calls[tuc.checkpoint] and not any(recompute for _, recompute in calls[tuc.checkpoint])


def test_a_stateful_policy_saving_every_second_matmul_matches_torch():
    def make_context():
        count = [0]

        def policy(ctx, op, *args, **kwargs):
            if op == aten.mm.default:
                count[0] += 1
                return CheckpointPolicy.MUST_SAVE if count[0] % 2 == 0 else CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)

    def four_matmuls(x, w):
        for _ in range(4):
            x = torch.mm(x, w).tanh()
        return x

    (torch_counts, torch_grads), (our_counts, our_grads) = run_both(four_matmuls, make_context, early_stop=False)
    assert_same(torch_grads, our_grads)
    plain_counts, _ = backward_counts(lambda: four_matmuls(*inputs()).sum(), *inputs())
    assert our_counts["mm"] == torch_counts["mm"] == plain_counts["mm"] + 2  # the odd ones, recomputed


@pytest.mark.parametrize("saved", ["rand_like", "none"])
def test_random_ops_saved_or_recomputed_give_the_forwards_numbers(saved):
    # Saved, the replay takes the forward's numbers from the policy's storage; recomputed, it draws
    # them again from the restored RNG.
    ops = (aten.rand_like, aten.mm) if saved == "rand_like" else (aten.mm,)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op.overloadpacket in ops else CheckpointPolicy.PREFER_RECOMPUTE

    def dropped(x, w):
        return (torch.mm(x, w) * torch.rand_like(x)).exp()

    grads, counts = [], []
    for call in (tuc.checkpoint, torch_ext.checkpoint_call):
        x, w = inputs()
        torch.manual_seed(7)
        out = call(dropped, x, w, use_reentrant=False,
                   context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
        count, grad = backward_counts(lambda: out.sum(), x, w)
        grads.append(grad)
        counts.append(count["rand_like"])
    x, w = inputs()
    torch.manual_seed(7)
    dropped(x, w).sum().backward()
    assert_same(grads[0], grads[1])
    assert_same(grads[1], (x.grad, w.grad))
    assert counts[0] == counts[1] == (0 if saved == "rand_like" else 1)


def two_draws(x):
    y = x * torch.rand_like(x)
    return (y.sin() * torch.rand_like(y)).sum()


def first_draw_saved():
    draws = [0]

    def policy(ctx, op, *args, **kwargs):
        if op == aten.rand_like.default:
            draws[0] += 1
            return CheckpointPolicy.MUST_SAVE if draws[0] == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def grad_and_next_draw(call):
    """x's gradient through call(x) from RNG seed 1, and the generator's next numbers after it."""
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    torch.manual_seed(1)
    call(x).backward()
    return x.grad, torch.rand(3)


def test_a_saved_draw_before_a_recomputed_one_gives_the_unwrapped_models_numbers():
    # The replay does not run the saved draw, so the generator would reach the second draw where the
    # forward's first began (torch's own selective checkpointing then gives other gradients).
    plain_grad, plain_next = grad_and_next_draw(two_draws)
    grad, following = grad_and_next_draw(
        lambda x: torch_ext.checkpoint_call(two_draws, x, use_reentrant=False, context_fn=first_draw_saved))
    assert torch.equal(grad, plain_grad)
    assert torch.equal(following, plain_next)  # the caller's generator goes on as without checkpointing


class ServesFirstDraw(TorchDispatchMode):
    """A recompute context that returns the forward's first draw instead of running it, as a policy's does."""

    def __init__(self, first):
        super().__init__()
        self.first = first

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func == aten.rand_like.default and self.first is not None:
            first, self.first = self.first, None
            return first
        return func(*args, **(kwargs or {}))


def test_a_policy_asked_before_its_op_runs_notes_the_generator_before_the_draw():
    # torch 2.11 asks the policy before the op runs (its context has no op_output), 2.13 after.
    from types import SimpleNamespace
    from torch_ext.checkpointing.forward_log import ForwardLog

    log = ForwardLog(first_draw_saved()[0].policy_fn)
    x = torch.ones(16)
    torch.manual_seed(0)
    forward = []
    for _ in range(2):
        log(SimpleNamespace(is_recompute=False), aten.rand_like.default, x)
        forward.append(torch.rand_like(x))
    torch.manual_seed(0)  # a replay starts from the forward's state
    with ServesFirstDraw(forward[0]), log.replay("two draws"):
        replayed = [torch.rand_like(x) for _ in range(2)]
    assert torch.equal(replayed[1], forward[1])  # without the noted state: the first draw's numbers


def mutating(x, w):
    y = torch.mm(x, w)
    y.mul_(2)
    return y.sin()


def test_an_in_place_change_of_a_saved_output_is_recomputed_where_torchs_replay_raises():
    x, w = inputs()
    out = tuc.checkpoint(mutating, x, w, use_reentrant=False, context_fn=SAVE_MM)
    with pytest.raises(RuntimeError, match="mutated"):
        out.sum().backward()
    x, w = inputs()
    expected_counts, expected = backward_counts(lambda: mutating(x, w).sum(), x, w)
    x, w = inputs()
    counts, grads = backward_counts(
        lambda: torch_ext.checkpoint_call(mutating, x, w, use_reentrant=False, context_fn=SAVE_MM).sum(), x, w)
    assert_same(grads, expected)
    assert counts["mm"] == expected_counts["mm"] + 1  # the changed product runs again in the replay


def test_an_in_place_change_of_a_saved_output_is_served_changed_when_allowed_as_torchs():
    allowed = functools.partial(create_selective_checkpoint_contexts, save_mm, allow_cache_entry_mutation=True)
    (torch_counts, torch_grads), (our_counts, our_grads) = run_both(mutating, allowed)
    assert_same(torch_grads, our_grads)
    assert torch_counts["mm"] == our_counts["mm"]  # not run again: the changed copy is served


def two_saved_draws(x):
    first = torch.rand_like(x)
    second = torch.rand_like(x)
    second.mul_(2)  # changed after it was saved: the replay draws it again
    return ((x * first).sin() * second).sum()


def save_draws(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op == aten.rand_like.default else CheckpointPolicy.PREFER_RECOMPUTE


def test_a_saved_draw_changed_in_place_draws_the_forwards_numbers_again():
    # The replay draws the changed output again, while the first is served without a draw: the
    # generator must be set to where the forward drew the second.
    plain_grad, plain_next = grad_and_next_draw(two_saved_draws)
    policy = functools.partial(create_selective_checkpoint_contexts, save_draws)
    grad, following = grad_and_next_draw(lambda x: torch_ext.checkpoint_call(two_saved_draws, x, context_fn=policy))
    assert torch.equal(grad, plain_grad)
    assert torch.equal(following, plain_next)


def test_views_saved_and_in_place_ops_recomputed_match_torch():
    def viewing(x, w):
        y = torch.mm(x, w).t()
        z = y[1:] * 2
        z.add_(1)
        return torch.mm(z, w[:, :3]).view(-1).sigmoid()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_SAVE if op.is_view or op == aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    (torch_counts, torch_grads), (our_counts, our_grads) = run_both(viewing, context_fn, early_stop=False)
    assert_same(torch_grads, our_grads)
    assert our_counts == torch_counts


def test_outputs_several_and_not_tensors():
    def several(x, w):
        y = torch.mm(x, w)
        return y.sin(), 3, {"z": y.cos()}

    results = []
    for call in (tuc.checkpoint, torch_ext.checkpoint_call):
        x, w = inputs()
        a, n, d = call(several, x, w, use_reentrant=False, context_fn=SAVE_MM)
        (a.sum() + d["z"].sum() * n).backward()
        results.append((x.grad, w.grad))
    assert_same(*results)


def test_a_second_backward_through_a_retained_graph_raises_as_torchs():
    for call in (tuc.checkpoint, torch_ext.checkpoint_call):
        out = call(fn, *inputs(), use_reentrant=False, context_fn=SAVE_MM).sum()
        out.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="backward an extra time"):
            out.backward()


def test_bad_context_fns_are_refused():
    x, w = inputs()
    with pytest.raises(TypeError, match="context_fn must be a callable"):
        torch_ext.checkpoint_call(fn, x, w, context_fn=3)
    with pytest.raises(TypeError, match="tuple of two context managers"):
        torch_ext.checkpoint_call(fn, x, w, context_fn=lambda: None)
    with pytest.raises(ValueError, match="OpOverload"):  # torch's own check of the op list
        torch_ext.checkpoint_call(fn, x, w, context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                                         [aten.mm]))
    with pytest.raises(TypeError, match="context_fn must be a callable"):
        torch_ext.checkpoint(fn, context_fn="mm")


def test_a_forward_context_that_swallows_the_error_is_an_error():
    class Swallow:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return True

    def failing(x):
        raise ValueError("boom")

    with pytest.raises(RuntimeError, match="suppressed an exception"):
        torch_ext.checkpoint_call(failing, inputs()[0], context_fn=lambda: (Swallow(), Swallow()))


class Block(nn.Module):
    def __init__(self, n=8):
        super().__init__()
        self.a = nn.Linear(n, n)
        self.b = nn.Linear(n, n)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).relu()


def save_addmm(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in (aten.addmm.default, aten.mm.default) else CheckpointPolicy.PREFER_RECOMPUTE


SAVE_ADDMM = functools.partial(create_selective_checkpoint_contexts, save_addmm)


@torch_ext.checkpoint(context_fn=SAVE_ADDMM)
class CheckpointedBlock(Block):
    pass


def chain(n_blocks=4):
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(n_blocks)])


def reference(model, x):
    """torch's SAC on every block: (backward op counts, input grad, parameter grads)."""
    def run():
        h = x
        for block in model:
            h = tuc.checkpoint(block, h, use_reentrant=False, context_fn=SAVE_ADDMM)
        return h.sum()
    counts, (grad,) = backward_counts(run, x)
    return counts, grad, [p.grad for p in model.parameters()]


def through_functions(model, x):
    for block in model:
        x = torch_ext.checkpoint(type(block).forward, context_fn=SAVE_ADDMM)(block, x)
    return x


def through_modules(model, x):
    for block in model:
        torch_ext.checkpoint(block, context_fn=SAVE_ADDMM)
    return model(x)


def through_a_chain(model, x):
    return torch_ext.CheckpointedSequential(list(model), every=1, context_fn=SAVE_ADDMM)(x)


ENTRY_POINTS = {"function": through_functions, "module": through_modules, "CheckpointedSequential": through_a_chain}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_entry_point_matches_torchs_selective_checkpointing(entry):
    x = torch.randn(4, 8, requires_grad=True)
    model = chain()
    torch_counts, torch_grad, torch_params = reference(model, x)
    x2 = x.detach().clone().requires_grad_(True)
    ours = chain()
    counts, (grad,) = backward_counts(lambda: ENTRY_POINTS[entry](ours, x2).sum(), x2)
    assert torch.equal(grad, torch_grad)
    assert_same([p.grad for p in ours.parameters()], torch_params)
    assert counts["addmm"] == torch_counts["addmm"] == 0  # backward of Linear uses mm; no forward addmm again
    assert counts["tanh"] == torch_counts["tanh"]


def test_a_checkpointed_class_and_its_copies_keep_the_policy():
    torch.manual_seed(0)
    original = CheckpointedBlock()
    for model in (original, copy.deepcopy(original), pickle.loads(pickle.dumps(original))):
        counts, _ = backward_counts(lambda: model(torch.randn(4, 8)).sum())
        assert counts["addmm"] == 0
    instance = torch_ext.checkpoint(Block(), context_fn=SAVE_ADDMM)
    for model in (copy.deepcopy(instance), pickle.loads(pickle.dumps(instance))):
        counts, _ = backward_counts(lambda: model(torch.randn(4, 8)).sum())
        assert counts["addmm"] == 0


def test_a_new_context_fn_per_call_does_not_accumulate():
    from torch_ext.checkpointing import api

    before = len(api._OPTIONS_CACHE)
    x, w = inputs()
    for _ in range(5):
        torch_ext.checkpoint_call(fn, x, w, context_fn=functools.partial(create_selective_checkpoint_contexts, save_mm))
    assert len(api._OPTIONS_CACHE) <= before + 1


def test_a_budget_plan_with_a_policy_is_refused():
    with pytest.raises(ValueError, match="CheckpointedSequential: budget_bytes with context_fn"):
        torch_ext.CheckpointedSequential(list(chain(2)), budget_bytes=1 << 20, context_fn=SAVE_ADDMM)
    with pytest.raises(ValueError, match="checkpoint_layers: budget_bytes with context_fn"):
        hf.checkpoint_layers(qwen2(), budget_bytes=1 << 20, inputs={"input_ids": torch.ones(1, 4, dtype=torch.long)},
                             context_fn=SAVE_ATTENTION)


def test_checkpoint_sequential_takes_context_fn():
    model = chain(4)
    x = torch.randn(4, 8, requires_grad=True)
    calls = []

    def counting_context():
        calls.append(1)
        return SAVE_ADDMM()

    out = torch_ext.checkpoint_sequential(model, 2, x, context_fn=counting_context)
    x2 = x.detach().clone().requires_grad_(True)
    expected = tuc.checkpoint_sequential(chain(4), 2, x2, use_reentrant=False)
    assert torch.equal(out, expected)
    assert calls == [1]  # the first of the two parts is checkpointed, under the policy
    counts, _ = backward_counts(lambda: torch_ext.checkpoint_sequential(chain(4), 2, x2, context_fn=SAVE_ADDMM).sum(),
                                x2)
    assert counts["addmm"] == 0


def test_nested_checkpoints_with_a_policy_give_torchs_gradients():
    def inner(x, w):
        return torch.mm(x, w).sin()

    results = []
    for call in (tuc.checkpoint, torch_ext.checkpoint_call):
        x, w = inputs()

        def outer(x, w, call=call):
            return call(inner, x.cos(), w, use_reentrant=False, context_fn=SAVE_MM).mm(w)
        call(outer, x, w, use_reentrant=False, context_fn=SAVE_MM).sum().backward()
        results.append((x.grad, w.grad))
    assert_same(*results)


@pytest.mark.parametrize("case", ["input_saved", "nothing_saved", "output_saved"])
def test_nested_checkpoints_with_early_stop_recompute_the_inner_segment_once(case):
    """torch's TestNestedCheckpoint.test_nested_checkpoint_set_early_stop_no_recompution_needed:
    the enclosing replay stops once the inner checkpoint's inputs are saved."""
    body = {"input_saved": torch.sin, "nothing_saved": torch.clone, "output_saved": torch.exp}[case]
    counts = {}
    for call in (tuc.checkpoint, torch_ext.checkpoint_call):
        count = [0]

        def inner(x, count=count):
            count[0] += 1
            return body(x)

        def outer(x, call=call):
            return call(inner, x, use_reentrant=False, early_stop=True)
        x = torch.tensor(1.0, requires_grad=True)
        call(outer, x, use_reentrant=False, early_stop=True).backward()
        counts[call] = count[0]
    assert counts[torch_ext.checkpoint_call] == counts[tuc.checkpoint]
    assert counts[torch_ext.checkpoint_call] == (1 if case == "nothing_saved" else 2)


def test_a_policy_compiles_in_one_graph_as_torchs_does():
    grads = []
    for ours in (True, False):
        torch._dynamo.reset()
        block = chain(1)[0]
        if ours:
            step = torch_ext.checkpoint(block, context_fn=SAVE_ADDMM)
        else:
            step = functools.partial(tuc.checkpoint, block, use_reentrant=False, context_fn=SAVE_ADDMM)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
        torch.compile(step, fullgraph=True, backend="aot_eager")(x).sum().backward()
        grads.append([x.grad] + [p.grad for p in block.parameters()])
    torch._dynamo.reset()
    assert_same(*grads)


def qwen2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                      attn_implementation="sdpa", bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.Qwen2ForCausalLM(config).train()


def save_attention_and_matmuls(ctx, op, *args, **kwargs):
    """The policy TRL's enable_selective_activation_checkpointing injects: attention and matmuls saved."""
    name = op.overloadpacket.__name__
    saved = name in ("mm", "addmm", "bmm") or name.startswith("_scaled_dot_product")
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


SAVE_ATTENTION = functools.partial(create_selective_checkpoint_contexts, save_attention_and_matmuls)


def hf_step(model):
    """(attention forwards in a training step, parameter gradients)."""
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    model.zero_grad(set_to_none=True)
    with OpCounter() as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    attention = sum(n for op, n in counter.counts.items() if op.startswith("_scaled_dot_product") and "backward" not in op)
    return attention, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("entry", ["gradient_checkpointing_enable", "gradient_checkpointing_kwargs",
                                   "checkpoint_layers"])
def test_a_hugging_face_model_with_a_policy_matches_torchs_selective_checkpointing(entry):
    reference = qwen2()
    kwargs = {"use_reentrant": False, "context_fn": SAVE_ATTENTION}  # as TRL passes it to Hugging Face
    reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    torch_attention, torch_grads = hf_step(reference)
    model = qwen2()
    if entry == "gradient_checkpointing_enable":
        hf.gradient_checkpointing_enable(model, context_fn=SAVE_ATTENTION)
    elif entry == "gradient_checkpointing_kwargs":
        hf.gradient_checkpointing_enable(model, gradient_checkpointing_kwargs=kwargs)
    else:
        hf.checkpoint_layers(model, every=1, context_fn=SAVE_ATTENTION)
    attention, grads = hf_step(model)
    assert attention == torch_attention == 2  # one per layer: saved, never run again in backward
    assert_same(grads, torch_grads)
    full = qwen2()
    hf.gradient_checkpointing_enable(full)
    assert hf_step(full)[0] == 4  # without the policy each layer's attention runs again

