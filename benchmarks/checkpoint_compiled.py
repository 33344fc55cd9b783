"""bench_checkpoint.py's compiled part: do op-level plans keep their saving decisions under torch.compile?

On Hugging Face GPT-2 and Llama (checkpoint_hf.models, padded batches, dropout on), each variant's
training step runs eager and compiled (torch.compile of the whole model), parameter gradients
preallocated:
  (a) no checkpointing
  (b) every decoder layer checkpointed (hf.gradient_checkpointing_enable)
  (f) op-level plans at 25%, 50% and 75% of (a)'s layer activation memory
      (hf.checkpoint_layers(model, budget_bytes=..., inputs=batch, ops=True))
  (f) the same budgets planned with gradients="held" (..., ops=True, gradients="held"): for a
      backward that holds every parameter gradient until it ends, as the whole model compiled does
Measured: the layers' peak in eager (checkpoint_hf.layers_peak: the memory a plan budgets), the
bytes the forward keeps for backward (live memory after the forward, above its start) and the
step's peak (torch_ext.memory.track), eager, compiled, and with each decoder layer compiled in
place (torch's regional compilation). A compiled backward is one graph that returns every weight
gradient together before they are added into .grad (docs/checkpoint.md), so the whole model's
compiled step can peak above eager's by up to the weights' bytes; compiled layer by layer, each
backward graph returns one layer's gradients. Plans for gradients added in place are checked in
eager and layer by layer compiled; plans for held gradients with the whole model compiled.
"""
from __future__ import annotations

import copy

import torch

import harness
from checkpoint_hf import layers_peak, models, padded_batch
from torch_ext import memory
from torch_ext.checkpointing import hf

FRACTIONS = (0.25, 0.5, 0.75)


