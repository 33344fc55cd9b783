"""torch_ext: the memory toolkit for PyTorch models that do not fit.

Importing the package loads the core library (libtorch_ext.so: torch.ops.torch_ext.* and
torch.classes.torch_ext.*) and the Python bindings (torch_ext._C).
"""
from pathlib import Path

import torch

from .version import __version__

_LIBRARY = Path(__file__).resolve().parent / "libtorch_ext.so"


def library_path() -> str:
    """Path of libtorch_ext.so, for torch.ops.load_library in processes that do not import torch_ext."""
    return str(_LIBRARY)


if not _LIBRARY.is_file():
    raise ImportError(
        f"torch_ext: {_LIBRARY} is missing; build it with `pip install --no-build-isolation -e .`"
    )
torch.ops.load_library(str(_LIBRARY))

from . import _C  # noqa: E402, F401  (needs the core library loaded first)
from . import cache, checkpointing, memory, paging, plan  # noqa: E402
from .cache import LazyExecutor, NodeCache, lazy  # noqa: E402
from .checkpointing import (  # noqa: E402
    CheckpointedSequential, CheckpointPlan, OpPlan, checkpoint, checkpoint_call, checkpoint_sequential, plan_checkpoints,
    plan_ops)
from .paging import LayerPager, SafetensorsSource, load_paged, page_weights, pager_of, save_pageable, unpage  # noqa: E402
from .plan import Batcher, PlanCache  # noqa: E402

__all__ = [
    "__version__", "library_path", "memory",
    # segment checkpointing
    "checkpointing", "checkpoint", "checkpoint_call", "CheckpointedSequential", "CheckpointPlan", "checkpoint_sequential", "plan_checkpoints",
    "plan_ops", "OpPlan",
    # weight paging
    "paging", "LayerPager", "SafetensorsSource", "page_weights", "unpage", "save_pageable", "load_paged", "pager_of",
    # lazy node cache
    "cache", "LazyExecutor", "NodeCache", "lazy",
    # dynamic-batch plan cache
    "plan", "PlanCache", "Batcher",
]
