"""The op-level planner (torch_ext.plan_ops): per-op measurement, the O(N log N) choice under a
byte budget of which blocks to checkpoint and which ops each saves, plans applied as torch's
selective checkpointing through torch_ext.checkpoint, monotonic in the budget, saved and loaded as
JSON; gradients equal the unwrapped chain's."""
import copy
import dataclasses
import json
import math
import re
import time
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import torch_ext
from torch_ext import memory
from torch_ext.checkpointing import op_recording
from torch_ext.checkpointing.api import _CheckpointedForward
from torch_ext.checkpointing.op_choice import _UNWRAP, _choose, _gradient_bytes, _peak, _steps
from torch_ext.checkpointing.op_planner import OpPlan
from torch_ext.checkpointing.op_recording import _OpRecorder


def mlp_chain(n=16, width=128):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(n)]


def peak_and_grads(layers, x, grads_preallocated=True):
    model = nn.Sequential(*layers)
    for p in model.parameters():
        # Preallocated, gradients accumulate in place: only activations count.
        p.grad = torch.zeros_like(p) if grads_preallocated else None
    x = x.detach().requires_grad_()
    with memory.track(x.device) as tracked:
        model(x).sum().backward()
    return tracked.peak_delta_bytes, [p.grad for p in model.parameters()] + [x.grad]


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def every_op_saved(plan, blocks=None):
    """plan with every block checkpointed, saving every candidate op (or those of `blocks`)."""
    n = len(plan.ops)
    return dataclasses.replace(plan, checkpointed=[True] * n, saved=[
        [op[:2] for op in block] if blocks is None or k in blocks else [] for k, block in enumerate(plan.ops)])


@pytest.fixture(scope="module")
def chain():
    layers = mlp_chain()
    x = torch.randn(128, 128)
    # The tests measure steps with .grad preallocated (peak_and_grads): gradients added in place.
    loose = torch_ext.plan_ops(layers, x, budget_bytes=1 << 40, repeat=1, gradients="accumulated")
    return layers, x, loose


def test_measures_every_op_of_every_block(chain):
    layers, x, loose = chain
    assert len(loose.ops) == 16
    for block in loose.ops:
        # The second Linear is the block's tail, which replays skip (the next test).
        assert [(name, index, nbytes) for name, index, nbytes, _ in block] == [
            ("aten.addmm.default", 0, 128 * 256 * 4), ("aten.gelu.default", 0, 128 * 256 * 4)]
        assert all(seconds > 0 for *_, seconds in block)
    # Room for everything: no block is checkpointed, nothing is recomputed.
    assert loose.checkpointed == [False] * 16 and loose.saved == [[]] * 16
    assert loose.predicted_recompute_seconds == 0 and loose.step_seconds > 0
    assert len(loose.block_replay_seconds) == 16 and all(s >= 0 for s in loose.block_replay_seconds)


def test_alike_blocks_share_their_timings_and_other_blocks_keep_their_own():
    """Identical layers get one timing per op (the median over them), so they are planned alike
    and not by the noise of timing each op once; a block of other shapes is timed on its own."""
    layers = mlp_chain(4) + mlp_chain(1, width=64)
    layers.insert(4, nn.Linear(128, 64))
    plan = torch_ext.plan_ops(layers, torch.randn(128, 128), budget_bytes=1 << 40, repeat=1)
    alike = plan.ops[:4]
    assert all(block == alike[0] for block in alike)
    assert len(set(plan.block_replay_seconds[:4])) == 1
    assert [op[:3] for op in plan.ops[5]] == [["aten.addmm.default", 0, 128 * 128 * 4],
                                              ["aten.gelu.default", 0, 128 * 128 * 4]]
    assert plan.ops[5] != alike[0] and plan.ops[4] == []  # a lone Linear is all tail


class CountedForwards(nn.Module):
    def __init__(self, width, calls):
        super().__init__()
        self.layer, self.calls = nn.Sequential(nn.Linear(width, width), nn.GELU()), calls

    def forward(self, x):
        self.calls.append(self)
        return self.layer(x)


def test_blocks_alike_to_repeat_measured_blocks_run_once_per_measurement():
    """repeat=3: the first three identical layers run 3 recorded forwards, the native policy's probe
    and 3 forwards with backward (7 forwards); later ones, whose timings are pooled with theirs,
    one of each (3 forwards). A block of other shapes is measured in full again."""
    torch.manual_seed(0)
    calls = []
    layers = [CountedForwards(64, calls) for _ in range(5)] + [nn.Linear(64, 32), CountedForwards(32, calls)]
    plan = torch_ext.plan_ops(layers, torch.randn(16, 64), budget_bytes=1 << 40, repeat=3)
    runs = Counter(id(layer) for layer in calls)
    assert [runs[id(layer)] for layer in layers[:5]] == [7, 7, 7, 3, 3]
    assert runs[id(layers[6])] == 7
    assert all(block == plan.ops[0] for block in plan.ops[:5])


def test_minimum_is_below_40_percent_of_the_plain_peak_with_equal_gradients(chain):
    layers, x, loose = chain
    plan = torch_ext.plan_ops(layers, x, budget_bytes=loose.min_budget_bytes, repeat=1, gradients="accumulated")
    # Nothing saved but, when it ranks first, an op of the last block (its saved outputs are part
    # of the activations its own backward holds anyway, so they cost no peak).
    assert plan.saved[:15] == [[]] * 15 and plan.checkpointed[:15] == [True] * 15
    assert plan.predicted_peak_bytes == loose.min_budget_bytes
    plain_peak, plain_grads = peak_and_grads(copy.deepcopy(layers), x)
    peak, grads = peak_and_grads(plan.apply(copy.deepcopy(layers)), x)
    assert peak <= 0.40 * plain_peak
    assert peak <= plan.budget_bytes
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


