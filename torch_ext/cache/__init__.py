"""Lazy node cache: run a torch.fx / torch.export graph node by node and reuse the outputs of
nodes whose inputs did not change since they were computed.

    executor = torch_ext.LazyExecutor(model)          # or torch_ext.lazy(model)
    out = executor(x, cond)                           # same results as model(x, cond)

Which nodes are reused. A node's cached output is returned only when the C++ NodeCache
(torch_ext._C.cache.NodeCache, csrc/torch_ext/cache/node_cache.h) finds every input the same
live tensor at the same version, data pointer, storage, sizes, strides, offset, dtype, device
and requires_grad (and the same values for non-tensors), the same grad / inference / autocast
mode, and the cached output tensors unchanged in place. Graph inputs are also keyed by content
(content_keys, the default): a new tensor with the same bytes, dtype, sizes, strides and device
matches (confirmed by comparing the bytes), where NodeCacheOptions' rule says hashing pays
(content_key_fraction of the weights the cached work reads). With store=, outputs are also
kept on disk across processes (torch_ext.cache.store). For call_module nodes the module's
parameters, buffers and training flag are inputs too. Optimizer steps and other in-place
updates bump version counters, so everything that depends on the updated tensors recomputes.

Never cached: random nodes (dropout in training, torch.rand*/randn*/randint*/bernoulli/
multinomial/normal/poisson, random in-place methods, aten ops tagged nondeterministic_seeded,
scaled_dot_product_attention with dropout, modules of the Dropout family and RReLU in
training); nodes with side effects (in-place methods and operators, setitem, out= calls,
mutable aten ops, torch.empty*, modules holding buffers while in training mode: they may
update them, like BatchNorm's running statistics); nodes named in never_cache.

Reused subgraphs. Inputs, get_attr values and shapes of those (x.shape, x.size(), x.device)
are "sources". A source that changed on two calls in a row is treated as varying: nodes
depending on it are computed without looking them up or storing them (no overhead, no
memory), e.g. the noisy latent of a diffusion sampler or the tokens of a full-miss workload.
A node that is pure and depends only on pure nodes (nothing in its closure random, with side
effects, or written in place by such a node) is a function of its closure's sources and its
call_module nodes' parameters, buffers and training flags. Only the "frontier" of such a
subgraph is looked up and stored: nodes whose output is used by the graph output, by a node
that cannot be reused this call, or by a node that depends on a graph input or a changed
source the frontier node does not. Their key is those sources and that module state (checked
in C++ in one call), so an unchanged conditioning encoder costs one lookup, not one per
node, and its interior is neither run, looked up nor held. All lookups happen before any node
runs (the keys need no interior values); then only the nodes a missed frontier needs run, in
graph order. A frontier whose source changed this call is computed and stored without a
lookup. Nodes outside reusable subgraphs (downstream of random or side-effect nodes) keep the
per-node keys on their inputs. invalidate_node(name) drops the node's entry and every entry
whose subgraph contains the node, so that the node and what depends on it recompute.

Modules torch.fx cannot trace (most Hugging Face models) are exported instead, with non-strict
torch.export and the arguments of the first call, once per call signature (pytree structure,
non-tensor values, dtypes, training flags, grad and autocast modes; sizes are Dim.AUTO), with
one warning per executor; the exported graph runs the same way. See torch_ext.cache.exporting.

Training and gradients. An output computed with grad enabled keeps its autograd graph and is
reused as is, so gradients flow through every use of it into the same parameters (summed by
autograd, as the plain module's per-use graphs are). Once a backward pass runs through it,
its graph's saved tensors are freed: a hook on its grad_fn then invalidates the entry, and
the next call recomputes it. Outputs computed under no_grad are never returned with grad
enabled, nor the other way round.

Limitations (documented, not detected): writes that bypass version counters (`p.data.copy_`,
`p.data.mul_`, NumPy views, writes to inference tensors) are invisible: call invalidate()
after them, or write through `with torch.no_grad(): p.copy_(...)`, which is seen.
Assignments like `p.data = t` are seen (the storage changes). Nodes whose inputs are
inference tensors (torch.inference_mode) are never reused: use torch.no_grad(). Graph outputs
served from the cache are the same tensor objects as on the call that computed them: do
not modify them in place (if you do, the cache notices and recomputes, but references kept
from earlier calls see the change). A traced module's structure is captured once per
combination of its submodules' training flags; attributes read by plain Python code at
trace time (not tensors) are constants of the graph, and tracing refuses a random tensor it
would freeze (torch.randn(4, 8) drawn without an input). Modules torch.fx treats as leaves
(torch.nn modules, parametrized ones included) are one node each: their internal weight
preprocessing is reused only together with their output. A subgraph is reused whole or not
at all: when one of its parameters changes (an optimizer step) the whole closure of the
frontier recomputes, including the part upstream of that parameter. The cost an entry
reports for eviction is its subgraph's compute time (shared inputs counted per use). Costs are host
seconds, which on CUDA measure the launch rather than the kernel; they only order evictions.
"""

import copy
from typing import Any, Iterable

from torch import nn

from .executor import LazyExecutor, NodeCache
from .store import NodeStore, StoreStats


def lazy(module, never_cache: Iterable[Any] = (), **options: Any) -> LazyExecutor:
    """Shorthand for LazyExecutor(module, never_cache, **options)."""
    return LazyExecutor(module, never_cache=never_cache, **options)


def lazy_forward(module: nn.Module, never_cache: Iterable[Any] = (), **options: Any) -> LazyExecutor:
    """Routes module's calls through a LazyExecutor while the module stays the object it is, so code
    that holds it (a diffusers pipeline's `pipe.text_encoder`) keeps reading its attributes (config,
    dtype, device) and calling it. Returns the executor (stats, store); `del module.forward` undoes it.

    The executor runs a shallow copy of the module (sharing its parameter, buffer and submodule
    dictionaries, so weight updates and reassignments are seen) and module.forward becomes the
    executor's call. Options as LazyExecutor's (store=..., content_keys=..., ...)."""
    if "forward" in vars(module) or "forward" in module._modules:
        raise ValueError(f"lazy_forward: {type(module).__name__} already has a forward of its own "
                         f"(routed already? `del module.forward` first)")
    executor = LazyExecutor(copy.copy(module), never_cache=never_cache, **options)
    object.__setattr__(module, "forward", executor)  # an instance attribute, not a registered submodule
    return executor


__all__ = ["LazyExecutor", "NodeCache", "NodeStore", "StoreStats", "lazy", "lazy_forward"]
