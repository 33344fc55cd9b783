"""Content keys of the lazy node cache: a graph input equal to one seen before, in a new tensor
object, is served from the cache (outputs equal to the plain module's), never when only a
truncated digest matches, and only where the NodeCache's rule says hashing pays."""
import io

import pytest
import torch
from torch import nn

from torch_ext import LazyExecutor, NodeCache, _C
from torch_ext.cache import lazy_forward
from torch_ext.demos import ConditionedDenoiser, sample


def denoiser():
    torch.manual_seed(0)
    return ConditionedDenoiser(width=64, encoder_layers=2, denoiser_layers=1, cond_tokens=16).eval()


def computed(executor, model, latent, tokens):
    """Nodes the executor ran for a 4-step sample; its result must equal the model's."""
    before = executor.stats().nodes_computed
    with torch.no_grad():
        got = sample(executor, latent, tokens, steps=4)
        assert torch.equal(got, sample(model, latent, tokens, steps=4))
    return executor.stats().nodes_computed - before


@pytest.fixture
def inputs():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 1024, (1, 16), generator=generator), torch.randn(1, 8, 64, generator=generator)


def test_an_equal_prompt_in_a_new_tensor_reuses_the_encoder(inputs):
    tokens, _ = inputs
    other = (tokens + 1) % 1024
    noise = torch.Generator().manual_seed(2)  # a new latent per sample, as a new seed gives
    model = denoiser()
    executor = LazyExecutor(model)
    assert executor.cache.content_keys and executor.cache.content_key_fraction == 0.01

    def run(prompt):
        return computed(executor, model, torch.randn(1, 8, 64, generator=noise), prompt)

    first = run(tokens)
    same_object = run(tokens)
    assert same_object < first
    assert run(tokens.clone()) == same_object  # tokenized again
    assert run(tokens.clone()) == same_object
    encoder = run(other) - same_object  # another prompt: encoded
    assert encoder > 0
    assert run(other.clone()) == same_object
    assert run(tokens.clone()) == same_object  # both prompts keep their entries
    assert executor.stats().entries > 0


def test_prompts_by_turns_keep_an_entry_each_up_to_entries_per_node(inputs):
    tokens, _ = inputs
    prompts = [(tokens + i) % 1024 for i in range(3)]
    noise = torch.Generator().manual_seed(2)
    results = {}
    for per_node in (1, 2, 3):
        model = denoiser()
        executor = LazyExecutor(model, entries_per_node=per_node)
        runs = [computed(executor, model, torch.randn(1, 8, 64, generator=noise), prompts[i % 3].clone())
                for i in range(9)]
        results[per_node] = runs[3:]  # after each prompt's first sample
    # Three prompts by turns: served only where a node holds three entries.
    assert results[3][0] == min(results[3]) == max(results[3])
    assert results[2] == results[1]
    assert min(results[1]) > results[3][0]


def test_identity_keys_alone_recompute_an_equal_prompt(inputs):
    tokens, latent = inputs
    for options in ({"content_keys": False}, {"content_key_fraction": 0.0}):
        model = denoiser()
        executor = LazyExecutor(model, **options)
        first = computed(executor, model, latent, tokens)
        assert computed(executor, model, latent, tokens) < first
        assert computed(executor, model, latent, tokens.clone()) == first


def test_a_forced_digest_collision_gives_the_models_values_not_the_cached_ones(inputs):
    tokens, _ = inputs
    other = (tokens + 7) % 1024  # a different prompt of the same shape

    def nodes_run(bits):
        NodeCache._set_digest_bits_for_testing(bits)
        try:
            model = denoiser()
            executor = LazyExecutor(model)
            noise = torch.Generator().manual_seed(2)
            return [computed(executor, model, torch.randn(1, 8, 64, generator=noise), prompt)
                    for prompt in (tokens, other, other.clone(), tokens.clone())]
        finally:
            NodeCache._set_digest_bits_for_testing(128)

    # With every digest equal only the byte comparison tells the prompts apart: the same nodes run as
    # with full digests (computed() checks each result against the model's).
    collided = nodes_run(0)
    assert collided == nodes_run(128)
    assert collided[1] > collided[2] == collided[3]  # the other prompt encoded, then both served
    with pytest.raises(ValueError, match="digest bits must be in"):
        NodeCache._set_digest_bits_for_testing(129)


def test_an_input_that_requires_grad_is_never_served_for_a_new_leaf():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    executor = LazyExecutor(model, content_key_fraction=float("inf"))
    x = torch.randn(2, 4, requires_grad=True)
    executor(x)
    y = x.detach().clone().requires_grad_()
    executor(y).sum().backward()  # through y's own graph, not x's
    model(x).sum().backward()
    assert torch.equal(y.grad, x.grad)


class OptionsHolder(nn.Module):
    def __init__(self):
        super().__init__()
        self.cache = NodeCache(content_keys=False, content_key_fraction=0.5, capacity_bytes=1 << 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_options_survive_saving_and_bad_ones_are_refused():
    with pytest.raises(ValueError, match="content_key_fraction must be a number >= 0"):
        NodeCache(content_key_fraction=-1.0)
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(OptionsHolder()), buffer)
    buffer.seek(0)
    cache = torch.jit.load(buffer).cache
    assert (cache.content_keys, cache.content_key_fraction, cache.capacity_bytes) == (False, 0.5, 1 << 20)


def test_lazy_forward_routes_a_module_that_stays_the_same_object():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).eval()
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = module(x)
        executor = lazy_forward(module, content_key_fraction=float("inf"))  # tiny weights: hash anyway
        assert torch.equal(module(x), expected) and torch.equal(module(x.clone()), expected)
        assert executor.stats().hits >= 1 and module[0].weight is executor.module[0].weight
        with pytest.raises(ValueError, match="already has a forward of its own"):
            lazy_forward(module)
        del module.forward
        calls = executor.stats().calls
        assert torch.equal(module(x), expected) and executor.stats().calls == calls


def test_digest_refuses_tensors_it_cannot_hash():
    assert _C.cache.digest(torch.arange(4)) == _C.cache.digest(torch.arange(4).clone())
    assert _C.cache.digest(torch.arange(4)) != _C.cache.digest(torch.arange(1, 5))
    with pytest.raises(ValueError, match="expected a contiguous CPU tensor that does not require grad"):
        _C.cache.digest(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match="expected a contiguous CPU tensor"):
        _C.cache.digest(torch.ones(2, requires_grad=True))