def test_gradients_added_as_made_are_not_counted_twice(chain):
    """With .grad allocated, a block's backward holds one parameter gradient at a time, which its
    measured workspace already counts: the minimum's prediction lies within less than one block's
    parameter bytes of the measured peak (adding them all again overestimated it by that much)."""
    layers, x, loose = chain
    plan = loose.with_budget(loose.min_budget_bytes)
    peak, _ = peak_and_grads(plan.apply(copy.deepcopy(layers)), x)
    assert peak <= plan.predicted_peak_bytes < peak + min(plan.block_parameter_bytes)


def test_lower_budget_never_gives_a_higher_measured_peak(chain):
    layers, x, loose = chain
    _, plain_grads = peak_and_grads(copy.deepcopy(layers), x)
    span = loose.no_checkpoint_peak_bytes - loose.min_budget_bytes
    peaks, predicted = [], []
    for fraction in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0):
        budget = int(loose.min_budget_bytes + fraction * span)
        plan = loose.with_budget(budget)  # one measurement, several budgets
        peak, grads = peak_and_grads(plan.apply(copy.deepcopy(layers)), x)
        assert plan.predicted_peak_bytes <= budget and peak <= budget
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
        peaks.append(peak)
        predicted.append(plan.predicted_peak_bytes)
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]
    assert predicted == sorted(predicted)


def backward_counts(plan, layers, x):
    model = nn.Sequential(*plan.apply(copy.deepcopy(layers)))
    # The counting mode runs through the forward too: a native policy serves its replay only under
    # the forward's dispatch-mode setting (a mode can change which ops a kernel calls).
    with OpCounter() as counter:
        loss = model(x.detach().requires_grad_()).sum()
        counter.counts.clear()
        loss.backward()
    return counter.counts


def test_saved_ops_do_not_run_again_in_backward(chain):
    layers, x, loose = chain
    wrapped = [True] * 16
    nothing = dataclasses.replace(loose, saved=[[] for _ in range(16)], checkpointed=wrapped)
    first_mm = dataclasses.replace(loose, saved=[[["aten.addmm.default", 0]] for _ in range(16)], checkpointed=wrapped)
    gelu = dataclasses.replace(loose, saved=[[["aten.gelu.default", 0]] if k % 2 else [] for k in range(16)],
                               checkpointed=wrapped)
    counts = backward_counts(nothing, layers, x)
    assert counts["aten.addmm.default"] >= 16 and counts["aten.gelu.default"] == 16
    assert backward_counts(first_mm, layers, x)["aten.addmm.default"] == counts["aten.addmm.default"] - 16
    assert backward_counts(gelu, layers, x)["aten.gelu.default"] == 8
    unwrapped_odd = dataclasses.replace(nothing, checkpointed=[k % 2 == 0 for k in range(16)])
    assert backward_counts(unwrapped_odd, layers, x)["aten.gelu.default"] == 8  # unwrapped blocks replay nothing


def test_a_blocks_tail_is_no_candidate_as_its_replays_stop_before_it(chain):
    """The second Linear of Linear, GELU, Linear saves its input (GELU's output) before it runs: the
    last tensor the block saves, so early stop ends every replay before that Linear. Saving its
    output would hold memory for nothing; the planner neither offers it nor counts it as recompute."""
    layers, x, loose = chain
    nothing = dataclasses.replace(loose, saved=[[] for _ in range(16)], checkpointed=[True] * 16)
    assert backward_counts(nothing, layers, x)["aten.addmm.default"] == 16  # each block's first Linear only
    assert all(("aten.addmm.default", 1) not in [tuple(op[:2]) for op in block] for block in loose.ops)
    recorder = _OpRecorder(time.perf_counter)
    with torch.enable_grad(), recorder, torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        layers[0](x.detach().requires_grad_())
    assert [record[:2] for record in recorder.records][-1] == ["aten.addmm.default", 1]
    assert recorder.tail_start == len(recorder.seconds) - 1 and recorder.tail_seconds == recorder.seconds[-1] > 0


def test_the_recordings_outputs_are_gone_before_the_probe_and_the_timed_forward(monkeypatch):
    """Kept, the recorded forward's outputs made the probe and the timed forward after it allocate
    fresh pages, whose faults the timed forward paid for (a GPT-2 layer's replay estimate, forward
    time less its ops', went from 2 to 12 ms at random)."""
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    x = torch.randn(256, 256)
    live = []

    def probe(*args, **kwargs):
        live.append(memory.stats().current_bytes)
        return native_names(*args, **kwargs)

    native_names = op_recording._native_names
    monkeypatch.setattr(op_recording, "_native_names", probe)
    before = memory.stats().current_bytes
    ops, *_ = op_recording._record_ops(layer, (x,), {}, True, 1, False, Counter())
    assert sum(nbytes for _, _, nbytes, _ in ops) == 2 * 256 * 1024 * 4  # the first Linear's and the GELU's
    assert live[0] - before < 256 * 1024 * 4  # not one of them is still held


