"""torch_ext's checkpoint as a drop-in for torch.utils.checkpoint (non-reentrant): each behaviour
PyTorch's own checkpoint tests check, on torch_ext, compared with the unwrapped computation."""
import contextlib
import copy
import random

import pytest
import torch
from torch import nn

import torch_ext
from torch_ext import checkpoint_call
from torch_ext.checkpointing import CheckpointError


def test_gradients_with_create_graph_and_double_backward_equal_the_unwrapped_function():
    model = nn.Sequential(nn.Linear(20, 10), nn.Tanh(), nn.Linear(10, 5), nn.Tanh()).double()
    x = torch.randn(3, 20, dtype=torch.double, requires_grad=True)
    plain = torch.autograd.grad(model(x).sum(), x, create_graph=True)[0]
    ckpt = torch.autograd.grad(checkpoint_call(model, x).sum(), x, create_graph=True)[0]
    assert torch.equal(plain, ckpt)
    assert torch.equal(torch.autograd.grad(plain.pow(2).sum(), x)[0], torch.autograd.grad(ckpt.pow(2).sum(), x)[0])


def test_nested_checkpoints_support_higher_order_gradients():
    def inner(x):
        return x.sin().exp()

    def outer(x):
        return checkpoint_call(inner, x.cos()) * x

    x = torch.randn(5, dtype=torch.double, requires_grad=True)
    expected = x.detach().requires_grad_()
    g1 = torch.autograd.grad(checkpoint_call(outer, x).sum(), x, create_graph=True)[0]
    r1 = torch.autograd.grad((expected.cos().sin().exp() * expected).sum(), expected, create_graph=True)[0]
    assert torch.allclose(g1, r1)
    g2 = torch.autograd.grad(g1.sum(), x)[0]
    r2 = torch.autograd.grad(r1.sum(), expected)[0]
    assert torch.allclose(g2, r2)


def test_a_tensor_read_through_a_closure_gets_its_gradient():
    weight = torch.randn(4, 4, requires_grad=True)

    def uses_closure(x):
        return (x @ weight).tanh()

    x = torch.randn(2, 4, requires_grad=True)
    grads = torch.autograd.grad(checkpoint_call(uses_closure, x).sum(), [x, weight])
    expected = torch.autograd.grad(uses_closure(x).sum(), [x, weight])
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


def test_detached_outputs_do_not_require_grad():
    out = checkpoint_call(lambda x: (x * 2).detach(), torch.randn(3, requires_grad=True))
    assert not out.requires_grad and out.grad_fn is None


def test_each_output_has_its_own_grad_fn_and_a_hook_on_one_may_take_the_gradient_of_another():
    x = torch.randn(3, requires_grad=True)
    a, b = checkpoint_call(lambda t: (t.sin(), t.cos()), x)
    assert a.grad_fn is not b.grad_fn
    seen = []
    def take_b(grad_inputs, grad_outputs):
        with torch.enable_grad():
            seen.append(torch.autograd.grad(b.sum(), x)[0])

    a.grad_fn.register_hook(take_b)
    a.sum().backward(retain_graph=True)
    assert torch.equal(seen[0], -x.detach().sin())


def test_a_segment_that_saves_nothing_is_not_replayed():
    calls = []

    def affine(x):
        calls.append(1)
        return x * 2 + 1  # multiplication by a number and addition save nothing for backward

    x = torch.randn(16, 32, requires_grad=True)
    checkpoint_call(affine, x).sum().backward()
    assert len(calls) == 1 and torch.equal(x.grad, torch.full_like(x, 2.0))


def test_a_segment_whose_backward_needs_only_its_inputs_and_parameters_is_not_replayed():
    """A Linear saves its input and its weight: both live until backward anyway, so they are kept as
    autograd keeps them and the segment is never run again (torch's checkpoint replays it)."""
    torch.manual_seed(0)
    layer = nn.Linear(32, 16)
    reference = copy.deepcopy(layer)
    calls = []

    def linear(x):
        calls.append(1)
        return layer(x)

    x = torch.randn(8, 32, requires_grad=True)
    checkpoint_call(linear, x).sum().backward()
    expected = x.detach().requires_grad_()
    reference(expected).sum().backward()
    assert len(calls) == 1
    assert torch.equal(x.grad, expected.grad)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(layer.parameters(), reference.parameters()))


