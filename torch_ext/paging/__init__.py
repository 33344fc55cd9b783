"""Weight paging: run models whose weights do not fit in memory, loading them from safetensors
files on demand within a byte budget.

    model = torch_ext.load_paged("gpt2-folder", "25%")           # a Hugging Face folder, one call
    source = torch_ext.SafetensorsSource("model.safetensors")     # or an index.json / folder
    pager = torch_ext.page_weights(model, source, budget_bytes=2**30)   # a model you built
    model(x)                       # each module's weights are acquired just before its forward
    pager.stats()                  # hits, misses, evictions, bytes_loaded, stall_seconds, ...
    torch_ext.unpage(model)        # resident again

The pager itself (C++: torch_ext::paging::LayerPager) is torch.classes.torch_ext.LayerPager;
LayerPager and SafetensorsSource here are thin Python faces over those classes (their
`script_object` is what TorchScript code takes).

Modules: source (the faces, budgets), install (page_weights, unpage, hooks, state_dict),
placeholder (PagedParameter), training (backward through paged weights), hf (load_paged).
"""
from .hf import load_paged
from .install import is_paged, page_weights, pager_of, save_pageable, unpage
from .placeholder import PagedParameter
from .source import LayerPager, SafetensorsSource, resolve_budget

__all__ = ["SafetensorsSource", "LayerPager", "PagedParameter", "page_weights", "unpage", "save_pageable",
           "is_paged", "pager_of", "load_paged", "resolve_budget"]
