"""PlanCache over torch.export programs: AOTInductor plans per bucket, compiled in Python, loaded
and run by the C++ core. Compiles take seconds each, so the models are tiny, the compiled caches
are module-scoped and saved once, and most tests load a saved folder (no compile)."""
import gc
import os
import subprocess
import sys

import pytest
import torch
from torch.export import Dim

from torch_ext import PlanCache

# The masked encoder is the C++ restart test's (one definition for both).
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "cpp", "plan_export"))
from save_export_cache import MaskedEncoder  # noqa: E402
from test_plan import Net as MLP  # noqa: E402  (pytest puts this folder on sys.path)

# The wrapper's C++ at -O0: compiles take a fraction of the time, the kernels are unchanged.
FAST = {"aot_inductor.compile_wrapper_opt_level": "O0"}


def close(got, want):
    # AOTInductor's fused kernels round differently from eager's: equal up to float rounding.
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def x(n: int) -> torch.Tensor:
    return torch.randn(n, 8)


def eager(module, *inputs):
    with torch.no_grad():
        return module(*inputs)


MLP_SHAPES = ({0: Dim("batch", max=16)},)


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    return MLP().eval()


@pytest.fixture(scope="module")
def mlp_folder(mlp, tmp_path_factory):
    """Plans at batch sizes 4 and 16 (every size its own bucket, so static), saved: 2 compiles."""
    cache = PlanCache(mlp, (x(2),), MLP_SHAPES, plan_shapes="static", inductor_configs=FAST, warmup_calls=1)
    cache.preload([4, 16], progress=False)
    assert cache.stats().compiles == 2
    for n in (4, 16):  # the plans equal eager (allclose) at their sizes
        inputs = x(n)
        close(cache(inputs), eager(mlp, inputs))
    folder = tmp_path_factory.mktemp("mlp") / "cache"
    cache.save(folder)
    return folder


def test_a_module_is_exported_with_its_dims_and_the_layout_comes_from_the_program(mlp, tmp_path):
    cache = PlanCache(mlp, (x(2),), MLP_SHAPES)  # exports; nothing compiles before a plan is needed
    assert cache.kind() == "export" and cache.stats().compiles == 0
    assert cache.batch_dims == [0] and cache.output_batch_dims == [0, 0] and cache.size_ranges == [[1, 16]]
    assert cache.dims == [] and len(cache.fingerprint) == 64
    program = torch.export.export(mlp, (x(2),), dynamic_shapes=MLP_SHAPES)
    assert PlanCache(program).fingerprint == cache.fingerprint
    torch.export.save(program, tmp_path / "mlp.pt2")
    assert PlanCache(tmp_path / "mlp.pt2").size_ranges == [[1, 16]]
    other = MLP().eval()
    assert PlanCache(other, (x(2),), MLP_SHAPES).fingerprint != cache.fingerprint


def test_the_script_object_keeps_its_program_file_after_the_python_cache_is_gone(mlp, tmp_path):
    # Scripted code may hold the script_object alone; saving it copies the program's file.
    cache = PlanCache(mlp, (x(2),), MLP_SHAPES, plan_shapes="static", inductor_configs=FAST, warmup_calls=1)
    cache.preload([2], progress=False)
    plans = cache.script_object
    del cache
    gc.collect()
    plans.save(str(tmp_path / "saved"))
    assert os.path.isfile(tmp_path / "saved" / "program.pt2")


def test_the_module_a_program_file_runs_on_a_miss_is_not_taken_for_the_one_it_was_exported_from(mlp, tmp_path):
    # A request no plan serves runs on the program's own module (program.module()). A script plan is
    # the frozen TorchScript of the nn.Module the program was exported from, which a file does not give.
    torch.export.save(torch.export.export(mlp, (x(2),), dynamic_shapes=MLP_SHAPES), tmp_path / "mlp.pt2")
    cache = PlanCache(tmp_path / "mlp.pt2", admit_after=2, warmup_calls=1)
    inputs = x(3)
    close(cache(inputs), eager(mlp, inputs))
    assert cache.stats().compiles == 0  # served by the program's module
    assert cache._program.eager_given() is None
    with pytest.raises(ValueError, match="needs the nn.Module the program is exported from"):
        cache._scripted_module(required=True)


