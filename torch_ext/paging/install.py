"""page_weights and unpage: a model's weights replaced by placeholders that hooks fill from a
LayerPager around each module's forward; state_dict() reads through the pager's source."""
from __future__ import annotations

import functools
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from .. import _C
from .placeholder import PagedParameter
from .source import LayerPager, SafetensorsSource
from .training import SavedWeightHooks

__all__ = ["page_weights", "unpage", "save_pageable", "is_paged", "pager_of"]

_STATE = "_torch_ext_paging"
_as_parameter = torch.Tensor._make_subclass  # nn.Parameter(t) without its Python __new__
# The hooks run as Python under torch.compile: Dynamo would otherwise compile each one once per
# module (its guards hold the module's checkpoint keys) until its recompile limit.
_eager = functools.partial(torch.compiler.disable, reason="torch_ext paging: a paged module's weights are acquired "
                           "from its pager around its forward, outside the graph (fullgraph=True cannot hold a "
                           "paged model)")


@dataclass
class _Slot:
    module: nn.Module
    attr: str
    kind: str  # "parameter" or "buffer"
    key: str   # checkpoint name


@dataclass
class _PagingState:
    pager: LayerPager
    slots: dict[nn.Module, list[_Slot]]
    placeholders: dict[str, torch.Tensor]      # key -> placeholder (shared by tied slots)
    requires_grad: dict[str, bool]             # key -> the original parameter's flag
    handles: list[Any] = field(default_factory=list)
    # key -> the tensor state_dict() returned for it, while someone holds it (tied names get one)
    stored: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)

    def stored_tensor(self, key: str) -> torch.Tensor:
        """The weight as stored: a zero-copy view of the source's file, or for a composition (experts
        stacked or weights dequantized while loading) a copy in the model's dtype (CPU; the budget
        is not used)."""
        t = self.stored.get(key)
        if t is None:
            source = self.pager.source
            t = source.view(key) if source.has_view(key) else source.load(key).to(self.placeholders[key].dtype)
            self.stored[key] = t
        return t


def _key_function(key_map, strip_prefix: str, add_prefix: str) -> Callable[[str], str]:
    if key_map is not None and (strip_prefix or add_prefix):
        raise ValueError("page_weights: pass key_map or strip_prefix/add_prefix, not both")
    if key_map is None:
        return lambda name: add_prefix + (name[len(strip_prefix):] if strip_prefix and name.startswith(strip_prefix)
                                          else name)
    if isinstance(key_map, Mapping):
        return lambda name: key_map.get(name, name)
    if callable(key_map):
        return key_map
    raise TypeError(f"page_weights: key_map must be a callable or a mapping, got {type(key_map).__name__}")


def is_paged(model: nn.Module) -> bool:
    return _STATE in model.__dict__


def pager_of(model: nn.Module) -> LayerPager:
    """The LayerPager a paged model's weights come from (its stats(), resident_bytes(), ...)."""
    state = model.__dict__.get(_STATE) if isinstance(model, nn.Module) else None
    if state is None:
        raise ValueError(f"pager_of: {type(model).__name__} is not paged (torch_ext.page_weights or load_paged)")
    return state.pager


def _refuse_accelerate_hooks(model: nn.Module, caller: str) -> None:
    """A model dispatched by accelerate (cpu_offload, disk_offload, device_map) moves its weights
    in its own hooks; paging it as well would fight them."""
    for name, module in model.named_modules():
        if hasattr(module, "_hf_hook"):
            where = f"module {name!r}" if name else f"the model ({type(model).__name__})"
            raise ValueError(
                f"{caller}: {where} has an accelerate hook (_hf_hook): the model is dispatched by accelerate "
                f"(cpu_offload, disk_offload or from_pretrained(device_map=...)), which moves its weights itself. "
                f"Page a model that accelerate has not dispatched: torch_ext.load_paged(folder, budget) builds one "
                f"from a Hugging Face folder, or remove the hooks first with "
                f"accelerate.hooks.remove_hook_from_module(model, recurse=True) (weights then on the meta device "
                f"are fine: they are paged from the file).")


