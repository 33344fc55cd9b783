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
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

__all__ = ["SafetensorsSource", "LayerPager", "page_weights", "unpage", "save_pageable", "is_paged"]

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
_POLICIES = ("auto", "lru", "scan_resistant")
_STATE = "_torch_ext_paging"
_INT_STATS = ("hits", "misses", "evictions", "bytes_loaded", "prefetches", "prefetch_hits", "over_budget_loads")


def _check_int(value: Any, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


class SafetensorsSource:
    """A .safetensors file, a sharded checkpoint's model.safetensors.index.json, or a folder holding
    either; validated completely when opened (errors name the file and the tensor).

    direct_io=True reads with O_DIRECT, bypassing the page cache (for files larger than it)."""

    def __init__(self, path: str | os.PathLike, *, direct_io: bool = False) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"SafetensorsSource: path must be a str or os.PathLike, got {type(path).__name__}")
        self.script_object = torch.classes.torch_ext.SafetensorsSource(os.fspath(path), bool(direct_io))

    @property
    def path(self) -> str:
        return self.script_object.path()

    @property
    def direct_io(self) -> bool:
        return self.script_object.direct_io()

    def names(self) -> list[str]:
        return self.script_object.names()

    def __contains__(self, name: str) -> bool:
        return self.script_object.contains(name)

    def __len__(self) -> int:
        return len(self.names())

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self.script_object.dtype(name)]

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self.script_object.shape(name))

    def nbytes(self, name: str) -> int:
        return self.script_object.nbytes(name)

    def view(self, name: str) -> torch.Tensor:
        """Zero-copy view of the mapped file (writes stay private to this process)."""
        return self.script_object.view(name)

    def load(self, name: str) -> torch.Tensor:
        """A copy in memory the caller owns."""
        return self.script_object.load(name)

    def files(self) -> list[str]:
        return self.script_object.files()

    def metadata(self) -> dict[str, str]:
        return dict(self.script_object.metadata())

    def total_bytes(self) -> int:
        return self.script_object.total_bytes()

    def __repr__(self) -> str:
        return f"SafetensorsSource({self.path!r}, {len(self)} tensors, {self.total_bytes()} bytes)"


class LayerPager:
    """Keeps a source's tensors resident within budget_bytes (see torch_ext/paging/layer_pager.h).

    acquire(id) returns the tensor; it stays valid while you hold it, and the pager never evicts a
    tensor someone holds, a pinned one, or one being loaded. policy: "lru" or "scan_resistant"
    (Belady's choice on the order recorded between the first two begin_pass() calls). prefetch: how
    many tensors of that order a background thread loads ahead. device: where tensors live ("cpu",
    or an accelerator, loaded through pinned staging buffers on a side stream). zero_copy (CPU only):
    serve views of the mapped file instead of copies; loads map its pages in, evictions give them
    back. Thread-safe."""

    def __init__(self, source: SafetensorsSource | str | os.PathLike, budget_bytes: int, *,
                 pinned: Iterable[str] = (), policy: str = "lru", prefetch: int = 0,
                 device: torch.device | str | None = None, zero_copy: bool = False) -> None:
        if not isinstance(source, SafetensorsSource):
            source = SafetensorsSource(source)
        _check_int(budget_bytes, "LayerPager: budget_bytes")
        _check_int(prefetch, "LayerPager: prefetch")
        if policy not in ("lru", "scan_resistant"):
            raise ValueError(f"LayerPager: policy must be 'lru' or 'scan_resistant', got {policy!r}")
        if isinstance(pinned, str):
            raise TypeError("LayerPager: pinned must be an iterable of tensor names, not a str")
        self.source = source
        self.script_object = torch.classes.torch_ext.LayerPager(
            source.script_object, budget_bytes, [str(p) for p in pinned], policy, prefetch,
            str(torch.device(device if device is not None else "cpu")), bool(zero_copy))

    def acquire(self, id: str) -> torch.Tensor:
        return self.script_object.acquire(id)

    def acquire_many(self, ids: list[str]) -> list[torch.Tensor]:
        """acquire() of each id in turn, in one call."""
        return self.script_object.acquire_many(list(ids))

    def begin_pass(self) -> None:
        self.script_object.begin_pass()

    def set_order(self, ids: Iterable[str]) -> None:
        self.script_object.set_order(list(ids))

    def order(self) -> list[str]:
        return self.script_object.order()

    def resident_bytes(self) -> int:
        return self.script_object.resident_bytes()

    def resident_count(self) -> int:
        return self.script_object.resident_count()

    def budget_bytes(self) -> int:
        return self.script_object.budget_bytes()

    def is_resident(self, id: str) -> bool:
        return self.script_object.is_resident(id)

    def is_pinned(self, id: str) -> bool:
        return self.script_object.is_pinned(id)

    def evict_all(self) -> None:
        self.script_object.evict_all()

    def reset_stats(self) -> None:
        self.script_object.reset_stats()

    @property
    def policy(self) -> str:
        return self.script_object.policy()

    @property
    def prefetch(self) -> int:
        return self.script_object.prefetch()

    @property
    def device(self) -> torch.device:
        return torch.device(self.script_object.device())

    @property
    def zero_copy(self) -> bool:
        return self.script_object.zero_copy()

    def stats(self) -> dict[str, int | float | bool]:
        """hits, misses, evictions, bytes_loaded, load_seconds, stall_seconds, prefetches,
        prefetch_hits, over_budget_loads, pinned_over_budget (the C++ PagerStats fields)."""
        raw = self.script_object.stats()
        out: dict[str, int | float | bool] = {}
        for key, value in raw.items():
            out[key] = int(value) if key in _INT_STATS else bool(value) if key == "pinned_over_budget" else value
        return out

    def __repr__(self) -> str:
        return (f"LayerPager({self.source.path!r}, budget_bytes={self.budget_bytes()}, policy={self.policy!r}, "
                f"prefetch={self.prefetch}, device={str(self.device)!r}, resident_bytes={self.resident_bytes()})")


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


