"""Hugging Face models with torch_ext's checkpointing. transformers is not imported here: these
functions work on the model objects you pass.

    torch_ext.checkpointing.hf.gradient_checkpointing_enable(model)        their path, our function
    torch_ext.checkpointing.hf.checkpoint_layers(model, every=2)           every other layer
    torch_ext.checkpointing.hf.checkpoint_layers(model, budget_bytes=B, inputs={"input_ids": ids, ...})

The first keeps Hugging Face's own gradient checkpointing (their layers turn caching off in
training, with their warning, and enable input gradients) and has it call torch_ext's checkpoint
instead of torch.utils.checkpoint's. The second checkpoints the repeated layers with
torch_ext.checkpoint directly, chosen by every=k or by a plan for a byte budget measured on the
model's real inputs: each layer receives, in one recorded forward, its attention mask, position
ids and rotary embeddings, and the planner measures it on exactly those.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .. import memory
from .api import _is_hf_cache, checkpoint, checkpoint_call, checkpoint_options, _pop_torch_keywords
from .chains import _PLANNED_POLICY
from .measuring import _storage_bytes, _tensor_leaves, _trainable_parameters
from .op_planner import OpPlan, plan_recorded_ops
from .planner import CheckpointPlan, _planning_gradients, plan_recorded_layers

__all__ = ["gradient_checkpointing_enable", "checkpoint_layers", "repeated_layers"]


def _is_checkpointing_layer(module: nn.Module) -> bool:
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)


def gradient_checkpointing_enable(model: nn.Module, *, every_n_layers: int = 1,
                                  gradient_checkpointing_kwargs: Optional[dict] = None, **options: Any) -> nn.Module:
    """model.gradient_checkpointing_enable(every_n_layers=...) with torch_ext's checkpoint as the
    function Hugging Face calls for each checkpointed layer; options are torch_ext.checkpoint's
    (context_fn included: a selective checkpointing policy, as TRL injects into Hugging Face's
    gradient_checkpointing_kwargs). gradient_checkpointing_kwargs: Hugging Face's spelling, the
    keywords of torch.utils.checkpoint.checkpoint as checkpoint_call takes them (use_reentrant and
    debug accepted and ignored, determinism_check "default", context_fn) or torch_ext's options.
    Returns the model."""
    if not hasattr(model, "gradient_checkpointing_enable"):
        raise TypeError(f"gradient_checkpointing_enable: {type(model).__name__} is not a Hugging Face model "
                        f"(it has no gradient_checkpointing_enable method)")
    kwargs = dict(gradient_checkpointing_kwargs or {})
    if set(kwargs) & set(options):
        raise TypeError(f"gradient_checkpointing_enable: {sorted(set(kwargs) & set(options))} given both as "
                        f"options and in gradient_checkpointing_kwargs")
    _pop_torch_keywords("gradient_checkpointing_enable", kwargs)
    options = {**kwargs, **options}
    checkpoint_options("gradient_checkpointing_enable", **options)  # validated before the model changes
    # transformers 5.23 renamed it activation_checkpointing_enable (the old name warns)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    if "every_n_layers" in inspect.signature(enable).parameters:
        enable(every_n_layers=every_n_layers)
    elif every_n_layers != 1:
        raise TypeError("gradient_checkpointing_enable: this transformers version has no every_n_layers")
    else:
        enable()
    function = functools.partial(checkpoint_call, **options)
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = function
    return model


def _uses_hugging_faces_checkpointing(model: nn.Module) -> bool:
    # transformers 5.23 renamed is_gradient_checkpointing is_activation_checkpointing (the old name warns)
    name = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    return bool(getattr(model, name, False))


def repeated_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated layers, the ones Hugging Face's gradient checkpointing checkpoints: every
    GradientCheckpointingLayer held in an nn.ModuleList, in the order the model registers them (an
    encoder-decoder's encoder layers, then its decoder's; none inside another), or else, for a model
    without them, the longest nn.ModuleList of modules of one class."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    # keyed by id, in order: a layer held by two lists (shared weights) counts once
    hf_layers = list({id(layer): layer for m in lists if all(_is_checkpointing_layer(layer) for layer in m)
                      for layer in m}.values())
    if hf_layers:
        inner = {id(sub) for layer in hf_layers for sub in layer.modules() if sub is not layer}
        return [layer for layer in hf_layers if id(layer) not in inner]
    uniform = [m for m in lists if len({type(layer) for layer in m}) == 1]
    if not uniform:
        raise ValueError(f"repeated_layers: {type(model).__name__} has no nn.ModuleList of repeated layers")
    return list(max(uniform, key=len))


def checkpoint_layers(model: nn.Module, *, every: Optional[int] = None, budget_bytes: Optional[int] = None,
                      inputs: Optional[dict] = None, ops: bool = False, repeat: int = 2,
                      gradients: Optional[str] = None, progress: Optional[Callable] = None,
                      **options: Any) -> list[int] | CheckpointPlan | OpPlan:
    """Checkpoint the model's repeated layers (repeated_layers(model): an encoder-decoder's in both
    stacks) with torch_ext.checkpoint (options: its options).

    every=k: layers 0, k, 2k, ... of repeated_layers(model); returns their indices. budget_bytes=B:
    runs model(**inputs) once (in the model's current mode, without grad) recording what each layer
    receives, measures each layer's forward and backward on it, and what the model's head and loss
    need after the layers and what the code around them holds (one more call with the layers run
    without grad: CheckpointPlan.head_bytes and around_bytes), and checkpoints the layers a plan of
    least recompute chooses so that the step's peak above what is in use before it (parameters,
    .grad) stays within B bytes, the layers taken in the order that forward runs them; returns the
    CheckpointPlan.
    budget_bytes=B with ops=True: an op-level plan instead (torch_ext.plan_ops, measured the same
    way): the layers the plan checkpoints save the ops it chooses
    (through the native policy, save=), the others are left unwrapped; returns the OpPlan. gradients (with
    budget_bytes): the planners' option, "held" by default (the step starts with .grad None, as
    after optimizer.zero_grad() or Trainer's, or the whole model is compiled); the gradients of the
    model's parameters outside the layers (its embeddings and head) then count as held through
    every layer's backward too. "accumulated" for a loop that keeps .grad allocated.
    Hugging Face's own gradient checkpointing must be off (the layers would be checkpointed twice)."""
    if (every is None) == (budget_bytes is None):
        raise ValueError("checkpoint_layers: give exactly one of every or budget_bytes")
    if ops and budget_bytes is None:
        raise ValueError("checkpoint_layers: ops=True plans under a budget; give budget_bytes, not every")
    gradients = _planning_gradients(gradients, budget_bytes, "checkpoint_layers")
    if _uses_hugging_faces_checkpointing(model):
        disable = ("activation_checkpointing_disable" if hasattr(model, "activation_checkpointing_disable")
                   else "gradient_checkpointing_disable")  # transformers 5.23's name; the old one warns
        raise ValueError(f"checkpoint_layers: {type(model).__name__} already uses Hugging Face's gradient "
                         f"checkpointing; call model.{disable}() first")
    resolved = checkpoint_options("checkpoint_layers", **options)  # validated before the model changes
    layers = repeated_layers(model)
    if every is not None:
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint_layers: every must be a positive int, got {every!r}")
        chosen = list(range(0, len(layers), every))
        for i in chosen:
            checkpoint(layers[i], **options)
        return chosen
    if not isinstance(inputs, dict) or not inputs:
        raise ValueError("checkpoint_layers: budget_bytes needs inputs, the keyword arguments of one model call "
                         "(input_ids, attention_mask, ...), to measure the layers on")
    if resolved.chooses_ops:
        raise ValueError(f"checkpoint_layers: {_PLANNED_POLICY}")
    inside = {id(p) for layer in layers for p in layer.parameters()}
    other = sum(p.nbytes for p in _trainable_parameters(model) if id(p) not in inside)
    if ops and options:
        raise ValueError(f"checkpoint_layers: ops=True takes no options (the plan sets each layer's save "
                         f"and measures with keep storage), got {sorted(options)}")
    layers, recorded = _record_layer_inputs(model, layers, inputs)
    around, head = _around_and_head(model, layers, inputs, gradients) or (0, None)
    if ops:
        op_plan = plan_recorded_ops(layers, recorded, budget_bytes, repeat, progress, gradients=gradients,
                                    other_gradient_bytes=other, head_bytes=head, around_bytes=around)
        op_plan.apply(layers)
        return op_plan
    storage = resolved.script.storage
    plan = plan_recorded_layers(layers, recorded, budget_bytes, storage, repeat, progress, gradients, other, head,
                                around)
    for start, _, checkpointed in plan.segments:
        if checkpointed:
            checkpoint(layers[start], **options)
    return plan