def page_weights(model: nn.Module, source: SafetensorsSource | str | os.PathLike, budget_bytes: int | float | str, *,
                 pinned: Iterable[str] = (), buffers: bool = False,
                 key_map: Callable[[str], str] | Mapping[str, str] | None = None,
                 strip_prefix: str = "", add_prefix: str = "", **options: Any) -> LayerPager:
    """Page `model`'s parameters (and persistent buffers, with buffers=True) from a safetensors
    checkpoint within budget_bytes; returns the pager.

    Each tensor is replaced by a meta-device placeholder that holds no memory; a forward pre-hook
    on its module acquires it from the pager and a forward hook puts the placeholder back. A plain
    nn.Embedding on the CPU instead reads the rows it looks up from the file (LayerPager.gather_rows)
    and never loads its table, and a plain nn.Linear or transformers Conv1D whose weight converts
    multiplies from the file (LayerPager.matmul) when the budget has no room for it, or, for a
    widening conversion (bf16 served as fp32), whenever the budget is below the model; unpage() gives
    them their own forwards back. Tied
    weights are one pager entry. The checkpoint key of a tensor named `name` in the model is
    key_map(name) (a callable or mapping), else add_prefix + name with strip_prefix removed.
    pinned: parameter or module names whose tensors are never evicted. budget_bytes: an int or
    float of bytes, "1GB", "512MiB", "30%" (of the source's bytes) or a max_memory-style dict by
    device ({"cpu": "1GB"}). Other keyword options are the pager's (LayerPager: policy, prefetch,
    device, zero_copy, dtype, ...). Everything is validated before the model is changed.

    A floating-point tensor stored in another floating-point dtype than the model's is converted
    as it is paged in (the pager's dtype option, set from the model; all floating-point tensors
    convert to one dtype): the budget counts converted bytes, and converted tensors are copies
    where the others are views of the mapped file (zero_copy, the cpu default).

    Paged parameters become PagedParameter placeholders (meta storage; `device` reports the
    pager's device) with requires_grad=False: paged weights are frozen. Gradients flow through
    them to inputs and to resident parameters (adapters); in backward each weight is acquired again
    for the node that needs it (torch_ext.paging.training). state_dict() returns the stored
    weights as zero-copy views of the source's file. A model with accelerate hooks is refused."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"page_weights: model must be an nn.Module, got {type(model).__name__}")
    if is_paged(model):
        raise RuntimeError(f"page_weights: {type(model).__name__} is already paged; call torch_ext.unpage first")
    if isinstance(pinned, str):
        raise TypeError("page_weights: pinned must be an iterable of names, not a str")
    _refuse_accelerate_hooks(model, "page_weights")
    to_key = _key_function(key_map, strip_prefix, add_prefix)
    source = source if isinstance(source, SafetensorsSource) else SafetensorsSource(source)
    names_of, tensors = _named_tensors(model, buffers)
    key_of, floating = _checkpoint_keys(model, source, names_of, tensors, to_key)
    options.update(_conversion_options(model, source, floating, options))
    pinned_keys = _pinned_keys(model, pinned, {n: key_of[tid] for tid, names in names_of.items() for n in names})
    pager = LayerPager(source, budget_bytes=budget_bytes, pinned=pinned_keys, **options)
    # Validation is over: from here on nothing raises, so the model is never left half-paged.
    _install(model, pager, key_of, buffers)
    return pager


def _named_tensors(model: nn.Module, buffers: bool) -> tuple[dict[int, list[str]], dict[int, tuple]]:
    """Every name of every parameter (and persistent buffer), tied ones included, by tensor id;
    and each tensor with its kind."""
    names_of: dict[int, list[str]] = {}
    tensors: dict[int, tuple[torch.Tensor, str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
        tensors[id(p)] = (p, "parameter")
    if buffers:
        for module_name, module in model.named_modules(remove_duplicate=False):
            for attr, b in module._buffers.items():
                if b is None or attr in module._non_persistent_buffers_set:
                    continue
                names_of.setdefault(id(b), []).append(f"{module_name}.{attr}" if module_name else attr)
                tensors[id(b)] = (b, "buffer")
    return names_of, tensors


def _checkpoint_keys(model: nn.Module, source: SafetensorsSource, names_of: dict, tensors: dict,
                     to_key: Callable[[str], str]) -> tuple[dict[int, str], dict[str, torch.dtype]]:
    """The checkpoint key of each tensor, and the model's dtype of each floating-point one stored
    in a floating-point dtype (the pager converts those, see _conversion_options). Raises naming
    every tensor that is missing from the source, or stored with another shape or a dtype no
    conversion turns into the model's."""
    key_of: dict[int, str] = {}
    floating: dict[str, torch.dtype] = {}
    problems: list[str] = []
    for tid, names in names_of.items():
        tensor, kind = tensors[tid]
        keys = [to_key(n) for n in names]
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"page_weights: key_map must return str, got {keys!r} for {names!r}")
        key = next((k for k in keys if k in source), None)
        if key is None:
            problems.append(f"{kind} {names[0]!r} (checkpoint key {keys[0]!r}) is missing")
            continue
        stored = source.meta(key)
        if stored.dtype.is_floating_point and tensor.dtype.is_floating_point:
            floating[key] = tensor.dtype
        elif stored.dtype != tensor.dtype:
            problems.append(f"tensor {key!r} is {stored.dtype} in the file, {tensor.dtype} in the model ({names[0]})")
        if stored.shape != tensor.shape:
            problems.append(f"tensor {key!r} has shape {tuple(stored.shape)} in the file, "
                            f"{tuple(tensor.shape)} in the model ({names[0]})")
        key_of[tid] = key
    if problems:
        _refuse(model, source, problems)
    if not key_of:
        raise ValueError(f"page_weights: {type(model).__name__} has no parameters to page")
    return key_of, floating


