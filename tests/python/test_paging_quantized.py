"""load_paged over quantized checkpoints that from_pretrained dequantizes as it loads on a machine
without the method's kernels: transformers' fine-grained FP8 (float8_e4m3fn weights and their
per-block scales, `weight_scale_inv`; DeepSeek-V3's format) and gpt-oss's MXFP4 experts (packed
FP4 `_blocks` and E8M0 `_scales`). torch_ext pages the stored quantized bytes and dequantizes each
weight as it is paged in (a `dequantize` composition), dense and per-expert weights alike; other
quantization methods are refused by name."""
import json

import pytest
import torch
from safetensors.torch import save_file

import torch_ext

transformers = pytest.importorskip("transformers")
from quantized_checkpoints import fp8_folder, mxfp4_folder  # noqa: E402
from test_paging_architectures import ARCHITECTURES, build, check_equal  # noqa: E402

@pytest.fixture(autouse=True)
def one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3"])
def test_an_fp8_checkpoint_pages_as_from_pretrained_dequantizes_it(tmp_path, model_type):
    cls, changes, kind = ARCHITECTURES[model_type]
    build(model_type, cls, changes, torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size="20KB")
    quantized = fp8_folder(tmp_path / "bf16", tmp_path / "fp8", block=8)
    assert len(quantized) >= 8
    loaded = getattr(transformers, cls).from_pretrained(tmp_path / "fp8").eval()
    assert loaded.dtype == torch.bfloat16
    paged = torch_ext.load_paged(tmp_path / "fp8", "30%")
    pager = torch_ext.pager_of(paged)
    assert paged.dtype == torch.bfloat16 and pager.stats().bytes_loaded == 0
    names = pager.source.names()
    assert not any(name.endswith("_scale_inv") for name in names)   # each read with its weight
    dense = [key for key in quantized if ".experts." not in key]
    assert dense and all(key in names and not pager.source.has_view(key) for key in dense)
    check_equal(paged, loaded, kind)
    assert pager.stats().evictions > 0 and pager.resident_bytes() <= pager.budget_bytes
    # as from_pretrained's, the model is no longer quantized: state_dict() and save_pretrained give what
    # it computes with
    assert not hasattr(paged.config, "quantization_config") and not hasattr(loaded.config, "quantization_config")
    expected = loaded.state_dict()
    assert all(torch.equal(t, expected[k]) and t.dtype == expected[k].dtype for k, t in paged.state_dict().items())
    paged.save_pretrained(tmp_path / "saved")
    check_equal(getattr(transformers, cls).from_pretrained(tmp_path / "saved").eval(), loaded, kind)


