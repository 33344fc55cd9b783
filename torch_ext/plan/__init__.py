"""Plan cache: plans per bucket of input sizes for serving at varying shapes (cache.py), over
TorchScript modules and torch.export programs (export.py, _compile.py)."""
from .cache import PlanCache

__all__ = ["PlanCache"]
