"""Part "hf" of bench_checkpoint: Hugging Face GPT-2 and Llama (built from a config) training steps
with a padded batch, with their defaults (dropout, use_cache), eager and under torch.compile:

  (a) no checkpointing
  (b) Hugging Face's model.activation_checkpointing_enable() (transformers 5.23's name for
      gradient_checkpointing_enable, which now warns that it is deprecated)
  (c) torch.utils.checkpoint per decoder layer (use_reentrant=False), with use_cache=False: with the
      default cache its replay appends to the cache again and fails on a padded batch
  (d) torch_ext per decoder layer (torch_ext.checkpointing.hf.checkpoint_layers(model, every=1))
  (e) torch_ext planned at 50% and (f) 25% of (a)'s layer activation memory
      (checkpoint_layers(model, budget_bytes=..., inputs=batch))

Step: model(input_ids, attention_mask, labels).loss.backward(), gradients preallocated. Step peak:
the highest live memory above the step's start (torch_ext.memory): what the planner budgets (the
layers, the head and what is around them). Layers peak: the decoder layers alone, forward and
backward on the inputs they receive in the model. Grad diff: max |g - g_(a) eager| / max |g_(a)
eager| after one step from the same seed; compiled rows run with
torch._inductor.config.fallback_random, so their dropout draws the masks eager draws. Compiled: torch.compile(model), compiled once before timing. Step time: rounds of
every variant of a model (harness.measure_interleaved), then (d) against (b) in rounds of their
own, alternating which runs first, judged by a 95% sign-test interval on the per-round difference.
"""
from __future__ import annotations

import copy
import functools
import time
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import harness
from torch_ext.checkpointing import hf

NONE, HF, TORCH, OURS = ("(a) no checkpointing", "(b) Hugging Face activation_checkpointing_enable()",
                         "(c) torch.utils.checkpoint per layer", "(d) torch_ext per layer")
PLANNED = {0.5: "(e) torch_ext planned, 50% budget", 0.25: "(f) torch_ext planned, 25% budget"}


def models(quick: bool) -> dict[str, Callable[[], torch.nn.Module]]:
    import transformers

    layers, width, vocab, seq = (4, 64, 256, 32) if quick else (12, 256, 2048, 128)
    gpt2 = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=vocab, n_positions=seq)
    llama = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=width * 8 // 3,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                     max_position_embeddings=seq, pad_token_id=0)

    def build(model_class, config):
        torch.manual_seed(0)
        return model_class(config).train()

    return {f"GPT-2 ({layers} layers, width {width})": functools.partial(build, transformers.GPT2LMHeadModel, gpt2),
            f"Llama ({layers} layers, width {width})": functools.partial(build, transformers.LlamaForCausalLM, llama)}


