"""Streamed matmuls: a Linear (or transformers' Conv1D) whose weight the pager converts from the
file's dtype, and for which the budget has no free room, multiplies block by block from the
mapped file (LayerPager.matmul) instead of loading and converting the whole weight; the result
is the whole weight's to the last bit."""
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import torch_ext

transformers = pytest.importorskip("transformers")
Conv1D = transformers.pytorch_utils.Conv1D


class Stack(nn.Module):
    """Four layers wide enough for several blocks each (512 KiB of fp32 per block)."""

    def __init__(self, width=512):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, 4 * width), Conv1D(width, 4 * width),
                                     nn.Linear(width, width, bias=False), Conv1D(width, width)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.fixture
def bf16_stack(tmp_path):
    """A bf16 checkpoint, and the fp32 model from_pretrained(dtype=float32) would build from it."""
    torch.manual_seed(0)
    model = Stack()
    path = tmp_path / "stack.safetensors"
    save_file({k: v.bfloat16().contiguous() for k, v in model.state_dict().items()}, path)
    reference = Stack()
    reference.load_state_dict({k: v.bfloat16().float() for k, v in model.state_dict().items()})
    return reference.eval(), path


def weight_keys(pager):
    return [k for k in pager.source.names() if k.endswith(".weight")]


# The biases in fp32: what the first pass's whole-weight loads may evict and a later pass reload.
BIAS_BYTES = sum(p.numel() * 4 for name, p in Stack().named_parameters() if name.endswith(".bias"))


def test_a_converted_weight_without_room_streams_and_equals_the_whole_product(bf16_stack):
    reference, path = bf16_stack
    model = Stack().eval()
    pager = torch_ext.page_weights(model, path, 1 << 20)  # 1 MiB: no fp32 weight has room
    assert all(pager.streams(k) for k in weight_keys(pager))
    x = torch.randn(3, 5, 512)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))  # each shape's first call loads its weight and compares
        first = pager.stats()
        for _ in range(2):
            assert torch.equal(model(x), reference(x))
    stats = pager.stats()
    # Every shape whose blocked product equals the whole one (on this machine's BLAS) streams:
    # no weight is loaded again (only biases the first pass's whole loads evicted, each once).
    streamed_shapes = 4 - stats.unstreamed_shapes
    assert stats.streamed_matmuls == 2 * streamed_shapes and first.streamed_matmuls == 0
    if streamed_shapes == 4:
        assert stats.evictions == first.evictions
        assert stats.bytes_loaded - first.bytes_loaded <= BIAS_BYTES
        assert not any(pager.is_resident(k) for k in weight_keys(pager))
    with torch.no_grad():
        assert torch.equal(model(x[0, 0]), reference(x[0, 0]))  # 1-D input: the weights are acquired
        assert torch.equal(model.layers[0](input=x), reference.layers[0](input=x))
        wide = torch.randn(3, 2048)  # Conv1D(nf=512, nx=2048)
        assert torch.equal(model.layers[1](x=wide), reference.layers[1](x=wide))
    assert pager.stats().bytes_loaded > stats.bytes_loaded


def test_streamed_weights_keep_their_file_pages_mapped_within_the_budget(bf16_stack):
    reference, path = bf16_stack
    model = Stack().eval()
    budget = 512 * 2048 * 4 + (64 << 10)  # one big weight in fp32, both big ones as bf16 file pages
    pager = torch_ext.page_weights(model, path, budget, prefetch=4)
    x = torch.randn(2, 512)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), reference(x))
        settled = pager.stats()
        for _ in range(3):
            assert torch.equal(model(x), reference(x))
    stats = pager.stats()
    if stats.unstreamed_shapes == 0:
        # Each shape was compared on its first call, which loaded its weight whole and dropped it
        # after. Since then every weight streams, some from pages kept mapped since the last pass;
        # nothing is evicted or loaded again, and what is counted stays within the budget.
        assert not any(pager.is_resident(k) for k in weight_keys(pager))
        assert stats.streamed_matmuls - settled.streamed_matmuls == 3 * 4
        assert stats.streamed_from_mapped_pages - settled.streamed_from_mapped_pages >= 3
        assert stats.evictions == settled.evictions
        assert stats.bytes_loaded == settled.bytes_loaded
        assert pager.resident_bytes() <= budget


