"""Checkpointing Hugging Face models built from a config (no downloads), trained as users train
them: model(input_ids=..., labels=...), use_cache left at its default, dropout on, with and
without padding masks. Gradients must equal the unwrapped model's exactly (CPU)."""
import copy
import warnings

import pytest
import torch

import torch_ext
from torch_ext.checkpointing import hf
from test_checkpoint_selective import SAVE_ATTENTION  # noqa: E402  (pytest puts this folder on sys.path)

transformers = pytest.importorskip("transformers")


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).train()


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64, attention_dropout=0.1, bos_token_id=0,
                                      eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).train()


MODELS = {"gpt2": gpt2, "llama": llama}


def batch(padded: bool):
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    if not padded:
        return {"input_ids": ids, "labels": ids}
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0  # the second sequence is padded
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def step(model, inputs, seed=1):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks in every model
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach()


def assert_exact(model, reference):
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "padded_mask"])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_layer_checkpointed_in_place_gives_the_unwrapped_models_gradients(name, padded):
    model = MODELS[name]()
    reference = copy.deepcopy(model)
    layers = hf.repeated_layers(model)
    for layer in layers:
        torch_ext.checkpoint(layer)
    inputs = batch(padded)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = step(model, inputs)
    assert torch.equal(loss, step(reference, inputs))
    assert_exact(model, reference)
    # The layers received the model's cache (use_cache defaults to True): turned off, said once.
    messages = [str(w.message) for w in caught if "Hugging Face cache" in str(w.message)]
    assert len(messages) <= 1 and all(type(layers[0]).__name__ in m for m in messages)


