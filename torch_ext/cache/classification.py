"""What a graph node and a value are, as the lazy executor sees them.

Node kinds: "pure", "random" (a new value at every call: never cached), "side_effect" (writes
somewhere: never cached, and what runs after it keeps per-node keys) or "check" (a runtime
assertion of an exported graph: run at every call, never cached, nothing depends on it), from the
function, method, operator or module a node calls and its constant arguments; shape nodes
(x.shape, x.size(), x.device, aten.sym_size), which are sources like the inputs they describe.
Source statuses across calls: STABLE (same as last call), FRESH (changed once), VARYING (changed
on two calls in a row). Value helpers: plain (comparable) values and the tensors a value holds.
"""
from __future__ import annotations

import inspect
import operator
import weakref
from typing import Any

import torch
from torch import fx, nn
from torch.nn import functional as F

STABLE, FRESH, VARYING = 0, 1, 2
_MISS = object()

_RANDOM_FUNCTIONS = {
    torch.rand, torch.rand_like, torch.randn, torch.randn_like, torch.randint, torch.randint_like,
    torch.randperm, torch.bernoulli, torch.multinomial, torch.normal, torch.poisson, torch.rrelu,
    F.gumbel_softmax, F.rrelu,
}
# Dropout-like functions: random unless p is the constant 0 or training the constant False.
# name -> (position of p, position of training, keyword of training)
_DROPOUT_FUNCTIONS = {
    F.dropout: (1, 2, "training"), F.dropout1d: (1, 2, "training"), F.dropout2d: (1, 2, "training"),
    F.dropout3d: (1, 2, "training"), F.alpha_dropout: (1, 2, "training"),
    F.feature_alpha_dropout: (1, 2, "training"), torch.dropout: (1, 2, "train"),
    torch.alpha_dropout: (1, 2, "train"), torch.feature_dropout: (1, 2, "train"),
    torch.feature_alpha_dropout: (1, 2, "train"),
}
_SIDE_EFFECT_FUNCTIONS = {
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul, operator.iand, operator.ior,
    operator.ixor, operator.ilshift, operator.irshift, torch.empty, torch.empty_like, torch.empty_strided,
    print,
}
_RANDOM_METHODS = {"bernoulli", "multinomial", "random_", "uniform_", "normal_", "bernoulli_", "exponential_",
                   "geometric_", "cauchy_", "log_normal_"}
_SIDE_EFFECT_METHODS = {"backward", "register_hook", "retain_grad", "new_empty", "new_empty_strided", "record_stream",
                        "__setitem__", "__delitem__"}
_RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
                   nn.RReLU)
_PLAIN_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _is_plain(value: Any) -> bool:
    if isinstance(value, _PLAIN_TYPES):
        return True
    if type(value) in (tuple, list, torch.Size):
        return all(isinstance(v, _PLAIN_TYPES) for v in value)
    return False


