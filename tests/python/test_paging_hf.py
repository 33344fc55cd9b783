"""Hugging Face models end to end (issue 18): one call from a folder to a paged model, budgets in
the ecosystem's spellings, a paged model that behaves like a model (device, generate, state_dict,
save_pretrained, to), adapters trained over paged weights (equal gradients on CPU, with and
without checkpointing, within the budget), and accelerate-dispatched models refused."""
import copy
import logging
import sys
import warnings

import pytest
import torch
from torch import nn

import torch_ext

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

VOCAB = 128


def gpt2_config(**changes):
    return GPT2Config(**{**dict(n_layer=3, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=1,
                                eos_token_id=2, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0), **changes})


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A resident GPT-2 and its save_pretrained folder, sharded into several files."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config()).eval()
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder, max_shard_size="60KB")
    assert (folder / "model.safetensors.index.json").exists()
    return model, folder


@pytest.fixture
def tokens():
    return torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def weight_bytes(folder):
    return torch_ext.SafetensorsSource(folder).total_bytes()


# ------------------------------------------------------------------------------ one-call load

def test_load_paged_builds_from_the_folder_without_reading_weights(gpt2, tokens):
    ref, folder = gpt2
    budget = weight_bytes(folder) // 4
    model = torch_ext.load_paged(folder, budget)
    pager = torch_ext.pager_of(model)
    assert pager.stats().bytes_loaded == 0 and pager.resident_bytes() == 0   # set-up read headers only
    assert isinstance(model, GPT2LMHeadModel) and not model.training
    assert all(p.is_meta and isinstance(p, torch_ext.paging.PagedParameter) for p in model.parameters())
    # tied weights: one placeholder, one pager entry (the file holds wte only)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "lm_head.weight" not in torch_ext.SafetensorsSource(folder)
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, ref(tokens).logits)
    stats = pager.stats()
    assert stats.over_budget_loads == 0 and pager.resident_bytes() <= budget
    # every tensor once, but the embeddings: their lookups read rows from the file (wpe is never
    # loaded, wte only for the tied lm_head)
    assert stats.misses == len(torch_ext.SafetensorsSource(folder)) - 1


def test_load_paged_from_a_single_file_and_a_base_model_checkpoint(gpt2, tokens, tmp_path):
    ref, _ = gpt2
    # A checkpoint of the base model (keys without "transformer.") loaded into the model with a
    # head: keys are found without the base_model_prefix; lm_head is tied to the file's wte.
    ref.transformer.save_pretrained(tmp_path / "base")
    model = torch_ext.load_paged(tmp_path / "base" / "model.safetensors", "50%",
                                 model_fn=lambda: GPT2LMHeadModel(gpt2_config()))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, ref(tokens).logits)
    assert torch_ext.pager_of(model).source.path().endswith("model.safetensors")


def test_non_persistent_buffers_get_their_real_values(tmp_path, tokens):
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    ref = LlamaForCausalLM(config).eval()
    ref.save_pretrained(tmp_path)
    model = torch_ext.load_paged(tmp_path, "25%")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()    # the normal way: meta init, buffers re-initialised
    buffers = dict(model.named_buffers())
    assert set(buffers) == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}   # not in the file
    for name, buffer in loaded.named_buffers():
        assert not buffers[name].is_meta and torch.equal(buffers[name], buffer), name
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, loaded(tokens).logits)
        assert torch.equal(model(tokens).logits, ref(tokens).logits)
    assert torch_ext.pager_of(model).stats().over_budget_loads == 0