def test_a_file_dtype_served_as_is_never_streams(tmp_path):
    torch.manual_seed(0)
    model = Stack().eval()
    path = tmp_path / "fp32.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    reference = Stack().eval()
    reference.load_state_dict(model.state_dict())
    pager = torch_ext.page_weights(model, path, 1 << 20)
    assert not any(pager.streams(k) for k in weight_keys(pager))
    x = torch.randn(2, 512)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert pager.stats().streamed_matmuls == 0


def test_autograd_through_a_streamed_layer_acquires_the_weight(bf16_stack):
    reference, path = bf16_stack
    model = Stack().eval()
    pager = torch_ext.page_weights(model, path, 1 << 20)
    x = torch.randn(2, 512, requires_grad=True)
    ref_x = x.detach().clone().requires_grad_()
    model(x).sum().backward()
    reference.requires_grad_(False)
    reference(ref_x).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=0)
    assert pager.stats().streamed_matmuls == 0  # every layer's input needs a gradient


def test_matmul_checks_its_arguments(bf16_stack):
    _, path = bf16_stack
    pager = torch_ext.LayerPager(path, 1 << 20, dtype="float32").script_object
    with pytest.raises(RuntimeError, match="nope"):
        pager.matmul("nope", torch.randn(2, 512), None, False)
    with pytest.raises(RuntimeError):  # torch's own shape error, from the whole weight
        pager.matmul("layers.0.weight", torch.randn(2, 100), None, False)
    with pytest.raises(RuntimeError):
        pager.matmul("layers.0.weight", torch.randn(2, 512, dtype=torch.float64), None, False)


def test_unpage_gives_streamed_layers_their_own_forward_back(bf16_stack):
    reference, path = bf16_stack
    model = Stack().eval()
    torch_ext.page_weights(model, path, 1 << 20)
    assert all("forward" in layer.__dict__ for layer in model.layers)
    torch_ext.unpage(model)
    assert not any("forward" in layer.__dict__ for layer in model.layers)
    x = torch.randn(2, 512)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_a_bf16_gpt2_served_as_fp32_streams_and_generates_as_from_pretrained(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=256, n_layer=2, n_head=4, vocab_size=4096, n_positions=64)
    transformers.GPT2LMHeadModel(config).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="2MB")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    paged = torch_ext.load_paged(tmp_path, "10%", dtype=torch.float32)
    tokens = torch.randint(0, 4096, (2, 9), generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-for-bit comparisons: see test_paging_architectures.one_intra_op_thread
    try:
        with torch.no_grad():
            assert torch.equal(paged(tokens).logits, loaded(tokens).logits)
            options = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
            assert torch.equal(paged.generate(tokens, **options), loaded.generate(tokens, **options))
    finally:
        torch.set_num_threads(threads)
    stats = torch_ext.pager_of(paged).stats()
    assert stats.streamed_matmuls + stats.unstreamed_shapes > 0


def test_a_streaming_model_compiles_and_its_paged_forwards_run_eagerly(bf16_stack):
    """Under torch.compile the streamed products still stream: each paged module's forward and hooks
    run eagerly, never compiled (Dynamo would compile each module's forward once, up to its limit)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    reference, path = bf16_stack
    model = Stack().eval()
    pager = torch_ext.page_weights(model, path, 1 << 20)
    torch._dynamo.reset()
    compiled = torch.compile(model)
    x = torch.randn(3, 5, 512)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), reference(x))
    assert pager.stats().streamed_matmuls > 0
    functions = [f for layer in model.layers
                 for f in [layer.forward, *layer._forward_pre_hooks.values(), *layer._forward_hooks.values()]]
    assert len(functions) == 3 * 4
    assert [f for f in functions if _debug_get_cache_entry_list(getattr(f, "__wrapped__", f).__code__)] == []
    torch._dynamo.reset()