def test_under_torch_compile_a_plan_keeps_for_backward_what_it_keeps_in_eager():
    # The compiled step's peak adds the weight gradients (the compiled backward returns them
    # together, before they are added into .grad); what a plan decides is what the forward keeps
    # for backward, and Inductor keeps the same. A plan that checkpoints every block and saves
    # nothing (boundaries only) and the native policy plans save through (matmul outputs): a plan
    # between them chooses its ops by measured time, so which ops it saves is not fixed, and a
    # compiled trace can name an op differently (docs/checkpoint.md).
    layers, x = mlp_chain(n=4), torch.randn(128, 128)
    loose = torch_ext.plan_ops(layers, x, budget_bytes=1 << 40, repeat=1)

    def kept_for_backward(make):
        kept = []
        for model in (make(), torch.compile(make())):
            torch._dynamo.reset()
            for _ in range(2):  # the first call compiles
                start = memory.stats().current_bytes
                out = model(x.detach().requires_grad_())
                kept.append(memory.stats().current_bytes - start)
                out.sum().backward()
        return kept[1], kept[3]  # eager, compiled: second calls

    unwrapped, _ = kept_for_backward(lambda: nn.Sequential(*copy.deepcopy(layers)))
    boundaries = dataclasses.replace(loose, checkpointed=[True] * 4, saved=[[]] * 4)
    eager, compiled = kept_for_backward(lambda: nn.Sequential(*boundaries.apply(copy.deepcopy(layers))))
    assert compiled == eager < unwrapped / 4
    eager, compiled = kept_for_backward(
        lambda: nn.Sequential(*[torch_ext.checkpoint(layer, save="matmul") for layer in copy.deepcopy(layers)]))
    assert compiled == eager and unwrapped / 4 < eager < unwrapped  # the addmm outputs, not gelu's


def test_held_gradients_count_own_and_every_later_blocks_gradients_in_each_blocks_backward():
    params = [10, 20, 30, 40]
    assert _gradient_bytes(params, "accumulated") == [0, 0, 0, 0]
    grads = _gradient_bytes(params, "held", other_bytes=5)
    assert grads == [105, 95, 75, 45]
    # What follows the chain (the stand-in for a model's head) needs what the last block's backward
    # needs, its held gradients included: here it is the peak (block 0's backward, holding every
    # gradient, needs 1 + 9 + 2 + 1 + 105 = 118), as the last block keeps 60 bytes.
    inputs, outputs, activations, workspace = [1] * 4, [1] * 4, [9] * 4, [2] * 4
    assert _peak([0, 0, 0, 60], inputs, outputs, activations, workspace, grads) == 4 + 60 + 9 + 2 + 1 + 45
    with pytest.raises(ValueError, match="gradients must be one of 'accumulated', 'held', got 'kept'"):
        torch_ext.plan_ops(mlp_chain(n=2), torch.randn(4, 128), budget_bytes=1 << 30, gradients="kept")


def test_a_plan_for_held_gradients_stays_within_its_budget_when_grad_starts_none(chain):
    # With .grad None at the step's start (optimizer.zero_grad()'s default) every block's gradients
    # stay until the backward ends. A plan made for gradients added in place runs over a budget
    # below them; planned for held gradients, that budget is refused, and those it takes hold.
    layers, x, loose = chain
    held = torch_ext.plan_ops(layers, x, budget_bytes=1 << 40, repeat=1)  # "held" is the default
    assert held.gradients == "held"
    # Block 0's backward holds the gradients of every block (its own, and those made before it).
    assert held.min_budget_bytes > sum(loose.block_parameter_bytes) > loose.min_budget_bytes
    low = (loose.min_budget_bytes + held.min_budget_bytes) // 2
    over, _ = peak_and_grads(loose.with_budget(low).apply(copy.deepcopy(layers)), x, grads_preallocated=False)
    assert over > low
    with pytest.raises(ValueError, match="gradients='held': block 0's backward holds"):
        held.with_budget(low)
    _, plain_grads = peak_and_grads(copy.deepcopy(layers), x)
    for fraction in (0.0, 0.3, 0.8):
        budget = int(held.min_budget_bytes + fraction * (held.no_checkpoint_peak_bytes - held.min_budget_bytes))
        plan = held.with_budget(budget)
        assert plan.gradients == "held" and OpPlan.from_json(plan.to_json()) == plan
        peak, grads = peak_and_grads(plan.apply(copy.deepcopy(layers)), x, grads_preallocated=False)
        assert peak <= budget and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


def _timed_as(plan: OpPlan, slower: str) -> OpPlan:
    """plan with each block's `slower` op timed 10x its others and no replay fixed cost: which ops
    a plan saves then does not depend on how this machine timed them (a replay's fixed cost, the
    block's forward less its ops, read 0 in most runs and up to 10 ms on a busy machine, where it
    made unwrapping blocks beat saving their GELU)."""
    edited = json.loads(plan.to_json())
    for block in edited["ops"]:
        fastest = min(op[3] for op in block)
        for op in block:
            op[3] = fastest * (10 if slower in op[0] else 1)
    edited["block_replay_seconds"] = [0.0] * len(edited["ops"])
    return OpPlan.from_json(json.dumps(edited))


