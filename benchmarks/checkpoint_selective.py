"""Part "selective" of bench_checkpoint: selective activation checkpointing (torch's context_fn) on
Hugging Face GPT-2 and Llama (12 layers, width 256, padded 4x128 batches, defaults on: dropout,
use_cache), eager and compiled, on the CPU (or, with --device cuda, the GPU; --eager-only leaves the
compiled rows out):

  (a) no checkpointing
  (b) Hugging Face's model.activation_checkpointing_enable() (torch.utils.checkpoint per layer)
  (c) torch's SAC: the same, with gradient_checkpointing_kwargs' context_fn a torchtitan-style
      policy (attention saved, and every second matmul of each layer's forward)
  (d) torch_ext per layer: hf.gradient_checkpointing_enable(model)
  (e) torch_ext with the same policy: hf.gradient_checkpointing_enable(model, context_fn=...)
  (g) torch_ext's native policy, the same choice decided in C++:
      hf.gradient_checkpointing_enable(model, save="torchtitan")
  (f) torch_ext's op-level planner at 25%, 50% and 75% of (a)'s layer activation memory
      (hf.checkpoint_layers(model, budget_bytes=..., inputs=batch, ops=True)); the plans save
      through (g)'s mechanism; each is checked within its budget over the whole step and over its
      layers run alone on the recorded inputs (the plan counts the head and what is around the
      layers, which hf.checkpoint_layers measures)
  compiled (torch.compile(model), inductor): (a), (c), (e), (g) and the (f) plans, planned with
      gradients="held" (a compiled backward returns every weight gradient together)
  (h) torch.compile of the unwrapped model with torch._functorch.config.activation_memory_budget
      at 0.25, 0.5 and 0.75 (Inductor's partitioner chooses what to recompute)

Step: model(**batch).loss.backward(), gradients preallocated; compiled rows run with
torch._inductor.config.fallback_random, so their dropout draws eager's masks, and are compiled by
their first step (not timed). Step peak: the highest live memory
above the step's start (torch_ext.memory). Grad diff: max |g - g_(a)| / max |g_(a)| after one step
from the same seed. Step time: rounds of every variant (harness.measure_interleaved), then (e)
against (c) in rounds of their own, alternating which runs first, judged by a 95% sign-test
interval on the per-round difference, and (g) against (c) the same way. Each plan is compared with
the fastest anchor ((a), (b), (c); compiled: (a), (c), (h)) whose step peak is not above the
plan's, eager with eager and compiled with compiled, in paired rounds of the two judged as (e)
against (c). A plot of step peak against step time, one point per variant:
docs/checkpoint_selective.png.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import textwrap
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import harness
from checkpoint_hf import layers_peak, models, padded_batch
import torch_ext
from torch_ext.checkpointing import hf

NONE, HF, TORCH_SAC, OURS, OURS_SAC, NATIVE = (
    "(a) no checkpointing", "(b) Hugging Face gradient checkpointing", "(c) torch SAC, torchtitan-style policy",
    "(d) torch_ext per layer", "(e) torch_ext + the same policy", "(g) torch_ext native policy (save='torchtitan')")
COMPILED = (NONE, TORCH_SAC, OURS_SAC, NATIVE)
PLANNED = {fraction: f"(f) torch_ext op-level plan, {fraction:.0%} budget" for fraction in (0.25, 0.5, 0.75)}
BUDGETED = {fraction: f"(h) torch.compile, activation_memory_budget={fraction}" for fraction in PLANNED}
ANCHORS = (NONE, HF, TORCH_SAC)
COMPILED_ANCHORS = (f"{NONE}, compiled", f"{TORCH_SAC}, compiled", *BUDGETED.values())
PLOT = Path(__file__).resolve().parent.parent / "docs" / "checkpoint_selective.png"

_MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)


def torchtitan_context():
    """torchtitan's selective policy: attention outputs saved, and every second matmul, counted per
    checkpointed call and, as torchtitan counts them, apart in the forward and the recompute (torch
    2.11 asks the policy again in the recompute, where one count over both would save other calls
    than the forward did; torch 2.13 replays the forward's answers)."""
    matmuls = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs):
        packet = op.overloadpacket
        if packet.__name__.startswith("_scaled_dot_product"):
            return CheckpointPolicy.MUST_SAVE
        if packet in _MATMULS:
            matmuls[ctx.is_recompute] += 1
            if matmuls[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def variants(base: torch.nn.Module) -> dict[str, torch.nn.Module]:
    built = {name: copy.deepcopy(base) for name in (NONE, HF, TORCH_SAC, OURS, OURS_SAC, NATIVE)}
    built[HF].activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    built[TORCH_SAC].activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": False, "context_fn": torchtitan_context})
    hf.gradient_checkpointing_enable(built[OURS])
    hf.gradient_checkpointing_enable(built[OURS_SAC], context_fn=torchtitan_context)
    hf.gradient_checkpointing_enable(built[NATIVE], save="torchtitan")
    return built


def planned(base: torch.nn.Module, batch: dict, device, built: dict, compiled_rows: bool) -> tuple[dict, dict, dict, list]:
    """Adds the op-level plans to built: (budgets, plans, the compiled rows' models, the layers'
    recorded inputs); the budgets are fractions of (a)'s layer activation memory
    (checkpoint_hf.layers_peak). The eager rows' plans are made for gradients added into .grad as
    they are made; the compiled rows' for gradients held (gradients="held": the compiled backward
    returns every weight gradient together), each under the row's name + ", compiled". One
    measurement per gradients mode, at the largest budget; the others are its plan.with_budget (so
    the plans of one mode are monotonic in the budget, as the planner promises for one measurement)."""
    _, recorded = hf._record_layer_inputs(base, hf.repeated_layers(base), batch)
    activation = layers_peak(built[NONE], recorded, device)
    budgets, plans, compiled = {}, {}, {}
    modes = (("accumulated", "", built), ("held", ", compiled", compiled))
    for gradients, suffix, rows in modes if compiled_rows else modes[:1]:
        measured, models = None, {}
        for fraction, eager_name in sorted(PLANNED.items(), reverse=True):
            name = eager_name + suffix
            model = copy.deepcopy(base)
            budgets[name] = int(activation * fraction)
            try:
                if measured is None:
                    plans[name] = measured = hf.checkpoint_layers(model, budget_bytes=budgets[name], inputs=batch,
                                                                  ops=True, repeat=2, gradients=gradients)
                else:
                    plans[name] = measured.with_budget(budgets[name])
                    plans[name].apply(hf.repeated_layers(model))
            except ValueError as error:  # below the minimum: reported, not timed
                plans[name] = error
                continue
            models[name] = model
        rows.update((name + suffix, models[name + suffix]) for name in PLANNED.values() if name + suffix in models)
    return budgets, plans, compiled, recorded


def budget_backend(fraction: float):
    """Inductor with the partitioner's activation_memory_budget set while it compiles (a backend of
    its own, so dynamo compiles each budget separately instead of reusing another row's graph)."""
    def backend(graph, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        with torch._functorch.config.patch(activation_memory_budget=fraction):
            return compile_fx(graph, example_inputs)
    return backend


def inductor_dropout_step(compiled, batch: dict) -> None:
    """A step with Inductor's own dropout (torch's default; its backward compiles in the first
    step): with fallback_random, as the other compiled rows run, the budgeted partitioner recomputes
    dropout with new numbers (GPT-2's gradients then differ from (a)'s by 0.7 of their largest)."""
    with torch._inductor.config.patch(fallback_random=False):
        compiled(**batch).loss.backward()


def compiled_steps(base: torch.nn.Module, built: dict, planned_compiled: dict, batch: dict) -> dict:
    """The compiled rows: name -> (model, step)."""
    def step(compiled):
        return functools.partial(lambda c: c(**batch).loss.backward(), compiled)

    models = {f"{name}, compiled": built[name] for name in COMPILED} | planned_compiled
    rows = {name: (model, step(torch.compile(model))) for name, model in models.items()}
    for fraction, name in BUDGETED.items():
        model = copy.deepcopy(base)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        compiled = torch.compile(model, backend=budget_backend(fraction))
        rows[name] = (model, functools.partial(inductor_dropout_step, compiled, batch))
    return rows


def run_model(label: str, build, quick: bool, device, report: harness.Report, checks: list, points: dict,
              compiled_rows: bool) -> None:
    progress = harness.progress(label)
    base = build().to(device)
    config = base.config
    batch = padded_batch(config.vocab_size, 2 if quick else 4, config.max_position_embeddings, device)
    built = variants(base)
    budgets, plans, planned_compiled, recorded = planned(base, batch, device, built, compiled_rows)
    progress("planned")
    for model in (*built.values(), *planned_compiled.values()):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    rows = {name: (model, functools.partial(lambda m: m(**batch).loss.backward(), model))
            for name, model in built.items()}
    if compiled_rows:
        rows.update(compiled_steps(base, built, planned_compiled, batch))
    steps, grad_diffs, peaks, reference = {}, {}, {}, None
    for name, (model, step) in rows.items():
        steps[name] = step
        torch.manual_seed(5)  # the same dropout masks in every variant
        step()  # compiles a compiled row
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).float().cpu()
        reference = grads if reference is None else reference
        grad_diffs[name] = ((grads - reference).abs().max() / reference.abs().max()).item()
        model.zero_grad(set_to_none=False)
        peaks[name] = harness.peak_memory(step, device)
        model.zero_grad(set_to_none=False)
        progress(f"{name}: first step and peak memory")
    built_by_row = {name: model for name, (model, _) in rows.items()}
    zero = {name: functools.partial(model.zero_grad, set_to_none=False) for name, model in built_by_row.items()}
    repeat, pair_repeat = (2, 4) if quick else (8, 20)
    # Alternating rounds: a variant that follows one of smaller peak pays the page faults of the
    # memory the allocator gave back, so a fixed order falls on the same variants each round.
    timings = harness.measure_interleaved(steps, warmup=1, repeat=repeat, before_each=zero, alternate=True)
    progress(f"{len(steps)} variants timed")
    base_time = timings[NONE].median_seconds
    for name, t in timings.items():
        report.add_row({"model": label, "variant": name, "step peak memory": harness.format_bytes(peaks[name]),
                        "vs (a) peak": f"{peaks[name] / peaks[NONE]:.0%}",
                        "step time": f"{harness.format_seconds(t.median_seconds)} ±{t.spread:.0%}",
                        "vs (a) time": f"{t.median_seconds / base_time:.2f}x",
                        "grad diff vs (a)": f"{grad_diffs[name]:.1e}"},
                       step_peak_bytes=peaks[name], step_seconds=t.median_seconds, timing=t,
                       grad_max_rel_diff=grad_diffs[name])
        points.setdefault(label, {})[name] = (t.median_seconds / base_time, peaks[name] / peaks[NONE])
    pair = harness.measure_interleaved({TORCH_SAC: steps[TORCH_SAC], OURS_SAC: steps[OURS_SAC], NATIVE: steps[NATIVE]},
                                       warmup=1, repeat=pair_repeat, before_each=zero, alternate=True)
    for ours, letter in ((OURS_SAC, "(e)"), (NATIVE, "(g)")):
        checks.append(harness.peak_and_time_check(label, pair, peaks, ours, TORCH_SAC, (letter, "(c)")))
    same = grad_diffs[OURS_SAC] == grad_diffs[TORCH_SAC] == grad_diffs[NATIVE] == 0
    checks.append((f"{label}: (c), (e) and (g) give (a)'s gradients exactly (dropout on): {'yes' if same else 'no'}",
                   same))
    for name, budget in budgets.items():
        held = name.endswith(", compiled")  # the compiled rows' plans are made for held gradients
        if isinstance(plans[name], ValueError):
            # Refusing is what the held planner must do below its minimum: no plan may run over.
            checks.append((f"{label}: {name}{' (gradients held)' if held else ''}: {plans[name]}", held))
            continue
        if held:
            checks.append((f"{label}: {name} (gradients held) within its budget: step peak "
                           f"{harness.format_bytes(peaks[name])} <= {harness.format_bytes(budget)} (predicted "
                           f"{harness.format_bytes(plans[name].predicted_peak_bytes)})", peaks[name] <= budget))
            continue
        # The plan counts the model's head and what is around its layers (hf.checkpoint_layers measures
        # them), so the whole step stays within the budget, as do the layers run alone.
        peak = layers_peak(built[name], recorded, device)
        checks.append((f"{label}: {name} within its budget: step peak {harness.format_bytes(peaks[name])} and layers "
                       f"peak {harness.format_bytes(peak)} <= {harness.format_bytes(budget)} (predicted "
                       f"{harness.format_bytes(plans[name].predicted_peak_bytes)}, {sum(plans[name].checkpointed)} of "
                       f"{len(plans[name].ops)} layers checkpointed, saving {sum(map(len, plans[name].saved))} of the "
                       f"{sum(map(len, plans[name].ops))} ops measured)", max(peak, peaks[name]) <= budget))
    progress("(e) and (g) paired with (c), the plans' layers measured")
    checks += anchor_checks(label, timings, peaks, steps, zero, pair_repeat)
    progress("plans paired with their anchors")
    half = PLANNED[0.5]
    if half in timings:
        # Paired: the interleaved rounds above time every variant once a round, too far apart for a 5% verdict.
        pair = harness.measure_interleaved({NONE: steps[NONE], half: steps[half]}, warmup=1, repeat=pair_repeat,
                                           before_each=zero, alternate=True)
        ratio, low, high = harness.paired_ratio(pair[half], pair[NONE])
        # What the plan's own op timings predict: the least recompute it found at this budget; and
        # what the planner chooses at this budget when a replay costs nothing but its recomputed ops
        # (no Python, no views): what the op costs alone allow on this machine.
        predicted = plans[half].predicted_recompute_seconds
        free_replay = dataclasses.replace(plans[half], block_replay_seconds=[0.0] * len(plans[half].ops))
        floor = free_replay.with_budget(budgets[half]).predicted_recompute_seconds
        checks.append((f"{label}: {half} at most 1.05x (a)'s step: in {len(pair[NONE].samples)} paired rounds "
                       f"{harness.format_seconds(pair[half].median_seconds)} vs "
                       f"{harness.format_seconds(pair[NONE].median_seconds)}, per round {ratio:.3f}x, 95% interval "
                       f"[{low:.3f}, {high:.3f}]x (sign test); the plan predicted "
                       f"{harness.format_seconds(predicted)} of recompute a step, "
                       f"{1 + predicted / pair[NONE].median_seconds:.3f}x; with a replay that cost only its "
                       f"recomputed ops, {harness.format_seconds(floor)}, "
                       f"{1 + floor / pair[NONE].median_seconds:.3f}x", ratio <= 1.05))
        progress(f"{half} paired with (a)")
    compiled_c = f"{TORCH_SAC}, compiled"
    for ours, letter in ((OURS_SAC, "e"), (NATIVE, "g")) if compiled_rows else ():
        compiled = f"{ours}, compiled"
        checks.append((f"{label}, compiled: ({letter}) at (c)'s step peak memory ({harness.format_bytes(peaks[compiled])} "
                       f"vs {harness.format_bytes(peaks[compiled_c])})", peaks[compiled] <= peaks[compiled_c] * 1.02))


def anchor_checks(label: str, timings: dict, peaks: dict, steps: dict, zero: dict, repeat: int) -> list:
    """Each plan (eager, compiled) against the fastest anchor of its kind whose peak is not above its
    own (fastest by the interleaved rounds' medians), judged in paired rounds of the two alone, as
    (e) against (c): met when the 95% interval of the per-round difference reaches 0 or below."""
    checks = []
    for plan in PLANNED.values():
        for name, anchors in ((plan, ANCHORS), (f"{plan}, compiled", COMPILED_ANCHORS)):
            if name not in timings:
                continue
            fits = [a for a in anchors if peaks[a] <= peaks[name]]
            if not fits:
                checks.append((f"{label}: {name}: no anchor peaks at or below its {harness.format_bytes(peaks[name])}",
                               True))
                continue
            fastest = min(fits, key=lambda a: timings[a].median_seconds)
            # The interleaved rounds time every variant once a round, too far apart for a verdict.
            pair = harness.measure_interleaved({name: steps[name], fastest: steps[fastest]}, warmup=1, repeat=repeat,
                                               before_each=zero, alternate=True)
            paired, low, high, faster = harness.paired_difference(pair[name], pair[fastest])
            verdict = "faster" if high < 0 else ("slower" if low > 0 else "a tie within this run's noise")
            checks.append((f"{label}: {name} ({harness.format_bytes(peaks[name])}) no slower than the fastest anchor "
                           f"at or below its peak, {fastest} ({harness.format_bytes(peaks[fastest])}): in {repeat} "
                           f"paired rounds {harness.format_seconds(pair[name].median_seconds)} vs "
                           f"{harness.format_seconds(pair[fastest].median_seconds)}, per round plan - anchor median "
                           f"{paired * 1e3:+.1f} ms, 95% interval [{low * 1e3:+.1f}, {high * 1e3:+.1f}] ms (sign test), "
                           f"the plan faster in {faster} of {repeat}: {verdict}", low <= 0))
    return checks


def deep_chain() -> tuple[list, torch.Tensor]:
    """256 Linear+GELU layers (width 256) and a batch of 64: the planners' scaling case."""
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(256)], torch.randn(64, 256)