def _record_layer_inputs(model: nn.Module, layers: Sequence[nn.Module],
                         inputs: dict) -> tuple[list[nn.Module], list[tuple[tuple, dict]]]:
    """The layers in the order one forward of model(**inputs) first runs them, and the (args, kwargs)
    each receives in it, caches dropped (a checkpointed layer runs without one in training)."""
    recorded: list = [None] * len(layers)
    order: list[int] = []

    def record(index):
        def hook(module, args, kwargs):
            args = tuple(None if _is_hf_cache(a) else a for a in args)
            kwargs = {k: (None if _is_hf_cache(v) else v) for k, v in kwargs.items()}
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            if recorded[index] is None:
                order.append(index)
            recorded[index] = (args, kwargs)
        return hook

    handles = [layer.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i, r in enumerate(recorded) if r is None]
    if missing:
        raise ValueError(f"checkpoint_layers: layers {missing} did not run in model(**inputs)")
    return [layers[i] for i in order], [recorded[i] for i in order]


def _around_and_head(model: nn.Module, layers: Sequence[nn.Module], inputs: dict,
                     gradients: str) -> Optional[tuple[int, int]]:
    """What a step of the model holds besides its layers' boundaries and what they keep (the plan
    counts those), as (around, head). around: what stays through the layers' backward, the code
    around them keeps (masks, rotary tables, the embeddings' saved tensors: the figure when the
    last layer's output is made, above the one before the step, less the layers' boundaries and
    that output) and, with gradients "accumulated", the head's gradients of parameters used before
    it too (tied embeddings: autograd holds one until the parameter's other gradients arrive; with
    "held" the plan counts every gradient outside the layers as held already). head: the peak from the
    moment that output is made until backward has brought its gradient back (the final norm, head
    and loss, forward and backward, parameter gradients held as `gradients` says: .grad allocated
    beforehand, or None), above the figure before the step less the boundaries.

    One call of model(**inputs) (no cache: a checkpointed layer runs without one) with the layers
    run without grad and the code around them with it, each layer's arguments held to the end as a
    step's graph holds them; backward from its loss where it computes one (labels given), else
    from the sum of its first floating-point output, the outputs dropped first, as in
    `model(**inputs).loss.backward()`. None where that cannot be told: the last layer runs again
    after its first call (a layer shared across depths), or nothing after it needs a gradient. The
    model's .grad, buffers and random state are as they were."""
    device = next((t.device for t in _tensor_leaves(inputs)), torch.device("cpu"))
    probe = _HeadProbe(layers, device)
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs = {**inputs, "use_cache": False}
    params = [p for p in model.parameters() if p.requires_grad]
    kept_grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    handles = probe.install(model, params)
    devices = sorted({t.device.index or 0 for t in _tensor_leaves(inputs) if t.device.type == "cuda"})
    try:
        for p in params:
            p.grad = torch.zeros_like(p) if gradients == "accumulated" else None
        begin = memory.stats(device).current_bytes
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            out = model(**inputs)
            loss = getattr(out, "loss", None)
            if loss is None:
                loss = next((t.sum() for t in _tensor_leaves(out) if t.is_floating_point()), None)
            del out
            if len(probe.marked) != 2 or loss is None or not loss.requires_grad:
                return None
            loss.backward()
        return probe.figures(begin, params if gradients == "accumulated" else [])
    finally:
        for handle in handles:
            handle.remove()
        for p, g in zip(params, kept_grads):
            p.grad = g
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


