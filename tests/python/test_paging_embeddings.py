"""Paged embeddings: a lookup reads its rows from the file, converted to the served dtype, and
never loads the whole table (for a 50k vocabulary the model's largest tensor)."""
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import torch_ext


class Tagger(nn.Module):
    def __init__(self, vocab=512, width=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, 4)

    def forward(self, ids):
        return self.head(self.embed(ids))


@pytest.fixture
def bf16_file(tmp_path):
    torch.manual_seed(0)
    model = Tagger()
    path = tmp_path / "tagger.safetensors"
    save_file({k: v.bfloat16().contiguous() for k, v in model.state_dict().items()}, path)
    reference = Tagger()
    reference.load_state_dict({k: v.bfloat16().float() for k, v in model.state_dict().items()})
    return reference.eval(), path


def test_a_lookup_reads_rows_converted_and_never_loads_the_table(bf16_file):
    reference, path = bf16_file
    model = Tagger().eval()
    pager = torch_ext.page_weights(model, path, "100%")
    ids = torch.tensor([[3, 511, 0], [7, 7, 200]])
    with torch.no_grad():
        out = model(ids)
    assert torch.equal(out, reference(ids))  # bf16 rows widen to fp32 exactly
    assert torch.equal(model.embed(ids), reference.embed(ids)) and model.embed(ids).dtype == torch.float32
    assert not pager.is_resident("embed.weight") and pager.is_resident("head.weight")
    assert pager.stats().bytes_loaded == pager.source.nbytes("head.weight") * 2 + pager.source.nbytes("head.bias") * 2
    with pytest.raises(IndexError):
        model.embed(torch.tensor([512]))


def test_unpage_gives_the_embedding_its_own_forward_and_table_back(bf16_file):
    reference, path = bf16_file
    model = Tagger().eval()
    torch_ext.page_weights(model, path, "100%")
    assert "forward" in model.embed.__dict__
    torch_ext.unpage(model)
    assert "forward" not in model.embed.__dict__ and model.embed.weight.dtype == torch.float32
    ids = torch.arange(10)
    assert torch.equal(model(ids), reference(ids))


def test_embeddings_that_rewrite_or_rescale_their_table_load_it(tmp_path):
    class Scaled(nn.Embedding):  # Gemma's and T5's kinds scale by the table's dtype in forward
        def forward(self, ids):
            return super().forward(ids) * 2.0

    torch.manual_seed(0)
    for embed in (nn.Embedding(64, 8, max_norm=1.0), Scaled(64, 8)):
        model = nn.Sequential(embed).eval()
        path = tmp_path / f"{type(embed).__name__}.safetensors"
        save_file({"0.weight": embed.weight.detach().clone()}, path)
        reference = nn.Sequential(type(embed)(64, 8, **({"max_norm": 1.0} if embed.max_norm else {})))
        reference.load_state_dict(model.state_dict())
        pager = torch_ext.page_weights(model, path, "100%")
        assert "forward" not in embed.__dict__
        ids = torch.tensor([1, 2, 63])
        with torch.no_grad():
            assert torch.equal(model(ids), reference(ids))
        assert pager.is_resident("0.weight")


def test_a_paged_embedding_refuses_a_weight_that_requires_grad(bf16_file):
    _, path = bf16_file
    model = Tagger()
    torch_ext.page_weights(model, path, "100%")
    model.embed.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"'embed.weight' \(Embedding.weight\) requires grad"):
        model.embed(torch.tensor([1]))