def test_a_dim_with_no_maximum_serves_any_batch(mlp):
    # torch.export's unbounded maximum (int_oo) is a sympy number that says it is finite.
    cache = PlanCache(mlp, (x(2),), ({0: Dim("batch")},), plan_shapes="static", inductor_configs=FAST,
                      warmup_calls=1)
    assert cache.size_ranges == [[1, 0]]  # 0: no largest
    inputs = x(40)
    close(cache(inputs), eager(mlp, inputs))


def test_bad_sources_and_options_are_refused(mlp, tmp_path):
    with pytest.raises(TypeError, match="come from the exported program"):
        PlanCache(mlp, (x(2),), MLP_SHAPES, batch_dims=[0])
    with pytest.raises(ValueError, match="no dynamic dimension"):
        PlanCache(mlp, (x(2),))
    with pytest.raises(TypeError, match="for exported programs"):
        PlanCache(torch.jit.script(mlp), (x(2),))
    with pytest.raises(FileNotFoundError):
        PlanCache(tmp_path / "missing.pt2")
    with pytest.raises(ValueError, match="unknown plan_shapes"):
        PlanCache(mlp, (x(2),), MLP_SHAPES, plan_shapes="sometimes")


class Boxed:
    def __init__(self, tensor):
        self.tensor = tensor


class ReturnsABox(torch.nn.Module):
    # As a Hugging Face causal LM with its defaults returns a DynamicCache: a class torch.export cannot flatten.
    def forward(self, inputs):
        return inputs * 2, Boxed(inputs)


def test_a_module_torch_export_cannot_take_is_named_with_what_it_returned():
    with pytest.raises(RuntimeError, match=r"could not export ReturnsABox .* use_cache=False\. torch\.export said: "
                                           r"Found <class '.*Boxed'> in output"):
        PlanCache(ReturnsABox(), (x(2),), MLP_SHAPES)


@pytest.mark.parametrize("mode", ["pad", "split", "auto"])
def test_pad_split_and_auto_serve_misses_from_a_saved_cache_with_no_compile(mlp, mlp_folder, mode):
    cache = PlanCache(mlp_folder, miss_mode=mode, warmup_calls=1)
    assert cache.cached_sizes() == [4, 16] and cache.stats().compiles == 0
    # 3, 1: padded to 4 (split cannot make them from 4s and 16s, it would build them); 8, 12: split
    # into 4s, or padded to 16.
    sizes = (4, 8, 12, 16) if mode == "split" else (4, 3, 8, 12, 16, 1)
    for n in sizes:
        inputs = x(n)
        got, want = cache(inputs), eager(mlp, inputs)
        close(got, want)
        assert isinstance(got, tuple) and len(got) == 2  # the program's output structure
    s = cache.stats()
    assert s.compiles == 0 and s.hits == 2 and s.misses == len(sizes) - 2
    if mode == "pad":
        assert s.padded_calls == 4 and s.split_calls == 0
    if mode == "split":
        assert s.split_calls == 2 and s.padded_calls == 0
    if mode == "auto":
        assert s.padded_calls + s.split_calls == 4 and s.padded_calls >= 2


def test_exact_mode_compiles_the_missing_plan_in_the_request(mlp, mlp_folder):
    cache = PlanCache(mlp_folder, warmup_calls=1, inductor_configs=FAST)
    inputs = x(6)
    close(cache(inputs), eager(mlp, inputs))
    s = cache.stats()
    assert 6 in cache and s.compiles == 1 and s.builds == 3


def test_background_builds_compile_in_another_process_while_requests_are_padded(mlp, mlp_folder):
    cache = PlanCache(mlp_folder, miss_mode="pad", background_builds=True, warmup_calls=1, inductor_configs=FAST)
    inputs = x(6)
    close(cache(inputs), eager(mlp, inputs))  # served at once, padded to 16
    assert cache.stats().padded_calls == 1
    cache.wait_for_builds()
    assert 6 in cache and cache.stats().compiles == 1
    close(cache(inputs), eager(mlp, inputs))
    assert {z.batch_size: z.hits for z in cache.stats().sizes}[6] == 1


