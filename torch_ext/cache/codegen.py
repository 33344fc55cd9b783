"""Code generation for the run loop: argument builders (env -> args, kwargs) for each node, and
_Segment, a stretch of steps that just run compiled into one Python function."""
from __future__ import annotations

from typing import Callable

from torch import fx
from torch.fx.node import map_aggregate

from .classification import VARYING


def _compile_arguments(args: tuple, kwargs: dict, index: dict) -> Callable[[list], tuple]:
    """A function env -> (args, kwargs) with each node replaced by its value."""
    def flat(value):
        return isinstance(value, fx.Node) or not isinstance(value, (tuple, list, dict, slice))

    if all(flat(a) for a in args) and all(flat(v) for v in kwargs.values()):
        arg_refs = [(i, index[a]) for i, a in enumerate(args) if isinstance(a, fx.Node)]
        kw_refs = [(k, index[v]) for k, v in kwargs.items() if isinstance(v, fx.Node)]
        arg_template, kw_template = list(args), dict(kwargs)
        if not kw_refs:
            if len(arg_refs) == 1 and len(args) == 1:
                (_, only), = arg_refs
                return lambda env: ((env[only],), kw_template)
            def build(env):
                a = arg_template.copy()
                for position, ref in arg_refs:
                    a[position] = env[ref]
                return a, kw_template
            return build

        def build_with_kwargs(env):
            a = arg_template.copy()
            for position, ref in arg_refs:
                a[position] = env[ref]
            kw = kw_template.copy()
            for key, ref in kw_refs:
                kw[key] = env[ref]
            return a, kw
        return build_with_kwargs

    def build_nested(env):
        lookup = lambda n: env[index[n]] if isinstance(n, fx.Node) else n  # noqa: E731
        return map_aggregate(args, lookup), map_aggregate(kwargs, lookup)
    return build_nested


class _Segment:
    """Consecutive steps that just run (pure, depending on a varying source: never looked up nor
    stored), compiled into one Python function so they cost what the module's own forward does
    rather than an interpreter iteration each."""

    __slots__ = ("run", "count")

    def __init__(self, steps: list, index: dict) -> None:
        namespace: dict = {}

        def constant(value) -> str:
            if value is None or isinstance(value, (bool, int, str)) or (
                    isinstance(value, float) and value == value and abs(value) != float("inf")):
                return repr(value)
            name = f"c{len(namespace)}"
            namespace[name] = value
            return name

        def expression(value) -> str:
            if isinstance(value, fx.Node):
                return f"env[{index[value]}]"
            if isinstance(value, tuple):
                items = "".join(expression(v) + ", " for v in value)
                return f"{constant(type(value))}({items})" if hasattr(value, "_fields") else f"({items})"
            if isinstance(value, list):  # fx's immutable_list too: the module received a list
                return "[" + ", ".join(expression(v) for v in value) + "]"
            if isinstance(value, dict):
                return "{" + ", ".join(f"{constant(k)}: {expression(v)}" for k, v in value.items()) + "}"
            if isinstance(value, slice):
                return f"slice({expression(value.start)}, {expression(value.stop)}, {expression(value.step)})"
            return constant(value)

        lines = ["def run(env, status):"]
        for step in steps:
            node = step.node
            args = [expression(a) for a in node.args]
            args += [f"{k}={expression(v)}" if k.isidentifier() else f"**{{{k!r}: {expression(v)}}}"
                     for k, v in node.kwargs.items()]
            if step.op == "call_module":
                callee = f"{constant(step.parent._modules)}[{step.attr!r}]"
            elif step.op == "call_method":
                callee = f"{args[0]}.{step.target}" if step.target.isidentifier() else \
                    f"getattr({args[0]}, {step.target!r})"
                args = args[1:]
            else:
                callee = constant(step.target)
            lines.append(f"    env[{step.index}] = {callee}({', '.join(args)})  # {step.name}")
            lines.append(f"    status[{step.index}] = {VARYING}")
            lines.extend(f"    env[{j}] = None" for j in step.release)
        exec(compile("\n".join(lines), "<torch_ext.LazyExecutor segment>", "exec"), namespace)
        self.run = namespace["run"]
        self.count = len(steps)