def test_the_cache_is_dropped_with_one_warning_per_layer_class():
    model = gpt2()
    for layer in hf.repeated_layers(model):
        torch_ext.checkpoint(layer)
    from torch_ext.checkpointing import api
    api._WARNED.discard("GPT2Block")
    with pytest.warns(UserWarning, match="GPT2Block was given a Hugging Face cache"):
        step(model, batch(False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        step(model, batch(False))


@pytest.mark.parametrize("name", list(MODELS))
def test_hugging_faces_own_gradient_checkpointing_calls_torch_ext(name, monkeypatch):
    model = MODELS[name]()
    reference = copy.deepcopy(model)
    calls = []
    original = hf.checkpoint_call
    monkeypatch.setattr(hf, "checkpoint_call", lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    hf.gradient_checkpointing_enable(model)
    inputs = batch(True)
    assert torch.equal(step(model, inputs), step(reference, inputs))
    assert_exact(model, reference)
    assert len(calls) == len(hf.repeated_layers(model))  # one checkpointed call per layer


def test_checkpoint_layers_every_k_and_by_budget():
    model = gpt2()
    reference = copy.deepcopy(model)
    assert hf.checkpoint_layers(model, every=2) == [0, 2]
    inputs = batch(True)
    step(model, inputs), step(reference, inputs)
    assert_exact(model, reference)

    model = llama()
    reference = copy.deepcopy(model)
    inputs = batch(True)
    plan = hf.checkpoint_layers(model, budget_bytes=1 << 40, inputs=inputs, repeat=1)
    assert plan.boundaries == []  # a budget above everything needs no recompute
    tight = hf.checkpoint_layers(copy.deepcopy(reference), budget_bytes=plan.min_budget_bytes, inputs=inputs, repeat=1)
    assert tight.predicted_peak_bytes <= tight.budget_bytes and tight.boundaries  # the least memory needs recompute
    model = copy.deepcopy(reference)
    chosen = hf.checkpoint_layers(model, budget_bytes=plan.min_budget_bytes, inputs=inputs, repeat=1)
    step(model, inputs), step(reference, inputs)
    assert_exact(model, reference)
    assert chosen.boundaries == tight.boundaries
    # Layers that were measured with the masks and rotary embeddings the model gives them.
    assert all(seconds > 0 for seconds in chosen.layer_forward_seconds)


def bart():
    torch.manual_seed(0)
    config = transformers.BartConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=3,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=64)
    return transformers.BartForConditionalGeneration(config).train()


def is_checkpointed(layer):
    return isinstance(layer.__dict__.get("forward"), torch_ext.checkpointing.api._CheckpointedForward)


@pytest.mark.parametrize("how", ["every", "layer plan", "op plan"])
def test_an_encoder_decoders_layers_are_checkpointed_in_both_stacks(how):
    model = bart()
    reference = copy.deepcopy(model)
    layers = hf.repeated_layers(model)
    assert layers == [*model.model.encoder.layers, *model.model.decoder.layers]
    inputs = batch(True)
    inputs["labels"] = inputs["labels"][:, :9].clone()  # a target shorter than the source
    if how == "every":
        assert hf.checkpoint_layers(model, every=1) == list(range(5))
        assert all(is_checkpointed(layer) for layer in layers)
    else:
        # gradients added into .grad as each layer's backward makes them: the least memory checkpoints every layer
        planning = dict(inputs=inputs, repeat=1, ops=how == "op plan", gradients="accumulated")
        loose = hf.checkpoint_layers(copy.deepcopy(reference), budget_bytes=1 << 40, **planning)
        plan = hf.checkpoint_layers(model, budget_bytes=loose.min_budget_bytes, **planning)
        checkpointed = plan.checkpointed if how == "op plan" else [
            any(start <= k < end and on for start, end, on in plan.segments) for k in range(5)]
        assert len(checkpointed) == 5 and checkpointed[1] and checkpointed[3]  # an encoder's layer and a decoder's
        if how == "layer plan":  # each layer's boundary is its own input: the decoder's are 9 positions long, not 16
            assert plan.layer_input_bytes == [2 * 16 * 32 * 4] * 2 + [2 * 9 * 32 * 4] * 3
        assert [is_checkpointed(layer) for layer in layers] == checkpointed
    step(model, inputs), step(reference, inputs)
    assert_exact(model, reference)


def test_a_layer_held_by_two_lists_is_one_repeated_layer():
    model = bart()
    model.shared_layers = torch.nn.ModuleList([model.model.decoder.layers[0]])  # weights shared, as some models do
    assert hf.repeated_layers(model) == [*model.model.encoder.layers, *model.model.decoder.layers]


def test_checkpoint_layers_refuses_what_would_checkpoint_twice_or_is_underspecified():
    model = gpt2()
    with pytest.raises(ValueError, match="exactly one of every or budget_bytes"):
        hf.checkpoint_layers(model)
    with pytest.raises(ValueError, match="needs inputs"):
        hf.checkpoint_layers(model, budget_bytes=1 << 20)
    model.activation_checkpointing_enable()  # transformers 5.23's name for gradient_checkpointing_enable
    with pytest.raises(ValueError, match="already uses Hugging Face's gradient checkpointing; call "
                                         r"model.activation_checkpointing_disable\(\) first"):
        hf.checkpoint_layers(model, every=1)
    with pytest.raises(TypeError, match="unknown option.*stroage"):
        hf.gradient_checkpointing_enable(gpt2(), stroage="bf16")
    with pytest.raises(TypeError, match="unknown option.*stroage"):
        hf.gradient_checkpointing_enable(gpt2(), gradient_checkpointing_kwargs={"stroage": "bf16"})
    with pytest.raises(TypeError, match=r"\['storage'\] given both as options and in gradient_checkpointing_kwargs"):
        hf.gradient_checkpointing_enable(gpt2(), storage="keep", gradient_checkpointing_kwargs={"storage": "bf16"})
    with pytest.raises(ValueError, match="determinism_check='none': torch_ext always checks its replays"):
        hf.gradient_checkpointing_enable(gpt2(), gradient_checkpointing_kwargs={"determinism_check": "none"})


@pytest.mark.parametrize("name", list(MODELS))
def test_a_checkpointed_decoder_layer_compiles_in_one_graph_with_the_models_keyword_arguments(name):
    """What the model passes a layer (mask, position ids, rotary embeddings, its cache) traces in
    one graph: recognising the cache costs dynamo no graph break."""
    model = MODELS[name]().eval()  # no dropout: compiled and eager draw different masks
    layers = hf.repeated_layers(model)
    seen = []
    handle = layers[1].register_forward_pre_hook(lambda m, a, k: seen.append((a, k)), with_kwargs=True)
    with torch.no_grad():
        model(**batch(padded=True))
    handle.remove()
    ((args, kwargs),) = seen

    def fresh_cache(value):
        return transformers.DynamicCache(config=model.config) if isinstance(value, transformers.Cache) else value

    args = [fresh_cache(a) for a in args]
    kwargs = {k: fresh_cache(v) for k, v in kwargs.items()}
    assert any(isinstance(v, transformers.Cache) for v in [*args, *kwargs.values()])
    reference = copy.deepcopy(layers[1])
    layer = torch_ext.checkpoint(layers[1])
    hidden = args[0].detach().requires_grad_()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cache warning
        out = torch.compile(layer, fullgraph=True, backend="aot_eager")(hidden, *args[1:], **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    expected = reference(hidden.detach(), *args[1:], **kwargs)
    expected = expected[0] if isinstance(expected, tuple) else expected
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    for (n, p), q in zip(layer.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


# Architectures beyond GPT-2 and Llama, each small, with its dropouts on: (config class, model class, changes)
ARCHITECTURES = {
    # parallel attention, added in place into the MLP's last product, which a policy saving matmuls keeps
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(parallel_attn=True, hidden_dropout=0.1,
                                                         attention_dropout=0.1)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(intermediate_size=128, hidden_dropout=0.1,
                                                             attention_dropout=0.1)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(intermediate_size=128, num_key_value_heads=2,
                                                            num_local_experts=4, num_experts_per_tok=2)),
    "bert": ("BertConfig", "BertForMaskedLM", dict(intermediate_size=128)),
    # sliding-window and full attention layers in turn, each given its own mask by the model
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(intermediate_size=128, num_key_value_heads=2,
                                                             head_dim=16, sliding_window=8, attention_dropout=0.1,
                                                             layer_types=["sliding_attention", "full_attention"])),
    # fused query/key/value and gate/up products, split by slicing their outputs
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(intermediate_size=128, num_key_value_heads=2, resid_pdrop=0.1,
                                                   embd_pdrop=0.1, attention_dropout=0.1)),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                                          decoder_start_token_id=0)),
}


