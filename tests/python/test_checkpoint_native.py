"""torch_ext's native selective checkpointing (the `save` option, decided in C++): the ops it names
are not run again in backward (counted with a dispatch mode, which a served op never reaches), the
gradients equal the unwrapped model's and torch's selective checkpointing with the same policy, on
every front door (Python, TorchScript, torch.compile) and on a Hugging Face model."""
import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import torch_ext
from torch_ext import memory
from torch_ext.checkpointing import hf, selective
from test_checkpoint_selective import OpCounter, assert_same, qwen2  # noqa: E402

aten = torch.ops.aten


def backward_counts(loss_fn, *leaves):
    """The ops backward ran, and the leaves' gradients. The counting mode runs through the forward
    too: the native policy serves a replay only under its forward's dispatch-mode setting."""
    with OpCounter() as counter:
        loss = loss_fn()
        counter.counts.clear()
        loss.backward()
    return counter.counts, [leaf.grad for leaf in leaves]


class MLP(nn.Module):
    def __init__(self, n=16):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(n, 2 * n), nn.Linear(2 * n, 2 * n), nn.Linear(2 * n, n)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.nn.functional.gelu(self.a(x))))).sin()


def run(save=None, n_blocks=2, context_fn=None, **options):
    """(backward op counts, input and parameter gradients) of n_blocks MLPs, each checkpointed."""
    torch.manual_seed(0)
    blocks = [MLP() for _ in range(n_blocks)]
    for block in blocks:
        if save is not None:
            torch_ext.checkpoint(block, save=save, **options)
        elif context_fn is not None:
            torch_ext.checkpoint(block, context_fn=context_fn, **options)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def loss():
        h = x
        for block in blocks:
            h = block(h)
        return h.sum()
    counts, (grad,) = backward_counts(loss, x)
    return counts, [grad] + [p.grad for block in blocks for p in block.parameters()]


def compute_ops(counts):
    """Op counts without detach, which torch's policy and ours issue differently as bookkeeping."""
    return {op: n for op, n in counts.items() if op != "detach"}


def torchs_policy(ops, every=1):
    """torch's selective checkpointing of the same decisions: ops saved, every `every`-th counted together."""
    def context_fn():
        seen = [0]

        def policy(ctx, op, *args, **kwargs):
            if op in ops:
                seen[0] += 1
                if seen[0] % every == 0:
                    return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)
    return context_fn


@pytest.mark.parametrize("early_stop", [True, False])
def test_saved_matmuls_do_not_run_in_backward_and_gradients_equal_the_unwrapped_models(early_stop):
    plain_counts, plain = run(n_blocks=2)
    full_counts, _ = run(save=[], n_blocks=2, early_stop=early_stop)
    counts, grads = run(save="matmul", early_stop=early_stop)
    assert_same(grads, plain)
    assert plain_counts["addmm"] == 0 and full_counts["addmm"] > 0
    assert counts["addmm"] == 0  # all 6 forward matmuls saved
    assert counts["tanh"] == full_counts["tanh"] > 0  # the rest is recomputed


@pytest.mark.parametrize("save, ops, every", [("matmul/2", (aten.addmm.default,), 2),
                                               ("aten.addmm.default", (aten.addmm.default,), 1),
                                               ("aten::gelu", (aten.gelu.default,), 1),
                                               (("aten::tanh", "aten.sin.default"), (aten.tanh.default, aten.sin.default), 1)])
def test_the_saved_set_and_gradients_equal_torchs_selective_checkpointing_with_the_same_policy(save, ops, every):
    torch_counts, torch_grads = run(context_fn=torchs_policy(ops, every))
    counts, grads = run(save=save)
    assert_same(grads, torch_grads)
    assert compute_ops(counts) == compute_ops(torch_counts)


