"""Save a TorchScript module that calls torch_ext ops, for examples/cpp/run_scripted_module.cpp.

Usage: python examples/save_scripted_module.py LIBTORCH_EXT_SO OUT.pt
Only torch is imported: the ops come from loading libtorch_ext.so, as any TorchScript user would.
"""
import sys
from typing import Tuple

import torch


class MeasuredDouble(torch.nn.Module):
    """Doubles its input and reports the CPU bytes and allocations that took."""

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, int, int]:
        before = torch.ops.torch_ext.memory_stats()
        y = x * 2
        after = torch.ops.torch_ext.memory_stats()
        return y, after[0] - before[0], after[2] - before[2]


def main() -> None:
    library, out = sys.argv[1], sys.argv[2]
    torch.ops.load_library(library)
    torch.jit.script(MeasuredDouble()).save(out)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