def scaling_check() -> tuple[str, bool]:
    """plan_ops over 256 Linear+GELU layers (width 256, batch 64): measuring and choosing, < 2 s."""
    layers, x = deep_chain()
    start = time.perf_counter()
    plan = torch_ext.plan_ops(layers, x, budget_bytes=1 << 40)
    seconds = time.perf_counter() - start
    start = time.perf_counter()
    plan.with_budget((plan.min_budget_bytes + plan.no_checkpoint_peak_bytes) // 2)
    choice = time.perf_counter() - start
    return (f"plan_ops over 256 Linear+GELU layers ({sum(map(len, plan.ops))} ops; width 256, batch 64, repeat=3): "
            f"{seconds:.2f} s measuring and choosing (target < 2 s); the choice alone {choice * 1e3:.1f} ms",
            seconds < 2.0)


def layer_planning_note() -> str:
    """plan_checkpoints (segments of any length) over the same 256 layers, at the budget halfway
    between its minimum and its peak without checkpointing, for each gradients mode (no target)."""
    layers, x = deep_chain()
    parts = []
    for gradients in ("accumulated", "held"):
        loose = torch_ext.plan_checkpoints(layers, x, budget_bytes=1 << 40, gradients=gradients)
        budget = (loose.min_budget_bytes + loose.no_checkpoint_peak_bytes) // 2
        start = time.perf_counter()
        plan = torch_ext.plan_checkpoints(layers, x, budget_bytes=budget, gradients=gradients)
        parts.append(f"gradients={gradients!r} {time.perf_counter() - start:.2f} s ({len(plan.segments)} segments "
                     f"at {harness.format_bytes(budget)})")
    return ("plan_checkpoints over the same 256 layers (segments of any length, repeat=3), measuring and choosing at "
            "the budget halfway between its minimum and its peak without checkpointing: " + "; ".join(parts) + ".")


def plot(points: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(points), figsize=(6 * len(points), 4.5), squeeze=False)
    for ax, (label, by_variant) in zip(axes[0], points.items()):
        for name, (time_ratio, peak_ratio) in by_variant.items():
            variant = name.removesuffix(", compiled")
            compiled = variant != name or variant in BUDGETED.values()
            ax.scatter(time_ratio, peak_ratio, s=40, marker="s" if compiled else "o")
            short = variant.split(")")[0] + ")"
            if variant in PLANNED.values():
                short += " " + variant.split(", ")[-1].split()[0]
            elif variant in BUDGETED.values():
                short += " " + variant.split("=")[-1]
            ax.annotate(short + (" compiled" if variant != name else ""), (time_ratio, peak_ratio),
                        textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_title(label)
        ax.set_xlabel("step time / (a) eager")
        ax.set_ylabel("step peak memory / (a) eager")
        ax.grid(alpha=0.3)
    legend = "; ".join((NONE, HF, TORCH_SAC, OURS, OURS_SAC, NATIVE, "(f) torch_ext op-level plans",
                        "(h) torch.compile, activation_memory_budget"))
    fig.suptitle("\n".join(textwrap.wrap("Selective checkpointing, CPU (squares: compiled): " + legend, 150)),
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)


def run(device: torch.device, quick: bool, command: str, compiled: bool = True) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    torch._inductor.config.fallback_random = True
    torch._dynamo.config.recompile_limit = 64  # each variant compiles the shared layer code once more
    columns = ["model", "variant", "step peak memory", "vs (a) peak", "step time", "vs (a) time", "grad diff vs (a)"]
    where = f"CUDA, {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "CPU"
    name = ("checkpoint_selective" + ("_cuda" if device.type == "cuda" else "") + ("" if compiled else "_eager")
            + ("_quick" if quick else ""))
    title = (f"Selective activation checkpointing of Hugging Face models, {'eager and compiled' if compiled else 'eager'} "
             f"({where})")
    report = harness.Report(name, title, columns, command)
    checks, points = [], {}
    for label, build in models(quick).items():
        run_model(label, build, quick, device, report, checks, points, compiled)
    report.notes.append("")
    report.notes.append(f"transformers {transformers.__version__}; {torch.get_num_threads()} torch thread(s). "
                        f"Policy of (c) and (e): torchtitan's (attention saved, every second matmul of a layer's "
                        f"forward saved); (g) the same choice through save='torchtitan', except where the model changes a "
                        f"matmul's output in place when no dispatch mode runs (torch's math attention adds its mask "
                        f"into the scores): the native policy recomputes that one, where torch's policy, under its "
                        f"dispatch mode, sees an out-of-place add and keeps it." + (
                            f" (h) draws dropout with Inductor's generator, so its gradients differ from (a)'s where "
                            f"the model has dropout. Compiled (f) rows: plans made with gradients='held' (the "
                            f"compiled backward returns every weight gradient before any is added into .grad); a "
                            f"budget below that minimum is refused. Plot: docs/{PLOT.name}." if compiled else
                            " No compiled rows (--eager-only)."))
    checks.append(scaling_check())
    report.notes.append(layer_planning_note())
    report.add_checks(checks)
    report.write()
    if not quick and device.type == "cpu":
        plot(points)