def test_occurrences_choose_which_calls_of_an_op_are_saved():
    torch_counts, torch_grads = run(context_fn=torchs_policy((aten.addmm.default,), 3))  # the third matmul
    counts, grads = run(save="aten::addmm#2")
    assert_same(grads, torch_grads)
    assert compute_ops(counts) == compute_ops(torch_counts)
    assert counts["addmm"] == 2 * 2  # per block: 3 matmuls, one saved


def test_the_torchtitan_preset_saves_attention_and_every_second_matmul():
    assert torch_ext.checkpoint_call(lambda x: x, torch.ones(1), save="torchtitan") is not None
    rules = torch_ext._C.checkpoint.save_rules(["torchtitan"])
    by_op = {op: (group, every) for op, group, every, _ in rules}
    assert by_op["aten::_scaled_dot_product_flash_attention_for_cpu.default"][1] == 1
    assert by_op["aten::mm.default"][1] == by_op["aten::addmm.default"][1] == 2
    assert by_op["aten::mm.default"][0] == by_op["aten::bmm.default"][0]  # matmuls counted together


@pytest.mark.parametrize("save, message", [
    ("aten::no_such_op", "names no operator"),
    ("aten::view", "view or in-place"),
    ("aten::add_.Tensor", "view or in-place"),
    ("aten::linear", "decomposes before autograd"),
    ("aten::bernoulli.default", "random op"),
    ("matmul/0", "at least 1"),
    ("aten::mm#x", "non-negative integer"),
    (("matmul", "aten::mm"), "an earlier item names too"),
])
def test_bad_items_are_refused_naming_the_item(save, message):
    with pytest.raises(ValueError, match=message):
        torch_ext.checkpoint(MLP(), save=save)


def test_save_with_context_fn_or_of_another_type_is_refused():
    with pytest.raises(ValueError, match="save and context_fn"):
        torch_ext.checkpoint(MLP(), save="matmul", context_fn=torchs_policy((aten.mm.default,)))
    with pytest.raises(TypeError, match="save must be a string or a sequence of strings"):
        torch_ext.checkpoint(MLP(), save=3)