def test_a_plan_for_held_gradients_stays_within_its_budget_with_the_whole_chain_compiled(chain):
    # A compiled backward is one graph that returns every weight gradient together, before they
    # are added into .grad (preallocated here): held until it ends, whatever the .grad.
    layers, x, loose = chain
    held = torch_ext.plan_ops(layers, x, budget_bytes=1 << 40, repeat=1, gradients="held")

    def peak(plan, compiled=True):
        torch._dynamo.reset()
        model = nn.Sequential(*plan.apply(copy.deepcopy(layers)))
        model = torch.compile(model) if compiled else model
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        for _ in range(2):  # the first call compiles
            with memory.track() as tracked:
                model(x.detach().requires_grad_()).sum().backward()
        return tracked.peak_delta_bytes

    low = (loose.min_budget_bytes + held.min_budget_bytes) // 2
    assert peak(loose.with_budget(low)) > low
    budget = held.min_budget_bytes
    matmuls_first = _timed_as(held, "addmm").with_budget(budget)
    assert all(("aten.addmm.default", 0) in map(tuple, saved) for saved in matmuls_first.saved if saved)
    assert peak(matmuls_first) <= budget
    # A block that saves its GELU but recomputes the matmul that made GELU's input. Tagged
    # MUST_SAVE, every node of GELU's decomposition would be barred from recompute, and the
    # compiled forward kept GELU's derivative beside its output (5.11 MB here); tagged PREFER_SAVE
    # (selective.saved_policy), it keeps what eager keeps.
    gelu_alone = _timed_as(held, "gelu").with_budget(budget)
    assert any(saved == [["aten.gelu.default", 0]] for saved in gelu_alone.saved)
    assert peak(gelu_alone, compiled=False) <= budget
    assert peak(gelu_alone) <= budget


def test_plan_round_trips_through_json(chain, tmp_path):
    layers, x, loose = chain
    plan = torch_ext.plan_ops(layers, x, budget_bytes=(loose.min_budget_bytes + loose.no_checkpoint_peak_bytes) // 3,
                              repeat=1, gradients="accumulated")
    path = str(tmp_path / "plan.json")
    plan.save(path)
    loaded = OpPlan.load(path)
    assert loaded == plan and loaded.predicted_overhead == plan.predicted_overhead
    assert loaded.saved_ops(3) == plan.saved_ops(3)
    _, plain_grads = peak_and_grads(copy.deepcopy(layers), x)
    _, grads = peak_and_grads(loaded.apply(copy.deepcopy(layers)), x)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    with pytest.raises(ValueError, match="not an OpPlan"):
        OpPlan.from_json('{"segments": []}')
    for text, why in (("", "not JSON"), ("[]", "a JSON list, not an object")):
        with open(path, "w") as f:
            f.write(text)
        with pytest.raises(ValueError, match=f"OpPlan.load: {re.escape(path)}: OpPlan.from_json: not an OpPlan .{why}"):
            OpPlan.load(path)
    edited = json.loads(plan.to_json())
    edited["gradients"] = "kept"
    with pytest.raises(ValueError, match=r"OpPlan.from_json: gradients must be one of .*got 'kept'"):
        OpPlan.from_json(json.dumps(edited))


def test_rounded_storage_is_chosen_only_where_no_exact_plan_fits_and_lowers_the_minimum(chain):
    """storage=("keep", "bf16"): budgets an exact plan meets get exact plans (the same as without
    the option, exact gradients); below the exact minimum every checkpointed block stores its input
    in bf16, and the measured peak stays within the budget, below the exact minimum's."""
    layers, x, exact = chain
    loose = exact.with_budget(1 << 40)
    both = torch_ext.plan_ops(layers, x, budget_bytes=1 << 40, repeat=1, storage=("keep", "bf16"),
                              gradients="accumulated")
    assert both.min_budget_bytes < exact.min_budget_bytes
    assert sum(both.block_input_rounded_bytes) * 2 == sum(both.block_input_bytes)  # fp32 inputs, halved
    at_exact_minimum = both.with_budget(exact.min_budget_bytes)
    assert at_exact_minimum.storage == ["keep"] * 16
    assert at_exact_minimum.saved == loose.with_budget(exact.min_budget_bytes).saved
    _, plain_grads = peak_and_grads(copy.deepcopy(layers), x)
    exact_peak, grads = peak_and_grads(at_exact_minimum.apply(copy.deepcopy(layers)), x)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    rounded = both.with_budget(both.min_budget_bytes)
    assert rounded.checkpointed == [True] * 16 and rounded.storage == ["bf16"] * 16
    assert "storage=bf16" in str(rounded)
    peak, grads = peak_and_grads(rounded.apply(copy.deepcopy(layers)), x)
    assert peak <= rounded.budget_bytes and peak < exact_peak
    assert all(torch.allclose(a, b, rtol=0.05, atol=1e-2) for a, b in zip(grads, plain_grads))
    assert not all(torch.equal(a, b) for a, b in zip(grads, plain_grads))  # rounded: lossy, as asked
    # Monotonic across the two storages: a lower budget never predicts a higher peak.
    budgets = range(both.min_budget_bytes, both.no_checkpoint_peak_bytes, 50_000)
    peaks = [both.with_budget(b).predicted_peak_bytes for b in budgets]
    assert peaks == sorted(peaks)
    assert OpPlan.from_json(rounded.to_json()) == rounded
    with pytest.raises(ValueError, match="storage must be one or more of 'keep', 'bf16', 'fp16'"):
        torch_ext.plan_ops(layers, x, budget_bytes=1 << 40, repeat=1, storage=("keep", "int8"))


