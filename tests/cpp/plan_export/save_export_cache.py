"""The fixture of the C++ restart test (test_plan_export.cpp): Python exports a tiny masked
encoder with a dynamic batch and sequence length, compiles two AOTInductor plans (static buckets,
to keep the compile short) and saves the cache; C++ then loads and serves it with no Python.

    python save_export_cache.py FOLDER

FOLDER/cache: the saved cache; FOLDER/script_cache: the same buckets as TorchScript plans (the
module's frozen TorchScript, plan_shapes 'script': no compile); FOLDER/reference.pt: a list
[x0, mask0, y0, x1, mask1, y1, ...] of requests and the eager model's outputs for them.
"""
import os
import shutil
import sys

import torch
import torch.nn.functional as F

import torch_ext


class MaskedEncoder(torch.nn.Module):
    """Token ids and an attention mask (1: attend, 0: padding) to per-token logits."""

    def __init__(self, vocab: int = 50, width: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, 5)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attend = mask[:, None, :].to(torch.bool)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=attend) + x)


def main(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    torch.manual_seed(0)
    model = MaskedEncoder().eval()
    batch, seq = torch.export.Dim("batch", min=1, max=4), torch.export.Dim("seq", min=2, max=16)
    example = (torch.randint(0, 50, (2, 8)), torch.ones(2, 8, dtype=torch.long))
    cache = torch_ext.PlanCache(model, example, {"ids": {0: batch, 1: seq}, "mask": {0: batch, 1: seq}},
                                buckets=[[4], [8, 16]], pad_values=[0, 0], dim_names=["batch", "seq"],
                                miss_mode="pad", plan_shapes="static",
                                inductor_configs={"aot_inductor.compile_wrapper_opt_level": "O0"})
    cache.preload([(4, 8), (4, 16)], progress=False)
    cache.save(os.path.join(folder, "cache"))
    scripted = torch_ext.PlanCache(model, example, {"ids": {0: batch, 1: seq}, "mask": {0: batch, 1: seq}},
                                   buckets=[[4], [8, 16]], pad_values=[0, 0], dim_names=["batch", "seq"],
                                   miss_mode="pad", plan_shapes="script")
    scripted.preload([(4, 8), (4, 16)], progress=False)
    scripted.save(os.path.join(folder, "script_cache"))
    reference = []
    with torch.no_grad():
        for n, length, valid in ((4, 8, 8), (3, 6, 6), (4, 16, 16), (2, 12, 9)):
            ids = torch.randint(1, 50, (n, length))
            mask = torch.ones(n, length, dtype=torch.long)
            mask[:, valid:] = 0  # the caller's own padding, masked out
            reference += [ids, mask, model(ids, mask)]
    torch.save(reference, os.path.join(folder, "reference.pt"))
    print(f"saved {cache.cached_buckets()} with {cache.stats().compiles} compiles to {folder}")


if __name__ == "__main__":
    main(sys.argv[1])
