"""What a paged model holds in place of its weights: a parameter on the meta device (no memory)
that reports the pager's execution device, so code that asks a model where it lives
(transformers' model.device, peft's adapters) gets the answer the resident model would give."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["PagedParameter"]

# Conversions Module.to()/cuda()/cpu()/half()/... apply to each parameter: a paged one stays where
# it is when nothing would change, and raises otherwise (a meta tensor would silently copy nothing).
_TO = torch.Tensor.to
_CONVERSIONS = {torch.Tensor.cuda: "cuda", torch.Tensor.cpu: "cpu", torch.Tensor.float: torch.float32,
                torch.Tensor.double: torch.float64, torch.Tensor.half: torch.float16,
                torch.Tensor.bfloat16: torch.bfloat16}


class PagedParameter(nn.Parameter):
    """A paged weight's placeholder: shape, dtype and requires_grad=False of the weight, storage on
    the meta device, `device` the pager's device. The weight itself is acquired from the pager in
    its module's forward; `name` is its checkpoint key."""

    def __new__(cls, like: torch.Tensor, device: torch.device, name: str) -> "PagedParameter":
        meta = torch.empty(like.shape, dtype=like.dtype, device="meta")
        self = torch.Tensor._make_subclass(cls, meta, False)
        self._execution_device = torch.device(device)
        self._name = name
        return self

    @property
    def device(self) -> torch.device:  # the execution device, not meta (the tensor's storage)
        return self._execution_device

    def __repr__(self) -> str:
        return (f"PagedParameter({self._name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self._execution_device})")

    def __deepcopy__(self, memo):
        raise RuntimeError(f"cannot deepcopy paged parameter {self._name!r}: torch_ext.unpage the model first, "
                           f"or load it again with torch_ext.load_paged")

    def __reduce_ex__(self, protocol):
        raise RuntimeError(f"cannot pickle paged parameter {self._name!r}: its weight lives in the pager's file; "
                           f"torch_ext.unpage the model first")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is _TO or func in _CONVERSIONS) and args and isinstance(args[0], PagedParameter):
            return args[0]._convert(func, args[1:], kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _convert(self, func, args, kwargs) -> "PagedParameter":
        if func is _TO:
            device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        elif isinstance(_CONVERSIONS[func], str):
            device, dtype = torch.device(_CONVERSIONS[func], *args[:1]), None
        else:
            device, dtype = None, _CONVERSIONS[func]
        same_device = device is None or _same_device(torch.device(device), self._execution_device)
        if same_device and (dtype is None or dtype == self.dtype):
            return self
        raise RuntimeError(
            f"paged parameter {self._name!r} is paged to {self._execution_device} as {self.dtype}: a paged model "
            f"cannot be moved or converted (asked for device={device}, dtype={dtype}); page it with "
            f"device=... (torch_ext.load_paged(..., device=...)), store the file in the dtype you want, or "
            f"torch_ext.unpage the model first")


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cpu" or a.index is None or b.index is None:
        return True
    return a.index == b.index