def test_an_output_changed_in_place_after_it_was_saved_is_recomputed():
    def segment(x, w):
        y = torch.mm(x, w)
        y.mul_(2)  # changes the saved output: serving it would give the replay the doubled values
        return (y.sin() * w.sum()).sum()

    leaves = [torch.randn(4, 4, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in range(2)]
    segment(*leaves).backward()
    expected = [leaf.grad.clone() for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    torch_ext.checkpoint_call(segment, *leaves, save="aten::mm").backward()
    assert_same([leaf.grad for leaf in leaves], expected)


def scores_changed_in_place(q, k, mask):
    # torch.matmul of 4-D tensors returns its bmm's output through aten::_unsafe_view, a tensor with a
    # version counter of its own; torch's math attention adds its mask to it in place the same way
    # (Hugging Face's T5 under sdpa)
    scores = torch.matmul(q, k.transpose(-2, -1))
    scores.add_(mask)
    return scores.softmax(-1)[..., 0].square().sum()


def attention_leaves(n=16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, n, 8, generator=g, requires_grad=True) for _ in range(2)] + [torch.randn(n, n, generator=g)]


def test_a_batched_product_changed_in_place_through_matmuls_result_is_recomputed_and_not_kept():
    q, k, mask = attention_leaves()
    scores_changed_in_place(q, k, mask).backward()
    expected = [q.grad.clone(), k.grad.clone()]
    kept = {}
    for save in (None, "aten::bmm"):
        q.grad = k.grad = None
        start = memory.stats().current_bytes
        loss = torch_ext.checkpoint_call(scores_changed_in_place, q, k, mask, save=save)
        kept[save] = memory.stats().current_bytes - start
        loss.backward()
        assert_same([q.grad, k.grad], expected)
    scores_bytes = 2 * 3 * 16 * 16 * 4
    assert kept[None] < scores_bytes and kept["aten::bmm"] < scores_bytes  # dropped as the forward ends


def test_the_probe_marks_an_output_changed_later_in_the_forward():
    q, k, mask = attention_leaves()

    def forward():
        scores_changed_in_place(q, k, mask)
        torch.matmul(q, k.transpose(-2, -1))
    probed = torch_ext._C.checkpoint.probe(forward, ["aten::bmm"])
    assert [(op, occurrence) for op, occurrence, _ in probed] == [("aten::bmm.default", 0), ("aten::bmm.default", 1)]
    assert probed[0][2] == -1 and probed[1][2] == 2 * 3 * 16 * 16 * 4


def test_under_torchs_policy_a_change_through_matmuls_result_is_recomputed():
    # torch.utils.checkpoint misses this change and replays with the changed scores: wrong gradients
    q, k, mask = attention_leaves()
    scores_changed_in_place(q, k, mask).backward()
    expected = [q.grad.clone(), k.grad.clone()]
    grads = {}
    for call in (torch.utils.checkpoint.checkpoint, torch_ext.checkpoint_call):
        q.grad = k.grad = None
        call(scores_changed_in_place, q, k, mask, use_reentrant=False,
             context_fn=torchs_policy({aten.bmm.default})).backward()
        grads[call] = [q.grad, k.grad]
    assert not torch.equal(grads[torch.utils.checkpoint.checkpoint][0], expected[0])
    assert_same(grads[torch_ext.checkpoint_call], expected)


def unwrapped_grad_then_reseed(segment, q, seed=3):
    """q's gradient through segment(q) from RNG seed (q.grad reset), and the RNG at seed again."""
    torch.manual_seed(seed)
    segment(q).backward()
    grad, q.grad = q.grad, None
    torch.manual_seed(seed)
    return grad


def test_attention_with_dropout_draws_the_forwards_numbers_and_without_it_is_served():
    # On the CPU, attention with dropout takes the math path (the fused CPU kernel has no dropout),
    # whose ops "attention" does not name; a fused op called with dropout_p > 0 is never served.
    def segment(q):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5).square().sum()

    q = torch.randn(2, 2, 8, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    expected = unwrapped_grad_then_reseed(segment, q)
    counts, (grad,) = backward_counts(lambda: torch_ext.checkpoint_call(segment, q, save="attention"), q)
    assert torch.equal(grad, expected)
    q.grad = None
    counts, _ = backward_counts(lambda: torch_ext.checkpoint_call(
        lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q).sum(), q, save="attention"), q)
    assert counts["_scaled_dot_product_flash_attention_for_cpu"] == 0


def test_a_replay_that_departs_from_its_forward_raises_naming_the_segment():
    calls = [0]

    def shifty(x, w):
        calls[0] += 1
        h = torch.mm(x, w) if calls[0] == 1 else torch.addmm(torch.zeros(4, 4), x, w)
        return torch.mm(h.sin(), w).sum()

    leaves = [torch.randn(4, 4, requires_grad=True) for _ in range(2)]
    loss = torch_ext.checkpoint_call(shifty, *leaves, save="matmul")
    with pytest.raises(RuntimeError, match="replay of .*shifty departs from its forward at aten::addmm"):
        loss.backward()


def test_a_nested_checkpoint_inside_a_saving_segment_keeps_its_own_choice():
    def inner(x, w):
        return torch.mm(x, w).cos()

    def outer(x, w, **options):
        return torch.mm(torch_ext.checkpoint_call(inner, x.sin(), w, **options), w).sum()

    leaves = [torch.randn(4, 4, generator=torch.Generator().manual_seed(i), requires_grad=True) for i in range(2)]
    outer(*leaves).backward()
    expected = [leaf.grad.clone() for leaf in leaves]
    for inner_save in (None, "matmul"):
        for leaf in leaves:
            leaf.grad = None
        torch_ext.checkpoint_call(functools.partial(outer, save=inner_save), *leaves, save="matmul").backward()
        assert_same([leaf.grad for leaf in leaves], expected)


