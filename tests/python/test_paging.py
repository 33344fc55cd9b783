import copy
import json
import struct
import threading
import time

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import torch_ext
from torch_ext.demos import GPT, GPTConfig

CONFIG = GPTConfig(n_layer=3, n_embd=64, n_head=4, vocab_size=256, block_size=32)


@pytest.fixture(scope="module")
def gpt_file(tmp_path_factory):
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    path = tmp_path_factory.mktemp("gpt") / "gpt.safetensors"
    torch_ext.save_pageable(model, path)
    return model, path


@pytest.fixture(scope="module")
def batch():
    return torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size), generator=torch.Generator().manual_seed(1))


def weight_bytes(path):
    return torch_ext.SafetensorsSource(path).total_bytes()


def assert_untouched(model, reference):
    """The model still holds its own resident weights and no paging hooks."""
    assert not torch_ext.paging.is_paged(model)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert p.device.type == "cpu" and torch.equal(p, q), name
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def raw_file(path, header, data=b""):
    text = header if isinstance(header, (str, bytes)) else json.dumps(header)
    text = text.encode() if isinstance(text, str) else text
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


# ---------------------------------------------------------------- source


def test_source_reads_every_dtype_written_by_safetensors(tmp_path):
    tensors = {
        "f32": torch.randn(3, 4), "f16": torch.randn(5).half(), "bf16": torch.randn(2, 2).bfloat16(),
        "f64": torch.randn(3).double(), "i64": torch.arange(7), "i8": torch.arange(-3, 3, dtype=torch.int8),
        "u8": torch.arange(9, dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5),
    }
    path = tmp_path / "all.safetensors"
    save_file(tensors, path, metadata={"format": "pt", "who": "test"})
    source = torch_ext.SafetensorsSource(path)
    assert sorted(source.names()) == sorted(tensors)
    assert source.metadata() == {"format": "pt", "who": "test"}
    assert source.total_bytes() == sum(t.nbytes for t in tensors.values())
    for name, t in tensors.items():
        assert source.dtype(name) == t.dtype and source.shape(name) == t.shape and source.nbytes(name) == t.nbytes
        assert torch.equal(source.load(name), t), name
        assert torch.equal(source.view(name), t), name
    assert "f32" in source and "zz" not in source


def test_source_views_are_zero_copy_and_private(tmp_path):
    path = tmp_path / "v.safetensors"
    save_file({"w": torch.arange(1024, dtype=torch.float32)}, path)
    source = torch_ext.SafetensorsSource(path)
    view = source.view("w")
    view.zero_()  # copy-on-write: the file and other sources see the original bytes
    assert torch.equal(torch_ext.SafetensorsSource(path).load("w"), torch.arange(1024, dtype=torch.float32))
    del source
    assert view.sum().item() == 0  # the view keeps the mapping alive


def test_source_direct_io_reads_the_same_bytes(tmp_path):
    path = tmp_path / "d.safetensors"
    tensors = {f"t{i}": torch.randn(1000 + i) for i in range(5)}
    save_file(tensors, path)
    try:
        source = torch_ext.SafetensorsSource(path, direct_io=True)
    except RuntimeError as error:
        pytest.skip(f"O_DIRECT unsupported here: {error}")
    assert source.direct_io
    for name, t in tensors.items():
        assert torch.equal(source.load(name), t)


