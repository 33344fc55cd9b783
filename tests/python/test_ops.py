"""torch.library.opcheck with its default checks on every op of the torch_ext namespace.

Every registered op needs sample arguments here, so a new op cannot go unchecked. The checks that
cannot hold, and why, are listed in CANNOT_HOLD and in docs/architecture.md ("Ops and
torch.compile"); the test asserts that exactly those fail, so the list never goes stale.
"""
import pytest
import torch
from torch import nn
from torch.library import opcheck

import torch_ext

MEASURED = ("the op reads or changes the allocator's live counters; it is tagged "
            "data_dependent_output, so tracing refuses it and torch.compile graph-breaks and runs it "
            "in place")
CANNOT_HOLD = {
    ("install_counting_allocator", "test_aot_dispatch_dynamic"): MEASURED,
    ("uninstall_counting_allocator", "test_aot_dispatch_dynamic"): MEASURED,
    ("counting_allocator_installed", "test_aot_dispatch_dynamic"): MEASURED,
    ("memory_stats", "test_aot_dispatch_dynamic"): MEASURED,
    ("reset_peak_memory", "test_aot_dispatch_dynamic"): MEASURED,
    ("checkpoint_module", "test_aot_dispatch_dynamic"): (
        "the op runs a TorchScript module, whose parameters are real tensors, in the TorchScript "
        "interpreter; AOT tracing cannot see into it. Dynamo graph-breaks at a ScriptModule; under "
        "torch.compile use torch_ext.checkpoint, which is traced"),
}


def samples():
    x = torch.randn(4, 16, requires_grad=True)
    block = torch.jit.script(nn.Linear(16, 16))
    return {
        "checkpoint_boundary_bytes": ([x], "bf16"),
        "checkpoint_module": (block, [x], "keep", True, True),
        "counting_allocator_installed": (),
        "install_counting_allocator": (),
        "memory_stats": (),
        "reset_peak_memory": (),
        "uninstall_counting_allocator": (),
    }


def registered_ops():
    return sorted({name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
                   if name.startswith("torch_ext::")})


def test_every_registered_op_has_samples():
    assert torch_ext.library_path()
    assert registered_ops() == sorted(samples())


@pytest.mark.parametrize("name", registered_ops())
def test_op_passes_opcheck_or_fails_only_where_documented(name):
    try:
        results = opcheck(getattr(torch.ops.torch_ext, name).default, samples()[name], raise_exception=False)
    finally:
        torch.ops.torch_ext.install_counting_allocator()  # the samples uninstall it
    failed = {check for check, result in results.items() if result != "SUCCESS"}
    assert failed == {check for op, check in CANNOT_HOLD if op == name}, results


def test_documented_exceptions_are_in_the_docs():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    for op, check in CANNOT_HOLD:
        assert f"`{op}`" in text and check in text, op