def test_errors_name_the_problem(chain):
    layers, x, loose = chain
    with pytest.raises(ValueError, match=f"minimum any op-level plan of these 16 blocks can meet: "
                                         f"{loose.min_budget_bytes} bytes"):
        torch_ext.plan_ops(layers, x, budget_bytes=loose.min_budget_bytes - 1, repeat=1, gradients="accumulated")
    with pytest.raises(ValueError, match="positive number of bytes"):
        torch_ext.plan_ops(layers, x, budget_bytes=0)
    with pytest.raises(ValueError, match="minimum any op-level plan"):
        loose.with_budget(loose.min_budget_bytes - 1)
    with pytest.raises(ValueError, match="the plan has 16 blocks, got 2 layers"):
        loose.apply(copy.deepcopy(layers[:2]))
    checkpointed = copy.deepcopy(layers)
    torch_ext.checkpoint(checkpointed[5])
    with pytest.raises(ValueError, match=r"layer 5 \(Sequential\) is already checkpointed"):
        loose.apply(checkpointed)
    # A saved plan applied to other layers: another width, dtype or set of trainable weights.
    tight = loose.with_budget(loose.min_budget_bytes)
    wider, halved, frozen = mlp_chain(width=256), copy.deepcopy(layers), copy.deepcopy(layers)
    halved[15].to(torch.bfloat16)
    frozen[2][0].weight.requires_grad_(False)
    held = 4 * (128 * 256 * 2 + 256 + 128)  # the float32 bytes of one Linear 128 -> 256 -> 128 block
    for others, index, holds in ((wider, 0, 4 * (256 * 512 * 2 + 512 + 256)), (halved, 15, held // 2),
                                 (frozen, 2, held - 4 * 128 * 256)):
        with pytest.raises(ValueError, match=rf"layer {index} \(Sequential\) holds {holds:,} bytes of trainable "
                                             rf"parameters where the plan's layer {index} held {held:,}"):
            tight.apply(others)
        assert not any(isinstance(layer.__dict__.get("forward"), _CheckpointedForward) for layer in others)
    with pytest.raises(IndexError, match="block 16"):
        loose.context_fn(16)
    for owner in (loose.save_items, loose.context_fn):  # the loose plan leaves every block unwrapped
        with pytest.raises(ValueError, match=r"leaves block 3 unwrapped \(is_checkpointed\(3\) is False\)"):
            owner(3)


def test_choice_takes_n_log_n_steps_and_fills_the_budget_in_order_of_seconds_per_byte():
    torch.manual_seed(0)
    blocks, per_block = 256, 16
    n = blocks * per_block
    nbytes = torch.randint(1, 1000, (blocks, per_block)).tolist()
    seconds = torch.rand(blocks, per_block).tolist()
    replay = torch.rand(blocks).tolist()
    ops = [[["op", i, nbytes[k][i], seconds[k][i]] for i in range(per_block)] for k in range(blocks)]
    inputs = outputs = workspace = grads = [10] * blocks
    activations = [sum(row) for row in nbytes]
    low = _peak([0] * blocks, inputs, outputs, activations, workspace, grads)
    high = _peak(activations, inputs, outputs, activations, workspace, grads)
    steps = [_steps(block, activations[k], replay[k]) for k, block in enumerate(ops)]
    # Each block's steps are in falling order of seconds per byte and end by unwrapping it; with
    # the op steps unwrapping replaces, they cover every op and the block's whole recompute.
    by_rate = [sorted(range(per_block), key=lambda i: -seconds[k][i] / nbytes[k][i]) for k in range(blocks)]
    for k, (hull, rest) in enumerate(steps):
        rates = [sec / b for _, b, sec in hull]
        assert rates == sorted(rates, reverse=True) and hull[-1][0] == _UNWRAP
        assert sum(b for _, b, _ in hull) == activations[k]
        assert sum(sec for *_, sec in hull) == pytest.approx(sum(seconds[k]) + replay[k])
        assert [step[0] for step in hull[:-1] + rest] == by_rate[k]
    previous_peak, unwrapped_seen = 0, False
    for fraction in (0.0, 0.1, 0.5, 0.9, 1.0):
        budget = low + fraction * (high - low)
        saved, checkpointed, peak, count = _choose(ops, replay, inputs, outputs, activations, workspace, grads, budget)
        assert count <= 4 * n * math.log2(n)
        # A checkpointed block saves a prefix of its ops by seconds per byte, an unwrapped one keeps
        # its activations, and the peak is _peak's of what the blocks keep.
        kept = []
        for k in range(blocks):
            chosen = sorted(i for _, i in saved[k])
            assert checkpointed[k] or not chosen
            assert chosen == sorted(by_rate[k][:len(chosen)])
            kept.append(sum(nbytes[k][i] for i in chosen) if checkpointed[k] else activations[k])
        assert _peak(kept, inputs, outputs, activations, workspace, grads) == peak <= budget
        # Nothing more fits: no checkpointed block's next op.
        for k in range(blocks):
            if checkpointed[k] and len(saved[k]) < per_block:
                more = list(kept)
                more[k] += nbytes[k][by_rate[k][len(saved[k])]]
                assert _peak(more, inputs, outputs, activations, workspace, grads) > budget
        assert peak >= previous_peak  # monotonic in the budget
        previous_peak = peak
        unwrapped_seen = unwrapped_seen or not all(checkpointed)
    assert unwrapped_seen and not any(checkpointed)  # the whole budget: nothing is checkpointed


def test_a_block_is_left_unwrapped_when_that_saves_more_time_per_byte_than_its_ops():
    # Blocks 0 and 1 have two ops each (4 and 6 of the 10 bytes a block keeps unwrapped, 1 s each).
    # Block 0's replay costs nothing beyond its ops, whose steps (0.25 s a byte, then unwrapping: 1
    # s for 6 bytes) beat unwrapping it at once (2 s for 10 bytes); block 1's replay costs 8 s
    # more, so unwrapping it (10 s for 10 bytes) beats its ops. Block 2, the last, has no ops.
    ops = [[["a", 0, 4, 1.0], ["b", 0, 6, 1.0]], [["a", 0, 4, 1.0], ["b", 0, 6, 1.0]], []]
    assert _steps(ops[0], 10, 0.0) == ([(0, 4, 1.0), (_UNWRAP, 6, 1.0)], [(1, 6, 1.0)])
    assert _steps(ops[1], 10, 8.0) == ([(_UNWRAP, 10, 10.0)], [(0, 4, 1.0), (1, 6, 1.0)])
    shape = ([0] * 3, [0] * 3, [10] * 3, [0] * 3, [0] * 3)  # inputs, outputs, activations, workspace, grads
    a = [["a", 0]]
    # Block k's backward peaks at what the blocks before it keep plus its own 10 bytes; what
    # follows the chain at what all three keep plus 10.
    for budget, saved, checkpointed, peak in (
            (10, [[], [], []], [True, True, True], 10),
            (16, [a, [], []], [True, True, True], 14),  # unwrapping block 1 does not fit: its ops
            (18, [a, a, []], [True, True, True], 18),
            (20, [[], [], []], [True, False, True], 20),
            (24, [a, [], []], [True, False, True], 24),
            (30, [[], [], []], [False, False, True], 30),
            # What follows the chain is counted as needing what the last block's backward needs.
            (40, [[], [], []], [False, False, False], 40)):
        assert _choose(ops, [0.0, 8.0, 0.0], *shape, budget=budget)[:3] == (saved, checkpointed, peak), budget
    # Unwrapping block 0 (5 s for 10 bytes) beats both its ops (b: 0.5 s a byte, a: 0.25); when it
    # does not fit, the block goes on with the ops it replaced, b first.
    ops = [[["a", 0, 4, 1.0], ["b", 0, 2, 1.0]], []]
    assert _steps(ops[0], 10, 3.0) == ([(_UNWRAP, 10, 5.0)], [(1, 2, 1.0), (0, 4, 1.0)])
    two_blocks = (field[:2] for field in shape)
    assert _choose(ops, [3.0, 0.0], *two_blocks, budget=12)[:3] == ([[["b", 0]], []], [True, True], 12)


def test_hugging_face_layers_planned_op_by_op_on_what_the_model_gives_them():
    transformers = pytest.importorskip("transformers")
    from torch_ext.checkpointing import hf

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    model = copy.deepcopy(reference)
    loose = hf.checkpoint_layers(copy.deepcopy(reference), budget_bytes=1 << 40, inputs=inputs, ops=True, repeat=1)
    assert all(block for block in loose.ops) and loose.checkpointed == [False] * 3
    plan = hf.checkpoint_layers(model, budget_bytes=(loose.min_budget_bytes + loose.no_checkpoint_peak_bytes) // 2,
                                inputs=inputs, ops=True, repeat=1)
    assert isinstance(plan, OpPlan) and plan.predicted_peak_bytes <= plan.budget_bytes
    assert all(plan.saves_natively(k) for k in range(len(plan.saved)))
    assert any(plan.checkpointed)
    assert [isinstance(layer.__dict__.get("forward"), _CheckpointedForward)
            for layer in hf.repeated_layers(model)] == plan.checkpointed
    for m in (model, reference):
        torch.manual_seed(1)
        m(**inputs, labels=ids).loss.backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad), name
    with pytest.raises(ValueError, match="ops=True plans under a budget"):
        hf.checkpoint_layers(copy.deepcopy(reference), every=1, ops=True)
    # Held gradients: those of the parameters outside the layers (embeddings, final norm, head)
    # count through every layer's backward.
    held = hf.checkpoint_layers(copy.deepcopy(reference), budget_bytes=1 << 40, inputs=inputs, ops=True, repeat=1,
                                gradients="held")
    layers = hf.repeated_layers(reference)
    outside = sum(p.nbytes for p in reference.parameters()) - sum(p.nbytes for layer in layers for p in layer.parameters())
    assert held.gradients == "held" and held.other_gradient_bytes == outside > 0
    # The first layer's backward holds every gradient of the model.
    assert held.min_budget_bytes > sum(p.nbytes for p in reference.parameters())
    # The layer-level planner takes the same option, "held" by default.
    held_layers = hf.checkpoint_layers(copy.deepcopy(reference), budget_bytes=1 << 40, inputs=inputs, repeat=1)
    assert held_layers.gradients == "held" and held_layers.other_gradient_bytes == outside
    assert held_layers.min_budget_bytes > sum(p.nbytes for p in reference.parameters())
    with pytest.raises(ValueError, match="gradients='held' is an option of planning under a budget"):
        hf.checkpoint_layers(copy.deepcopy(reference), every=2, gradients="held")
    for ops in (False, True):  # refused before anything is measured, on both planners' paths
        with pytest.raises(ValueError, match="checkpoint_layers: gradients must be one of .*got 'kept'"):
            hf.checkpoint_layers(copy.deepcopy(reference), budget_bytes=1 << 40, inputs=inputs, ops=ops,
                                 gradients="kept")