def kept_and_peak(model: torch.nn.Module, batch: dict, compiled: str) -> tuple[int, int]:
    """(bytes the forward keeps for backward, the step's peak above its start), second run.
    compiled: "" (eager), "model" (torch.compile of the whole model) or "layers" (each decoder
    layer compiled in place, torch's regional compilation: the model stays compiled after)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    step = torch.compile(model) if compiled == "model" else model
    if compiled == "layers":
        for layer in hf.repeated_layers(model):
            layer.compile()
    for _ in range(2):  # the first compiles
        torch.manual_seed(5)
        start = memory.stats().current_bytes
        with memory.track() as tracked:
            loss = step(**batch).loss
            kept = memory.stats().current_bytes - start
            loss.backward()
    return kept, tracked.peak_delta_bytes


def run_model(label: str, build, quick: bool, device, report: harness.Report, checks: list) -> None:
    base = build().to(device)
    batch = padded_batch(base.config.vocab_size, 2 if quick else 4, base.config.max_position_embeddings, device)
    _, recorded = hf._record_layer_inputs(base, hf.repeated_layers(base), batch)
    unplanned = layers_peak(copy.deepcopy(base), recorded, device)
    variants: dict[str, tuple[torch.nn.Module, int | None]] = {"(a) no checkpointing": (copy.deepcopy(base), None)}
    every = copy.deepcopy(base)
    hf.gradient_checkpointing_enable(every)
    variants["(b) every layer checkpointed"] = (every, None)
    short = label.split(" (")[0]
    for gradients in ("accumulated", "held"):
        for fraction in FRACTIONS:
            model, budget = copy.deepcopy(base), int(fraction * unplanned)
            name = f"(f) op-level plan at {fraction:.0%}" + (", gradients held" if gradients == "held" else "")
            try:
                hf.checkpoint_layers(model, budget_bytes=budget, inputs=batch, ops=True, repeat=2, gradients=gradients)
            except ValueError as error:  # below the minimum: said, not measured
                report.notes.append(f"{label}, {name[4:]}: {error}")
                checks.append((f"{short} {name[4:]}: no plan runs over the budget: the planner refuses "
                               f"{harness.format_bytes(budget)}, stating its minimum (below)", gradients == "held"))
                continue
            variants[name] = (model, budget)
    weights = sum(p.numel() * p.element_size() for p in base.parameters())
    for name, (model, budget) in variants.items():
        progress = harness.progress(f"{label}, {name}")
        held = name.endswith("gradients held")
        layers = layers_peak(model, recorded, device)
        (kept, peak), (kept_c, peak_c) = (kept_and_peak(model, batch, compiled) for compiled in ("", "model"))
        # Held-gradient plans are for the whole model compiled, not layer by layer.
        peak_l = None if held else kept_and_peak(model, batch, "layers")[1]
        torch._dynamo.reset()
        progress("measured")
        report.add_row({"model": label, "variant": name,
                        "budget": harness.format_bytes(budget) if budget else "-",
                        "layers peak (eager)": harness.format_bytes(layers),
                        "kept for backward: eager": harness.format_bytes(kept),
                        "compiled": harness.format_bytes(kept_c),
                        "step peak: eager": harness.format_bytes(peak),
                        "compiled ": harness.format_bytes(peak_c),
                        "layers compiled": harness.format_bytes(peak_l) if peak_l is not None else "-"},
                       model=label, variant=name, budget=budget, layers_peak=layers, kept=kept, kept_compiled=kept_c,
                       peak=peak, peak_compiled=peak_c, peak_layers_compiled=peak_l, weights=weights)
        if not budget:
            continue
        plan = f"{short} {name[4:]}"
        checks.append((f"{plan}: layers peak within the budget in eager ({harness.format_bytes(layers)} vs "
                       f"{harness.format_bytes(budget)})", layers <= budget))
        checks.append((f"{plan}: compiled, the forward keeps for backward at most 5% more than eager "
                       f"({harness.format_bytes(kept_c)} vs {harness.format_bytes(kept)})", kept_c <= 1.05 * kept))
        if held:
            checks.append((f"{plan}: the whole model compiled, step peak within the plan's budget "
                           f"({harness.format_bytes(peak_c)} vs {harness.format_bytes(budget)})", peak_c <= budget))
            continue
        checks.append((f"{plan}: each layer compiled, step peak within the plan's budget "
                       f"({harness.format_bytes(peak_l)} vs {harness.format_bytes(budget)})", peak_l <= budget))
        checks.append((f"{plan}: the whole model compiled, step peak within eager's + the weights' bytes "
                       f"({harness.format_bytes(peak_c)} vs {harness.format_bytes(peak)} + "
                       f"{harness.format_bytes(weights)}; plan with gradients='held' to bound it by the budget)",
                       peak_c <= peak + weights))


def run(device: torch.device, quick: bool, command: str) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    torch._inductor.config.fallback_random = True
    where = f"CUDA, {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "CPU"
    name = "checkpoint_compiled" + ("_cuda" if device.type == "cuda" else "") + ("_quick" if quick else "")
    columns = ["model", "variant", "budget", "layers peak (eager)", "kept for backward: eager", "compiled",
               "step peak: eager", "compiled ", "layers compiled"]
    report = harness.Report(name, f"Op-level checkpoint plans under torch.compile ({where})", columns, command)
    checks: list = []
    for label, build in models(quick).items():
        run_model(label, build, quick, device, report, checks)
    report.notes.append("")
    report.notes.append(
        f"transformers {transformers.__version__}; {torch.get_num_threads()} torch thread(s). Budgets: a fraction of "
        f"(a)'s layer activation memory (the decoder layers' forward and backward on the inputs the model gives them). "
        f"Kept for backward: live memory after the forward above its start (saved activations, the loss). Step "
        f"peak: one forward and backward, gradients preallocated; a compiled backward returns the weight gradients "
        f"together before they are added into .grad, so its peak may add up to the weights' bytes (compiled: the "
        f"whole model, one graph). Layers compiled: each decoder layer compiled in place (torch's regional "
        f"compilation), the rest eager: a layer's backward graph returns that layer's gradients only.")
    report.add_checks(checks)
    report.write()