def _tensors_of(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_of(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_of(v)]
    return []


def _argument(node: fx.Node, position: int, keyword: str, default: Any) -> Any:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(keyword, default)


def _function_kind(node: fx.Node) -> str:
    """'pure', 'random', 'side_effect' or 'check' for a call_function / call_method node."""
    target = node.target
    if node.op == "call_method":
        if target in _RANDOM_METHODS:
            return "random"
        if (target in _SIDE_EFFECT_METHODS or (target.endswith("_") and not target.endswith("__"))
                or (target.startswith("__i") and target.endswith("__")) or node.kwargs.get("inplace") is not None
                and node.kwargs.get("inplace") is not False):
            return "side_effect"
        return "pure"
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return _operator_kind(node)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return _subgraph_kind(node)
    if "out" in node.kwargs or target in _SIDE_EFFECT_FUNCTIONS or _writes_in_place(node):
        return "side_effect"
    if target in _RANDOM_FUNCTIONS:
        return "random"
    if target in _DROPOUT_FUNCTIONS:
        p_position, training_position, training_keyword = _DROPOUT_FUNCTIONS[target]
        if _argument(node, 3, "inplace", False) is not False:
            return "side_effect"
        p = _argument(node, p_position, "p", 0.5)
        training = _argument(node, training_position, training_keyword, True)
        return "pure" if training is False or (isinstance(p, (int, float)) and p == 0) else "random"
    if target is F.scaled_dot_product_attention:
        p = _argument(node, 4, "dropout_p", 0.0)
        return "pure" if isinstance(p, (int, float)) and p == 0 else "random"
    return "pure"


def _writes_in_place(node: fx.Node) -> bool:
    """torch.relu_-style functions, and functions called with inplace=True (or an inplace
    argument that is not the constant False)."""
    target = node.target
    name = getattr(target, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        return True
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False
    if "inplace" not in parameters:
        return False
    position = list(parameters).index("inplace")
    value = node.args[position] if len(node.args) > position else node.kwargs.get("inplace", False)
    return value is not False


_KIND_ORDER = ("pure", "check", "random", "side_effect")


def _operator_kind(node: fx.Node) -> str:
    """The kind of a node calling a torch.ops operator (as torch.export graphs do): from its schema
    (mutable: side effect), its tags (nondeterministic_seeded: random, unless its dropout is off),
    and its name (runtime assertions of exported graphs are checks: run at every call)."""
    target = node.target
    overloads = ([target] if isinstance(target, torch._ops.OpOverload)
                 else [getattr(target, name) for name in target.overloads()])
    name = overloads[0]._schema.name.split("::")[-1]
    if name.startswith("_assert") or name.startswith("sym_constrain_range"):
        return "check"
    if "out" in node.kwargs or any(op._schema.is_mutable for op in overloads):
        # torch.tensor(...) in forward exports as lift_fresh_copy then detach_: autograd metadata of a
        # fresh copy, nothing another node reads.
        if name == "detach_" and isinstance(node.args[0], fx.Node) and getattr(
                node.args[0].target, "__name__", "").startswith("lift_fresh_copy"):
            return "pure"
        return "side_effect"
    seeded = [op for op in overloads if torch.Tag.nondeterministic_seeded in op.tags]
    if seeded:
        return "pure" if all(_dropout_is_off(node, op) for op in seeded) else "random"
    if name.startswith("empty") or name.startswith("new_empty"):
        return "side_effect"
    return "pure"


def _dropout_is_off(node: fx.Node, op: torch._ops.OpOverload) -> bool:
    """A seeded operator that draws nothing: its train argument the constant False (dropout), or its
    dropout_p the constant 0 (attention)."""
    for position, argument in enumerate(op._schema.arguments):
        if argument.name not in ("train", "dropout_p"):
            continue
        if position < len(node.args) and not argument.kwarg_only:
            value = node.args[position]
        elif argument.name in node.kwargs:
            value = node.kwargs[argument.name]
        elif argument.has_default_value():
            value = argument.default_value
        else:
            return False
        if argument.name == "train" and value is False:
            return True
        if argument.name == "dropout_p" and type(value) in (int, float) and value == 0:
            return True
    return False


def _subgraph_kind(node: fx.Node) -> str:
    """A higher-order operator (wrap_with_set_grad_enabled, cond, ...) is what its subgraphs' nodes
    are at worst; one without a subgraph (auto_functionalized and the like) is a side effect."""
    owner = node.graph.owning_module
    kinds = []
    for argument in node.all_input_nodes:
        if argument.op != "get_attr" or owner is None:
            continue
        subgraph = owner
        for part in argument.target.split("."):
            subgraph = getattr(subgraph, part, None)
        if isinstance(subgraph, fx.GraphModule):
            kinds.extend(_function_kind(n) if n.op in ("call_function", "call_method") else "side_effect"
                         for n in subgraph.graph.nodes if n.op not in ("placeholder", "get_attr", "output"))
            kinds.append("pure")
    if not kinds:
        return "side_effect"
    return max(kinds, key=_KIND_ORDER.index)


def _random_in_training(module: nn.Module) -> bool:
    for m in module.modules():
        if isinstance(m, _RANDOM_MODULES):
            return True
        dropout = getattr(m, "dropout", None)
        if isinstance(dropout, float) and dropout > 0:
            return True
    return False


_SHAPE_ATTRIBUTES = {"shape", "ndim", "dtype", "device", "is_cuda", "layout"}
_SHAPE_OPERATORS = {"aten::sym_size", "aten::sym_numel", "aten::sym_stride", "aten::sym_storage_offset"}


def _is_shape_node(node: fx.Node) -> bool:
    """x.shape, x.size(), x.dim(), x.numel(), x.shape[1], x.device ...: values that say what a
    tensor is, not what it holds (torch.fx and torch.export spell them these ways)."""
    if node.op == "call_method":
        return node.target in ("size", "dim", "numel")
    if node.op == "call_function":
        if isinstance(node.target, torch._ops.OpOverload):
            return node.target._schema.name in _SHAPE_OPERATORS
        if node.target is getattr:
            return len(node.args) == 2 and node.args[1] in _SHAPE_ATTRIBUTES
        if node.target is operator.getitem:
            return isinstance(node.args[0], fx.Node) and _is_shape_node(node.args[0])
    return False


def _invalidation_hook(cache: torch.ScriptObject, node_id: int):
    """A grad_fn hook dropping node_id's entry: the graph behind the cached output is being freed
    (or was used once), so the next call recomputes it."""
    cache_ref = weakref.ref(cache)

    def on_backward(grad_inputs, grad_outputs):
        cache = cache_ref()
        if cache is not None:
            cache.invalidate_node(node_id)
    return on_backward
