"""The Python faces of the paging core's classes: SafetensorsSource and LayerPager
(torch.classes.torch_ext.*, csrc/torch_ext/paging/), and budgets in the ecosystem's spellings."""
from __future__ import annotations

import numbers
import operator
import os
import warnings
from typing import Any, Mapping, Sequence

import torch

from .._script import ScriptObjectFace, construct

__all__ = ["SafetensorsSource", "LayerPager", "resolve_budget"]


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
        self.script_object = construct("SafetensorsSource", torch.classes.torch_ext.SafetensorsSource, os.fspath(path),
                                       **options)

    def composed(self, programs: Mapping[str, Sequence[str]]) -> SafetensorsSource:
        """This source, also serving compositions: {name: program}, each a tensor made from stored
        tensors by layout ops (stack, cat, narrow, transpose, reshape) and block dequantization
        (dequantize: FP8 or FP4 values times their block scales); the program's spelling is in
        csrc/torch_ext/paging/source.h. load_paged makes them from transformers' checkpoint
        conversions (a layer's experts stacked into one tensor) and from FP8 checkpoints. A
        composition may take the name of a stored tensor it reads (a weight served dequantized in
        its place). A composition has no zero-copy view; the stored tensors it reads leave names()."""
        if not isinstance(programs, Mapping):
            raise TypeError(f"SafetensorsSource.composed: programs must be a mapping of names to programs, got "
                            f"{type(programs).__name__}")
        face = object.__new__(SafetensorsSource)
        face.script_object = self.script_object.composed({str(name): [str(op) for op in program]
                                                          for name, program in programs.items()})
        return face

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
    acquire_many(ids), gather_rows(id, indices) (an embedding lookup from the file, without loading
    the table; gathers_rows(id) says whether it can), matmul(id, input, bias, transposed) (a linear
    layer's product, streamed from the file where the weight converts and has no room, or widens
    and the budget is below the source; streams(id) says whether it can), begin_pass(),
    set_order(ids), order(),
    resident_bytes(), resident_count(), is_resident(id), is_pinned(id), evict_all(), stats() (a
    PagerStats), reset_stats(), and each
    option as a property. source: a SafetensorsSource or the path of one. Keyword options are those
    of the C++ PagerOptions: budget_bytes (an int or float of bytes, "1GB", "512MiB", "30%", or a
    max_memory-style dict of those by device, see resolve_budget), pinned, policy, prefetch, device,
    zero_copy, dtype, own_buffers, wait_timeout_seconds. budget_bytes may also be given as the
    second positional argument: LayerPager(path, 1 << 30). Thread-safe and fork-safe
    (docs/paging.md)."""

    def __init__(self, source: SafetensorsSource | str | os.PathLike, budget_bytes: Any = None,
                 **options: Any) -> None:
        self.source = source if isinstance(source, SafetensorsSource) else SafetensorsSource(source)
        if budget_bytes is not None:
            options["budget_bytes"] = budget_bytes
        if "budget_bytes" in options:
            options["budget_bytes"] = resolve_budget(options["budget_bytes"], options.get("device", "cpu"))
        if isinstance(options.get("dtype"), torch.dtype):
            options["dtype"] = str(options["dtype"]).removeprefix("torch.")
        options = {name: _as_script_value(value) for name, value in options.items()}
        self.script_object = construct("LayerPager", torch.classes.torch_ext.LayerPager, self.source.script_object,
                                       **options)
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


_SPELLINGS = ("an int or float of bytes, a string such as \"1GB\", \"512MiB\" or \"30%\" (of the weights), "
              "or a dict by device such as {\"cpu\": \"1GB\"} or {0: \"2GiB\", \"cpu\": \"8GB\"}")


def resolve_budget(budget: Any, device: Any = "cpu") -> int | float | str:
    """The budget for a pager on `device`: budget itself, or, for a max_memory-style dict (keys:
    "cpu", an accelerator index such as 0, "cuda:0", a torch.device; "disk" is ignored), the entry
    of the pager's device. Any integer type with __index__ (numpy's included) is a byte count, any
    real number type a float of bytes. The value is parsed by the C++ option (ByteBudget), which
    rejects bad spellings naming budget_bytes, whose message lists the spellings."""
    if not isinstance(budget, Mapping):
        return _plain_budget(budget)
    try:
        target = _device_key(device, torch.device(device).type)
    except (RuntimeError, TypeError, ValueError) as error:
        raise ValueError(f"budget_bytes: cannot resolve the pager's device {device!r}: {error}") from None
    found = []
    for key, value in budget.items():
        if key == "disk":
            continue
        try:
            key_device = _device_key(key, target[0])
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"budget_bytes: {key!r} is not a device; a dict of budgets is keyed by \"cpu\", an "
                             f"accelerator index (0) or a device string (\"cuda:0\"), e.g. {{0: \"2GiB\", "
                             f"\"cpu\": \"8GB\"}}") from None
        if key_device == target:
            found.append(_plain_budget(value))
    if len(found) != 1:
        what = "no entry" if not found else "several entries"
        raise ValueError(f"budget_bytes: the dict {dict(budget)!r} has {what} for the pager's device "
                         f"{torch.device(device)} (pass device=... to page on another device); expected {_SPELLINGS}")
    return found[0]  # checked by ByteBudget like any budget


def _plain_budget(budget: Any) -> int | float | str:
    """A budget as one of the types the C++ option reads: int, float or str."""
    if isinstance(budget, (bool, int, float, str)):
        return budget  # bool: rejected by the C++ parser like any other non-budget, naming its type
    try:
        return operator.index(budget)
    except TypeError:
        pass
    if isinstance(budget, numbers.Real):
        return float(budget)
    raise ValueError(f"LayerPager: budget_bytes={budget!r} (a {type(budget).__module__}.{type(budget).__qualname__}) "
                     f"is not a byte budget: expected {_SPELLINGS}; any integer type with __index__ (numpy's "
                     f"included) is a count of bytes")


def _device_key(device: Any, accelerator: str) -> tuple[str, int | None]:
    """(type, index) of a device spelled as accelerate's max_memory does: an int is an index of
    `accelerator`; an accelerator without an index is its index 0."""
    if isinstance(device, bool):
        raise TypeError(device)
    if isinstance(device, int):
        device = torch.device("cuda" if accelerator == "cpu" else accelerator, device)
    device = torch.device(device)
    if device.type == "cpu":
        return ("cpu", None)
    return (device.type, device.index or 0)