def test_sharded_checkpoint_is_one_source(tmp_path):
    save_file({"a": torch.randn(3)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": torch.randn(4), "c": torch.randn(2)}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": 36},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                       "c": "model-00002-of-00002.safetensors"}}))
    for path in (tmp_path, tmp_path / "model.safetensors.index.json"):
        source = torch_ext.SafetensorsSource(path)
        assert sorted(source.names()) == ["a", "b", "c"]
        assert len(source.files()) == 2
    (tmp_path / "bad.index.json").write_text(json.dumps({"weight_map": {"a": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(RuntimeError, match=r"bad\.index\.json.*\"a\""):
        torch_ext.SafetensorsSource(tmp_path / "bad.index.json")


def _good(tmp_path):
    path = tmp_path / "bad.safetensors"
    save_file({"w": torch.arange(4, dtype=torch.float32)}, path)
    return path


BAD_FILES = {
    "truncated header length": (lambda p: p.write_bytes(p.read_bytes()[:5]), "truncated"),
    "truncated data": (lambda p: p.write_bytes(p.read_bytes()[:-3]), r'"w".*out of range'),
    "absurd header length": (lambda p: p.write_bytes(struct.pack("<Q", 2**62) + p.read_bytes()[8:]),
                             "absurd header length"),
    "header longer than file": (lambda p: p.write_bytes(struct.pack("<Q", 10**6) + p.read_bytes()[8:]), "exceeds"),
    "malformed JSON": (lambda p: raw_file(p, '{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]', b"\0" * 16),
                       "malformed JSON"),
    "unknown dtype": (lambda p: raw_file(p, {"w": {"dtype": "F31", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16),
                      r'"w".*unknown dtype "F31"'),
    "out-of-range offsets": (lambda p: raw_file(p, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 32]}},
                                                b"\0" * 16), r'"w".*out of range'),
    "overlapping offsets": (lambda p: raw_file(p, {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 12]},
                                                   "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}},
                                               b"\0" * 16), r'"a".*"b".*overlapping'),
    "size differs from shape": (lambda p: raw_file(p, {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}},
                                                   b"\0" * 16), r'"w".*need 12'),
    "hole in the data": (lambda p: raw_file(p, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}},
                                            b"\0" * 16), r'"w".*holes'),
    "float in shape": (lambda p: raw_file(p, {"w": {"dtype": "F32", "shape": [4.0], "data_offsets": [0, 16]}},
                                          b"\0" * 16), "only integers"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_files_raise_naming_file_and_tensor(tmp_path, case):
    corrupt, pattern = BAD_FILES[case]
    path = _good(tmp_path)
    corrupt(path)
    with pytest.raises(RuntimeError, match=r"bad\.safetensors.*" + pattern):
        torch_ext.SafetensorsSource(path)
    model = nn.Linear(2, 2)
    reference = copy.deepcopy(model)
    with pytest.raises(RuntimeError, match=r"bad\.safetensors"):
        torch_ext.page_weights(model, path, 1 << 20)
    assert_untouched(model, reference)


def test_missing_file_raises(tmp_path):
    with pytest.raises(RuntimeError, match="absent.safetensors.*cannot open"):
        torch_ext.SafetensorsSource(tmp_path / "absent.safetensors")


# ---------------------------------------------------------------- pager


def _layers(tmp_path, n=8, floats=256):
    path = tmp_path / "layers.safetensors"
    save_file({f"t{i}": torch.full((floats,), float(i)) for i in range(n)}, path)
    return path


def test_pager_keeps_budget_and_held_tensors_stay_valid(tmp_path):
    pager = torch_ext.LayerPager(_layers(tmp_path), budget_bytes=3 * 1024)
    held = pager.acquire("t0")
    for i in range(1, 8):
        assert torch.equal(pager.acquire(f"t{i}"), torch.full((256,), float(i)))
        assert pager.resident_bytes() <= 3 * 1024
    assert pager.is_resident("t0")  # held by us: evicting it would free nothing
    assert torch.equal(held, torch.zeros(256))
    del held
    pager.acquire("t1")
    assert not pager.is_resident("t0")
    stats = pager.stats()
    assert stats.misses == 9 and stats.bytes_loaded == 9 * 1024 and stats.over_budget_loads == 0
    assert pager.resident_count() == 3 and pager.budget_bytes == 3 * 1024
    with pytest.raises(RuntimeError, match=r"layers\.safetensors.*\"nope\""):
        pager.acquire("nope")


def test_pinned_tensors_are_never_evicted_and_over_budget_is_flagged(tmp_path):
    path = _layers(tmp_path)
    pager = torch_ext.LayerPager(path, budget_bytes=2048, pinned=["t0"])
    for _ in range(2):
        for i in range(8):
            pager.acquire(f"t{i}")
    pager.evict_all()
    assert pager.is_pinned("t0") and pager.is_resident("t0") and not pager.is_pinned("t1")
    assert not pager.stats().pinned_over_budget
    over = torch_ext.LayerPager(path, budget_bytes=1500, pinned=["t0", "t1"])
    for i in range(8):
        over.acquire(f"t{i}")
    assert over.stats().pinned_over_budget is True
    assert over.is_resident("t0") and over.is_resident("t1")
    with pytest.raises(RuntimeError, match='pinned tensor "zz"'):
        torch_ext.LayerPager(path, budget_bytes=1, pinned=["zz"])


def test_scan_resistant_policy_hits_on_cyclic_sweeps_where_lru_does_not(tmp_path):
    path = _layers(tmp_path)
    rates = {}
    for policy in ("lru", "scan_resistant"):
        pager = torch_ext.LayerPager(path, budget_bytes=4 * 1024, policy=policy, prefetch=0)
        for sweep in range(5):
            pager.begin_pass()
            if sweep == 2:
                pager.reset_stats()
            for i in range(8):
                pager.acquire(f"t{i}")
        s = pager.stats()
        rates[policy] = s.hits / (s.hits + s.misses)
    assert rates["lru"] == 0
    assert rates["scan_resistant"] == pytest.approx(9 / 24)  # budget - 1 hits per sweep of 8


def test_concurrent_acquires_load_once(tmp_path):
    path = tmp_path / "big.safetensors"
    save_file({"w": torch.randn(1 << 20)}, path)
    pager = torch_ext.LayerPager(path, budget_bytes=8 << 20)
    barrier = threading.Barrier(6)
    got = []

    def work():
        barrier.wait()
        got.append(pager.acquire("w"))

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = pager.stats()
    assert stats.misses == 1 and stats.hits == 5 and stats.bytes_loaded == 4 << 20
    assert len({t.data_ptr() for t in got}) == 1


def test_pager_bad_arguments(tmp_path):
    path = _layers(tmp_path, n=1)
    with pytest.raises(ValueError, match="budget_bytes"):
        torch_ext.LayerPager(path, budget_bytes=-1)
    for bad in ("abc", "12 parsecs", "-1GB", "nan", 2**63, 2**200, float("inf"), [1]):
        with pytest.raises(ValueError, match="budget_bytes.*is not a byte budget"):
            torch_ext.LayerPager(path, budget_bytes=bad)
    with pytest.raises(ValueError, match="policy"):
        torch_ext.LayerPager(path, budget_bytes=1, policy="fifo")
    with pytest.raises(ValueError, match="prefetch"):
        torch_ext.LayerPager(path, budget_bytes=1, prefetch=-1)
    with pytest.raises(TypeError, match=r"^LayerPager: option prefetch takes int, got '2' \(str\)$"):
        torch_ext.LayerPager(path, budget_bytes=1, prefetch="2")
    with pytest.raises(TypeError, match=r"^SafetensorsSource: option direct_io takes bool, got 'yes' \(str\)$"):
        torch_ext.SafetensorsSource(path, direct_io="yes")
    with pytest.raises(RuntimeError, match="nodevice"):
        torch_ext.LayerPager(path, budget_bytes=1, device="nodevice")
    with pytest.raises(RuntimeError, match="device meta cannot be a target"):
        torch_ext.LayerPager(path, budget_bytes=1, device="meta")


def test_the_budget_is_also_positional_and_any_integer_type_is_a_byte_count(tmp_path):
    np = pytest.importorskip("numpy")
    path = _layers(tmp_path, n=2)
    assert torch_ext.LayerPager(path, 1 << 20).budget_bytes == 1 << 20          # the seed's spelling
    assert torch_ext.LayerPager(path, "50%").budget_bytes == torch_ext.SafetensorsSource(path).total_bytes() // 2
    for count in (np.int64(4096), np.uint32(4096), np.int16(2048), torch.tensor(4096)):
        assert torch_ext.LayerPager(path, count).budget_bytes == int(count), type(count)
    assert torch_ext.LayerPager(path, np.float32(4096.0)).budget_bytes == 4096
    assert torch_ext.LayerPager(path, budget_bytes={"cpu": np.int64(2048)}).budget_bytes == 2048
    with pytest.raises(TypeError, match="multiple values for argument 'budget_bytes'"):
        torch_ext.LayerPager(path, 1, budget_bytes=2)
    for bad, shown in ((object(), "builtins.object"), (np.array([1, 2]), "numpy.ndarray"), (b"1GB", "builtins.bytes")):
        with pytest.raises(ValueError, match=f"budget_bytes=.*a {shown}.* is not a byte budget: expected an int or "
                                             f"float of bytes.*\"1GB\".*__index__"):
            torch_ext.LayerPager(path, bad)


def test_dtype_converts_as_it_pages_and_zero_copy_is_the_cpu_default(tmp_path):
    path = _layers(tmp_path, n=3)
    source = torch_ext.SafetensorsSource(path)
    pager = torch_ext.LayerPager(path, source.total_bytes())
    assert pager.zero_copy and pager.dtype is None and pager.acquire("t1").data_ptr() == pager.source.view("t1").data_ptr()
    half = torch_ext.LayerPager(path, "100%", dtype=torch.float16, prefetch=0)
    assert half.dtype == "float16" and half.budget_bytes == source.total_bytes() // 2   # "100%" of what is resident
    for name in source.names():
        assert torch.equal(half.acquire(name), source.load(name).half())
    assert half.resident_bytes() == source.total_bytes() // 2
    with pytest.raises(ValueError, match=r"unknown dtype 'int8'; expected 'float32', 'float16', 'bfloat16' or 'float64'"):
        torch_ext.LayerPager(path, 1, dtype=torch.int8)


@pytest.mark.parametrize("stored, served", [(a, b) for a in (torch.float32, torch.float16, torch.bfloat16)
                                             for b in (torch.float32, torch.float16, torch.bfloat16) if a != b])
@pytest.mark.parametrize("zero_copy", [None, False])
def test_every_floating_point_conversion_equals_torchs_and_integers_stay_as_stored(tmp_path, stored, served, zero_copy):
    path = tmp_path / "mixed.safetensors"
    generator = torch.Generator().manual_seed(0)
    save_file({"w": (torch.randn(64, 300, generator=generator) * 100).to(stored), "ids": torch.arange(7)}, path)
    source = torch_ext.SafetensorsSource(path)
    pager = torch_ext.LayerPager(source, "100%", dtype=served, zero_copy=zero_copy, prefetch=0)
    weight, ids = pager.acquire("w"), pager.acquire("ids")
    assert weight.dtype == served and torch.equal(weight, source.load("w").to(served))
    assert ids.dtype == torch.int64 and torch.equal(ids, torch.arange(7))
    assert (ids.data_ptr() == source.view("ids").data_ptr()) == (zero_copy is None)   # views unless told not to
    assert pager.resident_bytes() == 64 * 300 * served.itemsize + 7 * 8


def test_torchscript_front_door(tmp_path):
    path = _layers(tmp_path, n=3)

    @torch.jit.script
    def total(pager: torch.classes.torch_ext.LayerPager, ids: list[str]) -> torch.Tensor:
        out = torch.zeros(256)
        pager.begin_pass()
        for i in ids:
            out = out + pager.acquire(i)
        return out

    @torch.jit.script
    def total_many(pager: torch.classes.torch_ext.LayerPager, ids: list[str]) -> torch.Tensor:
        out = torch.zeros(256)
        for t in pager.acquire_many(ids):
            out = out + t
        return out

    source = torch.classes.torch_ext.SafetensorsSource(str(path))
    pager = torch.classes.torch_ext.LayerPager(source, budget_bytes=1024, pinned=["t2"], policy="scan_resistant")
    assert torch.equal(total(pager, ["t0", "t1", "t2"]), torch.full((256,), 3.0))
    assert pager.is_pinned("t2") and pager.resident_bytes() <= 2048
    wrapped = torch_ext.LayerPager(path, budget_bytes=1024)
    assert torch.equal(total(wrapped.script_object, ["t1", "t1"]), torch.full((256,), 2.0))
    assert torch.equal(total_many(wrapped.script_object, ["t2", "t0", "t2"]), torch.full((256,), 4.0))
    assert [t[0].item() for t in wrapped.acquire_many(["t2", "t0"])] == [2.0, 0.0]


def test_the_hooks_binding_acquires_in_order_and_its_tensors_stay_held_while_alive(tmp_path):
    # torch_ext._C.paging.Pager is what the hooks around each paged module call.
    pager = torch_ext.LayerPager(_layers(tmp_path), budget_bytes=2 * 1024, zero_copy=False, prefetch=0)
    hot = torch_ext._C.paging.Pager(pager.script_object)
    held = hot.acquire_many(["t3", "t1"])
    assert isinstance(held, tuple) and [t[0].item() for t in held] == [3.0, 1.0]
    one = hot.acquire("t2")
    assert torch.equal(one, torch.full((256,), 2.0))
    for i in (4, 5, 6):
        pager.acquire(f"t{i}")
    assert all(pager.is_resident(f"t{i}") for i in (1, 2, 3))  # held, so not evicted
    assert pager.stats().hits + pager.stats().misses == 6
    del held, one
    for i in (4, 5):
        pager.acquire(f"t{i}")
    assert not pager.is_resident("t3") and pager.resident_bytes() <= 2 * 1024
    with pytest.raises(RuntimeError, match=r'layers.safetensors.*no tensor "t9"'):
        hot.acquire_many(["t0", "t9"])
    with pytest.raises(RuntimeError, match=r'layers.safetensors.*no tensor "t9"'):
        hot.acquire("t9")


# ---------------------------------------------------------------- page_weights


@pytest.mark.parametrize("policy,prefetch", [("lru", 0), ("scan_resistant", 0), ("scan_resistant", 4), ("auto", 1)])
def test_paged_outputs_equal_resident_within_budget(gpt_file, batch, policy, prefetch):
    model, path = gpt_file
    budget = weight_bytes(path) // 4
    paged = copy.deepcopy(model)
    pager = torch_ext.page_weights(paged, path, budget, policy=policy, prefetch=prefetch)
    # placeholders: no memory (meta storage), reporting the execution device
    assert all(p.is_meta and p.device == torch.device("cpu") for p in paged.parameters())
    peak = [0]
    for m in paged.modules():
        m.register_forward_hook(lambda *_: peak.__setitem__(0, max(peak[0], pager.resident_bytes())))
    with torch.no_grad():
        expected = model(batch)
        for _ in range(3):
            assert torch.equal(paged(batch), expected)
    stats = pager.stats()
    assert peak[0] <= budget and stats.over_budget_loads == 0
    assert pager.resident_bytes() <= budget
    assert pager.policy == ("scan_resistant" if policy == "auto" else policy)
    if not prefetch:
        assert stats.prefetches == 0
    # Whether the prefetcher wins a race against these tiny loads depends on scheduling; that it
    # loads ahead is asserted without a race in test_prefetcher_loads_the_next_tensor_ahead.


def test_prefetcher_loads_the_next_tensor_ahead(gpt_file, batch):
    model, path = gpt_file
    paged = copy.deepcopy(model)
    pager = torch_ext.page_weights(paged, path, weight_bytes(path), prefetch=1)
    with torch.no_grad():
        for _ in range(2):  # the first pass records the order
            paged(batch)
    order = pager.order()
    assert len(order) > 2 and order[0] != order[1]
    pager.evict_all()
    pager.begin_pass()
    first = pager.acquire(order[0])
    deadline = time.monotonic() + 30
    while not pager.is_resident(order[1]):  # nobody but the prefetcher acquires it
        assert time.monotonic() < deadline, f"the prefetcher never loaded {order[1]}"
        time.sleep(0.001)
    before = pager.stats()
    assert before.prefetches >= 1
    pager.acquire(order[1])
    after = pager.stats()
    assert after.prefetch_hits == before.prefetch_hits + 1 and after.misses == before.misses
    del first


def test_direct_io_paging_equals_resident(gpt_file, batch):
    model, path = gpt_file
    paged = copy.deepcopy(model)
    try:
        pager = torch_ext.page_weights(paged, torch_ext.SafetensorsSource(path, direct_io=True), weight_bytes(path) // 4,
                                       prefetch=4)
    except RuntimeError as error:
        pytest.skip(f"O_DIRECT unsupported here: {error}")
    assert pager.source.direct_io
    with torch.no_grad():
        expected = model(batch)
        for _ in range(2):
            assert torch.equal(paged(batch), expected)


def test_zero_copy_paging_maps_the_file_and_equals_resident(gpt_file, batch):
    model, path = gpt_file
    paged = copy.deepcopy(model)
    budget = weight_bytes(path) // 4
    pager = torch_ext.page_weights(paged, path, budget, prefetch=4, zero_copy=True)
    assert pager.zero_copy
    with torch.no_grad():
        expected = model(batch)
        for _ in range(2):
            assert torch.equal(paged(batch), expected)
    assert pager.resident_bytes() <= budget and pager.stats().over_budget_loads == 0
    key = "blocks.0.attn.qkv.weight"
    assert pager.acquire(key).data_ptr() == pager.source.view(key).data_ptr()  # no copy
    with pytest.raises(ValueError, match="zero_copy.*cpu"):
        torch_ext.LayerPager(path, budget_bytes=1, zero_copy=True, device="meta")


def test_scan_resistant_beats_lru_on_a_model(gpt_file, batch):
    model, path = gpt_file
    rates = {}
    for policy in ("lru", "scan_resistant"):
        paged = copy.deepcopy(model)
        pager = torch_ext.page_weights(paged, path, weight_bytes(path) // 2, policy=policy, prefetch=0)
        with torch.no_grad():
            for i in range(4):
                if i == 2:
                    pager.reset_stats()
                paged(batch)
        s = pager.stats()
        rates[policy] = s.hits / (s.hits + s.misses)
    assert rates["scan_resistant"] > rates["lru"] + 0.2


def test_tied_weights_are_loaded_once(gpt_file, batch):
    model, path = gpt_file
    paged = copy.deepcopy(model)
    pager = torch_ext.page_weights(paged, path, weight_bytes(path))
    assert paged.lm_head.weight is paged.wte.weight
    with torch.no_grad():
        paged(batch)
    # Every tensor exactly once, but for the position embedding: its rows are read, the table is
    # not loaded (the tied token embedding is loaded for lm_head).
    source = torch_ext.SafetensorsSource(path)
    assert pager.stats().bytes_loaded == weight_bytes(path) - source.nbytes("wpe.weight")
    assert pager.stats().misses == len(source.names()) - 1


def test_pinned_modules_stay_resident(gpt_file, batch):
    model, path = gpt_file
    paged = copy.deepcopy(model)
    pager = torch_ext.page_weights(paged, path, weight_bytes(path) // 3, pinned=["wte", "blocks.0.ln_1"])
    source = torch_ext.SafetensorsSource(path)
    key = "wte.weight" if "wte.weight" in source else "lm_head.weight"
    with torch.no_grad():
        for _ in range(2):
            paged(batch)
    assert pager.is_pinned(key) and pager.is_resident(key) and pager.is_resident("blocks.0.ln_1.weight")
    assert not pager.is_pinned("blocks.1.attn.qkv.weight")
    with pytest.raises(ValueError, match="pinned name 'nope'"):
        torch_ext.page_weights(copy.deepcopy(model), path, 1, pinned=["nope"])


def test_unpage_makes_the_model_resident_again(gpt_file, batch):
    model, path = gpt_file
    paged = copy.deepcopy(model)
    torch_ext.page_weights(paged, path, weight_bytes(path) // 4)
    torch_ext.unpage(paged)
    assert not torch_ext.paging.is_paged(paged)
    assert paged.lm_head.weight is paged.wte.weight
    assert all(p.device.type == "cpu" and p.requires_grad for p in paged.parameters())
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in paged.modules())
    with torch.no_grad():
        assert torch.equal(paged(batch), model(batch))
    with pytest.raises(ValueError, match="not paged"):
        torch_ext.unpage(paged)


class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.model = inner

    def forward(self, x):
        return self.model(x)


@pytest.mark.parametrize("mapping", ["add_prefix", "callable", "strip_prefix"])
def test_key_mapping_pages_checkpoints_written_by_other_tools(tmp_path, gpt_file, batch, mapping):
    model, _ = gpt_file
    if mapping == "strip_prefix":
        path = tmp_path / "plain.safetensors"
        torch_ext.save_pageable(model, path)
        target, kwargs = Wrapper(copy.deepcopy(model)), {"strip_prefix": "model."}
    else:
        path = tmp_path / "prefixed.safetensors"
        torch_ext.save_pageable(Wrapper(model), path)
        target = copy.deepcopy(model)
        kwargs = {"add_prefix": "model."} if mapping == "add_prefix" else {"key_map": lambda name: "model." + name}
    torch_ext.page_weights(target, path, weight_bytes(path) // 2, **kwargs)
    with torch.no_grad():
        assert torch.equal(target(batch), model(batch))


def test_buffers_can_be_paged(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).eval()
    model[1].running_mean.normal_()
    model[1].running_var.uniform_(0.5, 2)
    path = tmp_path / "bn.safetensors"
    torch_ext.save_pageable(model, path)
    paged = copy.deepcopy(model)
    torch_ext.page_weights(paged, path, 1 << 20, buffers=True)
    assert paged[1].running_mean.device.type == "meta"
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert torch.equal(paged(x), model(x))


def test_mismatches_raise_and_leave_the_model_untouched(tmp_path, gpt_file):
    model, path = gpt_file
    cases = {
        "missing tensor": ({k: v for k, v in model.state_dict().items() if k not in ("wte.weight", "lm_head.weight",
                                                                                       "blocks.1.mlp.fc.bias")},
                           r"'blocks\.1\.mlp\.fc\.bias'.*missing"),
        "shape": ({**{k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
                   "blocks.0.ln_1.weight": torch.ones(3)}, r"'blocks\.0\.ln_1\.weight' has shape \(3,\)"),
        # (a floating-point tensor in another floating-point dtype is converted as it is paged in)
        "dtype": ({**{k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
                   "ln_f.bias": torch.zeros(CONFIG.n_embd, dtype=torch.int32)}, r"'ln_f\.bias' is torch\.int32"),
    }
    for case, (tensors, pattern) in cases.items():
        file = tmp_path / f"{case.replace(' ', '_')}.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, file)
        target = copy.deepcopy(model)
        with pytest.raises(ValueError, match=file.name.replace(".", r"\.") + ".*" + pattern):
            torch_ext.page_weights(target, file, 1 << 20)
        assert_untouched(target, model)


def test_page_weights_bad_arguments(gpt_file):
    model, path = gpt_file
    target = copy.deepcopy(model)
    with pytest.raises(TypeError, match="nn.Module"):
        torch_ext.page_weights(object(), path, 1)
    with pytest.raises(ValueError, match="policy"):
        torch_ext.page_weights(target, path, 1, policy="mru")
    with pytest.raises(ValueError, match="budget_bytes"):
        torch_ext.page_weights(target, path, -5)
    with pytest.raises(ValueError, match="not both"):
        torch_ext.page_weights(target, path, 1, key_map=str, add_prefix="x")
    assert_untouched(target, model)
    torch_ext.page_weights(target, path, 1 << 20)
    with pytest.raises(RuntimeError, match="already paged"):
        torch_ext.page_weights(target, path, 1 << 20)
    with pytest.raises(ValueError, match="is paged"):
        torch_ext.save_pageable(target, path)


def test_a_failing_forward_still_releases_the_weights(gpt_file):
    model, path = gpt_file
    paged = copy.deepcopy(model)
    pager = torch_ext.page_weights(paged, path, weight_bytes(path))
    with pytest.raises(Exception):
        paged(torch.zeros(2, CONFIG.block_size + 5, dtype=torch.long))  # longer than the position table
    assert all(p.is_meta for p in paged.parameters())
    pager.evict_all()
    assert pager.resident_bytes() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_target_matches_resident_on_the_device(gpt_file, batch):
    model, path = gpt_file
    resident = copy.deepcopy(model).cuda()
    paged = copy.deepcopy(model)
    pager = torch_ext.page_weights(paged, path, weight_bytes(path) // 4, device="cuda", prefetch=2)
    with torch.no_grad():
        expected = resident(batch.cuda())
        for _ in range(2):
            assert torch.equal(paged(batch.cuda()), expected)
    assert pager.device.type == "cuda"