def test_a_tensor_passed_by_keyword_is_kept_as_it_is():
    calls = []

    def scaled(x, *, scale):
        calls.append(1)
        return x * scale

    x, scale = torch.randn(4, 3, requires_grad=True), torch.randn(3)
    checkpoint_call(scaled, x, scale=scale).sum().backward()
    assert len(calls) == 1 and torch.equal(x.grad, scale.expand(4, 3))
    out = checkpoint_call(scaled, x, scale=scale)
    scale.mul_(2)
    changed = r"scaled: saved tensor 0 \(Float\[3\] on cpu\).* modified by an inplace operation"
    with pytest.raises(CheckpointError, match=changed):
        out.sum().backward()


def _identity_hooks():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)


@pytest.mark.parametrize("enclosing, runs", [("saved_tensors_hooks", 2), ("checkpoint", 2), ("memory.track", 1),
                                             ("memory.track, hooks inside", 2)])
def test_under_other_saved_tensor_hooks_every_saved_tensor_is_recomputed(enclosing, runs):
    """Enclosing hooks decide where a tensor lives (an enclosing checkpoint drops the segment's
    input, paging drops its weights): keeping a tensor there could hold what they free. memory.track's
    return each tensor as it is: a step measured under them runs as it does untracked."""
    torch.manual_seed(0)
    layer = nn.Linear(32, 16)
    calls = []

    def linear(x):
        calls.append(1)
        return layer(x)

    x = torch.randn(8, 32, requires_grad=True)
    if enclosing == "checkpoint":
        out = checkpoint_call(lambda t: checkpoint_call(linear, t.exp()), x)
    elif enclosing == "saved_tensors_hooks":
        with _identity_hooks():
            out = checkpoint_call(linear, x.exp())
    else:
        with torch_ext.memory.track() as tracked:
            h = x.exp()  # saves its output: tracked
            with _identity_hooks() if enclosing.endswith("inside") else contextlib.nullcontext():
                out = checkpoint_call(linear, h)
        assert tracked.saved_bytes >= h.nbytes
    out.sum().backward()
    assert len(calls) == runs
    assert torch.allclose(x.grad, (layer.weight.sum(0) * x.detach().exp()).expand_as(x))


def test_transparent_hooks_are_unmarked_innermost_first():
    with pytest.raises(RuntimeError, match="no Python saved-tensor hooks pushed since the last mark"):
        torch_ext._C.checkpoint.mark_hooks_transparent()
    with _identity_hooks():
        torch_ext._C.checkpoint.mark_hooks_transparent()
        with _identity_hooks(), pytest.raises(RuntimeError, match="not the last ones marked"):
            torch_ext._C.checkpoint.unmark_hooks_transparent()
        torch_ext._C.checkpoint.unmark_hooks_transparent()


def test_a_kept_parameter_modified_in_place_before_backward_raises_naming_the_segment():
    layer = nn.Linear(4, 4)
    out = torch_ext.checkpoint(layer)(torch.randn(2, 4, requires_grad=True))
    with torch.no_grad():
        layer.weight.add_(1)  # an optimizer step before the backward
    with pytest.raises(CheckpointError, match=r"Linear: saved tensor 1 .* modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("early_stop", [True, False])
def test_early_stop_ends_a_replay_at_the_last_tensor_it_must_recompute(early_stop):
    """The product at the segment's end saves only its input and weight, which are kept: the replay
    stops after the exp, the last tensor it recomputes, and skips the product."""
    torch.manual_seed(0)
    weight = torch.randn(64, 64, requires_grad=True)
    reached_product = []

    def segment(x):
        h = x.exp()
        reached_product.append(1)
        return h + x @ weight  # the tail: a 64x64x64 product, worth stopping before

    x = torch.randn(64, 64, requires_grad=True)
    grads = torch.autograd.grad(checkpoint_call(segment, x, early_stop=early_stop).sum(), [x, weight])
    assert len(reached_product) == (1 if early_stop else 2)
    expected = torch.autograd.grad(segment(x).sum(), [x, weight])
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))