def test_scripted_code_passes_save_to_the_cpp_front_door():
    class Parent(nn.Module):
        save: list[str]

        def __init__(self, save: list[str]):
            super().__init__()
            torch.manual_seed(0)
            self.block = torch.jit.script(MLP())
            self.save = save

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.torch_ext.checkpoint_module(self.block, [x], save=self.save)[0]

    grads = []
    for save in ([], ["matmul"]):
        model = torch.jit.script(Parent(save))
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        counts, (grad,) = backward_counts(lambda: model(x).sum(), x)
        grads.append([grad] + [p.grad for p in model.parameters()])
        assert (counts["addmm"] == 0) == bool(save)
    assert_same(*grads)


def test_compiled_the_same_decisions_reach_torch_compile():
    grads = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        block = torch_ext.checkpoint(MLP(), save="matmul/2")
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        step = torch.compile(block, fullgraph=True, backend="aot_eager") if compiled else block
        step(x).sum().backward()
        grads.append([x.grad] + [p.grad for p in block.parameters()])
    torch._dynamo.reset()
    assert_same(*grads)


def kept_for_backward(save, backend="aot_eager"):
    """Bytes the forward of a checkpointed MLP keeps for backward (its second step), compiled with
    `backend`, or eager where backend is None."""
    torch.manual_seed(0)
    block = torch_ext.checkpoint(MLP(64), save=save)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    step = torch.compile(block, fullgraph=True, backend=backend) if backend else block
    for _ in range(2):  # the first compiles
        start = memory.stats().current_bytes
        out = step(x)
        kept = memory.stats().current_bytes - start
        out.sum().backward()
    return kept


def test_compiled_policies_on_the_same_code_do_not_share_a_graph():
    # Dynamo takes a plain function passed as context_fn without a guard: a second model with
    # another policy would run the first one's graph and keep what that policy keeps.
    torch._dynamo.reset()
    alone = kept_for_backward("aten::addmm#0")
    torch._dynamo.reset()
    everything = kept_for_backward("matmul")
    after = kept_for_backward("aten::addmm#0")
    torch._dynamo.reset()
    assert everything > alone and after == alone


def test_compiled_a_saved_pointwise_op_keeps_what_eager_keeps():
    # Inductor's decompositions make GELU several nodes. Tagged MUST_SAVE, each of them was barred
    # from recompute, and the forward kept GELU's derivative beside its output: twice eager's bytes.
    torch._dynamo.reset()
    compiled = kept_for_backward("aten::gelu", backend="aot_eager_decomp_partition")
    torch._dynamo.reset()
    assert compiled == kept_for_backward("aten::gelu", backend=None) == 256 * 128 * 4


def test_compiled_policy_finds_an_op_whose_cached_overload_was_replaced():
    # packet.__getattr__(name) makes a new OpOverload and caches it on the packet, while dispatch
    # keeps handing policies the object it met first. Rules that knew ops by identity, built after
    # such a call, matched no op: the compiled policy saved nothing.
    torch._dynamo.reset()
    before = kept_for_backward("matmul")  # mm and addmm dispatched: their objects are fixed
    packets = (torch.ops.aten.mm, torch.ops.aten.addmm)
    originals = [packet.default for packet in packets]
    try:
        for packet, original in zip(packets, originals):
            assert packet.__getattr__("default") is not original and packet.default is not original
        selective._rules.cache_clear()  # rules built from now on see the new objects
        torch._dynamo.reset()
        after = kept_for_backward("matmul")
    finally:
        for packet, original in zip(packets, originals):
            packet.default = original
        selective._rules.cache_clear()
        torch._dynamo.reset()
    assert before > 0 and after == before


