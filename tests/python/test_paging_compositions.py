"""SafetensorsSource.composed: tensors made from stored tensors by layout ops (the checkpoint
conversions transformers applies while loading: experts stacked, projections concatenated or
split), served by a LayerPager like stored ones."""
import pytest
import torch
from safetensors.torch import save_file

import torch_ext


@pytest.fixture
def experts(tmp_path):
    """Two layers' per-expert gate/up/down weights, as Mixtral's checkpoints store them, and a
    fused qkv weight, in one file."""
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(2):
        for e in range(3):
            for part, shape in (("w1", (4, 6)), ("w3", (4, 6)), ("w2", (6, 4))):
                tensors[f"l{layer}.experts.{e}.{part}"] = torch.randn(shape, generator=generator)
    tensors["qkv"] = torch.randn(9, 6, generator=generator)
    tensors["norm"] = torch.randn(6, generator=generator)
    path = tmp_path / "experts.safetensors"
    save_file(tensors, path)
    return path, tensors


def gate_up(layer):
    """transformers' MergeModulelist(dim=0) then Concatenate(dim=1) of w1 and w3, as a program."""
    program = [f"tensor l{layer}.experts.{e}.w1" for e in range(3)] + ["stack 0 3"]
    program += [f"tensor l{layer}.experts.{e}.w3" for e in range(3)] + ["stack 0 3", "cat 1 2"]
    return program


def test_compositions_equal_torchs_ops_on_the_stored_tensors(experts):
    path, t = experts
    source = torch_ext.SafetensorsSource(path)
    composed = source.composed({
        "l0.gate_up": gate_up(0),
        "l0.down": [f"tensor l0.experts.{e}.w2" for e in range(3)] + ["stack 0 3", "transpose 1 2"],
        "q": ["tensor qkv", "narrow 0 0 3"],
        "kv": ["tensor qkv", "narrow 0 3 6", "reshape 2 3 6", "transpose 0 1"],
    })
    expected = {
        "l0.gate_up": torch.cat([torch.stack([t[f"l0.experts.{e}.{w}"] for e in range(3)]) for w in ("w1", "w3")], 1),
        "l0.down": torch.stack([t[f"l0.experts.{e}.w2"] for e in range(3)]).transpose(1, 2),
        "q": t["qkv"][:3],
        "kv": t["qkv"][3:].reshape(2, 3, 6).transpose(0, 1),
    }
    for name, want in expected.items():
        assert composed.meta(name).shape == want.shape and composed.dtype(name) == want.dtype
        assert composed.nbytes(name) == want.numel() * want.element_size()
        got = composed.load(name)
        assert torch.equal(got, want) and got.is_contiguous()
        assert not composed.has_view(name)
        with pytest.raises(RuntimeError, match=f'"{name}" is a composition of stored tensors.*load'):
            composed.view(name)
    # the source it was made from is unchanged; the stored tensors keep their views
    assert "l0.gate_up" not in source and set(source.names()) == set(t)
    assert composed.has_view("norm") and torch.equal(composed.view("l0.experts.0.w1"), t["l0.experts.0.w1"])


def test_names_list_each_composition_where_its_first_tensor_was(experts):
    path, t = experts
    composed = torch_ext.SafetensorsSource(path).composed({
        "l1.gate_up": gate_up(1),
        "q": ["tensor qkv", "narrow 0 0 3"],
        "k": ["tensor qkv", "narrow 0 3 3"],
    })
    names = composed.names()
    stored_order = torch_ext.SafetensorsSource(path).names()
    read = {f"l1.experts.{e}.{w}" for e in range(3) for w in ("w1", "w3")} | {"qkv"}
    assert [n for n in names if n not in ("l1.gate_up", "q", "k")] == [n for n in stored_order if n not in read]
    first_read = min(stored_order.index(n) for n in read if n.startswith("l1."))
    assert names.index("l1.gate_up") == len([n for n in stored_order[:first_read] if n not in read])
    assert names.index("q") == names.index("k") + 1          # both read qkv: listed together, in name order
    assert len(composed) == len(names)
    assert "l1.experts.0.w1" in composed                      # still readable, no longer listed