def test_a_fresh_process_serves_the_saved_cache_with_zero_compiles(mlp, mlp_folder, tmp_path):
    inputs = [x(n) for n in (4, 3, 16, 9)]
    torch.save([inputs, [eager(mlp, i) for i in inputs]], tmp_path / "reference.pt")
    code = f"""
import sys, torch, torch_ext
inputs, outputs = torch.load({str(tmp_path / 'reference.pt')!r})
cache = torch_ext.PlanCache({str(mlp_folder)!r}, miss_mode="pad", warmup_calls=1)
assert cache.traffic() == {{(4,): 1, (16,): 1}}, cache.traffic()  # the saved log: the fixture's two calls
for i, want in zip(inputs, outputs):
    torch.testing.assert_close(cache(i), want, rtol=1e-4, atol=1e-5)
s = cache.stats()
print(s.compiles, s.builds, s.calls, "torch._inductor.codecache" in sys.modules)
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(torch_ext_dir())),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    compiles, builds, calls, compiler_loaded = out.stdout.split()
    assert (compiles, builds, calls) == ("0", "2", "4")
    assert compiler_loaded == "False"  # the restart never needed Inductor's compiler


def torch_ext_dir() -> str:
    import torch_ext
    return os.path.dirname(torch_ext.__file__)


def test_a_folder_saved_from_another_program_is_refused(mlp_folder):
    torch.manual_seed(1)
    other = PlanCache(MLP().eval(), (x(2),), MLP_SHAPES)
    with pytest.raises(RuntimeError, match="different exported program"):
        other.load(mlp_folder)


def test_a_saved_folder_whose_manifest_is_not_the_pinned_one_is_refused_before_any_code_loads(mlp, mlp_folder,
                                                                                             tmp_path):
    import hashlib
    trusted = hashlib.sha256((mlp_folder / "manifest.txt").read_bytes()).hexdigest()
    pinned = PlanCache(mlp_folder, manifest_sha256=trusted)
    inputs = x(4)
    close(pinned(inputs), eager(mlp, inputs))
    assert pinned.stats().compiles == 0
    # Another folder (its manifest edited as an attacker would, its program and packages replaced
    # by bytes that could not load): refused by the pin, before any of them is opened.
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.txt").write_text((mlp_folder / "manifest.txt").read_text().replace("lower 4", "lower 3"))
    assert hashlib.sha256((other / "manifest.txt").read_bytes()).hexdigest() != trusted
    for name in os.listdir(mlp_folder):
        if name != "manifest.txt":
            (other / name).write_bytes(b"not a package")
    with pytest.raises(RuntimeError, match="refusing .*other: the SHA-256 of its manifest .* nothing in the folder "
                       "was loaded"):
        PlanCache(other, manifest_sha256=trusted)


def test_the_compile_request_holds_only_tensors_and_plain_values_and_is_read_weights_only(tmp_path):
    from torch_ext.plan import _compile
    path = str(tmp_path / "request.pt")
    request = dict(program="p.pt2", dim_of=[{0: 0, 1: 1}], upper=[8, 16], lower=[1, 1], dynamic=True,
                   example=[torch.randn(2, 3)], devices=["cpu"], package="p.pt2", threads=1,
                   inductor_configs={"aot_inductor.compile_wrapper_opt_level": "O0", "max_autotune": False})
    _compile.write_request(path, request)
    back = _compile.read_request(path)
    assert back.keys() == request.keys() and torch.equal(back["example"][0], request["example"][0])
    assert back["dim_of"] == request["dim_of"] and back["inductor_configs"] == request["inductor_configs"]
    # Anything else is refused when written, naming where it is...
    with pytest.raises(TypeError, match=r"request\['inductor_configs'\]\['hook'\] is a function"):
        _compile.write_request(path, {**request, "inductor_configs": {"hook": lambda: None}})
    # ...and a file holding an arbitrary object is refused when read (weights_only=True).
    torch.save({"program": MLP()}, path)
    with pytest.raises(Exception, match="Weights only load failed"):
        _compile.read_request(path)


def test_auto_builds_every_kind_measures_each_and_keeps_the_fastest(mlp):
    cache = PlanCache(mlp, (x(2),), MLP_SHAPES, buckets=[[8, 16]], plan_shapes="auto", inductor_configs=FAST,
                      warmup_calls=2)
    assert cache.has_script_module  # the MLP scripts: its frozen TorchScript is a third kind
    cache.preload([8], progress=False)  # the bucket of sizes 1..8
    s = cache.stats()
    z = {z.batch_size: z for z in s.sizes}[8]
    assert s.compiles == 2 and z.compiles == 2  # a static and a dynamic package; TorchScript compiles nothing
    measured = {"static": z.static_seconds, "dynamic": z.dynamic_seconds, "script": z.script_seconds}
    assert all(seconds > 0 for seconds in measured.values())
    assert z.shapes == min(measured, key=lambda kind: (measured[kind], kind != "static"))
    for n in range(1, 9):
        inputs = x(n)
        close(cache(inputs), eager(mlp, inputs))
    s = cache.stats()
    assert s.hits == 8 and s.compiles == 2
    # A static plan pads the smaller sizes of its bucket; the others run them as they are.
    assert (s.padded_elements > 0) == (z.shapes == "static")


def test_a_script_plan_serves_an_exported_programs_buckets_and_is_saved_and_loaded_with_them(mlp, tmp_path):
    cache = PlanCache(mlp, (x(2),), MLP_SHAPES, buckets=[[4, 16]], plan_shapes="script", warmup_calls=1)
    cache.preload([4, 16], progress=False)
    for n in (1, 3, 4, 9, 16):  # each size runs as it is: no padding
        inputs = x(n)
        close(cache(inputs), eager(mlp, inputs))
    s = cache.stats()
    assert [(z.batch_size, z.shapes) for z in s.sizes] == [(4, "script"), (16, "script")]
    assert s.compiles == 0 and s.padded_elements == 0
    folder = tmp_path / "cache"
    cache.save(folder)
    manifest = (folder / "manifest.txt").read_text()
    assert "plan 4 lower 1 script\n" in manifest and "file module.pt " in manifest

    served = PlanCache(str(folder))  # no module given: the saved frozen module serves
    restarted = PlanCache(mlp, (x(2),), MLP_SHAPES, buckets=[[4, 16]], plan_shapes="script", warmup_calls=1)
    assert restarted.load(folder) == 2
    for loaded in (served, restarted):
        for n in (2, 11):
            inputs = x(n)
            close(loaded(inputs), eager(mlp, inputs))
        assert [z.shapes for z in loaded.stats().sizes] == ["script", "script"] and loaded.stats().compiles == 0
    served.save(tmp_path / "again")  # the adopted module keeps its origin's hashes: the module loads it
    assert PlanCache(mlp, (x(2),), MLP_SHAPES, buckets=[[4, 16]], warmup_calls=1).load(tmp_path / "again") == 2

    other = MLP().eval()  # other weights: its scripted module would not serve the saved one
    with torch.no_grad():
        other.fc1.weight.add_(1)
    stranger = PlanCache(other, (x(2),), MLP_SHAPES, buckets=[[4, 16]], warmup_calls=1)
    with pytest.raises(RuntimeError, match="saved from a different (exported program|module)"):
        stranger.load(folder)


class Unscriptable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in (self.fc, self.fc))  # a generator: torch.export takes it, TorchScript not


def test_script_plans_need_the_module_in_eval_mode_and_scripting(mlp, tmp_path):
    with pytest.raises(ValueError, match=r"plan_shapes='script' needs a module torch.jit.script takes \(Unscriptable"):
        PlanCache(Unscriptable().eval(), (x(2),), MLP_SHAPES, plan_shapes="script")
    assert not PlanCache(Unscriptable().eval(), (x(2),), MLP_SHAPES).has_script_module  # 'auto': compiled kinds only
    training = MLP()
    with pytest.raises(ValueError, match=r"needs the module \(Net\) in eval mode"):
        PlanCache(training, (x(2),), MLP_SHAPES, plan_shapes="script")
    program = torch.export.export(mlp, (x(2),), dynamic_shapes=MLP_SHAPES)
    with pytest.raises(ValueError, match="needs the nn.Module the program is exported from"):
        PlanCache(program, plan_shapes="script")
    assert not PlanCache(program).has_script_module


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    return MaskedEncoder().eval()


def tokens(n: int, length: int, valid: int):
    ids = torch.randint(1, 50, (n, length))
    mask = torch.ones(n, length, dtype=torch.long)
    mask[:, valid:] = 0
    return ids, mask


@pytest.fixture(scope="module")
def encoder_cache(encoder):
    """Batch x sequence buckets, padded along the sequence with the mask's 0: 2 compiles."""
    batch, seq = Dim("batch", min=1, max=4), Dim("seq", min=2, max=16)
    cache = PlanCache(encoder, tokens(2, 8, 8), {"ids": {0: batch, 1: seq}, "mask": {0: batch, 1: seq}},
                      buckets=[[4], [8, 16]], pad_values=[0, 0], dim_names=["batch", "seq"], miss_mode="pad",
                      plan_shapes="static", inductor_configs=FAST, warmup_calls=1)
    cache.preload([(4, 8), (4, 16)], progress=False)
    return cache