def _refuse(model: nn.Module, source: SafetensorsSource, problems: list[str]) -> None:
    shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
    raise ValueError(f"page_weights: {source.path()} does not match {type(model).__name__}: {shown}")


def _conversion_options(model: nn.Module, source: SafetensorsSource, floating: dict[str, torch.dtype],
                        options: dict[str, Any]) -> dict[str, Any]:
    """The pager's dtype and keep_float32 options that serve each floating-point tensor in the
    model's dtype: none when the file holds the model's dtypes, else the model's dtype, with the
    tensors it keeps in float32 (a float16 T5's `wo`) listed. Options the caller gave are checked."""
    def served(key: str, dtype: Any, keep: set[str]) -> torch.dtype:
        if key in keep:
            return torch.float32
        return getattr(torch, dtype) if isinstance(dtype, str) else dtype or source.dtype(key)

    if "dtype" in options or "keep_float32" in options:
        dtype, keep, chosen = options.get("dtype"), set(options.get("keep_float32", ())), {}
    else:
        dtype, keep, chosen = None, set(), {}
        wanted = set(floating.values())
        if any(source.dtype(key) != want for key, want in floating.items()) and \
                (len(wanted) == 1 or (len(wanted) == 2 and torch.float32 in wanted)):
            dtype = (wanted - {torch.float32} or wanted).pop()
            keep = {key for key, want in floating.items() if want != dtype}
            chosen = {"dtype": dtype, "keep_float32": sorted(keep)}
    problems = [f"tensor {key!r} is {source.dtype(key)} in the file, {want} in the model, and the pager serves it in "
                f"{served(key, dtype, keep)}" for key, want in floating.items() if served(key, dtype, keep) != want]
    if problems:
        _refuse(model, source, problems + ["the pager converts floating-point tensors to one dtype (its dtype "
                                           "option), or to float32 (keep_float32)"])
    return chosen


def _pinned_keys(model: nn.Module, pinned: Iterable[str], name_to_key: dict[str, str]) -> list[str]:
    """The checkpoint keys of the tensors a pinned parameter or module name covers."""
    keys: set[str] = set()
    for p in pinned:
        matched = [k for n, k in name_to_key.items() if n == p or n.startswith(p + ".")]
        if not matched:
            raise ValueError(f"page_weights: pinned name {p!r} matches no parameter of {type(model).__name__}")
        keys.update(matched)
    return sorted(keys)


def _install(model: nn.Module, pager: LayerPager, key_of: dict[int, str], buffers: bool) -> None:
    """Replace the paged tensors by placeholders and hook each module that holds some."""
    slots: dict[nn.Module, list[_Slot]] = {}
    placeholders: dict[str, torch.Tensor] = {}
    requires_grad: dict[str, bool] = {}
    device = torch.device(str(pager.script_object.device))
    for module in model.modules():
        for kind, table in (("parameter", module._parameters), ("buffer", module._buffers if buffers else {})):
            for attr, t in table.items():
                if t is None or id(t) not in key_of:
                    continue
                key = key_of[id(t)]
                if key not in placeholders:
                    placeholders[key] = PagedParameter(t, device, key) if kind == "parameter" \
                        else torch.empty(t.shape, dtype=t.dtype, device="meta")
                    requires_grad[key] = t.requires_grad
                slots.setdefault(module, []).append(_Slot(module, attr, kind, key))
    for module, module_slots in slots.items():
        for slot in module_slots:
            table = module._parameters if slot.kind == "parameter" else module._buffers
            table[slot.attr] = placeholders[slot.key]

    state = _PagingState(pager, slots, placeholders, requires_grad)
    state.handles.append(model.register_forward_pre_hook(_eager(lambda module, args: pager.begin_pass()), prepend=True))
    hot = _C.paging.Pager(pager.script_object)  # acquire without torch.classes' boxed call, for the hooks
    saved = SavedWeightHooks(hot.acquire)
    for module, module_slots in slots.items():
        if _gathers_rows(module, module_slots, pager):
            state.handles.extend(_hook_embedding(module, module_slots[0], state))
        else:
            streamed = _streamed_weight(module, module_slots, pager)
            state.handles.extend(_hook_module(module, module_slots, state, hot.acquire_many, saved, streamed))
    model.__dict__[_STATE] = state