def test_a_pager_serves_compositions_within_its_budget(experts):
    path, t = experts
    composed = torch_ext.SafetensorsSource(path).composed({f"l{i}.gate_up": gate_up(i) for i in range(2)})
    want = {f"l{i}.gate_up": torch.cat([torch.stack([t[f"l{i}.experts.{e}.{w}"] for e in range(3)])
                                        for w in ("w1", "w3")], 1) for i in range(2)}
    one = composed.nbytes("l0.gate_up")
    for dtype in (None, torch.float64):
        options = {} if dtype is None else {"dtype": dtype}
        pager = torch_ext.LayerPager(composed, one * (2 if dtype else 1) + 64, **options)
        assert pager.zero_copy                                # the stored tensors are still views
        for _ in range(2):
            for name, expected in want.items():
                got = pager.acquire(name)
                assert torch.equal(got, expected.to(got.dtype)) and got.dtype == (dtype or torch.float32)
                del got
        stats = pager.stats()
        assert stats.evictions >= 2 and pager.resident_bytes() <= pager.budget_bytes
        assert stats.bytes_loaded == 4 * one * (2 if dtype else 1)


@pytest.mark.parametrize("programs, message", [
    ({"x": ["tensor nope"]}, r'composition "x": reads "nope", which the source does not hold'),
    ({"x": ["tensor qkv", "scale 2"]}, r'composition "x": "scale 2": unknown op "scale"'),
    ({"x": ["tensor qkv", "tensor norm"]}, r'composition "x": a program must leave one tensor, it leaves 2'),
    ({"x": ["cat 0 2"]}, r'composition "x": "cat 0 2": needs 2 tensor\(s\), the program has 0 before it'),
    ({"x": ["tensor qkv", "narrow 0 x 3"]}, r'"narrow 0 x 3": expected integers'),
    ({"x": ["tensor qkv", "tensor norm", "cat 0 2"]}, r'composition "x": "cat 0 2": does not apply to the stored '
                                                      r"tensors' shapes"),
    ({"x": ["tensor qkv", "narrow 0 5 9"]}, r'"narrow 0 5 9": does not apply to the stored tensors\' shapes'),
    ({"qkv": ["tensor norm"]}, r'composition "qkv": the source holds a tensor of that name \(a composition may '
                               r"take the name of a stored tensor only when it reads it"),
    ({"x": ["tensor qkv", "tensor i", "cat 0 2"]}, r'"cat 0 2": joins tensors of Float and Long \(the tensor i\)'),
])
def test_bad_programs_raise_naming_the_composition_and_the_op(experts, programs, message):
    path, t = experts
    save_file({**t, "i": torch.zeros(2, 6, dtype=torch.long)}, path)
    source = torch_ext.SafetensorsSource(path)
    with pytest.raises(ValueError, match=message):
        source.composed(programs)
    assert set(source.names()) == set(t) | {"i"}


def test_transformers_conversion_ops_record_the_programs_that_give_their_results(experts):
    """Each layout op of transformers' checkpoint conversions, run on load_paged's stand-ins of
    the stored tensors, records a program whose composition equals the op run on the tensors."""
    core = pytest.importorskip("transformers.core_model_loading")
    from torch_ext.paging.hf import _Layout

    path, t = experts
    source = torch_ext.SafetensorsSource(path)
    w1 = [f"l0.experts.{e}.w1" for e in range(3)]
    w3 = [f"l0.experts.{e}.w3" for e in range(3)]
    cases = [  # (ops, {source pattern: stored names}, target patterns)
        ([core.MergeModulelist(dim=0), core.Concatenate(dim=1)], {"w1": w1, "w3": w3}, ["gate_up"]),
        ([core.MergeModulelist(dim=0)], {"w2": [f"l0.experts.{e}.w2" for e in range(3)]}, ["down"]),
        ([core.Chunk(dim=0)], {"qkv": ["qkv"]}, ["q", "k", "v"]),
        ([core.Transpose(0, 1)], {"qkv": ["qkv"]}, ["qkv_t"]),
        ([core.Interleave(dim=0)], {"qkv": ["l0.experts.0.w2"]}, ["interleaved"]),
        ([core.Interleave(dim=1), core.Chunk(dim=1)], {"w1": ["l0.experts.1.w1"]}, ["a", "b"]),
    ]
    for ops, inputs, targets in cases:
        def run(tensor_of):
            collected = {pattern: [tensor_of(name) for name in names] for pattern, names in inputs.items()}
            for op in ops:
                collected = op.convert(collected, source_patterns=list(inputs), target_patterns=targets)
            return collected

        expected = run(lambda name: t[name])
        recorded = run(lambda name: _Layout.stored(source, name))
        composed = source.composed({name: layout.program for name, layout in recorded.items()})
        assert set(recorded) == set(expected) == set(targets)
        for name, want in expected.items():
            assert torch.equal(composed.load(name), want), (ops, name)
