"""The checkpoint decorator and the call path every checkpointed segment takes into the C++ node
(torch_ext._C.checkpoint.apply)."""
from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .. import _C
from .replay_tail import _TAIL_ATTRIBUTE, _ReplayTail

_apply = _C.checkpoint.apply


def checkpoint_options(owner: str, **options: Any) -> torch.ScriptObject:
    """A torch.classes.torch_ext.CheckpointOptions from keyword options (names, defaults and checks
    are the C++ CheckpointOptions'); raises TypeError naming owner for an unknown option."""
    names = option_names()
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise TypeError(f"{owner}: unknown option(s) {', '.join(unknown)}; the options are {', '.join(names)}")
    return torch.classes.torch_ext.CheckpointOptions(**options)


def option_names() -> list[str]:
    return _DEFAULT_OPTIONS.fields()


_DEFAULT_OPTIONS = torch.classes.torch_ext.CheckpointOptions()


def _trainable_parameters(module: nn.Module) -> list[torch.Tensor]:
    """module.parameters() that require grad (each once), without the generator machinery."""
    if not module._modules:
        return [p for p in module._parameters.values() if p is not None and p.requires_grad]
    seen, params = set(), []
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def _plain_tensors(args: tuple) -> bool:
    for a in args:
        if type(a) is not torch.Tensor:
            return False
    return True