def test_load_paged_bad_input_names_the_file(gpt2, tmp_path, monkeypatch):
    _, folder = gpt2
    with pytest.raises(FileNotFoundError, match="nowhere"):
        torch_ext.load_paged(tmp_path / "nowhere", "1GB")
    lone = tmp_path / "lone"
    lone.mkdir()
    GPT2LMHeadModel(gpt2_config()).save_pretrained(lone)
    (lone / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing.*model_fn"):
        torch_ext.load_paged(lone, "1GB")
    with pytest.raises(TypeError, match="model_fn returned int"):
        torch_ext.load_paged(folder, "1GB", model_fn=lambda: 3)
    with pytest.raises(ValueError, match="dtype applies to models built from config.json"):
        torch_ext.load_paged(folder, "1GB", model_fn=lambda: GPT2LMHeadModel(gpt2_config()), dtype=torch.float16)
    # a model that does not match the file: the tensor and the file are named
    with pytest.raises(ValueError, match=r"transformer\.wte\.weight.*shape"):
        torch_ext.load_paged(folder, "1GB", model_fn=lambda: GPT2LMHeadModel(gpt2_config(vocab_size=VOCAB + 1)))
    # transformers is optional: without it, a clear error unless model_fn is given
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(RuntimeError, match="needs transformers.*model_fn"):
        torch_ext.load_paged(folder, "1GB")


# ------------------------------------------------------------------------------ budgets

@pytest.mark.parametrize("budget, expected", [
    (300_000, 300_000), (3e5, 300_000), ("1GB", 10**9), ("512MiB", 512 << 20), ("1.5 GiB", 3 << 29),
    ({"cpu": "1GB"}, 10**9), ({0: "2GiB", "cpu": 100_000}, 100_000), ({torch.device("cpu"): "1MB", "disk": "1TB"}, 10**6),
])
def test_budget_spellings(gpt2, budget, expected):
    _, folder = gpt2
    model = torch_ext.load_paged(folder, budget)
    assert torch_ext.pager_of(model).budget_bytes == expected


def test_budget_percent_is_of_the_weights(gpt2):
    _, folder = gpt2
    assert torch_ext.pager_of(torch_ext.load_paged(folder, "30%")).budget_bytes == int(weight_bytes(folder) * 0.3)
    assert torch_ext.pager_of(torch_ext.load_paged(folder, {"cpu": "50%"})).budget_bytes == weight_bytes(folder) // 2


def test_the_device_entry_of_a_budget_dict_applies():
    resolve = torch_ext.paging.resolve_budget
    budgets = {0: "2GiB", "cuda:1": "3GiB", "cpu": "8GB", "disk": "1TB"}
    assert resolve(budgets, "cpu") == "8GB"
    assert resolve(budgets, "cuda") == resolve(budgets, "cuda:0") == resolve(budgets, torch.device("cuda", 0)) == "2GiB"
    assert resolve(budgets, "cuda:1") == "3GiB"
    assert resolve("30%", "cuda") == "30%"
    with pytest.raises(ValueError, match="budget_bytes.*no entry for the pager's device cuda:2"):
        resolve(budgets, "cuda:2")


@pytest.mark.parametrize("budget, message", [
    ({0: "1GB"}, "no entry for the pager's device cpu"),
    ({"cuda:0": "1GB", "cuda": 5}, "no entry for the pager's device cpu"),
    ({"cpu": 1, torch.device("cpu"): 2}, "several entries"),
    ({"gpu0": "1GB"}, "'gpu0' is not a device"),
    ({"cpu": "lots"}, "is not a byte budget"),
    ("12 parsecs", "is not a byte budget"),
    ([1], "is not a byte budget"),
    (True, "is not a byte budget"),
])
def test_bad_budgets_name_the_argument(gpt2, budget, message):
    _, folder = gpt2
    with pytest.raises(ValueError, match="budget_bytes") as error:
        torch_ext.load_paged(folder, budget)
    assert message in str(error.value)


# ------------------------------------------------------------------------------ behaves like a model

def test_device_and_generate_like_the_resident_model(gpt2, tokens, caplog):
    ref, folder = gpt2
    model = torch_ext.load_paged(folder, "25%")
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert all(p.device == torch.device("cpu") for p in model.parameters())
    expected = ref.generate(tokens, max_new_tokens=12, do_sample=False, pad_token_id=0)
    caplog.clear()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="transformers"):
        warnings.simplefilter("always")
        generated = model.generate(tokens, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert [str(w.message) for w in caught] == []
    assert [r.getMessage() for r in caplog.records] == []
    assert torch.equal(generated, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_paged_onto_a_cuda_device_with_a_max_memory_budget(gpt2, tokens):
    ref, folder = gpt2
    resident = copy.deepcopy(ref).cuda()
    model = torch_ext.load_paged(folder, {0: "50%", "cpu": "1GB"}, device="cuda")
    pager = torch_ext.pager_of(model)
    assert pager.budget_bytes == weight_bytes(folder) // 2
    assert model.device.type == "cuda" and all(b.is_cuda for b in model.buffers())
    tokens = tokens.cuda()
    with torch.no_grad():   # the same weights and kernels on the same device
        assert torch.equal(model(tokens).logits, resident(tokens).logits)
    options = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(model.generate(tokens, **options), resident.generate(tokens, **options))
    assert model.to("cuda") is model
    with pytest.raises(RuntimeError, match="cannot be moved"):
        model.cpu()


def test_state_dict_and_save_pretrained_read_through_the_pager(gpt2, tmp_path):
    ref, folder = gpt2
    model = torch_ext.load_paged(folder, "25%")
    state = model.state_dict()
    expected = ref.state_dict()
    assert state.keys() == expected.keys()
    assert all(not t.is_meta and torch.equal(t, expected[k]) for k, t in state.items())
    assert state["lm_head.weight"] is state["transformer.wte.weight"]       # tied: one tensor
    assert torch_ext.pager_of(model).stats().bytes_loaded == 0              # views of the file, not pager loads
    assert all(p.is_meta for p in model.parameters())                       # still paged
    assert model.transformer.h[0].state_dict()["attn.c_attn.weight"].equal(expected["transformer.h.0.attn.c_attn.weight"])

    model.save_pretrained(tmp_path / "saved")
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    reloaded = back.state_dict()
    assert reloaded.keys() == expected.keys() and all(torch.equal(reloaded[k], expected[k]) for k in expected)
    assert back.lm_head.weight is back.transformer.wte.weight


def test_unpage_restores_a_resident_model(gpt2, tokens):
    ref, folder = gpt2
    model = torch_ext.unpage(torch_ext.load_paged(folder, "25%"))
    assert not torch_ext.paging.is_paged(model)
    assert all(type(p) is nn.Parameter and not p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, ref(tokens).logits)


def test_moves_that_change_nothing_work_and_others_raise(gpt2, tokens):
    ref, folder = gpt2
    model = torch_ext.load_paged(folder, "25%")
    assert model.to("cpu") is model and model.cpu() is model and model.float() is model
    assert model.to(torch.float32) is model and model.to("cpu", torch.float32) is model
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, ref(tokens).logits)
    for move in (lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.to("meta"), lambda m: m.double()):
        with pytest.raises(RuntimeError, match=r"paged parameter 'transformer\.wte\.weight'.*cannot be moved"):
            move(model)
    with pytest.raises(RuntimeError, match=r"transformer\.wte\.weight.*is paged from"):
        model.load_state_dict(ref.state_dict())
    with pytest.raises(RuntimeError, match="cannot deepcopy paged parameter"):
        copy.deepcopy(model)


# ------------------------------------------------------------------------------ training adapters

class LoRA(nn.Module):
    """A low-rank adapter over a frozen nn.Linear or GPT-2 Conv1D: base(x) + x A B."""

    def __init__(self, base, rank=4):
        super().__init__()
        self.base = base
        fan_in, fan_out = base.weight.shape if isinstance(base, Conv1D) else (base.in_features, base.out_features)
        generator = torch.Generator().manual_seed(fan_in * 7919 + fan_out)
        self.lora_a = nn.Parameter(torch.randn(fan_in, rank, generator=generator) / rank)
        self.lora_b = nn.Parameter(torch.randn(rank, fan_out, generator=generator) / rank)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a) @ self.lora_b