def page_weights(model: nn.Module, path_or_source: SafetensorsSource | str | os.PathLike, budget_bytes: int, *,
                 pinned: Iterable[str] = (), policy: str = "auto", prefetch: int = 1,
                 device: torch.device | str | None = None, buffers: bool = False,
                 key_map: Callable[[str], str] | Mapping[str, str] | None = None,
                 strip_prefix: str = "", add_prefix: str = "", direct_io: bool = False,
                 zero_copy: bool = False) -> LayerPager:
    """Page `model`'s parameters (and persistent buffers, with buffers=True) from a safetensors
    checkpoint within budget_bytes; returns the pager.

    Each tensor is replaced by a meta-device placeholder that holds no memory; a forward pre-hook
    on its module acquires it from the pager and a forward hook puts the placeholder back. Tied
    weights are one pager entry. The checkpoint key of a tensor named `name` in the model is
    key_map(name) (a callable or mapping), else add_prefix + name with strip_prefix removed.
    pinned: parameter or module names whose tensors are never evicted. policy "auto" is
    "scan_resistant" when the paged bytes exceed the budget, else "lru". prefetch: tensors to load
    ahead of the forward pass. direct_io: read with O_DIRECT; zero_copy: map the file instead of
    copying (CPU; see LayerPager). Everything is validated before the model is changed.
    Paged weights are for inference: they are acquired with requires_grad=False."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"page_weights: model must be an nn.Module, got {type(model).__name__}")
    if is_paged(model):
        raise RuntimeError(f"page_weights: {type(model).__name__} is already paged; call torch_ext.unpage first")
    _check_int(budget_bytes, "page_weights: budget_bytes")
    _check_int(prefetch, "page_weights: prefetch")
    if policy not in _POLICIES:
        raise ValueError(f"page_weights: policy must be one of {_POLICIES}, got {policy!r}")
    if isinstance(pinned, str):
        raise TypeError("page_weights: pinned must be an iterable of names, not a str")
    to_key = _key_function(key_map, strip_prefix, add_prefix)
    source = path_or_source if isinstance(path_or_source, SafetensorsSource) else \
        SafetensorsSource(path_or_source, direct_io=direct_io)

    # Every name of every tensor, tied ones included.
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
        if source.dtype(key) != tensor.dtype:
            problems.append(f"tensor {key!r} is {source.dtype(key)} in the file, {tensor.dtype} in the model "
                            f"({names[0]})")
        if source.shape(key) != tensor.shape:
            problems.append(f"tensor {key!r} has shape {tuple(source.shape(key))} in the file, "
                            f"{tuple(tensor.shape)} in the model ({names[0]})")
        key_of[tid] = key
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise ValueError(f"page_weights: {source.path} does not match {type(model).__name__}: {shown}")
    if not key_of:
        raise ValueError(f"page_weights: {type(model).__name__} has no parameters to page")

    name_to_key = {n: key_of[tid] for tid, names in names_of.items() for n in names}
    pinned_keys: list[str] = []
    for p in pinned:
        matched = [k for n, k in name_to_key.items() if n == p or n.startswith(p + ".")]
        if not matched:
            raise ValueError(f"page_weights: pinned name {p!r} matches no parameter of {type(model).__name__}")
        pinned_keys.extend(matched)
    paged_bytes = sum(source.nbytes(k) for k in set(key_of.values()))
    if policy == "auto":
        policy = "scan_resistant" if paged_bytes > budget_bytes else "lru"
    pager = LayerPager(source, budget_bytes, pinned=sorted(set(pinned_keys)), policy=policy, prefetch=prefetch,
                       device=device, zero_copy=zero_copy)

    # Validation is over: from here on nothing raises, so the model is never left half-paged.
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
    return pager


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
                         f"{model.__dict__[_STATE].pager.source.path} (torch_ext.unpage it to save elsewhere)")
    try:
        from safetensors.torch import save_model
    except ImportError as error:  # pragma: no cover - a pinned requirement
        raise RuntimeError("save_pageable needs the safetensors package (pip install safetensors==0.8.0)") from error
    save_model(model, os.fspath(path), metadata=dict(metadata or {"format": "pt"}))