def _gathers_rows(module: nn.Module, module_slots: list[_Slot], pager: LayerPager) -> bool:
    """A plain nn.Embedding (no max_norm, which rewrites the table; no forward of its own set on
    the instance) whose table the pager can read rows of: its lookups need no whole table."""
    return (type(module) is nn.Embedding and module.max_norm is None and "forward" not in module.__dict__
            and len(module_slots) == 1 and module_slots[0].attr == "weight"
            and pager.script_object.gathers_rows(module_slots[0].key))


def _streamed_weight(module: nn.Module, module_slots: list[_Slot], pager: LayerPager) -> _Slot | None:
    """The weight of a plain nn.Linear or transformers' Conv1D (no forward of its own set on the
    instance) that the pager converts from the file's dtype: its products can stream from the file
    (LayerPager.matmul) instead of loading and converting the whole weight."""
    conv1d = type(module).__name__ == "Conv1D" and type(module).__module__ == "transformers.pytorch_utils"
    if not (type(module) is nn.Linear or conv1d) or "forward" in module.__dict__:
        return None
    weight = next((slot for slot in module_slots if slot.attr == "weight" and slot.kind == "parameter"), None)
    return weight if weight is not None and pager.script_object.streams(weight.key) else None


class _InstanceForward:
    """A forward set on one module instance, removed like a hook handle."""

    def __init__(self, module: nn.Module, forward: Callable) -> None:
        self.module = module
        module.forward = forward

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


def _hook_embedding(module: nn.Module, slot: _Slot, state: _PagingState) -> list[Any]:
    """An embedding lookup reads its rows from the file (converted to the served dtype) instead of
    loading the whole table: for a 50k-token vocabulary that is the model's largest tensor, and a
    bf16 checkpoint served as fp32 would otherwise convert all of it for a few rows."""
    gather_rows = state.pager.script_object.gather_rows
    placeholder = state.placeholders[slot.key]

    def forward(input: torch.Tensor) -> torch.Tensor:
        if placeholder.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"paged parameter {slot.key!r} (Embedding.weight) requires grad: paged weights are "
                               f"frozen; train adapters over them, or torch_ext.unpage the model to train its weights")
        return gather_rows(slot.key, input)

    return [_InstanceForward(module, _eager(forward))] + _state_dict_hooks(module, [slot], state)


