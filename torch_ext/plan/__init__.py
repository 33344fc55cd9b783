"""Plan cache: plans per bucket of input sizes for serving at varying shapes (cache.py), over
TorchScript modules and torch.export programs (export.py, _compile.py), and a dynamic batcher in
front of it (batcher.py)."""
from .batcher import Batcher
from ._planning import DriftStats
from .cache import PlanCache

__all__ = ["Batcher", "DriftStats", "PlanCache"]