def architecture(name):
    config_class, model_class, changes = ARCHITECTURES[name]
    torch.manual_seed(0)
    options = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    config = getattr(transformers, config_class)(**{**options, **changes})
    return getattr(transformers, model_class)(config).train()


@pytest.mark.parametrize("how", ["torch's policy", "save='torchtitan'", "op plan"])
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_other_architectures_checkpointed_per_op_give_the_unwrapped_models_gradients(name, how):
    # long enough that the layers' activations, not the head's, make the step's peak
    ids = torch.randint(1, 128, (4, 64), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(4, 64, dtype=torch.long)
    mask[1, 40:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    reference = architecture(name)
    step(reference, inputs)
    model = architecture(name)
    if how == "torch's policy":
        hf.gradient_checkpointing_enable(model, context_fn=SAVE_ATTENTION)
    elif how == "save='torchtitan'":
        hf.gradient_checkpointing_enable(model, save="torchtitan")
    else:
        with torch.no_grad():
            loose = hf.checkpoint_layers(copy.deepcopy(model), budget_bytes=1 << 40, inputs=inputs, ops=True, repeat=1)
        budget = (loose.min_budget_bytes + loose.no_checkpoint_peak_bytes) // 2
        plan = hf.checkpoint_layers(model, budget_bytes=budget, inputs=inputs, ops=True, repeat=1)
        assert any(plan.is_checkpointed(i) for i in range(len(plan.saved)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' use_cache notice
        step(model, inputs)
    assert_exact(model, reference)