def padded_batch(vocab: int, batch: int, seq: int, device) -> dict:
    """Right-padded rows: row i loses its last i * seq / (2 * batch) tokens."""
    ids = torch.randint(1, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row in range(batch):
        mask[row, seq - row * seq // (2 * batch):] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def torch_checkpoint_per_layer(model: torch.nn.Module) -> None:
    def checkpointed(forward, *args, **kwargs):
        return torch_checkpoint(forward, *args, use_reentrant=False, **kwargs)

    for layer in hf.repeated_layers(model):
        layer.forward = functools.partial(checkpointed, layer.forward)


def layers_peak(model: torch.nn.Module, recorded: list, device) -> int:
    """Peak memory of the decoder layers' forward and backward on the inputs recorded in the model."""
    layers = hf.repeated_layers(model)
    first_args, _ = recorded[0]
    hidden = first_args[0].detach().requires_grad_()

    def run():
        x = hidden
        for layer, (args, kwargs) in zip(layers, recorded):
            out = layer(x, *args[1:], **kwargs)
            x = out[0] if isinstance(out, tuple) else out
        x.backward(torch.ones_like(x))

    run()
    peak = harness.peak_memory(run, device)
    model.zero_grad(set_to_none=False)
    return peak


def variants(base: torch.nn.Module, batch: dict, device) -> tuple[dict, dict, dict, int, list]:
    """The eager models of (a)-(f) (copies of base), the plans, their budgets, (a)'s layer
    activation bytes and the layers' recorded inputs."""
    _, recorded = hf._record_layer_inputs(base, hf.repeated_layers(base), batch)
    built = {NONE: copy.deepcopy(base), HF: copy.deepcopy(base), TORCH: copy.deepcopy(base), OURS: copy.deepcopy(base)}
    built[HF].activation_checkpointing_enable()
    torch_checkpoint_per_layer(built[TORCH])
    # With the default cache, torch's replay appends to the cache the forward filled, and the
    # recomputed attention fails on a padded batch (keys of twice the mask's length).
    built[TORCH].config.use_cache = False
    hf.checkpoint_layers(built[OURS], every=1)
    activation = layers_peak(built[NONE], recorded, device)
    plans, budgets = {}, {}
    for fraction, name in PLANNED.items():
        model = copy.deepcopy(base)
        budgets[name] = int(activation * fraction)
        try:
            # The steps preallocate .grad: gradients added in place.
            plans[name] = hf.checkpoint_layers(model, budget_bytes=budgets[name], inputs=batch, gradients="accumulated")
        except ValueError as error:  # no placement fits: reported, not timed
            plans[name] = error
            continue
        built[name] = model
    return built, plans, budgets, activation, recorded


def run_model(label: str, build: Callable, quick: bool, device, report: harness.Report, checks: list) -> dict:
    base = build().to(device)
    config = base.config
    batch_size, seq = (2, config.max_position_embeddings) if quick else (4, config.max_position_embeddings)
    batch = padded_batch(config.vocab_size, batch_size, seq, device)
    built, plans, budgets, activation, recorded = variants(base, batch, device)
    steps, models_by_row, reference = {}, {}, None
    for name, model in built.items():
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        for compiled in (False, True):
            row = f"{name}, {'compiled' if compiled else 'eager'}"
            call = torch.compile(model) if compiled else model

            def step(call=call):
                call(**batch).loss.backward()
            steps[row], models_by_row[row] = step, model
    compile_seconds, grad_diffs, peaks = {}, {}, {}
    for row, step in steps.items():
        model = models_by_row[row]
        start = time.perf_counter()
        torch.manual_seed(5)
        step()  # compiles the compiled rows; the seed gives every row the same dropout masks
        compile_seconds[row] = time.perf_counter() - start
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).float().cpu()
        if reference is None:
            reference = grads
        grad_diffs[row] = ((grads - reference).abs().max() / reference.abs().max()).item()
        model.zero_grad(set_to_none=False)
        peaks[row] = harness.peak_memory(step, device)
        model.zero_grad(set_to_none=False)
    zero = {row: functools.partial(models_by_row[row].zero_grad, set_to_none=False) for row in steps}
    repeat, pair_repeat = (2, 4) if quick else (8, 20)
    timings = harness.measure_interleaved(steps, warmup=1, repeat=repeat, before_each=zero)
    layer_peaks = {name: layers_peak(model, recorded, device) for name, model in built.items()}

    base_time = timings[f"{NONE}, eager"].median_seconds
    for row, t in timings.items():
        name = row.rsplit(", ", 1)[0]
        plan = plans.get(name)
        report.add_row({
            "model": label, "variant": row, "step peak memory": harness.format_bytes(peaks[row]),
            "layers peak memory": harness.format_bytes(layer_peaks[name]) if row.endswith("eager") else "",
            "step time": f"{harness.format_seconds(t.median_seconds)} ±{t.spread:.0%}",
            "vs (a) eager": f"{t.median_seconds / base_time:.2f}x", "grad diff vs (a) eager": f"{grad_diffs[row]:.1e}",
            "checkpointed layers": str(plan.boundaries) if plan is not None else ("none" if name == NONE else "all"),
        }, step_peak_bytes=peaks[row], layers_peak_bytes=layer_peaks[name], step_seconds=t.median_seconds,
            timing=t, grad_max_rel_diff=grad_diffs[row], first_call_seconds=compile_seconds[row],
            budget_bytes=budgets.get(name), plan=plan.as_dict() if plan is not None else None)
    for mode in ("eager", "compiled"):
        b, d = f"{HF}, {mode}", f"{OURS}, {mode}"
        pair = harness.measure_interleaved({b: steps[b], d: steps[d]}, warmup=1, repeat=pair_repeat,
                                           before_each=zero, alternate=True)
        checks.append(harness.peak_and_time_check(f"{label}, {mode}", pair, peaks, d, b, ("(d)", "(b)")))
    for name, budget in budgets.items():
        plan = plans[name]
        if isinstance(plan, ValueError):
            checks.append((f"{label}: {name}: {plan}", False))
        else:
            step_peak = peaks[f"{name}, eager"]
            checks.append((f"{label}: {name} within its budget over the whole eager step and over the layers alone: "
                           f"step peak {harness.format_bytes(step_peak)}, layers peak "
                           f"{harness.format_bytes(layer_peaks[name])} <= {harness.format_bytes(budget)} (predicted "
                           f"{harness.format_bytes(plan.predicted_peak_bytes)})",
                           max(step_peak, layer_peaks[name]) <= budget))
    exact = all(grad_diffs[f"{name}, eager"] == 0 for name in built)
    checks.append((f"{label}: every eager variant's gradients equal (a)'s exactly (dropout on): "
                   f"{'yes' if exact else 'no'}", exact))
    return {"activation_bytes": activation, "batch": list(batch["input_ids"].shape),
            "first_call_seconds": compile_seconds}


def run(device: torch.device, quick: bool, command: str) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    torch._inductor.config.fallback_random = True
    # Every variant is a model of its own running the same code: each compiles the model's forward
    # once more (dynamo guards on the checkpointed forwards' identity), past the default limit of 8,
    # beyond which dynamo would silently run the rest eagerly.
    torch._dynamo.config.recompile_limit = 64
    columns = ["model", "variant", "step peak memory", "layers peak memory", "step time", "vs (a) eager",
               "grad diff vs (a) eager", "checkpointed layers"]
    where = f"CUDA, {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "CPU"
    name = "checkpoint_hf" + ("_cuda" if device.type == "cuda" else "") + ("_quick" if quick else "")
    report = harness.Report(name, f"Segment checkpointing of Hugging Face models, padded batches ({where})",
                            columns, command)
    checks, data = [], {}
    for label, build in models(quick).items():
        data[label] = run_model(label, build, quick, device, report, checks)
    report.notes.append("")
    report.notes.append(
        f"transformers {transformers.__version__}; {torch.get_num_threads()} torch thread(s). " + "; ".join(
            f"{label}: batch {tuple(d['batch'])}, (a)'s layer activations {harness.format_bytes(d['activation_bytes'])}"
            for label, d in data.items()) + ". Right-padded rows; labels -100 on padding. Compiled rows include "
        "nothing of their compile time (first call, in the JSON).")
    report.data = {"models": data}
    report.add_checks(checks)
    report.write()