def test_batch_and_sequence_are_bucketed_together_and_padded_positions_are_masked(encoder, encoder_cache):
    assert encoder_cache.dims == [[1, 1]] and encoder_cache.output_dims == [[1]]
    assert encoder_cache.cached_buckets() == [[4, 8], [4, 16]]
    before = encoder_cache.stats()
    for n, length, valid in ((4, 8, 8), (3, 5, 5), (1, 2, 2), (2, 9, 9), (4, 16, 11), (3, 13, 7)):
        inputs = tokens(n, length, valid)
        got = encoder_cache(*inputs)
        assert got.shape == (n, length, 5)
        close(got, eager(encoder, *inputs))
    s = encoder_cache.stats()
    assert s.compiles == before.compiles and s.hits - before.hits == 6
    assert s.padded_elements - before.padded_elements == (4 * 8 - 3 * 5) + (4 * 8 - 2) + (4 * 16 - 2 * 9) + (4 * 16 - 3 * 13)
    with pytest.raises(RuntimeError, match="seq 17 is above the largest size the module accepts, 16"):
        encoder_cache(*tokens(2, 17, 17))


def test_infer_batch_splits_a_large_batch_along_the_batch_only(encoder, encoder_cache):
    inputs = tokens(10, 12, 12)
    close(encoder_cache.infer_batch(*inputs), eager(encoder, *inputs))