def _hook_module(module: nn.Module, module_slots: list[_Slot], state: _PagingState,
                 acquire_many: Callable[[list[str]], tuple], saved: SavedWeightHooks, streamed: _Slot | None
                 ) -> list[Any]:
    """The hooks of one module holding paged tensors: acquire around its forward (and save those
    weights for backward by key), and _state_dict_hooks. With a `streamed` weight, a forward that
    autograd does not need the weight for streams it instead (_streaming_forward)."""
    placeholders = state.placeholders
    keys = [slot.key for slot in module_slots]

    def pre_hook(module, args):
        grad = torch.is_grad_enabled()
        if grad:
            for slot in module_slots:
                if placeholders[slot.key].requires_grad:
                    raise RuntimeError(f"paged parameter {slot.key!r} ({type(module).__name__}.{slot.attr}) requires "
                                       f"grad: paged weights are frozen; train adapters over them, or "
                                       f"torch_ext.unpage the model to train its weights")
        if streamed is not None and not (grad and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
            return  # the weights stay placeholders: the forward streams them
        acquired = acquire_many(keys)
        for slot, t in zip(module_slots, acquired):
            if slot.kind == "parameter":
                module._parameters[slot.attr] = _as_parameter(nn.Parameter, t, False)
            else:
                module._buffers[slot.attr] = t
        saved.push(module, list(zip(keys, acquired)))

    def post_hook(module, args, output):
        saved.pop(module)
        for slot in module_slots:
            table = module._parameters if slot.kind == "parameter" else module._buffers
            table[slot.attr] = placeholders[slot.key]

    handles = [module.register_forward_pre_hook(_eager(pre_hook)),
               module.register_forward_hook(_eager(post_hook), always_call=True)]
    if streamed is not None:
        handles.append(_streaming_forward(module, module_slots, streamed, state))
    return handles + _state_dict_hooks(module, module_slots, state)


def _streaming_forward(module: nn.Module, module_slots: list[_Slot], streamed: _Slot,
                       state: _PagingState) -> _InstanceForward:
    """A forward that computes the product with LayerPager.matmul while the weight is still a
    placeholder (the pre-hook left it), and the class's forward over the acquired weights otherwise."""
    matmul, acquire = state.pager.script_object.matmul, state.pager.script_object.acquire
    placeholder = state.placeholders[streamed.key]
    bias = next((slot for slot in module_slots if slot.attr == "bias" and slot.kind == "parameter"), None)
    transposed = type(module) is not nn.Linear  # Conv1D stores (in, out)
    class_forward = type(module).forward

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        if module._parameters["weight"] is not placeholder:
            return class_forward(module, *args, **kwargs)
        (input,) = args + tuple(kwargs.values())  # Linear's `input`, Conv1D's `x`
        return matmul(streamed.key, input, acquire(bias.key) if bias is not None else module.bias, transposed)

    return _InstanceForward(module, _eager(forward))


def _state_dict_hooks(module: nn.Module, module_slots: list[_Slot], state: _PagingState) -> list[Any]:
    """Stored weights in state_dict(); load_state_dict() refused."""

    def state_dict_hook(module, state_dict, prefix, local_metadata):
        for slot in module_slots:
            entry = state_dict.get(prefix + slot.attr)
            if isinstance(entry, torch.Tensor) and entry.is_meta:
                state_dict[prefix + slot.attr] = state.stored_tensor(slot.key)

    def load_state_dict_hook(module, state_dict, prefix, *args):
        names = [prefix + slot.attr for slot in module_slots if prefix + slot.attr in state_dict]
        if names:
            raise RuntimeError(f"load_state_dict: {names[0]!r} is paged from {state.pager.source.path()}: a paged "
                               f"model's weights are that file's; torch_ext.unpage the model first, or page it from "
                               f"a file holding the new weights")

    return [module.register_state_dict_post_hook(state_dict_hook),
            module.register_load_state_dict_pre_hook(load_state_dict_hook)]


def unpage(model: nn.Module) -> nn.Module:
    """Make a paged model resident again (on the pager's device); returns the model."""
    state: _PagingState | None = model.__dict__.get(_STATE)
    if state is None:
        raise ValueError(f"unpage: {type(model).__name__} is not paged")
    loaded: dict[str, torch.Tensor] = {}
    for key, placeholder in state.placeholders.items():  # load all first: a failure changes nothing
        t = state.pager.acquire(key)
        loaded[key] = nn.Parameter(t, requires_grad=state.requires_grad[key]) \
            if isinstance(placeholder, nn.Parameter) else t
    for handle in state.handles:
        handle.remove()
    for module, module_slots in state.slots.items():
        for slot in module_slots:
            table = module._parameters if slot.kind == "parameter" else module._buffers
            table[slot.attr] = loaded[slot.key]
    del model.__dict__[_STATE]
    return model


def save_pageable(model: nn.Module, path: str | os.PathLike, *, metadata: Mapping[str, str] | None = None) -> None:
    """Write model's weights as a safetensors file (the safetensors package; tied weights once)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_pageable: model must be an nn.Module, got {type(model).__name__}")
    if is_paged(model):
        raise ValueError(f"save_pageable: {type(model).__name__} is paged; its weights are already in "
                         f"{model.__dict__[_STATE].pager.source.path()} (torch_ext.unpage it to save elsewhere)")
    try:
        from safetensors.torch import save_model
    except ImportError as error:  # pragma: no cover - a pinned requirement
        raise RuntimeError("save_pageable needs the safetensors package (pip install safetensors==0.8.0)") from error
    save_model(model, os.fspath(path), metadata=dict(metadata or {"format": "pt"}))