def _flatten_output(out: Any, box: list) -> list[torch.Tensor]:
    leaves, spec = pytree.tree_flatten(out)
    box[0] = (spec, leaves)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _unflatten_output(outputs: list[torch.Tensor], box: list) -> Any:
    spec, leaves = box[0]
    it = iter(outputs)
    return pytree.tree_unflatten([next(it) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)


def _name_of(fn: Any) -> str:
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _call_segment(box: list, tail: Optional["_ReplayTail"], params: list[torch.Tensor], modules: Sequence[nn.Module],
                  fn: Callable, tensors: list[torch.Tensor]) -> Any:
    """What the core calls as the segment: fn(*tensors), through the call site's early stop unless
    it has none or it is off; an output other than one tensor is flattened, its structure kept in box."""
    out = fn(*tensors) if tail is None or tail.off else tail.replay(fn, tensors, params, modules)
    return out if type(out) is torch.Tensor else _flatten_output(out, box)


def _run(fn: Callable, args: tuple, kwargs: dict, params: list[torch.Tensor], options: torch.ScriptObject,
         name: str, tail: Optional["_ReplayTail"] = None,
         modules: Sequence[nn.Module] = ()) -> Any:
    """fn(*args, **kwargs) as one checkpointed segment whose other tensors requiring grad are params;
    tail: the call site's early stop for its replays; modules: those fn calls or runs."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    box: list = [None]  # the output's structure when it is not one tensor
    if not kwargs and _plain_tensors(args):
        # Fast path: positional plain tensors. The segment holds no input, so the storage policy
        # alone decides what stays alive.
        segment = functools.partial(_call_segment, box, tail, params, modules, fn)
        outputs = _apply(segment, list(args), params, options, name)
    else:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        tensors = [leaves[i] for i in slots]
        for leaf in leaves:
            if isinstance(leaf, nn.Module):
                params = params + [p for p in _trainable_parameters(leaf) if not any(p is q for q in params)]
        if not params and not any(t.requires_grad for t in tensors):
            return fn(*args, **kwargs)
        # The replay needs the non-tensor leaves; the tensors come back from the boundary.
        for i in slots:
            leaves[i] = None

        def segment(replayed):
            call_leaves = list(leaves)
            for i, t in zip(slots, replayed):
                call_leaves[i] = t
            call_args, call_kwargs = pytree.tree_unflatten(call_leaves, spec)
            return _call_segment(box, tail, params, modules, lambda *_: fn(*call_args, **call_kwargs), replayed)

        outputs = _apply(segment, tensors, params, options, name)
    return outputs[0] if box[0] is None else _unflatten_output(outputs, box)


# Under torch.compile a checkpoint is a graph break (dynamo cannot trace into the C++ node);
# eager calls skip the disable wrapper, which costs microseconds per call.
_run_eager = _run
_run_under_compile = torch.compiler.disable(_run)


def _runner():
    return _run_under_compile if torch.compiler.is_compiling() else _run_eager


class _CheckpointedForward:
    """An instance's checkpointed forward. It refers to its module weakly: the module holds it, and
    a strong reference back would leave the module (and its parameters) to the cycle collector.
    Deep-copies and pickles with its module."""

    def __init__(self, module: nn.Module, forward: Callable, options: torch.ScriptObject) -> None:
        self._module = weakref.ref(module)
        self.forward = forward
        self.options = options
        self._torch_ext_checkpoint = options
        self.tail = _ReplayTail()

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
        forward = self.forward
        if not torch.is_grad_enabled():
            return forward(module, *args, **kwargs)
        if kwargs or not _plain_tensors(args) or torch.compiler.is_compiling():
            return _runner()(functools.partial(forward, module), args, kwargs, _trainable_parameters(module),
                             self.options, type(module).__name__, self.tail, (module,))
        # The common case, kept short: tensors in, tensors out.
        box: list = [None]
        params = _trainable_parameters(module)
        segment = functools.partial(_call_segment, box, self.tail, params, (module,),
                                    functools.partial(forward, module))
        outputs = _apply(segment, list(args), params, self.options, type(module).__name__)
        return outputs[0] if box[0] is None else _unflatten_output(outputs, box)


def checkpoint(target: Any = None, **options: Any) -> Any:
    """Checkpoint a module class, a module instance or a function.

    - ``@checkpoint`` on an nn.Module subclass: every instance's forward is checkpointed (the
      class is changed in place and returned).
    - ``checkpoint(module)``: that instance's forward is checkpointed in place; state_dict keys,
      hooks and parameters are unchanged. Returns the module.
    - ``@checkpoint`` on a function: returns a checkpointed wrapper. Gradients flow to its tensor
      arguments (nested in lists, tuples, dicts), to the parameters of nn.Modules among its
      arguments and of the module a bound method belongs to; a tensor requiring grad reached any
      other way (a closure) raises in backward, since its gradient would be lost.

    Keyword arguments, pytree inputs and outputs, non-tensor arguments and outputs, inputs that do
    not require grad and nested checkpoints all work. Options are those of the C++
    CheckpointOptions (torch.classes.torch_ext.CheckpointOptions): storage ("keep", exact;
    "offload"; "bf16" / "fp16", lossy) and preserve_rng_state. Use as
    ``@checkpoint(storage="bf16")`` to pass options.
    """
    resolved = checkpoint_options("torch_ext.checkpoint", **options)
    if target is None:
        return functools.partial(checkpoint, **options)
    if isinstance(target, type):
        return _checkpoint_class(target, resolved)
    if isinstance(target, nn.Module):
        if isinstance(target.__dict__.get("forward"), _CheckpointedForward) or getattr(
                type(target).forward, "_torch_ext_checkpoint", None) is not None:
            return target
        if "forward" in target.__dict__:
            raise TypeError(f"torch_ext.checkpoint: {type(target).__name__} instance has its own forward attribute; "
                            "checkpoint its class or a function instead")
        target.forward = _CheckpointedForward(target, type(target).forward, resolved)
        return target
    if callable(target):
        return _checkpoint_function(target, resolved)
    raise TypeError(f"torch_ext.checkpoint: expected an nn.Module subclass, an nn.Module or a callable, "
                    f"got {type(target).__name__}")


def _checkpoint_class(target: type, options: torch.ScriptObject) -> type:
    if not issubclass(target, nn.Module):
        raise TypeError(f"torch_ext.checkpoint: class {target.__name__} is not an nn.Module subclass")
    original = target.forward
    if getattr(original, "_torch_ext_checkpoint", None) is not None:
        return target

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            return original(self, *args, **kwargs)
        tail = self.__dict__.get(_TAIL_ATTRIBUTE) or self.__dict__.setdefault(_TAIL_ATTRIBUTE, _ReplayTail())
        return _runner()(functools.partial(original, self), args, kwargs, _trainable_parameters(self), options,
                         type(self).__name__, tail, (self,))

    forward._torch_ext_checkpoint = options
    target.forward = forward
    return target


def _checkpoint_function(fn: Callable, options: torch.ScriptObject) -> Callable:
    owner = fn.__self__ if inspect.ismethod(fn) and isinstance(fn.__self__, nn.Module) else None
    name = _name_of(fn)
    tail = _ReplayTail()

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        params = _trainable_parameters(owner) if owner is not None else []
        return _runner()(fn, args, kwargs, params, options, name, tail)

    wrapper._torch_ext_checkpoint = options
    return wrapper


def _restore_forward(module: nn.Module, forward: Callable, options: dict) -> "_CheckpointedForward":
    return _CheckpointedForward(module, forward, checkpoint_options("torch_ext.checkpoint", **options))