def test_the_batcher_pads_requests_of_different_lengths_into_one_batch_and_slices_each_back(encoder, encoder_cache):
    import random
    import threading

    from torch_ext import Batcher

    errors = []
    # The clients submit in rounds: with batches only of 4 rows, a client that ran ahead could
    # finish while fewer than 4 others were left, whose requests would then never fill a batch.
    rounds = threading.Barrier(8)
    with Batcher(encoder_cache, max_batch_size=4, max_delay_ms=600_000, group_by_bucket=False) as batcher:
        def client(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(3):
                    length = rng.randint(2, 16)
                    inputs = tokens(1, length, rng.randint(1, length))
                    rounds.wait(timeout=60)
                    got = batcher(*inputs)
                    assert got.shape == (1, length, 5)
                    close(got, eager(encoder, *inputs))
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        workers = [threading.Thread(target=client, args=(seed,)) for seed in range(8)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        s = batcher.stats()
    assert not errors, errors[:3]
    # 8 clients, one request a round each, batches of 4 rows: full batches only.
    assert s.requests == 24 and s.batches == 6 and s.max_batch_rows == 4 and s.failed == 0


@pytest.mark.parametrize("group_by_bucket", [True, False])
def test_the_batcher_joins_only_requests_of_one_sequence_bucket_unless_told_otherwise(encoder, encoder_cache,
                                                                                     group_by_bucket):
    from torch_ext import Batcher

    # Lengths 5, 12, 6, 3: buckets 8, 16, 8, 8 of seq. The 4th request fills max_batch_size=4 rows.
    requests = [tokens(1, length, length) for length in (5, 12, 6, 3)]
    with Batcher(encoder_cache, max_batch_size=4, max_delay_ms=600_000, group_by_bucket=group_by_bucket) as batcher:
        assert batcher.group_by_bucket == group_by_bucket
        futures = [batcher.submit(*inputs) for inputs in requests]
        if group_by_bucket:
            # The oldest's bucket runs (3 rows, padded to 6 at most); the length-12 request waits for
            # rows of its own bucket, here until close() runs what is queued.
            futures[0].result(timeout=60)
            assert not futures[1].done()
    s = batcher.stats()
    for inputs, future in zip(requests, futures):
        got = future.result(timeout=0)
        assert got.shape == (1, inputs[0].shape[1], 5)
        close(got, eager(encoder, *inputs))
    assert (s.batches, s.max_batch_rows) == ((2, 3) if group_by_bucket else (1, 4))


def test_requests_queued_before_a_follow_are_grouped_by_the_new_caches_buckets(encoder, encoder_cache):
    from torch_ext import Batcher

    # Lengths 5 and 12 fall in seq buckets 8 and 16 of encoder_cache, in one bucket (16) of `wide`.
    # admit_after keeps `wide` from compiling: its misses run the program.
    batch, seq = Dim("batch", min=1, max=4), Dim("seq", min=2, max=16)
    wide = PlanCache(encoder, tokens(2, 8, 8), {"ids": {0: batch, 1: seq}, "mask": {0: batch, 1: seq}},
                     buckets=[[4], [16]], pad_values=[0, 0], dim_names=["batch", "seq"], miss_mode="pad",
                     admit_after=1_000_000, inductor_configs=FAST)
    requests = [tokens(1, 5, 5), tokens(1, 12, 12)]
    with Batcher(encoder_cache, max_batch_size=2, max_delay_ms=600_000) as batcher:
        first = batcher.submit(*requests[0])
        batcher.script_object.follow(wide.script_object)
        second = batcher.submit(*requests[1])  # 2 rows: the batch runs, both requests in it
        for inputs, future in zip(requests, (first, second)):
            close(future.result(timeout=60), eager(encoder, *inputs))
        s = batcher.stats()
    assert (s.batches, s.max_batch_rows) == (1, 2)
    assert wide.stats().calls == 1  # the batch ran on the cache it was grouped for


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(images))).mean((2, 3)))


