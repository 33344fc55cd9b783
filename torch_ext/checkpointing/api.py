"""The checkpoint decorator, the drop-in for torch.utils.checkpoint.checkpoint, and the one call
path every checkpointed segment takes: torch_ext._C.checkpoint.run, the C++ frame of
csrc/torch_ext/checkpoint/frame.h (saved-tensor hooks: the forward builds the ordinary graph
around placeholders, the first unpack in a backward replays the segment, checked, stopping once
every saved tensor is recomputed). Under torch.compile the segment is traced instead, through
torch.utils.checkpoint, as torch's own checkpoint is."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils.checkpoint import _CachingTorchDispatchMode

from .. import _C
from .._script import construct
from .forward_log import ForwardLog
from .selective import compiled_context_fn, save_items

CheckpointError = _C.checkpoint.CheckpointError
_run_segment = _C.checkpoint.run


@dataclass(frozen=True)
class Options:
    """Checkpoint options: `script` is the C++ CheckpointOptions (names, defaults and checks are
    its), `compiled` the keywords torch.utils.checkpoint takes under torch.compile (plain Python
    values, which dynamo traces without a graph break)."""

    script: Optional[torch.ScriptObject]  # None (and native None) where made inside a compiled forward
    native: Any  # what _C.checkpoint.run takes
    compiled: tuple
    # torch's selective checkpointing: a callable returning (forward context, recompute context), as
    # torch.utils.checkpoint takes it; a Python object, so the one option C++ cannot hold.
    context_fn: Optional[Callable] = None

    @property
    def chooses_ops(self) -> bool:
        """Whether a policy (context_fn or save) chooses op outputs to keep: a layer planner's
        measurements, taken without it, would not count them."""
        return self.context_fn is not None or self.script.save is not None

    def as_dict(self) -> dict:
        """The options as keywords (the C++ ones, and context_fn when one is set)."""
        values = self.script.as_dict()
        if self.context_fn is not None:
            values["context_fn"] = self.context_fn
        return values


_OPTIONS_CACHE: dict = {}
# Read once: a call on a torch.classes object inside a compiled forward (checkpoint_call, which
# Hugging Face's checkpointing calls per layer) is a graph break.
_OPTION_NAMES = (*torch.classes.torch_ext.CheckpointOptions().fields(), "context_fn")


def option_names() -> tuple[str, ...]:
    return _OPTION_NAMES


def _context_fn(owner: str, context_fn: Any) -> Optional[Callable]:
    if context_fn is None or context_fn is torch.utils.checkpoint.noop_context_fn:
        return None
    if not callable(context_fn):
        raise TypeError(f"{owner}: context_fn must be a callable returning two context managers (the forward's and "
                        f"the recomputation's), as torch.utils.checkpoint takes it; got {type(context_fn).__name__}")
    return context_fn


def checkpoint_options(owner: str, **options: Any) -> Options:
    """Options from keywords, validated by C++ (context_fn, a Python callable, here); raises
    TypeError naming owner for an unknown one. The C++ options are built once per distinct set of
    keywords (a context_fn is not cached: a new one per call must not accumulate)."""
    context_fn = _context_fn(owner, options.pop("context_fn", None))
    if "save" in options:
        options["save"] = save_items(owner, options["save"])
        if options["save"] is not None and context_fn is not None:
            raise ValueError(f"{owner}: save and context_fn both choose what the forward keeps; give one")
    resolved = _native_options(owner, options)
    if context_fn is None:
        return resolved
    return dataclasses.replace(resolved, compiled=resolved.compiled + (("context_fn", context_fn),),
                               context_fn=context_fn)


def _native_options(owner: str, options: dict) -> Options:
    key = tuple(sorted(options.items()))
    try:
        return _OPTIONS_CACHE[key]
    except (KeyError, TypeError):  # TypeError: an unhashable value, validated below
        pass
    if torch.compiler.is_compiling():  # first seen in a traced forward: what a compiled run takes
        return Options(None, None, _compiled(_plain_keywords(owner, key), options.get("save")))
    return _resolved_options(owner, key)


def _compiled(plain: tuple, save: Optional[tuple]) -> tuple:
    """torch.utils.checkpoint's keywords under torch.compile: the plain ones, and save's policy as
    a context_fn (Inductor's partitioner takes the same decisions as its recompute tags)."""
    return plain + ((("context_fn", compiled_context_fn(save)),) if save else ())


@torch.compiler.assume_constant_result  # run, not traced: building a torch.classes object is a graph break
def _plain_keywords(owner: str, key: tuple) -> tuple:
    """The plain compiled keywords for these options, validated and cached as in eager."""
    return _plain_of(_resolved_options(owner, key).script)


def _plain_of(script: torch.ScriptObject) -> tuple:
    return (("preserve_rng_state", script.preserve_rng_state), ("early_stop", script.early_stop))


def _resolved_options(owner: str, key: tuple) -> Options:
    options = dict(key)
    unknown = sorted(set(options) - set(option_names()))
    if unknown:
        raise TypeError(f"{owner}: unknown option(s) {', '.join(unknown)}; the options are {', '.join(option_names())}")
    save = options.get("save")
    script = construct(owner, torch.classes.torch_ext.CheckpointOptions,
                       **dict(options, save=list(save) if save else None))
    resolved = Options(script, _C.checkpoint.native_options(script), _compiled(_plain_of(script), save))
    _OPTIONS_CACHE[key] = resolved
    return resolved


# ---- Hugging Face caches: state a segment would change twice (once more in its replay)
_WARNED: set = set()


@torch.compiler.assume_constant_result  # a property of the class, which dynamo guards on
def _is_hf_cache_class(cls: type) -> bool:
    return any(c.__name__ == "Cache" and c.__module__.startswith("transformers.") for c in cls.__mro__)


def _is_hf_cache(value: Any) -> bool:
    return value is not None and _is_hf_cache_class(type(value))


def _without_caches(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """args and kwargs with Hugging Face Cache objects replaced by None and use_cache by False, as
    Hugging Face's own gradient checkpointing does in training (once warned per segment name)."""
    found = [i for i, a in enumerate(args) if type(a) is not torch.Tensor and _is_hf_cache(a)]
    keys = [k for k, v in kwargs.items() if v is not None and type(v) is not torch.Tensor and _is_hf_cache(v)]
    if not found and not keys:
        return args, kwargs
    args = tuple(None if i in found else a for i, a in enumerate(args))
    kwargs = {k: None if k in keys else v for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    if name not in _WARNED and not torch.compiler.is_compiling():
        _WARNED.add(name)
        warnings.warn(f"torch_ext.checkpoint: {name} was given a Hugging Face cache; a checkpointed segment would "
                      f"update it again in its replay, so caching is off inside it (as Hugging Face's own gradient "
                      f"checkpointing does in training)", stacklevel=4)
    return args, kwargs


def _run(fn: Callable, args: tuple, kwargs: dict, options: Options, name: str) -> Any:
    """fn(*args, **kwargs) as one checkpointed segment named name (in errors)."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if kwargs or not all(type(a) is torch.Tensor for a in args):
        args, kwargs = _without_caches(name, args, kwargs)
    if torch.compiler.is_compiling():
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **dict(options.compiled), **kwargs)
    if options.context_fn is not None:
        fn = _UnderContexts(fn, options.context_fn, name)
    return _run_segment(fn, args, kwargs, options.native, name)


class _UnderContexts:
    """A segment run under context_fn's contexts, as torch.utils.checkpoint runs it: its forward
    (the first call) under the first, every replay under the second. One per checkpointed call:
    context_fn is called once per call, as torch calls it (a selective checkpointing policy's
    contexts share the storage of the outputs the policy saves in that call)."""

    __slots__ = ("fn", "forward_context", "recompute_context", "name", "forward_done", "forward_log")

    def __init__(self, fn: Callable, context_fn: Callable, name: str) -> None:
        contexts = context_fn()
        if not isinstance(contexts, tuple) or len(contexts) != 2:
            raise TypeError(f"torch_ext.checkpoint: {name}: context_fn must return a tuple of two context managers "
                            f"(the forward's, the recomputation's), got {type(contexts).__name__}")
        self.fn = fn
        self.forward_context, self.recompute_context = contexts
        self.name = name
        self.forward_done = False
        # torch's policy contexts: the forward's random ops and in-place writes noted through its
        # policy (forward_log.py).
        self.forward_log = None
        if isinstance(self.forward_context, _CachingTorchDispatchMode):
            self.forward_log = self.forward_context.policy_fn = ForwardLog(self.forward_context.policy_fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.forward_done:
            replay = self.forward_log.replay(self.name) if self.forward_log is not None else None
            try:
                with self.recompute_context, replay or contextlib.nullcontext():
                    return self.fn(*args, **kwargs)
            except RuntimeError as error:  # torch's policy raises without naming the segment
                error.add_note(f"torch_ext.checkpoint: in the replay of {self.name}, under context_fn's policy")
                raise
        self.forward_done = True
        with self.forward_context:
            out = self.fn(*args, **kwargs)
            if self.forward_log is not None and \
                    not getattr(self.recompute_context, "allow_cache_entry_mutation", False):
                self.forward_log.recompute_changed(self.forward_context.storage)
            return out
        raise RuntimeError(f"torch_ext.checkpoint: {self.name}: the forward context from context_fn suppressed an "
                           f"exception raised in the checkpointed forward; a failed forward has no value to return")


def _name_of(fn: Any) -> str:
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


class _CheckpointedForward:
    """An instance's checkpointed forward. It refers to its module weakly: the module holds it, and
    a strong reference back would leave the module (and its parameters) to the cycle collector.
    Deep-copies and pickles with its module."""

    def __init__(self, module: nn.Module, forward: Callable, options: Options) -> None:
        self._module = weakref.ref(module)
        self.forward = forward
        self.options = options
        self._torch_ext_checkpoint = options
        self._name = type(module).__name__

    @property
    def module(self) -> nn.Module:
        return self._module()

    def __deepcopy__(self, memo) -> "_CheckpointedForward":
        module = self._module()
        # Deep-copied with its module (from the module's __dict__), the copy belongs to the module's copy.
        return _CheckpointedForward(memo.get(id(module), module), self.forward, self.options)

    def __reduce__(self):
        return _restore_forward, (self._module(), self.forward, self.options.as_dict())

    def __call__(self, *args, **kwargs):
        module = self._module()
        if not torch.is_grad_enabled():
            return self.forward(module, *args, **kwargs)
        return _run(functools.partial(self.forward, module), args, kwargs, self.options, self._name)


def _restore_forward(module: nn.Module, forward: Callable, options: dict) -> _CheckpointedForward:
    return _CheckpointedForward(module, forward, checkpoint_options("torch_ext.checkpoint", **options))


def checkpoint(target: Any = None, **options: Any) -> Any:
    """Checkpoint a module class, a module instance or a function.

    - ``@checkpoint`` on an nn.Module subclass: every instance's forward is checkpointed (the
      class is changed in place and returned).
    - ``checkpoint(module)``: that instance's forward is checkpointed in place; state_dict keys,
      hooks and parameters are unchanged. Returns the module.
    - ``@checkpoint`` on a function: returns a checkpointed wrapper.

    Options are those of the C++ CheckpointOptions (torch.classes.torch_ext.CheckpointOptions):
    storage ("keep", exact; "offload"; "bf16" / "fp16", lossy), preserve_rng_state and
    early_stop; and torch's context_fn (selective checkpointing with
    torch.utils.checkpoint.create_selective_checkpoint_contexts). Use as
    ``@checkpoint(storage="bf16")`` to pass options. Gradients equal the unwrapped segment's
    (on CPU with "keep": bit for bit), whatever the segment reads (tensors in nested arguments,
    closures, module parameters), with double backward, nested checkpoints and hooks on its
    outputs' grad_fns. A replay is checked against its forward: every tensor it
    saves for backward must match in shape, dtype and device, else CheckpointError names the
    segment and the first differing tensor. Hugging Face Cache arguments are set to None in the
    segment (caching off, as their gradient checkpointing does), with one warning.
    """
    resolved = checkpoint_options("torch_ext.checkpoint", **options)
    if target is None:
        return functools.partial(checkpoint, **options)
    if isinstance(target, type):
        return _checkpoint_class(target, resolved)
    if isinstance(target, nn.Module):
        name = type(target).__name__
        if isinstance(target.__dict__.get("forward"), _CheckpointedForward):
            _same_options(f"this {name}", target.__dict__["forward"].options, resolved, "del module.forward undoes it")
            return target
        if getattr(type(target).forward, "_torch_ext_checkpoint", None) is not None:
            _same_options(f"class {name}", type(target).forward._torch_ext_checkpoint, resolved,
                          "checkpoint instances, not the class, to give them options of their own")
            return target
        if "forward" in target.__dict__:
            raise TypeError(f"torch_ext.checkpoint: {name} instance has its own forward attribute; "
                            "checkpoint its class or a function instead")
        target.forward = _CheckpointedForward(target, type(target).forward, resolved)
        return target
    if callable(target):
        return _checkpoint_function(target, resolved)
    raise TypeError(f"torch_ext.checkpoint: expected an nn.Module subclass, an nn.Module or a callable, "
                    f"got {type(target).__name__}")


def _same_options(what: str, existing: Options, requested: Options, undo: str) -> None:
    """A module checkpointed again: with its options, nothing changes; with others, refused (a
    second checkpoint would nest in the first, and keeping the first would drop them unseen)."""
    if existing.as_dict() != requested.as_dict():
        raise ValueError(f"torch_ext.checkpoint: {what} is already checkpointed with {existing.as_dict()}, not "
                         f"{requested.as_dict()}; {undo}")


def _checkpoint_class(target: type, options: Options) -> type:
    if not issubclass(target, nn.Module):
        raise TypeError(f"torch_ext.checkpoint: class {target.__name__} is not an nn.Module subclass")
    original = target.forward
    if getattr(original, "_torch_ext_checkpoint", None) is not None:
        _same_options(f"class {target.__name__}", original._torch_ext_checkpoint, options,
                      "checkpoint instances, not the class, to give them options of their own")
        return target
    name = target.__name__

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return original(self, *args, **kwargs)
        return _run(functools.partial(original, self), args, kwargs, options, name)

    forward._torch_ext_checkpoint = options
    target.forward = forward
    return target


def _checkpoint_function(fn: Callable, options: Options) -> Callable:
    name = _name_of(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return _run(fn, args, kwargs, options, name)

    wrapper._torch_ext_checkpoint = options
    return wrapper


# torch.utils.checkpoint.checkpoint's keywords that select its implementation or debug it; torch_ext
# has one implementation (the non-reentrant one) and always checks its replays.
_TORCH_ONLY = ("use_reentrant", "debug")


def _pop_torch_keywords(owner: str, keywords: dict) -> None:
    """Takes torch.utils.checkpoint's use_reentrant, debug and determinism_check out of keywords:
    the first two are ignored, and determinism_check must be "default"."""
    determinism_check = keywords.pop("determinism_check", "default")
    if determinism_check != "default":
        raise ValueError(f"{owner}: determinism_check={determinism_check!r}: torch_ext always checks its replays "
                         f"(\"default\")")
    for keyword in _TORCH_ONLY:
        keywords.pop(keyword, None)


def checkpoint_call(function: Callable, *args: Any, context_fn: Any = None, **kwargs: Any) -> Any:
    """Drop-in for torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, ...):
    run function(*args, **kwargs) checkpointed and return its output. Takes torch's keywords
    (use_reentrant and debug are accepted and ignored: torch_ext has the non-reentrant
    implementation only; early_stop and preserve_rng_state are options) and torch_ext's options
    (storage); context_fn as torch's (selective activation checkpointing). determinism_check
    must be "default" (torch_ext always checks its replays)."""
    _pop_torch_keywords("torch_ext.checkpoint_call", kwargs)
    names = option_names()
    options = checkpoint_options("torch_ext.checkpoint_call", context_fn=context_fn,
                                 **{k: kwargs.pop(k) for k in list(kwargs) if k in names})
    return _run(function, args, kwargs, options, _name_of(function))