def add_adapters(model):
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (Conv1D, nn.Linear)) and name != "lm_head":
                setattr(module, name, LoRA(child))
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def train_step(model, tokens, checkpoint):
    if checkpoint == "torch_ext":
        for block in model.transformer.h:
            torch_ext.checkpoint(block)
    elif checkpoint is not None:   # torch.utils.checkpoint per layer
        model.gradient_checkpointing_enable({"use_reentrant": checkpoint == "hugging_face_reentrant"})
    embeddings = torch.randn(*tokens.shape, 64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*given a Hugging Face cache")   # a checkpointed GPT2Block's
        loss = model(inputs_embeds=embeddings, labels=tokens).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss, grads, embeddings.grad


@pytest.mark.parametrize("checkpoint", [None, "torch_ext", "hugging_face", "hugging_face_reentrant"])
def test_adapters_train_over_paged_weights_with_equal_gradients_within_budget(gpt2, tokens, checkpoint):
    ref, folder = gpt2
    resident = add_adapters(copy.deepcopy(ref)).train()
    loss, grads, input_grad = train_step(resident, tokens, checkpoint)

    budget = weight_bytes(folder) // 5
    model = add_adapters(torch_ext.load_paged(folder, budget)).train()
    pager = torch_ext.pager_of(model)
    resident_in_backward = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_hook(lambda grad: resident_in_backward.append(pager.resident_bytes()))
    paged_loss, paged_grads, paged_input_grad = train_step(model, tokens, checkpoint)

    assert len(grads) == 4 * 3 * 2   # c_attn, c_proj, c_fc, mlp.c_proj per block, A and B each
    torch.testing.assert_close(paged_loss, loss, rtol=0, atol=0)
    assert paged_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(paged_grads[name], grads[name], rtol=0, atol=0, msg=name)
    torch.testing.assert_close(paged_input_grad, input_grad, rtol=0, atol=0)
    # The backward re-acquired the weights it needed one node at a time: the graph held none.
    stats = pager.stats()
    assert stats.over_budget_loads == 0
    assert len(resident_in_backward) == len(grads)
    assert max(resident_in_backward) <= budget + stats.largest_tensor_bytes
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_a_paged_model_compiles_and_gives_the_resident_models_results(gpt2, tokens):
    """torch.compile over a paged model: Dynamo breaks the graph at each paged module's hooks, which
    run eagerly and are never compiled (their guards would hold each module's checkpoint keys, one
    recompile per module up to Dynamo's limit). Logits and adapter gradients match the resident
    model's within compile's rounding, within the budget."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    ref, folder = gpt2
    torch._dynamo.reset()
    budget = weight_bytes(folder) // 4
    model = torch_ext.load_paged(folder, budget)
    paged = torch.compile(model)
    with torch.no_grad():
        for t in (tokens, tokens.flip(1)):
            torch.testing.assert_close(paged(t).logits, ref(t).logits)
    pager = torch_ext.pager_of(model)
    assert pager.stats().misses > 0 and pager.resident_bytes() <= budget + pager.stats().largest_tensor_bytes

    trained = add_adapters(torch_ext.load_paged(folder, budget)).train()
    loss, grads, input_grad = train_step(add_adapters(copy.deepcopy(ref)).train(), tokens, None)
    paged_loss, paged_grads, paged_input_grad = train_step(torch.compile(trained), tokens, None)
    paged_grads = {name.removeprefix("_orig_mod."): grad for name, grad in paged_grads.items()}
    torch.testing.assert_close(paged_loss, loss)
    assert paged_grads.keys() == grads.keys() and len(grads) == 4 * 3 * 2
    for name in grads:
        torch.testing.assert_close(paged_grads[name], grads[name], msg=name)
    torch.testing.assert_close(paged_input_grad, input_grad)
    assert torch_ext.pager_of(trained).stats().over_budget_loads == 0

    hooks = [hook for m in [*model.modules(), *trained.modules()]
             for hook in [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]]
    assert len(hooks) > 20
    assert [h for h in hooks if _debug_get_cache_entry_list(getattr(h, "__wrapped__", h).__code__)] == []
    with pytest.raises(torch._dynamo.exc.Unsupported, match="torch_ext paging: a paged module's weights"):
        torch.compile(model, fullgraph=True)(tokens)
    torch._dynamo.reset()


def test_paged_weights_that_require_grad_raise_naming_them(gpt2, tokens):
    _, folder = gpt2
    model = torch_ext.load_paged(folder, "25%")
    model.transformer.h[1].mlp.c_fc.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"paged parameter 'transformer\.h\.1\.mlp\.c_fc\.weight'.*frozen"):
        model(tokens)
    with torch.no_grad():   # inference does not care
        model(tokens)


def test_peft_lora_over_paged_weights_gives_the_resident_gradients(gpt2, tokens):
    peft = pytest.importorskip("peft", reason="peft is optional (pinned in .ci/requirements.txt)")
    ref, folder = gpt2

    def step(model):
        torch.manual_seed(3)
        config = peft.LoraConfig(r=4, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,
                                 init_lora_weights="gaussian")
        wrapped = peft.get_peft_model(model, config).train()
        loss = wrapped(input_ids=tokens, labels=tokens).loss
        loss.backward()
        return loss, {n: p.grad for n, p in wrapped.named_parameters() if p.requires_grad}

    loss, grads = step(copy.deepcopy(ref))
    model = torch_ext.load_paged(folder, "20%")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paged_loss, paged_grads = step(model)
    # peft 0.21.2 calls transformers 5.23's deprecated is_gradient_checkpointing: its warning, not ours
    assert [str(w.message) for w in caught if not str(w.message).startswith("`is_gradient_checkpointing`")] == []
    torch.testing.assert_close(paged_loss, loss, rtol=0, atol=0)
    assert paged_grads.keys() == grads.keys() and len(grads) == 2 * 4 * 3
    for name in grads:
        torch.testing.assert_close(paged_grads[name], grads[name], rtol=0, atol=0, msg=name)
    assert torch_ext.pager_of(model).stats().over_budget_loads == 0


# ------------------------------------------------------------------------------ accelerate

def test_a_model_dispatched_by_accelerate_is_refused_naming_the_module(gpt2, tokens, tmp_path):
    accelerate = pytest.importorskip("accelerate")
    ref, folder = gpt2
    dispatched = accelerate.cpu_offload(copy.deepcopy(ref), execution_device="cpu")
    with pytest.raises(ValueError, match=r"the model \(GPT2LMHeadModel\) has an accelerate hook.*load_paged.*"
                                         r"remove_hook_from_module"):
        torch_ext.page_weights(dispatched, folder, "25%")
    mapped = GPT2LMHeadModel.from_pretrained(folder, device_map="auto", max_memory={"cpu": 200_000},
                                             offload_folder=tmp_path)
    with pytest.raises(ValueError, match=r"has an accelerate hook.*device_map"):
        torch_ext.page_weights(mapped, folder, "25%")
    # what the error says to do works (cpu_offload untied lm_head from wte: the key map ties them again)
    accelerate.hooks.remove_hook_from_module(dispatched, recurse=True)
    torch_ext.page_weights(dispatched, folder, "25%", key_map={"lm_head.weight": "transformer.wte.weight"})
    with torch.no_grad():
        assert torch.equal(dispatched(tokens).logits, ref(tokens).logits)