class _HeadProbe:
    """_around_and_head's hooks: each layer runs without grad (the code around it with grad), its
    arguments held; the last layer's output is replaced by leaves that stand for it, where the
    peak is reset; which modules ran before that, and which parameters the head's backward gave a
    gradient."""

    def __init__(self, layers: Sequence[nn.Module], device: torch.device) -> None:
        self.layers, self.device = layers, device
        self.arguments: list = []
        self.marked: list = []  # the leaves standing for the last layer's output, the figure then
        self.ran: dict = {}  # the modules that ran before the mark, by id
        self.graded: set = set()  # ids of the parameters the head's backward gave a gradient

    def install(self, model: nn.Module, params: list) -> list:
        layer_ids = {id(layer) for layer in self.layers}
        handles = [layer.register_forward_pre_hook(self.before, with_kwargs=True) for layer in self.layers]
        handles += [layer.register_forward_hook(self.after, with_kwargs=True) for layer in self.layers]
        handles += [module.register_forward_pre_hook(self.seen) for module in model.modules()
                    if id(module) not in layer_ids]
        handles += [p.register_post_accumulate_grad_hook(lambda p: self.graded.add(id(p))) for p in params]
        return handles

    def seen(self, module, args) -> None:
        if not self.marked:
            self.ran[id(module)] = module

    def before(self, module, args, kwargs) -> None:
        self.arguments.append((args, kwargs))
        self.ran[id(module)] = module
        torch.set_grad_enabled(False)  # nothing of the layer's own is held (enable_grad restores the mode)

    def after(self, module, args, kwargs, output):
        torch.set_grad_enabled(True)
        leaves: list[torch.Tensor] = []
        output = pytree.tree_map(lambda t: leaves.append(t.detach().requires_grad_()) or leaves[-1]
                                 if isinstance(t, torch.Tensor) and t.is_floating_point() else t, output)
        if module is self.layers[-1]:
            if self.marked:  # the last layer again: its first call did not end the layers
                self.marked.append(None)
            memory.reset_peak(self.device)
            self.marked.extend([leaves, memory.stats(self.device).current_bytes])
        return output

    def figures(self, begin: int, params: list) -> tuple[int, int]:
        """(around, head) as _around_and_head says, the tied gradients among params counted."""
        leaves, mark = self.marked
        output = _storage_bytes(leaves, set())
        boundaries = _storage_bytes([_tensor_leaves(args)[0] for args, _ in self.arguments if _tensor_leaves(args)],
                                    set())
        used_before = {id(p) for module in self.ran.values() for p in module.parameters(recurse=False)}
        tied = sum(p.nbytes for p in params if id(p) in self.graded and id(p) in used_before)
        head = memory.stats(self.device).peak_bytes - begin - boundaries
        return max(0, mark - begin - boundaries - output) + tied, max(0, head)
