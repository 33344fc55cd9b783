"""Weight paging: run models whose weights do not fit in memory, loading them from safetensors
files on demand within a byte budget.

    source = torch_ext.SafetensorsSource("model.safetensors")     # or an index.json / folder
    pager = torch_ext.page_weights(model, source, budget_bytes=2**30)
    model(x)                       # each module's weights are acquired just before its forward
    pager.stats()                  # hits, misses, evictions, bytes_loaded, stall_seconds, ...
    torch_ext.unpage(model)        # resident again

The pager itself (C++: torch_ext::paging::LayerPager) is torch.classes.torch_ext.LayerPager;
LayerPager and SafetensorsSource here are thin Python wrappers over those classes (their
`script_object` is what TorchScript code takes).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from ._script import ScriptObjectFace

__all__ = ["SafetensorsSource", "LayerPager", "page_weights", "unpage", "save_pageable", "is_paged"]

_STATE = "_torch_ext_paging"


class SafetensorsSource(ScriptObjectFace):
    """A .safetensors file, a sharded checkpoint's model.safetensors.index.json, or a folder holding
    either; validated completely when opened (errors name the file and the tensor).

    The object is torch.classes.torch_ext.SafetensorsSource: names(), meta(name) (a meta tensor
    with the stored dtype and shape), nbytes(name), view(name) (zero-copy), load(name) (a copy),
    files(), metadata(), total_bytes(), path(), len() and `in`. Keyword options are those of the
    C++ SourceOptions (direct_io: read with O_DIRECT, bypassing the page cache)."""

    def __init__(self, path: str | os.PathLike, **options: Any) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"SafetensorsSource: path must be a str or os.PathLike, got {type(path).__name__}")
        self.script_object = torch.classes.torch_ext.SafetensorsSource(os.fspath(path), **options)

    def dtype(self, name: str) -> torch.dtype:
        return self.script_object.meta(name).dtype

    def shape(self, name: str) -> torch.Size:
        return self.script_object.meta(name).shape

    def __len__(self) -> int:
        return len(self.script_object)

    def __contains__(self, name: str) -> bool:
        return name in self.script_object


class LayerPager(ScriptObjectFace):
    """Keeps a source's tensors resident within a byte budget (csrc/torch_ext/paging/layer_pager.h).

    The object is torch.classes.torch_ext.LayerPager: acquire(id) returns the tensor (valid while
    you hold it; the pager never evicts a tensor someone holds, a pinned one, or one being loaded),
    acquire_many(ids), begin_pass(), set_order(ids), order(), resident_bytes(), resident_count(),
    is_resident(id), is_pinned(id), evict_all(), stats() (a PagerStats), reset_stats(), and each
    option as a property. source: a SafetensorsSource or the path of one. Keyword options are those
    of the C++ PagerOptions: budget_bytes (an int or float of bytes, or "1GB", "512MiB", "30%"),
    pinned, policy, prefetch, device, zero_copy, own_buffers, wait_timeout_seconds. Thread-safe and
    fork-safe (docs/paging.md)."""

    def __init__(self, source: SafetensorsSource | str | os.PathLike, **options: Any) -> None:
        self.source = source if isinstance(source, SafetensorsSource) else SafetensorsSource(source)
        options = {name: _as_script_value(value) for name, value in options.items()}
        self.script_object = torch.classes.torch_ext.LayerPager(self.source.script_object, **options)
        stats = self.script_object.stats()
        if stats.budget_below_largest_tensor:  # C++ warns on stderr (TORCH_WARN); Python users get a warning
            warnings.warn(f"LayerPager({self.source.path()}): budget_bytes={self.script_object.budget_bytes} is "
                          f"smaller than the largest tensor ({stats.largest_tensor_bytes} bytes): loading it "
                          f"exceeds the budget (stats: budget_below_largest_tensor)", UserWarning, stacklevel=2)


def _as_script_value(value: Any) -> Any:
    """TorchScript carries 64-bit ints only: a larger int goes to C++ as its decimal text, which the
    option's own parser reads or rejects naming the option (budget_bytes=2**63 is a ValueError)."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        return str(value)
    return value


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