@pytest.mark.parametrize("ops", [True, False], ids=["op_plan", "layer_plan"])
@pytest.mark.parametrize("gradients", ["accumulated", "held"])
def test_a_hugging_face_plan_holds_its_budget_in_a_step_whose_head_needs_more_than_a_layer(gradients, ops):
    # A head with a wide vocabulary (logits, their log-softmax and their gradients, 1 MiB each)
    # needs far more than a layer of width 32: counted as a layer's needs (the op planner) or not
    # at all (the layer planner), the plan at its minimum budget ran over it in a real step (the
    # layer plan 9x over); hf.checkpoint_layers measures the head instead.
    transformers = pytest.importorskip("transformers")
    from torch_ext.checkpointing import hf

    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=4096, n_positions=32)
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 4096, (2, 32))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    loose = hf.checkpoint_layers(copy.deepcopy(reference), budget_bytes=1 << 40, inputs=inputs, ops=ops, repeat=1,
                                 gradients=gradients)
    assert loose.head_bytes > 2 * (2 * 32 * 4096 * 4)  # at least the log-softmax and a gradient of the logits
    # The head's gradient of the tied embeddings waits in autograd for the embedding's own, through
    # every layer's backward (with gradients held, as every gradient outside the layers is).
    tied = reference.transformer.wte.weight.nbytes
    assert (loose.around_bytes >= tied) if gradients == "accumulated" else (loose.other_gradient_bytes >= tied)
    model = copy.deepcopy(reference)
    plan = hf.checkpoint_layers(model, budget_bytes=loose.min_budget_bytes, inputs=inputs, ops=ops, repeat=1,
                                gradients=gradients)
    assert plan.head_bytes == loose.head_bytes and all(p.grad is None for p in model.parameters())
    for _ in range(2):  # the second step is measured (the first allocates what steps keep)
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if gradients == "accumulated" else None
        with memory.track() as tracked:
            model(**inputs).loss.backward()
    assert tracked.peak_delta_bytes <= plan.budget_bytes
    # The prediction is the step's, not far above it either.
    assert plan.predicted_peak_bytes - tracked.peak_delta_bytes < 0.25 * plan.budget_bytes
    # A budget below the minimum is refused saying what the head adds.
    with pytest.raises(ValueError, match=r"below the minimum .*the model's head and loss need \d+\.\d\d MiB after them"):
        hf.checkpoint_layers(copy.deepcopy(reference), budget_bytes=loose.min_budget_bytes // 2, inputs=inputs, ops=ops,
                             repeat=1, gradients=gradients)