def test_a_dynamic_plan_of_a_convolution_net_answers_each_batch_size_with_its_rows():
    # Traced at its range's largest batch, AOTInductor compiled this net into a package whose output
    # kept 16 rows for any batch; the cache traces a dynamic bucket inside its range.
    torch.manual_seed(0)
    net = ConvNet().eval()
    cache = PlanCache(net, (torch.randn(4, 3, 8, 8),), ({0: Dim("batch", max=16)},), buckets=[[16]],
                      plan_shapes="dynamic", inductor_configs=FAST, warmup_calls=1)
    cache.preload([16], progress=False)
    for n in (1, 3, 10, 16):
        images = torch.randn(n, 3, 8, 8)
        close(cache(images), eager(net, images))


class BertPooled(torch.nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        import transformers
        self.bert = transformers.BertModel(config)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=ids, attention_mask=mask).pooler_output


def test_a_dynamic_plan_over_a_hugging_face_bert_s_sequence_range_equals_eager():
    # Traced at a narrowed view of the example, export guarded the sequence on the view's stride
    # (!= the range's largest size) and refused the range; the cache traces a contiguous copy.
    import transformers
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    bert = BertPooled(config).eval()
    batch, seq = Dim("batch", min=1, max=4), Dim("seq", min=2, max=32)
    cache = PlanCache(bert, tokens(2, 8, 8), {"ids": {0: batch, 1: seq}, "mask": {0: batch, 1: seq}},
                      buckets=[[4], [32]], pad_values=[0, 0], plan_shapes="dynamic", inductor_configs=FAST,
                      warmup_calls=1)
    cache.preload([(4, 32)], progress=False)
    for n, length in ((1, 2), (3, 17), (4, 32)):
        ids, mask = tokens(n, length, length)
        close(cache(ids, mask), eager(bert, ids, mask))