def test_an_mxfp4_gpt_oss_checkpoint_pages_as_from_pretrained_dequantizes_it(tmp_path):
    cls, changes, kind = ARCHITECTURES["gpt_oss"]
    model = build("gpt_oss", cls, changes, torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    experts = mxfp4_folder(tmp_path / "bf16", tmp_path / "mxfp4")
    loaded = getattr(transformers, cls).from_pretrained(tmp_path / "mxfp4").eval()   # dequantized: no kernels here
    assert loaded.dtype == torch.bfloat16 and not hasattr(loaded.config, "quantization_config")
    paged = torch_ext.load_paged(tmp_path / "mxfp4", "30%")
    pager = torch_ext.pager_of(paged)
    names = pager.source.names()
    assert set(experts) <= set(names) and not any(name.endswith(("_blocks", "_scales")) for name in names)
    assert all(not pager.source.has_view(key) and pager.source.dtype(key) == torch.float32 for key in experts)
    check_equal(paged, loaded, kind)
    with pytest.raises(AssertionError):                  # quantizing changed the model: the check can fail
        check_equal(paged, model, kind)
    assert pager.stats().evictions > 0 and pager.resident_bytes() <= pager.budget_bytes
    assert not hasattr(paged.config, "quantization_config")


def test_an_fp8_checkpoint_dequantizes_into_the_dtype_asked_for(tmp_path):
    """The whole model in `dtype`, each dequantized weight rounded once from float32. (transformers
    5.23's from_pretrained(dtype=...) of an FP8 checkpoint mixes dtypes here, the dequantized
    weights in `dtype` and the rest in bf16, and its forward raises; its bf16 model is the
    reference: every float32 weight of ours rounds to its value, every float16 one is ours in
    float32 rounded.)"""
    cls, changes, kind = ARCHITECTURES["qwen3_moe"]
    build("qwen3_moe", cls, changes, torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size="20KB")
    fp8_folder(tmp_path / "bf16", tmp_path / "fp8", block=8)
    loaded = getattr(transformers, cls).from_pretrained(tmp_path / "fp8").eval()
    paged = {dtype: torch_ext.load_paged(tmp_path / "fp8", "30%", dtype=dtype) for dtype in (torch.float32, torch.float16)}
    expected = loaded.state_dict()       # state_dict(): dequantized weights in `dtype`, views as stored (bf16)
    fp32, fp16 = paged[torch.float32].state_dict(), paged[torch.float16].state_dict()
    assert all(torch.equal(t.to(expected[k].dtype), expected[k]) for k, t in fp32.items())
    assert all(torch.equal(t, fp32[k].to(t.dtype)) for k, t in fp16.items())
    batch = {"input_ids": torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))}
    with torch.no_grad():
        reference = loaded(**batch).logits.float()
        for dtype, model in paged.items():
            assert all(p.dtype == dtype for p in model.parameters())
            logits = model(**batch).logits
            assert logits.dtype == dtype
            torch.testing.assert_close(logits.float(), reference, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("suffix", [".scale", ".qscale_weight"])
def test_fp8_scales_in_the_other_spellings_transformers_reads(tmp_path, suffix):
    """"X.scale" (DeepSeek-V4) and "X.qscale_weight" (Mistral) name the scales of "X.weight", as
    transformers' FP8 quantizer renames them."""
    from safetensors.torch import load_file

    cls, changes, kind = ARCHITECTURES["llama"]
    build("llama", cls, changes, torch.bfloat16).save_pretrained(tmp_path / "bf16")
    fp8_folder(tmp_path / "bf16", tmp_path / "fp8", block=8)
    tensors = load_file(tmp_path / "fp8" / "model.safetensors")
    renamed = {k.removesuffix(".weight_scale_inv") + suffix if k.endswith(".weight_scale_inv") else k: t
               for k, t in tensors.items()}
    assert sum(k.endswith(suffix) for k in renamed) >= 8
    save_file(renamed, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    loaded = getattr(transformers, cls).from_pretrained(tmp_path / "fp8").eval()
    paged = torch_ext.load_paged(tmp_path / "fp8", "30%")
    assert not any(name.endswith(suffix) for name in torch_ext.pager_of(paged).source.names())
    check_equal(paged, loaded, kind)


def test_fp8_weights_differ_from_their_unquantized_values(tmp_path):
    """The test above would pass trivially if quantizing changed nothing: it changes the logits."""
    cls, changes, kind = ARCHITECTURES["llama"]
    model = build("llama", cls, changes, torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16", max_shard_size="20KB")
    fp8_folder(tmp_path / "bf16", tmp_path / "fp8", block=8)
    paged = torch_ext.load_paged(tmp_path / "fp8", "30%")
    with pytest.raises(AssertionError):
        check_equal(paged, model, kind)


@pytest.mark.parametrize("method", ["bitsandbytes", "gptq", "compressed-tensors", None])
def test_other_quantization_methods_are_refused_naming_the_method_and_the_config(tmp_path, method):
    cls, changes, _ = ARCHITECTURES["llama"]
    build("llama", cls, changes).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"config\.json declares {method!r} quantization.*not {method!r}"):
        torch_ext.load_paged(tmp_path, "30%")


def test_dequantize_equals_transformers_fp8_dequantization(tmp_path):
    """The composition op against transformers' own Fp8Dequantize, for the scale layouts
    checkpoints hold: blocks, per-expert grids, one per-tensor scale, E8M0 exponents, packed FP4
    in int8 (transformers' FP8 loader's FP4 experts), and every float8 type safetensors stores."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    generator = torch.Generator().manual_seed(0)
    cases = {
        "blocks": (torch.randn(24, 40, generator=generator).to(torch.float8_e4m3fn),
                   torch.rand(3, 5, generator=generator)),
        "experts": (torch.randn(4, 16, 8, generator=generator).to(torch.float8_e5m2),
                    torch.rand(4, 2, 1, generator=generator)),
        "per_tensor": (torch.randn(16, 8, generator=generator).to(torch.float8_e4m3fn),
                       torch.rand((), generator=generator)),
        "e8m0": (torch.randn(16, 16, generator=generator).to(torch.float8_e4m3fn),
                 torch.randint(110, 140, (2, 2), dtype=torch.uint8, generator=generator)),
        "fp4": (torch.randint(-128, 128, (8, 16), dtype=torch.int8, generator=generator),
                torch.rand(8, 2, generator=generator).bfloat16()),
        "e4m3fnuz": (torch.randn(16, 16, generator=generator).to(torch.float8_e4m3fnuz),
                     torch.rand(2, 2, generator=generator)),             # AMD's FP8 (safetensors F8_E4M3FNUZ)
        "e5m2fnuz": (torch.randn(16, 16, generator=generator).to(torch.float8_e5m2fnuz),
                     torch.rand(1, 1, generator=generator)),
    }
    save_file({**{k: q for k, (q, _) in cases.items()}, **{k + ".s": s for k, (_, s) in cases.items()}},
              tmp_path / "q.safetensors")
    source = torch_ext.SafetensorsSource(tmp_path / "q.safetensors")
    composed = source.composed({k: [f"tensor {k}", f"tensor {k}.s", "dequantize"] for k in cases})
    assert set(composed.names()) == set(cases)           # each took its weight's name; scales are read with it
    reference = Fp8Dequantize(None)
    for name, (values, scales) in cases.items():
        expected = reference._dequantize_one(values, scales, torch.float32)
        assert composed.dtype(name) == torch.float32 and composed.shape(name) == expected.shape
        assert torch.equal(composed.load(name), expected), name
    assert composed.has_view("blocks.s") and not composed.has_view("blocks")


def test_dequantizing_float32_values_leaves_the_stored_tensor_as_it_was(tmp_path):
    """Values already float32 are copied before the scales multiply them: the stored tensor is a
    view of the mapped file, and scaling it in place changed every later read of it."""
    values, scales = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([[2.0, 0.5]])
    save_file({"v": values, "s": scales}, tmp_path / "f32.safetensors")
    source = torch_ext.SafetensorsSource(tmp_path / "f32.safetensors")
    composed = source.composed({"x": ["tensor v", "tensor s", "dequantize"]})
    expected = values * scales.repeat_interleave(4, 1)
    assert torch.equal(composed.load("x"), expected) and torch.equal(composed.load("x"), expected)
    assert torch.equal(source.view("v"), values) and torch.equal(composed.view("v"), values)


@pytest.mark.parametrize("program, message", [
    (["tensor blocks", "tensor experts.s", "dequantize"], r'"dequantize": .*hold 4 grid\(s\) for the quantized '
                                                          r"tensor's 1"),
    (["tensor experts", "tensor blocks.s", "dequantize"], r"grid \(3, 5\) do not divide the quantized tensor's "
                                                          r"\(16, 8\)"),
    (["tensor blocks.s", "tensor blocks.s", "dequantize"], None),  # float values are their own values: valid
    (["tensor index", "tensor blocks.s", "dequantize"], r"the quantized tensor is Long"),
    (["tensor blocks", "dequantize"], r"needs 2 tensor\(s\), the program has 1"),
    (["tensor blocks", "tensor blocks.s", "dequantize 1"], r'expected "dequantize" \(it takes no arguments\)'),
])
def test_bad_dequantizations_raise_naming_the_composition_and_the_op(tmp_path, program, message):
    generator = torch.Generator().manual_seed(0)
    save_file({"blocks": torch.randn(24, 40, generator=generator).to(torch.float8_e4m3fn),
               "blocks.s": torch.rand(3, 5, generator=generator),
               "experts": torch.randn(4, 16, 8, generator=generator).to(torch.float8_e5m2),
               "experts.s": torch.rand(4, 2, 1, generator=generator),
               "index": torch.zeros(24, 40, dtype=torch.long)}, tmp_path / "q.safetensors")
    source = torch_ext.SafetensorsSource(tmp_path / "q.safetensors")
    if message is None:
        assert source.composed({"x": program}).shape("x") == (3, 5)
        return
    with pytest.raises(ValueError, match=r'composition "x": .*' + message):
        source.composed({"x": program})


def test_a_pager_dequantizes_fused_experts_part_by_part_in_its_dtype(tmp_path):
    """Eight FP8 experts stacked into one tensor and served in bf16: each expert is dequantized and
    converted into its slice of the result, so the largest allocation is one expert's float32
    values, not the fused tensor in float32 (twice the result's size)."""
    from torch.profiler import ProfilerActivity, profile

    generator = torch.Generator().manual_seed(0)
    stored, program = {}, []
    for e in range(8):
        stored[f"e{e}"] = torch.randn(256, 256, generator=generator).to(torch.float8_e4m3fn)
        stored[f"e{e}.s"] = torch.rand(2, 2, generator=generator)
        program += [f"tensor e{e}", f"tensor e{e}.s", "dequantize"]
    save_file(stored, tmp_path / "experts.safetensors")
    source = torch_ext.SafetensorsSource(tmp_path / "experts.safetensors").composed({"experts": program + ["stack 0 8"]})
    pager = torch_ext.LayerPager(source, "100%", dtype=torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        experts = pager.acquire("experts")
    expected = torch.stack([(stored[f"e{e}"].float().reshape(2, 128, 2, 128) * stored[f"e{e}.s"][:, None, :, None])
                            .reshape(256, 256) for e in range(8)]).bfloat16()
    assert torch.equal(experts, expected)
    largest = max(event.cpu_memory_usage for event in profiled.events())
    one_expert = 256 * 256 * 4
    assert one_expert <= largest < 2 * one_expert


def test_dequantize_compositions_from_torchscript(tmp_path):
    """The TorchScript extension's path: scripted code composes a dequantization over
    torch.classes.torch_ext.SafetensorsSource and pages it in bf16."""
    @torch.jit.script
    def dequantized(source: torch.classes.torch_ext.SafetensorsSource) -> torch.Tensor:
        composed = source.composed({"w": ["tensor w", "tensor w_scale_inv", "dequantize"]})
        pager = torch.classes.torch_ext.LayerPager(composed, budget_bytes=1 << 20, dtype="bfloat16")
        return pager.acquire("w")

    generator = torch.Generator().manual_seed(0)
    weight, scales = torch.randn(16, 32, generator=generator).to(torch.float8_e4m3fn), torch.rand(2, 4)
    save_file({"w": weight, "w_scale_inv": scales}, tmp_path / "w.safetensors")
    got = dequantized(torch.classes.torch_ext.SafetensorsSource(str(tmp_path / "w.safetensors")))
    expected = (weight.float().reshape(2, 8, 4, 8) * scales[:, None, :, None]).reshape(16, 32).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