def page_weights(model: nn.Module, source: SafetensorsSource | str | os.PathLike, budget_bytes: int | float | str, *,
                 pinned: Iterable[str] = (), buffers: bool = False,
                 key_map: Callable[[str], str] | Mapping[str, str] | None = None,
                 strip_prefix: str = "", add_prefix: str = "", **options: Any) -> LayerPager:
    """Page `model`'s parameters (and persistent buffers, with buffers=True) from a safetensors
    checkpoint within budget_bytes; returns the pager.

    Each tensor is replaced by a meta-device placeholder that holds no memory; a forward pre-hook
    on its module acquires it from the pager and a forward hook puts the placeholder back. Tied
    weights are one pager entry. The checkpoint key of a tensor named `name` in the model is
    key_map(name) (a callable or mapping), else add_prefix + name with strip_prefix removed.
    pinned: parameter or module names whose tensors are never evicted. Other keyword options are
    the pager's (LayerPager: policy, prefetch, device, zero_copy). Everything is validated before
    the model is changed. Paged weights are for inference: they are acquired with
    requires_grad=False."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"page_weights: model must be an nn.Module, got {type(model).__name__}")
    if is_paged(model):
        raise RuntimeError(f"page_weights: {type(model).__name__} is already paged; call torch_ext.unpage first")
    if isinstance(pinned, str):
        raise TypeError("page_weights: pinned must be an iterable of names, not a str")
    to_key = _key_function(key_map, strip_prefix, add_prefix)
    source = source if isinstance(source, SafetensorsSource) else SafetensorsSource(source)
    names_of, tensors = _named_tensors(model, buffers)
    key_of = _checkpoint_keys(model, source, names_of, tensors, to_key)
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
                     to_key: Callable[[str], str]) -> dict[int, str]:
    """The checkpoint key of each tensor; raises naming every tensor that is missing from the
    source or stored with another dtype or shape."""
    key_of: dict[int, str] = {}
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
        if stored.dtype != tensor.dtype:
            problems.append(f"tensor {key!r} is {stored.dtype} in the file, {tensor.dtype} in the model ({names[0]})")
        if stored.shape != tensor.shape:
            problems.append(f"tensor {key!r} has shape {tuple(stored.shape)} in the file, "
                            f"{tuple(tensor.shape)} in the model ({names[0]})")
        key_of[tid] = key
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ValueError(f"page_weights: {source.path()} does not match {type(model).__name__}: {shown}")
    if not key_of:
        raise ValueError(f"page_weights: {type(model).__name__} has no parameters to page")
    return key_of


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
    """Replace the paged tensors by meta placeholders and hook each module that holds some."""
    slots: dict[nn.Module, list[_Slot]] = {}
    placeholders: dict[str, torch.Tensor] = {}
    requires_grad: dict[str, bool] = {}
    for module in model.modules():
        for kind, table in (("parameter", module._parameters), ("buffer", module._buffers if buffers else {})):
            for attr, t in table.items():
                if t is None or id(t) not in key_of:
                    continue
                key = key_of[id(t)]
                if key not in placeholders:
                    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
                    placeholders[key] = nn.Parameter(meta, requires_grad=t.requires_grad) if kind == "parameter" \
                        else meta
                    requires_grad[key] = t.requires_grad
                slots.setdefault(module, []).append(_Slot(module, attr, kind, key))
    for module, module_slots in slots.items():
        for slot in module_slots:
            table = module._parameters if slot.kind == "parameter" else module._buffers
            table[slot.attr] = placeholders[slot.key]

    state = _PagingState(pager, slots, placeholders, requires_grad)
    acquire_many = pager.script_object.acquire_many
    state.handles.append(model.register_forward_pre_hook(lambda module, args: pager.begin_pass(), prepend=True))
    for module, module_slots in slots.items():
        def pre_hook(module, args, module_slots=module_slots, keys=[slot.key for slot in module_slots]):
            for slot, t in zip(module_slots, acquire_many(keys)):
                if slot.kind == "parameter":
                    module._parameters[slot.attr] = nn.Parameter(t, requires_grad=False)
                else:
                    module._buffers[slot.attr] = t

        def post_hook(module, args, output, module_slots=module_slots):
            for slot in module_slots:
                table = module._parameters if slot.kind == "parameter" else module._buffers
                table[slot.attr] = placeholders[slot.key]

        state.handles.append(module.register_forward_pre_hook(pre_hook))
        state.handles.append(module.register_forward_hook(post_hook, always_call=True))
    model.__dict__[_STATE] = state


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