def test_a_hugging_face_model_with_the_torchtitan_preset_matches_torchs_policy():
    def torchtitan():
        seen = [0]

        def policy(ctx, op, *args, **kwargs):
            name = op.overloadpacket.__name__
            if name.startswith("_scaled_dot_product"):
                return CheckpointPolicy.MUST_SAVE
            if name in ("mm", "addmm", "bmm", "baddbmm"):
                seen[0] += 1
                if seen[0] % 2 == 0:
                    return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)

    def step(model):
        ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(3))
        counts, _ = backward_counts(lambda: model(input_ids=ids, labels=ids).loss)
        return counts, [p.grad for p in model.parameters()]

    reference = qwen2()
    reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                           "context_fn": torchtitan})
    torch_counts, torch_grads = step(reference)
    model = qwen2()
    hf.gradient_checkpointing_enable(model, save="torchtitan")
    counts, grads = step(model)
    assert_same(grads, torch_grads)
    assert compute_ops(counts) == compute_ops(torch_counts)
    assert counts["_scaled_dot_product_flash_attention_for_cpu"] == 0


def test_t5_under_sdpa_saving_matmuls_gives_full_checkpointings_gradients():
    # T5's relative position bias is an attention mask that requires grad, so sdpa takes torch's math
    # attention, which adds the mask in place to its matmul's result: a saved bmm output changed later
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    base = transformers.T5ForConditionalGeneration(config).train()
    g = torch.Generator().manual_seed(3)
    batch = dict(input_ids=torch.randint(1, 128, (2, 12), generator=g), labels=torch.randint(1, 128, (2, 7), generator=g))
    grads = {}
    for save in (None, ("matmul", "attention")):
        model = copy.deepcopy(base)
        hf.gradient_checkpointing_enable(model, **({} if save is None else {"save": save}))
        torch.manual_seed(1)  # the same dropout masks in both
        model(**batch).loss.backward()
        grads[save] = [p.grad for p in model.parameters()]
    assert_same(grads[("matmul", "attention")], grads[None])


@pytest.mark.parametrize("block_type, save, op, runs", [
    ("MLP", "matmul", "addmm", 3),  # the forward's matmuls, served once, run again
    ("DropoutMLP", "dropout", "bernoulli_", 2),  # the masks, served once, drawn again (the RNG replayed)
])
def test_a_second_backward_through_a_retained_graph_recomputes_what_the_first_replay_took(block_type, save, op, runs):
    torch.manual_seed(0)
    block = globals()[block_type]()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(3)
    expected = torch.autograd.grad(block(x).sum(), x)[0]
    torch_ext.checkpoint(block, save=save)
    torch.manual_seed(3)
    with OpCounter() as counter:
        loss = block(x).sum()
        first = torch.autograd.grad(loss, x, retain_graph=True)[0]
        counter.counts.clear()
        second = torch.autograd.grad(loss, x)[0]
    assert torch.equal(first, expected) and torch.equal(second, expected)
    assert counter.counts[op] == runs


def test_a_layer_budget_with_save_is_refused_as_with_context_fn():
    with pytest.raises(ValueError, match="budget_bytes with context_fn or save"):
        torch_ext.CheckpointedSequential([MLP(), MLP()], budget_bytes=1 << 20, save="matmul")
    with pytest.raises(ValueError, match="budget_bytes with context_fn or save"):
        hf.checkpoint_layers(qwen2(), budget_bytes=1 << 20, inputs={"input_ids": torch.ones(1, 4, dtype=torch.long)},
                             save="matmul")


def test_every_python_entry_point_takes_save():
    torch.manual_seed(0)
    layers = [MLP() for _ in range(4)]
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    expected = torch.autograd.grad(nn.Sequential(*layers)(x).sum(), x)[0]
    runs = {
        "CheckpointedSequential": lambda: torch_ext.CheckpointedSequential(layers, every=1, save="matmul")(x),
        "checkpoint_sequential": lambda: torch_ext.checkpoint_sequential(nn.Sequential(*layers), 4, x, save="matmul"),
        "checkpoint_call": lambda: torch_ext.checkpoint_call(nn.Sequential(*layers), x, save="matmul"),
    }
    for name, forward in runs.items():
        with OpCounter() as counter:
            out = forward()
            counter.counts.clear()
            (grad,) = torch.autograd.grad(out.sum(), x)
        assert torch.equal(grad, expected), name
        assert counter.counts["addmm"] == 0, name