def _chain_with_a_wide_head():
    """4 blocks of width 32, then a 4096-way classifier and its loss: the head needs far more
    than a block (logits, their log-softmax and their gradients, 1 MiB each)."""
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 32)) for _ in range(4)]
    classifier = nn.Linear(32, 4096)
    target = torch.randint(0, 4096, (64,))
    return layers, classifier, lambda y: nn.functional.cross_entropy(classifier(y), target), torch.randn(64, 32)


@pytest.mark.parametrize("ops", [True, False], ids=["plan_ops", "CheckpointedSequential"])
@pytest.mark.parametrize("gradients", ["accumulated", "held"])
def test_a_chain_plan_given_its_head_holds_its_budget_over_the_whole_step(gradients, ops):
    layers, classifier, head, x = _chain_with_a_wide_head()

    def planned_step(budget, with_head):
        """(plan, the second step's peak): the chain planned for budget, then classifier and loss."""
        model = copy.deepcopy(layers)
        given = head if with_head else None
        if ops:
            plan = torch_ext.plan_ops(model, x, budget_bytes=budget, repeat=1, gradients=gradients, head=given)
            plan.apply(model)
            chain = nn.Sequential(*model)
        else:
            chain = torch_ext.CheckpointedSequential(model, budget_bytes=budget, gradients=gradients, head=given)
        params = list(chain.parameters()) + list(classifier.parameters())
        for _ in range(2):  # the second step is measured (the first plans, and allocates what steps keep)
            for p in params:
                p.grad = torch.zeros_like(p) if gradients == "accumulated" else None
            with memory.track() as tracked:
                head(chain(x)).backward()
        return (plan if ops else chain.plan), tracked.peak_delta_bytes

    planner = torch_ext.plan_ops if ops else torch_ext.plan_checkpoints
    loose = planner(layers, x, budget_bytes=1 << 40, repeat=1, gradients=gradients, head=head)
    assert loose.head_bytes > 3 * (64 * 4096 * 4)  # the logits, their log-softmax and a gradient at least
    held = sum(p.nbytes for p in classifier.parameters())
    assert loose.other_gradient_bytes == (held if gradients == "held" else 0)
    assert classifier.weight.grad is None  # planning leaves the head's gradients as they were
    plan, peak = planned_step(loose.min_budget_bytes, with_head=True)
    assert plan.head_bytes == loose.head_bytes
    assert peak <= plan.budget_bytes
    assert plan.predicted_peak_bytes - peak < 0.25 * plan.budget_bytes
    # Planned for the chain alone, the same step runs over that plan's budget.
    blind = planner(layers, x, budget_bytes=1 << 40, repeat=1, gradients=gradients)
    blind_plan, blind_peak = planned_step(blind.min_budget_bytes, with_head=False)
    assert blind_plan.head_bytes is None and blind_peak > blind_plan.budget_bytes