def test_the_replay_receives_the_callers_tensors():
    seen = []

    def record(x, y):
        seen.append((x, y))
        return (x * y).exp().sum()  # exp saves its output: the product, which the replay recomputes

    x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    checkpoint_call(record, x, y).backward()
    assert len(seen) == 2 and seen[1][0] is x and seen[1][1] is y


def test_checkpoint_sequential_checkpoints_all_but_its_last_part():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x * torch.tensor(2.0)  # saves its scalar tensor: a replay is needed

    modules = [Counter() for _ in range(10)]
    out = torch_ext.checkpoint_sequential(modules, 2, torch.randn(3, 4, requires_grad=True))
    assert all(m.calls == 1 for m in modules)
    out.sum().backward()
    assert [m.calls for m in modules] == [2] * 5 + [1] * 5


def test_non_tensor_inputs_and_outputs():
    def foo(t1, t2, scale, t3):
        t4 = t1 + t2 * t3
        t5 = t1 * t2 + t3
        t4 *= scale
        t5 *= scale
        return scale, t4, None, True, t5, "bar", t1

    generator = torch.Generator().manual_seed(0)
    t1, t2, t3 = (torch.rand(10, generator=generator) for _ in range(3))
    t1.requires_grad_(), t2.requires_grad_()
    scale = random.Random(0).randint(1, 10)
    res = checkpoint_call(foo, t1, t2, scale, t3)
    assert res[0] == scale and res[2] is None and res[3] is True and res[5] == "bar"
    assert torch.equal(res[1], (t1 + t2 * t3) * scale) and torch.equal(res[4], (t1 * t2 + t3) * scale)
    assert res[6] is t1  # an input returned as is, as torch's non-reentrant checkpoint returns it
    res[1].sum().backward(retain_graph=True)
    res[4].sum().backward(retain_graph=True)
    res[6].sum().backward()
    grads = (t1.grad.clone(), t2.grad.clone())
    t1.grad = t2.grad = None
    ref = foo(t1, t2, scale, t3)
    torch.autograd.backward([ref[1].sum(), ref[4].sum(), ref[6].sum()])
    # Three backward calls accumulate into .grad in another order than one call: rounding may differ.
    assert torch.allclose(grads[0], t1.grad) and torch.allclose(grads[1], t2.grad)


def test_a_segment_without_tensors_returns_its_results():
    assert checkpoint_call(lambda a, b: (a + b, "x"), 1.5, 2) == (3.5, "x")


def test_outputs_that_do_not_require_grad_fail_in_backward_as_torchs_do():
    out = checkpoint_call(lambda a, b: a, torch.randn(1, 4), torch.randn(1, 4, requires_grad=True))
    with pytest.raises(RuntimeError, match="does not require grad"):
        out.sum().backward()


def test_dropout_masks_of_the_replay_equal_the_forwards():
    inp = torch.randn(20000, requires_grad=True)
    phase1, phase2 = nn.Dropout(), nn.Dropout()
    state = torch.get_rng_state()
    checkpoint_call(phase2, phase1(inp)).sum().backward()
    with_checkpoint = inp.grad
    torch.set_rng_state(state)
    inp.grad = None
    phase2(phase1(inp)).sum().backward()
    assert torch.equal(with_checkpoint, inp.grad)


def test_a_backward_inside_the_segment_works():
    def grad_inside(x):
        y = x.sin()
        (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return gx * y

    x = torch.randn(4, dtype=torch.double, requires_grad=True)
    expected = torch.autograd.grad(grad_inside(x).sum(), x)[0]
    assert torch.allclose(torch.autograd.grad(checkpoint_call(grad_inside, x).sum(), x)[0], expected)


def test_each_backward_pass_through_a_retained_graph_replays_once():
    calls = []

    def counted(x):
        calls.append(1)
        return x.exp()

    x = torch.randn(3, requires_grad=True)
    out = checkpoint_call(counted, x).sum()
    out.backward(retain_graph=True)
    out.backward()
    assert len(calls) == 3 and torch.equal(x.grad, 2 * x.detach().exp())


class Projected(nn.Module):
    """tanh, then a projection and a scaling: the projection saves its input and weight, so with
    early stop a replay ends at that save and neither the product nor what follows runs again."""

    def __init__(self, width=64):
        super().__init__()
        self.first = nn.Linear(width, width)
        self.projection = nn.Linear(width, width)
        self.after_projection = 0

    def forward(self, x):
        h = self.projection(self.first(x).tanh())
        self.after_projection += 1
        return h * 2


@pytest.mark.parametrize("early_stop", [True, False])
def test_early_stop_ends_a_replay_at_the_last_saved_tensor_when_the_tail_is_worth_it(early_stop):
    segment = Projected()
    reference = copy.deepcopy(segment)
    torch_ext.checkpoint(segment, early_stop=early_stop)
    x = torch.randn(64, 64, requires_grad=True)  # the tail: a 64x64x64 product, worth stopping before
    segment(x).sum().backward()
    assert segment.after_projection == (1 if early_stop else 2)
    reference(x.detach()).sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(segment.parameters(), reference.parameters()))


class AddmmCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.addmm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.addmm += func.overloadpacket is torch.ops.aten.addmm
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("early_stop", [True, False])
def test_a_scripted_module_gives_the_eager_gradients_from_its_first_backward_and_stops_early(early_stop):
    """Two things stood between a TorchScript module and checkpointing from Python (torch's
    non-reentrant checkpoint fails the same way): the profiling executor runs a function's first
    call, and the first call of each new shape, on another plan than the calls after it, so the
    replay saved other tensors than its forward; and an early stop reached the replay as the
    interpreter's RuntimeError, with no message. Both raised an empty RuntimeError in backward."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    reference = copy.deepcopy(eager)
    scripted = torch.jit.script(eager)
    for batch in (64, 32, 64):  # a new batch size is a new plan's first call again
        x = torch.randn(batch, 64, requires_grad=True)
        out = checkpoint_call(scripted, x, early_stop=early_stop)
        with AddmmCounter() as counter:
            out.sum().backward()
        # the last Linear saves its input: with early stop the replay ends before its product
        assert counter.addmm == (2 if early_stop else 3), batch
        expected = x.detach().requires_grad_()
        reference(expected).sum().backward()
        assert torch.equal(x.grad, expected.grad), batch
    for p, q in zip(eager.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_the_torchscript_front_door_checkpoints_through_the_same_frame():
    """torch.ops.torch_ext.checkpoint_module from a Python process: the forward keeps only the block's
    input (what it would have saved are placeholders, which memory.track's hooks around it do not
    see), the replay stops before the last product, and double backward works."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)).double()
    reference = copy.deepcopy(eager)
    block = torch.jit.script(eager)
    x = torch.randn(64, 64, dtype=torch.double, requires_grad=True)
    with torch_ext.memory.track() as tracked:
        out = torch.ops.torch_ext.checkpoint_module(block, [x])[0]
    assert tracked.saved_bytes == x.nbytes
    with AddmmCounter() as counter:
        (grad,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    assert counter.addmm == 2
    expected_x = x.detach().requires_grad_()
    (expected,) = torch.autograd.grad(reference(expected_x).pow(2).sum(), expected_x, create_graph=True)
    assert torch.equal(grad, expected)
    assert torch.equal(torch.autograd.grad(grad.sum(), x)[0], torch.autograd.grad(expected.sum(), expected_x)[0])


def test_the_torchscript_front_door_keeps_what_lives_until_backward():
    """Outside other saved-tensor hooks, a scripted Linear's input and weight are kept, not replayed,
    and a weight changed before the backward raises (the C++ front door's frame, as Python's)."""
    torch.manual_seed(0)
    eager = nn.Linear(32, 16)
    reference = copy.deepcopy(eager)
    block = torch.jit.script(eager)
    x = torch.randn(8, 32, requires_grad=True)
    out = torch.ops.torch_ext.checkpoint_module(block, [x])[0]
    with AddmmCounter() as counter:
        out.sum().backward()
    assert counter.addmm == 0  # a replay would run the forward's addmm again
    expected = x.detach().requires_grad_()
    reference(expected).sum().backward()
    assert torch.equal(x.grad, expected.grad) and torch.equal(eager.weight.grad, reference.weight.grad)
    out = torch.ops.torch_ext.checkpoint_module(block, [x])[0]
    with torch.no_grad():
        eager.weight.add_(1)
    # Raised in C++ inside the engine, it reaches Python with its type, as from Python's front door.
    with pytest.raises(CheckpointError, match=r"Linear.forward: saved tensor 1 .* modified by an inplace operation"):
        out.sum().backward()


def test_torchscript_and_python_checkpoints_nest_either_way():
    """A C++ frame (checkpoint_module) inside a Python one, and Python's saved-tensor hooks
    (memory.track) around both: each tensor goes to the innermost, and the gradients are eager's."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32))
    reference = copy.deepcopy(eager)
    block = torch.jit.script(eager)

    def outer(x):
        return torch.ops.torch_ext.checkpoint_module(block, [x.sin()])[0].exp()

    x = torch.randn(16, 32, requires_grad=True)
    with torch_ext.memory.track() as tracked:
        loss = checkpoint_call(outer, x).sum()
    assert tracked.saved_bytes == x.nbytes  # the outer frame's input; the rest is placeholders
    with AddmmCounter() as counter:
        loss.backward()
    assert counter.addmm == 2 * 2  # the outer replay runs the block's forward, whose own frame replays it
    expected = x.detach().requires_grad_()
    reference(expected.sin()).exp().sum().backward()
    assert torch.equal(x.grad, expected.grad)
    for p, q in zip(eager.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_compiled_autograd_refuses_the_torchscript_front_doors_hooks_as_documented():
    """docs/checkpoint.md (C++): compiled autograd takes only Python saved-tensor hooks."""
    block = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)))
    out = torch.ops.torch_ext.checkpoint_module(block, [torch.randn(4, 8, requires_grad=True)])[0]
    with pytest.raises(RuntimeError, match="Compiled Autograd only supports python saved tensor hooks"):
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
            out.sum().backward()


def test_a_replay_that_departs_from_its_forward_inside_torchscript_raises_the_named_error():
    """The interpreter re-raises the replay's error as its own RuntimeError; the frame's error is what
    reaches the caller."""

    class Alternating(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if int(self.calls) % 2 == 1:
                return x.tanh()
            return x[:1].tanh()

    out = checkpoint_call(torch.jit.script(Alternating()), torch.randn(2, 3, requires_grad=True))
    with pytest.raises(CheckpointError, match=r"the replay of .* produced saved tensor 0 .*Float\[1, 3\].* where its "
                                              r"forward produced .*Float\[2, 3\]"):
        out.sum().backward()


def test_early_stop_leaves_a_small_elementwise_tail_alone():
    calls = []

    def small_tail(x):
        h = x.exp()                     # saves its output
        calls.append(1)
        return h * 2 + 1                # 2 small elementwise ops after it: not worth an early stop

    x = torch.randn(4, requires_grad=True)
    checkpoint_call(small_tail, x).sum().backward()
    assert len(calls) == 2  # the replay ran to the end


def test_torchs_keywords_are_accepted_and_unsupported_ones_are_refused():
    x = torch.randn(3, requires_grad=True)
    out = checkpoint_call(torch.sin, x, use_reentrant=False, debug=False, early_stop=True, preserve_rng_state=True)
    out.sum().backward()
    out = checkpoint_call(torch.sin, x, context_fn=torch.utils.checkpoint.noop_context_fn)  # torch's default
    out.sum().backward()
    with pytest.raises(ValueError, match="always checks its replays"):
        checkpoint_call(torch.sin, x, determinism_check="none")
    layers = [torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)]
    torch_ext.checkpoint_sequential(layers, 2, x, use_reentrant=False, debug=False, determinism_check="default")
    with pytest.raises(ValueError, match="checkpoint_sequential: determinism_check='none': torch_ext always checks"):
        torch_ext.checkpoint_sequential(layers, 2, x, determinism_check="none")


def test_a_non_deterministic_segment_raises_the_named_error():
    calls = []

    def grows(x):
        calls.append(1)
        return torch.cat([x] * len(calls)).exp()

    out = checkpoint_call(grows, torch.randn(2, requires_grad=True))
    with pytest.raises(CheckpointError, match=r"the replay of .*grows produced saved tensor 0 .*Float\[4\].* where "
                                              r"its forward produced .*Float\[2\]"):
        out.sum().backward()
