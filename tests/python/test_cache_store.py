"""The lazy node cache's store on disk (LazyExecutor(store=...), torch_ext.cache.NodeStore): it
survives a restart, refuses changed and truncated files and a changed model, stays within its
budget, and several processes can write to one folder at once."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torch_ext import LazyExecutor
from torch_ext.cache import NodeStore
from torch_ext.demos import ConditionedDenoiser, sample

ROOT = Path(__file__).resolve().parents[2]

# Builds the model (seed from argv[2]), samples once with the store in argv[1], prints the nodes run and the stats.
SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from torch_ext import LazyExecutor
    from torch_ext.demos import ConditionedDenoiser, sample
    torch.manual_seed(int(sys.argv[2]))
    model = ConditionedDenoiser(width=64, encoder_layers=2, denoiser_layers=1, cond_tokens=16).eval()
    executor = LazyExecutor(model, store=sys.argv[1], store_budget_bytes=int(sys.argv[4]) if len(sys.argv) > 4 else None)
    latent = torch.ones(1, 8, 64)
    with torch.no_grad():
        for prompt in range(int(sys.argv[3]) if len(sys.argv) > 3 else 1):
            tokens = (torch.arange(16) + prompt).reshape(1, 16)
            got = sample(executor, latent, tokens, steps=4)
            assert torch.equal(got, sample(model, latent, tokens, steps=4)), prompt
    print(json.dumps({"computed": executor.stats().nodes_computed, **executor.store.stats().as_dict()}))
""")


def run(store, seed=0, prompts=1, budget=None):
    args = [sys.executable, "-c", SCRIPT, str(store), str(seed), str(prompts)] + ([str(budget)] if budget else [])
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def result(process):
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def model(seed=0):
    torch.manual_seed(seed)
    return ConditionedDenoiser(width=64, encoder_layers=2, denoiser_layers=1, cond_tokens=16).eval()


def computed(executor, module, tokens):
    before = executor.stats().nodes_computed
    latent = torch.ones(1, 8, 64)
    with torch.no_grad():
        assert torch.equal(sample(executor, latent, tokens, steps=4), sample(module, latent, tokens, steps=4))
    return executor.stats().nodes_computed - before


TOKENS = torch.arange(16).reshape(1, 16)


def test_the_store_survives_a_restart(tmp_path):
    first = result(run(tmp_path))
    assert first["writes"] > 0 and first["hits"] == 0
    second = result(run(tmp_path))  # a new process: the encoder (and the first step) come from disk
    assert second["hits"] > 0 and second["writes"] == 0 and second["computed"] < first["computed"]
    other_model = result(run(tmp_path, seed=1))  # other weights: nothing of the old model is used
    assert other_model["hits"] == 0 and other_model["computed"] == first["computed"]


@pytest.mark.parametrize("damage", ["changed", "truncated"])
def test_a_changed_or_truncated_file_is_a_miss_with_a_warning(tmp_path, damage):
    executor = LazyExecutor(model(), store=tmp_path)
    first = computed(executor, model(), TOKENS)
    for path in (tmp_path / "entries").glob("*.safetensors"):
        data = bytearray(path.read_bytes())
        if damage == "changed":
            data[-1] ^= 0xFF  # the last byte of the last tensor
        else:
            del data[len(data) // 2:]
        path.write_bytes(bytes(data))
    fresh = LazyExecutor(model(), store=tmp_path)  # a new executor: nothing in memory
    with pytest.warns(RuntimeWarning, match=damage if damage == "truncated" else "BLAKE2b"):
        assert computed(fresh, model(), TOKENS) == first
    stats = fresh.store.stats()
    assert stats.hits == 0 and stats.rejected > 0 and stats.writes > 0


def test_a_changed_model_never_hits_an_old_entry(tmp_path):
    module = model()
    first = computed(LazyExecutor(module, store=tmp_path), module, TOKENS)
    with torch.no_grad():
        module.encoder_norm.weight[0] += 1  # one weight
    executor = LazyExecutor(module, store=tmp_path)
    assert computed(executor, module, TOKENS) == first and executor.store.stats().hits == 0
    again = LazyExecutor(module, store=tmp_path)
    assert computed(again, module, TOKENS) < first and again.store.stats().hits > 0


def test_the_store_stays_within_its_budget(tmp_path):
    executor = LazyExecutor(model(), store=tmp_path, store_budget_bytes=10_000)
    for prompt in range(4):
        computed(executor, model(), TOKENS + prompt)
    stats = executor.store.stats()
    assert 0 < stats.bytes_on_disk <= 10_000 and stats.evictions > 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    files = {entry["file"] for entry in manifest["entries"].values()}
    assert files == {path.name for path in (tmp_path / "entries").glob("*.safetensors")}
    with pytest.raises(ValueError, match="budget_bytes must be None or an int >= 0"):
        NodeStore(tmp_path, budget_bytes=-1)


def test_processes_writing_to_one_store_at_once_leave_it_consistent(tmp_path):
    writers = [run(tmp_path, seed=0, prompts=6, budget=60_000) for _ in range(3)]
    stats = [result(process) for process in writers]
    # (a writer may find every entry already written by the others: which one writes is a race)
    assert sum(s["writes"] for s in stats) > 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    store = NodeStore(tmp_path)
    assert sum(entry["bytes"] for entry in manifest["entries"].values()) <= 60_000
    for key, entry in manifest["entries"].items():  # every listed file is whole
        data = (tmp_path / "entries" / entry["file"]).read_bytes()
        assert len(data) == entry["bytes"]
    assert not list(tmp_path.glob(".manifest-*")) and not list((tmp_path / "entries").glob(".writing-*"))
    assert store.stats().bytes_on_disk <= 60_000
    reader = result(run(tmp_path, seed=0, prompts=6))  # and what they left is served
    assert reader["hits"] > 0 and reader["rejected"] == 0