def test_a_chain_head_is_checked_and_measuring_it_changes_nothing():
    layers, classifier, head, x = _chain_with_a_wide_head()
    torch.manual_seed(5)
    state = torch.get_rng_state()
    plan = torch_ext.plan_checkpoints(layers, x, budget_bytes=1 << 40, repeat=1, head=head)
    assert torch.equal(torch.get_rng_state(), state) and plan.head_bytes > 0
    with pytest.raises(TypeError, match="plan_ops: head must be a callable .*got int"):
        torch_ext.plan_ops(layers, x, budget_bytes=1 << 40, repeat=1, head=3)
    with pytest.raises(ValueError, match=r"plan_checkpoints: head must return the loss, a one-element tensor .*"
                                         r"got Tensor\(64, 4096\)"):
        torch_ext.plan_checkpoints(layers, x, budget_bytes=1 << 40, repeat=1, head=classifier)
    with pytest.raises(ValueError, match=r"plan_checkpoints: budget_bytes=.* below the minimum .*counted with the "
                                         r"layers: the model's head and loss need \d+\.\d\d MiB after them; gradients="):
        torch_ext.plan_checkpoints(layers, x, budget_bytes=plan.min_budget_bytes - 1, repeat=1, head=head)
    with pytest.raises(ValueError, match="head is an option of planning under a budget; give budget_bytes"):
        torch_ext.CheckpointedSequential(layers, every=2, head=head)
    chain = torch_ext.CheckpointedSequential(copy.deepcopy(layers), budget_bytes=1 << 40, head=classifier)
    assert list(chain.state_dict()) == list(nn.Sequential(*layers).state_dict())  # the head is not a layer


def test_plans_keep_dropout_masks_or_draw_them_again_and_gradients_stay_exact():
    # A kept mask draw (bernoulli_) leaves the generator where the forward's was after it, so the
    # draws a plan recomputes still get the forward's numbers whatever it keeps.
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(64, 128), nn.Dropout(0.3), nn.GELU(), nn.Dropout(0.3), nn.Linear(128, 64))
              for _ in range(4)]
    x = torch.randn(32, 64)
    loose = torch_ext.plan_ops(layers, x, budget_bytes=1 << 40, repeat=1)
    assert [name for name, *_ in loose.ops[0]].count("aten.bernoulli_.float") == 2
    torch.manual_seed(3)
    _, plain_grads = peak_and_grads(copy.deepcopy(layers), x)
    plans = [loose.with_budget(loose.min_budget_bytes + fraction * (loose.no_checkpoint_peak_bytes
                                                                    - loose.min_budget_bytes))
             for fraction in (0.0, 0.5)] + [every_op_saved(loose), every_op_saved(loose, blocks={1, 2})]
    for plan in plans:
        wrapped = [k for k in range(4) if plan.is_checkpointed(k)]
        kept = sum(name == "aten.bernoulli_.float" for k in wrapped for name, _ in plan.saved[k])
        torch.manual_seed(3)
        with OpCounter() as counter:
            _, grads = peak_and_grads(plan.apply(copy.deepcopy(layers)), x)
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
        # The forward's draws, then those a replay does not keep.
        assert counter.counts["aten.bernoulli_.float"] == 8 + (2 * len(wrapped) - kept)


class SelfAttention(nn.Module):
    """Attention without dropout or mask: the CPU's fused kernel, an op tagged random (it takes a
    dropout_p) that draws nothing when dropout_p is 0."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        q = self.proj(x).view(2, 8, 2, 8).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(2, 8, 16) + x


def test_fused_attention_without_dropout_is_a_candidate_and_a_plan_that_keeps_it_does_not_rerun_it():
    torch.manual_seed(0)
    layers = [SelfAttention() for _ in range(3)]
    x = torch.randn(2, 8, 16)
    attention = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    plan = every_op_saved(torch_ext.plan_ops(layers, x, budget_bytes=1 << 40, repeat=1))
    assert all([attention, 0] in block for block in plan.saved)
    _, expected = peak_and_grads(copy.deepcopy(layers), x)
    with OpCounter() as counter:
        _, grads = peak_and_grads(plan.apply(copy.deepcopy(layers)), x)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected))
    assert counter.counts[attention] == 3  # the forward's calls only


class MaskedAttention(nn.Module):
    """Attention with a float mask and dropout: torch's math path adds the mask in place into its
    first bmm's output, unless a dispatch mode (the planner's recorder) is active, when it adds it
    out of place. An output projection follows, so that the second bmm is not in the tail."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)
        self.register_buffer("mask", torch.randn(1, 1, 8, 8, generator=torch.Generator().manual_seed(1)))

    def forward(self, x):
        q = self.proj(x).view(2, 8, 2, 8).transpose(1, 2)
        attention = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=self.mask, dropout_p=0.2)
        return self.out(attention.transpose(1, 2).reshape(2, 8, 16)) + x


def test_ops_a_dispatch_mode_changes_are_not_candidates_and_plans_stay_exact():
    torch.manual_seed(0)
    layers = [MaskedAttention() for _ in range(3)]
    x = torch.randn(2, 8, 16)
    loose = torch_ext.plan_ops(layers, x, budget_bytes=1 << 40, repeat=1)
    names = {name for block in loose.ops for name, *_ in block}
    assert "aten.addmm.default" in names and "aten.add.Tensor" not in names
    # Only the first bmm's output is changed in place without a mode: the second stays a candidate.
    assert all([index for name, index, *_ in block if name == "aten.bmm.default"] == [1] for block in loose.ops)
    assert all("aten.add.Tensor" not in native for native in loose.native_ops)
    torch.manual_seed(3)
    _, plain_grads = peak_and_grads(copy.deepcopy(layers), x)
    plan = every_op_saved(loose)
    torch.manual_seed(3)
    _, grads = peak_and_grads(plan.apply(copy.deepcopy(layers)), x)
    assert all(plan.saves_natively(k) for k in range(3))
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
