"""Plan cache: plans per bucket of input sizes for serving at varying shapes (cache.py), over
TorchScript modules and torch.export programs (export.py, _compile.py), buckets chosen from the
traffic it serves (traffic.py: the choice; _planning.py: from_traffic, replan and
replan_on_drift), and a dynamic batcher in front of it (batcher.py)."""
from .batcher import Batcher
from ._planning import DriftStats
from .cache import PlanCache

__all__ = ["Batcher", "DriftStats", "PlanCache"]
