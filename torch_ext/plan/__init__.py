"""Plan cache: plans per bucket of input sizes for serving at varying shapes (cache.py), over
TorchScript modules and torch.export programs (export.py, _compile.py), and a dynamic batcher in
front of it (batcher.py)."""
from .batcher import Batcher
from .cache import DriftStats, PlanCache

__all__ = ["Batcher", "DriftStats", "PlanCache"]
