"""The `save` option (native selective checkpointing, csrc/torch_ext/checkpoint/selective.h): its
spelling in Python, and the same decisions as torch's selective checkpointing policy for
torch.compile, whose partitioner takes a policy's recompute tags instead of running our kernels."""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .. import _C


def save_items(owner: str, save: Any) -> Optional[tuple]:
    """`save` as the tuple of strings C++ takes (None: nothing saved); raises TypeError naming owner."""
    if save is None:
        return None
    if isinstance(save, str):
        return (save,)
    if isinstance(save, (list, tuple)) and all(isinstance(item, str) for item in save):
        return tuple(save) or None
    raise TypeError(f"{owner}: save must be a string or a sequence of strings ('matmul', 'attention', 'torchtitan' or "
                    f"ops such as 'aten::mm'), got {type(save).__name__}")


def _overload(qualified: str):
    namespace, rest = qualified.split("::", 1)
    name, overload = rest.split(".", 1)
    packet = getattr(getattr(torch.ops, namespace), name)
    return getattr(packet, overload)


@functools.lru_cache(maxsize=None)
def _dropout_index(op) -> Optional[int]:
    names = [argument.name for argument in op._schema.arguments]
    return names.index("dropout_p") if "dropout_p" in names else None


def dropout_p(op, args: tuple, kwargs: dict) -> Optional[float]:
    """The call's dropout_p (its schema default 0 when not given), or None when op takes none."""
    index = _dropout_index(op)
    if index is None:
        return None
    return kwargs.get("dropout_p", args[index] if index < len(args) else 0.0)


def _qualified(op) -> Optional[str]:
    """'aten::mm.default': an overload's name, the key of _rules (None for what is not an op
    overload, such as a higher-order op). Not the OpOverload object: code that calls
    `packet.__getattr__(name)` replaces a packet's cached overload with a new object, which an
    identity key would then miss (and the policy would silently save nothing)."""
    if not isinstance(op, torch._ops.OpOverload):
        return None
    return f"{op._schema.name}.{op._overloadname}"


@functools.lru_cache(maxsize=64)
def _rules(items: tuple) -> dict:
    """qualified op overload name (_qualified) -> (group, every, occurrences)."""
    rules = {}
    for qualified, group, every, occurrences in _C.checkpoint.save_rules(list(items)):
        try:
            op = _overload(qualified)
        except AttributeError:  # not in this build
            continue
        if _dropout_index(op) is None and torch.Tag.nondeterministic_seeded in op.tags:
            continue  # a mask draw: compiled, it is regenerated from its seed (and saving it would keep the float mask)
        rules[_qualified(op)] = (group, every, frozenset(occurrences))
    return rules


def saved_policy(op) -> CheckpointPolicy:
    """The tag for an op a policy saves, for torch.compile's partitioner: MUST_SAVE, except
    PREFER_SAVE for a pointwise op. Inductor decomposes a pointwise op such as GELU or SiLU into
    several nodes and a MUST_SAVE tag goes on each of them, so the partitioner may not recompute
    the intermediates its backward reuses (GELU's 1 + erf(x / sqrt 2)): it keeps one of them, or
    the derivative made from it, beside the output, where eager keeps the output alone. With
    PREFER_SAVE the op is left to the partitioner's min-cut, which keeps its output or recomputes
    it by the cut the partitioner finds cheapest. Eager saves PREFER_SAVE and MUST_SAVE outputs
    alike."""
    pointwise = isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags
    return CheckpointPolicy.PREFER_SAVE if pointwise else CheckpointPolicy.MUST_SAVE


def compiled_context_fn(items: tuple) -> Callable:
    """A context_fn for torch.utils.checkpoint under torch.compile that saves what `save=items`
    saves in eager: the same groups, periods, occurrences and dropout rule. A functools.partial:
    dynamo guards on a partial's arguments, while a plain function passed as context_fn is taken
    without a guard, so two policies on the same code would share one compiled graph."""
    return functools.partial(_compiled_contexts, tuple(items))


def _compiled_contexts(items: tuple) -> tuple:
    rules = _rules(items)
    groups = 1 + max((rule[0] for rule in rules.values()), default=0)
    counts = {False: [0] * groups, True: [0] * groups}

    def policy(ctx, op, *args, **kwargs):
        rule = rules.get(_qualified(op))
        if rule is None:
            return CheckpointPolicy.PREFER_RECOMPUTE
        group, every, occurrences = rule
        seen = counts[ctx.is_recompute]
        occurrence = seen[group]
        seen[group] += 1
        saved = occurrence in occurrences if occurrences else (occurrence + 1) % every == 0
        if saved:  # an op that drops out only where its dropout_p is 0
            saved = dropout_p(op, args, kwargs) in (None, 0.0)
        return saved_policy(op) if saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
