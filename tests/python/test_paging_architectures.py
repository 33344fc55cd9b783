"""load_paged over the checkpoints people download (issue 24): a sweep of transformers
architectures, each built from a small config, saved sharded by save_pretrained and loaded with
torch_ext.load_paged (no key_map, no other option) against from_pretrained in the same dtype;
experts transformers fuses while loading are paged as compositions of the stored tensors; a bf16
checkpoint served as fp32 and fp16."""
import warnings

import pytest
import torch

import torch_ext

transformers = pytest.importorskip("transformers")

VOCAB = 128
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB,
             max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
KV = dict(num_key_value_heads=2)

# model_type: (class, config changes, inputs: "causal" | "masked" | "seq2seq" | "image")
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", KV, "causal"),
    "mistral": ("MistralForCausalLM", KV, "causal"),
    "qwen2": ("Qwen2ForCausalLM", KV, "causal"),
    "qwen3": ("Qwen3ForCausalLM", {**KV, "head_dim": 8}, "causal"),
    "gemma": ("GemmaForCausalLM", {**KV, "head_dim": 8}, "causal"),
    "gemma2": ("Gemma2ForCausalLM", {**KV, "head_dim": 8}, "causal"),
    "phi": ("PhiForCausalLM", {}, "causal"),
    "phi3": ("Phi3ForCausalLM", KV, "causal"),
    "gpt2": ("GPT2LMHeadModel", {}, "causal"),
    "gpt_neox": ("GPTNeoXForCausalLM", {}, "causal"),    # checkpoints name the head embed_out
    "opt": ("OPTForCausalLM", dict(ffn_dim=64, word_embed_proj_dim=32), "causal"),
    "falcon": ("FalconForCausalLM", {}, "causal"),
    "bloom": ("BloomForCausalLM", dict(n_head=4), "causal"),
    "gptj": ("GPTJForCausalLM", dict(rotary_dim=4), "causal"),
    "stablelm": ("StableLmForCausalLM", KV, "causal"),
    "olmo": ("OlmoForCausalLM", {}, "causal"),
    "starcoder2": ("Starcoder2ForCausalLM", KV, "causal"),
    "granitemoe": ("GraniteMoeForCausalLM", dict(KV, num_local_experts=4, num_experts_per_tok=2), "causal"),
    # transformers stacks (and concatenates) these experts' stored tensors while loading
    "mixtral": ("MixtralForCausalLM", dict(KV, num_local_experts=4, num_experts_per_tok=2), "causal"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(KV, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=32), "causal"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(KV, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              head_dim=8), "causal"),
    "olmoe": ("OlmoeForCausalLM", dict(KV, num_experts=4, num_experts_per_tok=2), "causal"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                                                  kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                                                  qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1), "causal"),
    "gpt_oss": ("GptOssForCausalLM", dict(KV, num_local_experts=4, num_experts_per_tok=2, head_dim=8), "causal"),
    "bert": ("BertForMaskedLM", {}, "masked"),
    "roberta": ("RobertaForMaskedLM", dict(pad_token_id=1), "masked"),
    "distilbert": ("DistilBertForMaskedLM", dict(dim=32, n_heads=4, hidden_dim=64, n_layers=2), "masked"),
    "electra": ("ElectraForMaskedLM", dict(embedding_size=32), "masked"),
    "t5": ("T5ForConditionalGeneration", dict(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8,
                                              decoder_start_token_id=0), "seq2seq"),
    "bart": ("BartForConditionalGeneration", dict(d_model=32, encoder_layers=2, decoder_layers=2,
                                                  encoder_attention_heads=4, decoder_attention_heads=4,
                                                  encoder_ffn_dim=64, decoder_ffn_dim=64), "seq2seq"),
    "vit": ("ViTForImageClassification", dict(image_size=32, patch_size=8, num_labels=3), "image"),
}
@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """The comparisons are bit for bit. With two intra-op threads, torch's CPU matmul sometimes
    computed the reference model's own first forward differently in the last bit from the same
    product called again (BLOOM's lm_head: one row of the batch, about once in 20 runs); one
    thread makes each product the same computation every time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(model_type, cls, changes, dtype=torch.float32):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **{**SMALL, **changes})
    return getattr(transformers, cls)(config).to(dtype).eval()


def inputs_for(kind):
    generator = torch.Generator().manual_seed(1)
    if kind == "image":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=generator)}
    tokens = torch.randint(3, VOCAB, (2, 12), generator=generator)
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0                                   # a padded row: masks are honoured alike
    batch = {"input_ids": tokens, "attention_mask": mask}
    if kind == "seq2seq":
        batch["decoder_input_ids"] = torch.randint(3, VOCAB, (2, 5), generator=generator)
    return batch


def check_equal(paged, loaded, kind):
    batch = inputs_for(kind)
    with torch.no_grad():
        expected = loaded(**batch).logits
        assert torch.equal(paged(**batch).logits, expected)
    if kind in ("causal", "seq2seq"):
        prompt = {k: v for k, v in batch.items() if k != "decoder_input_ids"}
        options = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(paged.generate(**prompt, **options), loaded.generate(**prompt, **options))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """model_type -> {dtype: a save_pretrained folder, sharded}, written once per dtype."""
    made = {}

    def folder(model_type, dtype):
        if (model_type, dtype) not in made:
            cls, changes, _ = ARCHITECTURES[model_type]
            path = tmp_path_factory.mktemp(f"{model_type}-{str(dtype)[6:]}")
            build(model_type, cls, changes, dtype).save_pretrained(path, max_shard_size="20KB")
            assert (path / "model.safetensors.index.json").exists()
            made[model_type, dtype] = path
        return made[model_type, dtype]
    return folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_load_paged_equals_from_pretrained(folders, model_type, dtype):
    cls, _, kind = ARCHITECTURES[model_type]
    folder = folders(model_type, dtype)
    loaded = getattr(transformers, cls).from_pretrained(folder, dtype=dtype).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)    # no budget warning: 30% holds the largest tensor here
        paged = torch_ext.load_paged(folder, "30%")
    pager = torch_ext.pager_of(paged)
    assert pager.stats().bytes_loaded == 0             # set-up read no weight
    assert paged.dtype == dtype and pager.zero_copy    # the file's dtype: views of the mapped file
    expected = loaded.state_dict()                     # every weight and buffer, in from_pretrained's dtype
    state = paged.state_dict()
    assert set(state) == set(expected)
    assert all(torch.equal(t, expected[k]) and t.dtype == expected[k].dtype for k, t in state.items()), \
        [k for k, t in state.items() if not (torch.equal(t, expected[k]) and t.dtype == expected[k].dtype)]
    check_equal(paged, loaded, kind)
    assert pager.stats().evictions > 0 and pager.resident_bytes() <= pager.budget_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["as-fp32", "as-fp16"])
@pytest.mark.parametrize("model_type", ["llama", "gpt_neox", "t5", "mixtral"])
def test_a_bf16_checkpoint_converts_as_it_is_paged_in(folders, model_type, dtype):
    cls, _, kind = ARCHITECTURES[model_type]
    folder = folders(model_type, torch.bfloat16)
    loaded = getattr(transformers, cls).from_pretrained(folder, dtype=dtype).eval()
    budget = "60%" if model_type == "mixtral" else "30%"  # a fused gate_up_proj is half this small model
    paged = torch_ext.load_paged(folder, budget, dtype=dtype)
    pager = torch_ext.pager_of(paged)
    assert paged.dtype == dtype and pager.dtype == str(dtype)[6:]
    assert not pager.is_resident(pager.source.names()[0]) and pager.stats().bytes_loaded == 0
    check_equal(paged, loaded, kind)
    stats = pager.stats()
    # the budget counts converted bytes: 30% of the file's bf16 bytes hold fewer converted tensors
    assert pager.resident_bytes() <= pager.budget_bytes and stats.over_budget_loads == 0
    assert stats.bytes_loaded > 0 and stats.bytes_loaded % (dtype.itemsize) == 0


def test_an_fp32_checkpoint_serves_bf16_and_the_budget_counts_converted_bytes(folders):
    folder = folders("llama", torch.float32)
    paged = torch_ext.load_paged(folder, "100%", dtype=torch.bfloat16)
    loaded = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    check_equal(paged, loaded, "causal")
    pager = torch_ext.pager_of(paged)
    # every tensor resident, in bf16: half the file's fp32 bytes; but the token embedding, whose
    # rows are read from the file by each lookup
    embedding = "model.embed_tokens.weight"
    assert not pager.is_resident(embedding)
    assert pager.resident_count() == len(pager.source) - 1
    assert pager.resident_bytes() * 2 == pager.source.total_bytes() - pager.source.nbytes(embedding)


def test_the_model_is_built_in_the_configs_dtype_as_from_pretrained_builds_it(folders, tmp_path):
    """from_pretrained's dtype="auto" takes config.json's dtype before the file's: an fp32 file
    whose config says bfloat16 gives a bf16 model, each weight converted as it is paged in."""
    import json
    import shutil

    shutil.copytree(folders("llama", torch.float32), tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert config["dtype"] == "float32"
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()
    paged = torch_ext.load_paged(tmp_path / "llama", "30%")
    assert loaded.dtype == paged.dtype == torch.bfloat16
    check_equal(paged, loaded, "causal")


FUSED_WHILE_LOADING = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"]


@pytest.mark.parametrize("model_type", FUSED_WHILE_LOADING)
def test_experts_fused_while_loading_are_compositions_of_the_stored_tensors(folders, tmp_path, model_type):
    cls, _, kind = ARCHITECTURES[model_type]
    folder = folders(model_type, torch.float32)
    stored = torch_ext.SafetensorsSource(folder)
    assert any(".experts.0." in name for name in stored.names())       # the file holds one tensor per expert
    paged = torch_ext.load_paged(folder, "30%")
    source = torch_ext.pager_of(paged).source
    fused = [name for name in source.names() if not source.has_view(name)]
    assert fused and all(".experts." in name for name in fused)
    assert not any(".experts.0." in name for name in source.names())
    assert set(fused) <= set(dict(paged.named_parameters()))               # one pager entry per fused parameter
    # state_dict() reads them through the source; save_pretrained writes transformers' original format
    paged.save_pretrained(tmp_path)
    assert any(".experts.0." in name for name in torch_ext.SafetensorsSource(tmp_path).names())
    again = getattr(transformers, cls).from_pretrained(tmp_path).eval()
    check_equal(paged, again, kind)
    torch_ext.unpage(paged)                                                  # the fused tensors, resident
    assert not torch_ext.paging.is_paged(paged)
    check_equal(paged, again, kind)


class Doubled(transformers.core_model_loading.ConversionOps):
    """A conversion that computes (not a layout op)."""

    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        return {target_patterns[0]: torch.mul(next(iter(input_dict.values())), 2)}


def test_a_conversion_that_computes_is_refused_naming_the_parameter_and_the_op(folders, monkeypatch):
    import transformers.conversion_mapping as mapping

    folder = folders("mixtral", torch.float32)  # saved before the patch: save_pretrained reverses the mapping
    original = mapping.get_model_conversion_mapping

    def computing(model, *args, **kwargs):
        transforms = original(model, *args, **kwargs)
        converters = [t for t in transforms if isinstance(t, transformers.core_model_loading.WeightConverter)]
        down = next(c for c in converters if len(c.source_patterns) == 1)
        down.operations = [*down.operations, Doubled()]
        return transforms

    monkeypatch.setattr(mapping, "get_model_conversion_mapping", computing)
    with pytest.raises(ValueError, match=r"parameter 'model\.layers\.0\.mlp\.experts\.down_proj' of "
                                         r"MixtralForCausalLM is made by transformers' checkpoint conversion .*"
                                         r"which applies .*mul.*save_original_format=False"):
        torch_ext.load_paged(folder, "30%")


@pytest.mark.parametrize("damage", ["an expert of another shape", "an expert missing"])
def test_experts_that_do_not_fit_the_model_are_refused_naming_the_parameter(folders, tmp_path, damage):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "mixtral"
    shutil.copytree(folders("mixtral", torch.float32), folder)
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    key = next(k for k in index["weight_map"] if ".layers.1." in k and ".experts.3.w1." in k)
    shard = folder / index["weight_map"][key]
    tensors = load_file(shard)
    if damage == "an expert missing":
        del tensors[key], index["weight_map"][key]
        index_file.write_text(json.dumps(index))
    else:
        tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"parameter 'model\.layers\.1\.mlp\.experts\.gate_up_proj' of "
                                         r"MixtralForCausalLM is made by transformers' checkpoint conversion"):
        torch_ext.load_paged(folder, "30%")


@pytest.mark.parametrize("model_type", FUSED_WHILE_LOADING[:2])
def test_a_folder_saved_in_the_converted_format_pages(tmp_path, model_type):
    cls, changes, _ = ARCHITECTURES[model_type]
    model = build(model_type, cls, changes)
    model.save_pretrained(tmp_path, max_shard_size="20KB", save_original_format=False)
    paged = torch_ext.load_paged(tmp_path, "30%")
    check_equal(paged, model, "causal")