def test_a_replay_under_another_dispatch_mode_setting_than_its_forward_runs_every_op():
    # torch's math attention adds its mask in place unless a dispatch mode is active: the replay's ops
    # would not line up with the forward's, so nothing is served and the gradients stay exact.
    mask = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(2))

    def segment(q):
        attention = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask, dropout_p=0.25)
        return (attention + q).square().sum()

    q = torch.randn(2, 2, 8, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    expected = unwrapped_grad_then_reseed(segment, q)
    loss = torch_ext.checkpoint_call(segment, q, save="aten::add.Tensor")
    with OpCounter() as counter:
        loss.backward()
    assert torch.equal(q.grad, expected)
    assert counter.counts["add"] >= 2  # the mask add (out of place under the mode) and the residual add, run


class DropoutMLP(nn.Module):
    """Two dropouts (CPU dropout draws its mask with bernoulli_) around matmuls."""

    def __init__(self, n=16):
        super().__init__()
        self.a, self.b = nn.Linear(n, 2 * n), nn.Linear(2 * n, n)

    def forward(self, x):
        h = torch.nn.functional.dropout(torch.tanh(self.a(x)), 0.3, self.training)
        return torch.nn.functional.dropout(self.b(h), 0.2, self.training).sin()


def dropout_run(**options):
    """(bernoulli_ calls in backward, gradients of x and the parameters, the RNG's next draw after
    backward) of two DropoutMLPs, checkpointed with options (unwrapped when none), from seed 3."""
    torch.manual_seed(0)
    blocks = [DropoutMLP() for _ in range(2)]
    for block in blocks:
        if options:
            torch_ext.checkpoint(block, **options)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(3)
    counts, (grad,) = backward_counts(lambda: blocks[1](blocks[0](x)).sum(), x)
    return counts["bernoulli_"], [grad] + [p.grad for block in blocks for p in block.parameters()], torch.rand(4)


@pytest.mark.parametrize("save, drawn_again", [
    ("dropout", 0), ("dropout#1", 2), (("dropout#0", "matmul"), 2), ("aten::bernoulli_", 0)])
def test_a_saved_dropout_mask_is_not_drawn_again_and_later_draws_match_the_forward(save, drawn_again):
    # Skipping a draw leaves the generator where the forward's was after it, so a dropout drawn
    # again after a served one gets the forward's mask: the gradients are the unwrapped model's
    # exactly, and so is the RNG's stream after backward.
    _, expected, expected_next = dropout_run()
    drawn, grads, next_draw = dropout_run(save=save)
    assert_same(grads, expected)
    assert torch.equal(next_draw, expected_next)
    assert drawn == drawn_again


def test_without_rng_replay_a_dropout_mask_is_drawn_again():
    # preserve_rng_state=False: the replay draws new numbers (torch's semantics), so no mask is kept.
    drawn, _, _ = dropout_run(save="dropout", preserve_rng_state=False)
    assert drawn == 4


def test_scripted_code_keeps_dropout_masks_through_the_cpp_front_door():
    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.block = torch.jit.script(DropoutMLP())

        def forward(self, x: torch.Tensor, save: list[str]) -> torch.Tensor:
            return torch.ops.torch_ext.checkpoint_module(self.block, [x], save=save)[0]

    model = torch.jit.script(Parent())
    results = []
    for save in ([], ["dropout"]):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        counts, (grad,) = backward_counts(lambda: model(x, save).sum(), x)
        results.append(([grad] + [p.grad for p in model.parameters()], torch.rand(4), counts["bernoulli_"]))
    assert_same(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert (results[0][2], results[1][2]) == (2, 0)
