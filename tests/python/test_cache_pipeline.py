"""A diffusers StableDiffusionPipeline (small configs, no downloads) with its text encoder routed
through a LazyExecutor (torch_ext.cache.lazy_forward): called again with the same prompt and
another seed, the text encoder runs no node of its own (only the exported graph's runtime
checks); in a new process, with the store, neither. Images equal the plain pipeline's."""
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from torch_ext.cache import lazy_forward  # noqa: E402
from torch_ext.demos import tiny_stable_diffusion  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


class CountEmbeddings(TorchDispatchMode):
    """Counts aten.embedding calls on real tensors (not torch.export's fake ones): in this pipeline
    only the text encoder embeds (tokens, positions)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.embedding.default and type(args[0]) in (torch.Tensor, torch.nn.Parameter):
            self.count += 1
        return func(*args, **(kwargs or {}))


def images(pipe, seed, prompt="a cat"):
    """One pipeline call with the pipeline's defaults (classifier-free guidance: the text encoder
    encodes the prompt, then the empty negative prompt) and how many embeddings it ran."""
    with CountEmbeddings() as counter:
        out = pipe(prompt, num_inference_steps=2, height=8, width=8,
                   generator=torch.Generator().manual_seed(seed), output_type="pt").images
    return out, counter.count


def routed(pipe, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the torch.export fallback's warning
        return lazy_forward(pipe.text_encoder, **options)


def test_a_second_call_with_the_same_prompt_runs_no_text_encoder_node(tmp_path):
    plain = tiny_stable_diffusion(str(tmp_path))
    expected = [images(plain, seed)[0] for seed in (0, 1, 2)]
    pipe = tiny_stable_diffusion(str(tmp_path))
    executor = routed(pipe)
    got, embeddings = images(pipe, 0)
    assert torch.equal(got, expected[0]) and embeddings == 3  # tokens of prompt and negative, positions once
    for seed in (1, 2):  # the prompt is tokenized again: a new tensor, equal values
        got, embeddings = images(pipe, seed)
        assert torch.equal(got, expected[seed]) and embeddings == 0
    assert executor.stats().hits >= 2
    got, embeddings = images(pipe, 0, prompt="a dog")  # another prompt: encoded
    # Its tokens are embedded; positions and the negative prompt are served.
    assert torch.equal(got, images(plain, 0, prompt="a dog")[0]) and embeddings == 1
    got, embeddings = images(pipe, 3)  # back to the first prompt: still held
    assert torch.equal(got, images(plain, 3)[0]) and embeddings == 0
    del pipe.text_encoder.forward  # routed back: the plain module again
    assert torch.equal(images(pipe, 1)[0], expected[1])


SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    import torch
    from torch_ext.cache import lazy_forward
    from torch_ext.demos import tiny_stable_diffusion
    sys.path.insert(0, sys.argv[3])
    from test_cache_pipeline import images
    pipe = tiny_stable_diffusion(sys.argv[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        executor = lazy_forward(pipe.text_encoder, store=sys.argv[2])
    got, embeddings = images(pipe, 5)
    torch.save(got, sys.argv[1] + "/image.pt")
    print(json.dumps({"embeddings": embeddings, **executor.store.stats().as_dict()}))
""")


def test_a_new_process_with_the_store_runs_no_text_encoder_node(tmp_path):
    def run():
        out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), str(tmp_path / "store"),
                              str(Path(__file__).parent)], capture_output=True, text=True, timeout=600,
                             env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1]), torch.load(tmp_path / "image.pt")

    first, image = run()
    assert first["embeddings"] == 3 and first["writes"] > 0
    second, again = run()
    assert second["embeddings"] == 0 and second["hits"] > 0 and second["rejected"] == 0
    assert torch.equal(again, image) and torch.equal(image, images(tiny_stable_diffusion(str(tmp_path)), 5)[0])
