"""Random draws in the replay of a segment under torch's selective checkpointing policy (context_fn).

A replay starts from the forward's generator states and draws its random ops again in order, which
gives the forward's numbers only while it runs every draw the forward ran. A random op the policy
saves is not run again, so the generator is left behind, and a later random op that the replay runs
draws other numbers than in the forward. (A CUDA attention with dropout saved, then a dropout after
it: torch's own selective checkpointing gave Hugging Face GPT-2 gradients off by 0.59 of their
largest on an H200.) torch_ext notes each draw's generator state in the forward, through the policy
(torch 2.13 asks it after the op ran, torch 2.11 before: forward_log.py), and, where a saved draw
comes before one the replay runs, sets the generator at each draw of the replay as the forward had
it there.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .selective import dropout_p


def draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the call draws random numbers: a random op, unless its dropout_p is 0 (attention)."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    p = dropout_p(func, args, kwargs)
    return p is None or p != 0.0


def _generator(args: tuple, kwargs: dict) -> Optional[torch.Generator]:
    """The generator a random op draws from: its generator argument, else its device's default
    (None for a device without default generators)."""
    if kwargs.get("generator") is not None:
        return kwargs["generator"]
    device = next((leaf.device for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)),
                  None)
    device = torch.device(kwargs.get("device") or "cpu") if device is None else device
    if device.type == "cpu":
        return torch.default_generator
    generators = getattr(torch.get_device_module(device.type), "default_generators", None)
    if not generators:
        return None
    return generators[device.index if device.index is not None else torch.get_device_module(device.type).current_device()]


class ReplayDraws(TorchDispatchMode):
    """In a replay (entered inside the policy's recompute context, so it sees every op first), sets
    the generator at each random op to the state the forward noted there: before the op where the
    state was noted before the draw, after it (a saved op is not run, so nothing else moves the
    generator there) where it was noted after."""

    def __init__(self, noted: list) -> None:
        super().__init__()
        self.noted = noted
        self.next = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not draws(func, args, kwargs) or self.next >= len(self.noted):
            return func(*args, **kwargs)
        generator, state, after, _ = self.noted[self.next]
        self.next += 1
        if not after:
            generator.set_state(state)
        out = func(*args, **kwargs)
        if after:
            generator.set_state(state)
        return out
