"""Demo models and the tour behind `python -m torch_ext demo`.

The models are plain PyTorch, built from a config with random weights (nothing is downloaded):
the tests, the benchmarks and the demo use them. The library never imports this module.
"""
from __future__ import annotations

import copy
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    @classmethod
    def gpt2_small(cls, **overrides) -> "GPTConfig":
        """GPT-2 small's shape (124M parameters)."""
        return cls(**{"vocab_size": 50257, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768,
                      **overrides})


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"GPTConfig: n_embd={config.n_embd} is not a multiple of n_head={config.n_head}")
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        shape = (batch, time, self.n_head, channels // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """A pre-norm transformer decoder block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder: token and position embeddings, n_layer blocks, a tied LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's initialisation: small normal weights keep the first logits (and losses) sane.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(positions))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class EncoderClassifier(nn.Module):
    """A small transformer encoder (2 layers, d_model 64) with a classification head, for serving demos."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


class ConditionedDenoiser(nn.Module):
    """A diffusion-style model: a conditioning encoder (token embeddings and transformer
    blocks, mean-pooled) and a denoiser (transformer blocks over the latent tokens, with the
    conditioning and a timestep embedding added). A sampler calls it at every step with a new
    latent and timestep but the same conditioning."""

    def __init__(self, width: int = 256, heads: int = 4, encoder_layers: int = 6, denoiser_layers: int = 2,
                 vocab_size: int = 1024, cond_tokens: int = 77) -> None:
        super().__init__()
        config = GPTConfig(vocab_size=vocab_size, block_size=cond_tokens, n_layer=encoder_layers, n_head=heads,
                           n_embd=width)
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Parameter(torch.randn(cond_tokens, width) * 0.02)
        self.encoder = nn.ModuleList(Block(config) for _ in range(encoder_layers))
        self.encoder_norm = nn.LayerNorm(width)
        self.time_mlp = nn.Sequential(nn.Linear(1, width), nn.SiLU(), nn.Linear(width, width))
        self.denoiser = nn.ModuleList(Block(config) for _ in range(denoiser_layers))
        self.out = nn.Linear(width, width)

    def encode(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.token_embedding(tokens) + self.position_embedding
        for block in self.encoder:
            h = block(h)
        return self.encoder_norm(h).mean(dim=1, keepdim=True)

    def denoise(self, latent: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h = latent + cond + self.time_mlp(t.reshape(-1, 1, 1))
        for block in self.denoiser:
            h = block(h)
        return self.out(h)

    def forward(self, latent: torch.Tensor, t: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.denoise(latent, t, self.encode(tokens))


def sample(model: Callable, latent: torch.Tensor, tokens: torch.Tensor, steps: int, progress=None) -> torch.Tensor:
    """A plain Euler-style sampling loop: `steps` calls of model(latent, t, tokens)."""
    schedule = torch.linspace(1.0, 0.0, steps + 1)
    iterator = range(steps) if progress is None else progress(range(steps), desc="sampling steps")
    for i in iterator:
        t = schedule[i].reshape(1)
        latent = latent + (schedule[i + 1] - schedule[i]) * model(latent, t, tokens)
    return latent


def tiny_stable_diffusion(folder: str, seed: int = 0):
    """A diffusers StableDiffusionPipeline built from small configs, no downloads: a 2-layer CLIP text
    encoder (width 32), a two-level UNet2DConditionModel, a one-level VAE, DDIM, and a CLIP tokenizer
    of letters written to folder. Needs diffusers and transformers."""
    import json

    import diffusers
    import transformers

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for letter in "abcdefghijklmnopqrstuvwxyz":
        vocab[letter] = len(vocab)
        vocab[letter + "</w>"] = len(vocab)
    Path(folder, "vocab.json").write_text(json.dumps(vocab))
    Path(folder, "merges.txt").write_text("#version: 0.2\n")
    tokenizer = transformers.CLIPTokenizer(str(Path(folder, "vocab.json")), str(Path(folder, "merges.txt")),
                                           model_max_length=16)
    torch.manual_seed(seed)
    text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1)).eval()
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8).eval()
    vae = diffusers.AutoencoderKL(block_out_channels=(8,), in_channels=3, out_channels=3, latent_channels=4,
                                  down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
                                  norm_num_groups=8, sample_size=8).eval()
    scheduler = diffusers.DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                        clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    pipe = diffusers.StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                             scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                             requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def demo_cache(progress) -> None:
    """A 50-step diffusion-style loop, plain and through a LazyExecutor: time per step, hit rate."""
    torch.manual_seed(0)
    from torch_ext import LazyExecutor

    model = ConditionedDenoiser().eval()
    tokens = torch.randint(0, 1024, (1, 77))
    latent = torch.randn(1, 64, 256)
    steps = 50
    executor = LazyExecutor(model)
    cond = model.encode(tokens).detach()
    with torch.no_grad():
        sample(model, latent, tokens, 2), sample(executor, latent, tokens, 2)  # warm-up
        executor.reset_stats()
        start = time.perf_counter()
        expected = sample(model, latent, tokens, steps, progress)
        plain_seconds = (time.perf_counter() - start) / steps
        start = time.perf_counter()
        got = sample(executor, latent, tokens, steps, progress)
        lazy_seconds = (time.perf_counter() - start) / steps
        stats = executor.stats().as_dict()
        start = time.perf_counter()
        sample(lambda x, t, _: model.denoise(x, t, cond), latent, tokens, steps, progress)
        alone_seconds = (time.perf_counter() - start) / steps
    print(f"model: conditioning encoder ({len(model.encoder)} blocks over {tokens.shape[1]} tokens) + denoiser "
          f"({len(model.denoiser)} blocks over {latent.shape[1]} latent tokens), width {latent.shape[2]}")
    print(f"{steps} steps, same conditioning; time per step (one pass each, see benchmarks/bench_cache.py "
          f"for interleaved medians):")
    print(f"  plain module:          {plain_seconds * 1e3:7.2f} ms")
    print(f"  LazyExecutor:          {lazy_seconds * 1e3:7.2f} ms  ({plain_seconds / lazy_seconds:.2f}x faster)")
    print(f"  denoiser alone:        {alone_seconds * 1e3:7.2f} ms  (LazyExecutor / denoiser alone = "
          f"{lazy_seconds / alone_seconds:.2f})")
    print(f"hit rate: {stats['hit_rate']:.0%} of node executions reused ({stats['nodes_reused']} reused, "
          f"{stats['nodes_computed']} computed); {stats['entries']} outputs cached, "
          f"{stats['cached_bytes'] / 2**10:.1f} KiB held")
    print(f"same result as the plain loop: {torch.equal(expected, got)}")


# ---- demo sections (python -m torch_ext demo), in the order of the README ----


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def demo_memory(progress) -> None:
    """A training step of the built-in decoder: peak CPU memory and bytes saved for backward."""
    from torch_ext import memory

    torch.manual_seed(0)
    config = GPTConfig(n_layer=6, n_embd=256, n_head=8, vocab_size=1024, block_size=256)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, config.vocab_size, (8, config.block_size))
    parameter_bytes = sum(p.nbytes for p in model.parameters())
    steps = 3
    results = []
    for _ in progress(range(steps), desc="training steps"):
        start = time.perf_counter()
        with memory.track() as tracked:
            loss = language_model_loss(model(batch[:, :-1]), batch[:, 1:])
            saved = tracked.saved_bytes
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        results.append((time.perf_counter() - start, tracked.peak_delta_bytes, saved, loss.item()))
    seconds, peak, saved, loss = results[-1]
    print(f"model: GPT, {config.n_layer} blocks, width {config.n_embd}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters ({_mib(parameter_bytes)})")
    print(f"batch: {tuple(batch[:, :-1].shape)} tokens")
    print(f"step time:             {seconds * 1e3:.0f} ms (last of {steps}; the first also creates optimizer state)")
    print(f"peak CPU memory above the step's start: {_mib(peak)}")
    print(f"saved for backward:    {_mib(saved)} (each storage once, parameters included)")
    print(f"loss:                  {loss:.4f}")


def demo_checkpoint(progress, quick: bool = False) -> None:
    """A training step of the built-in decoder without checkpointing, with every block
    checkpointed, and with a plan for half of the blocks' activation memory."""
    from torch_ext import CheckpointedSequential, memory, plan_checkpoints

    torch.manual_seed(0)
    config = (GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=64) if quick else
              GPTConfig(n_layer=8, n_embd=128, n_head=4, vocab_size=1024, block_size=128))
    batch = torch.randint(0, config.vocab_size, (2 if quick else 4, config.block_size))
    inputs, targets = batch[:, :-1], batch[:, 1:]
    base = GPT(config)
    for p in base.parameters():
        p.grad = torch.zeros_like(p)  # gradients accumulate in place: the peak is activations
    embedded = base.embed(inputs).detach()

    def step(model_blocks):
        def run():
            x = base.embed(inputs)
            x = model_blocks(x)
            language_model_loss(base.head(x), targets).backward()
        return run

    plain = nn.Sequential(*base.blocks)
    every = CheckpointedSequential(base.blocks, every=1)
    with memory.track() as tracked:
        step(plain)()
    activation_bytes = tracked.peak_delta_bytes
    plan = plan_checkpoints(list(base.blocks), embedded, budget_bytes=activation_bytes // 2, gradients="accumulated",
                            repeat=1 if quick else 2, progress=progress)
    planned = CheckpointedSequential(base.blocks, boundaries=plan)
    rows = []
    for name, blocks in progress([("no checkpointing", plain), ("every block", every),
                                  ("planned, 50% budget", planned)], desc="training steps"):
        run = step(blocks)
        run()  # warm-up
        seconds = []
        for _ in range(1 if quick else 3):
            with memory.track() as tracked:
                start = time.perf_counter()
                run()
                seconds.append(time.perf_counter() - start)
        rows.append((name, tracked.peak_delta_bytes, statistics.median(seconds)))
    mib = 2.0 ** 20
    print(f"model: GPT, {config.n_layer} blocks, width {config.n_embd}, batch {tuple(inputs.shape)}")
    print(f"{'variant':<22} {'step peak CPU memory':>21} {'step time':>10}")
    for name, peak, seconds in rows:
        print(f"{name:<22} {peak / mib:>17.1f} MiB {seconds * 1e3:>7.0f} ms")
    print(f"plan for {plan.budget_bytes / mib:.1f} MiB (half the unplanned step's peak) of block activations: "
          f"boundaries {plan.boundaries}, predicted blocks peak {plan.predicted_peak_bytes / mib:.1f} MiB, predicted "
          f"overhead {plan.predicted_overhead:.0%} (minimum feasible budget {plan.min_budget_bytes / mib:.1f} MiB); "
          "the step's peak also holds the embedding, head and logits")


def demo_paging(progress) -> None:
    """The built-in decoder paged from a safetensors file at a quarter of its weights' size."""
    from torch_ext import SafetensorsSource, page_weights, save_pageable

    torch.manual_seed(0)
    config = GPTConfig(n_layer=6, n_embd=256, n_head=8, vocab_size=2048, block_size=128)
    model = GPT(config).eval()
    batch = torch.randint(0, config.vocab_size, (4, config.block_size))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "gpt.safetensors"
        save_pageable(model, path)
        weight_bytes = SafetensorsSource(path).total_bytes()
        paged = copy.deepcopy(model)
        pager = page_weights(paged, path, weight_bytes // 4, prefetch=4)
        passes = 4
        with torch.no_grad():
            expected = model(batch)
            start = time.perf_counter()
            for _ in range(passes):
                model(batch)
            resident_seconds = (time.perf_counter() - start) / passes
            start = time.perf_counter()
            for _ in progress(range(passes), desc="paged forwards"):
                out = paged(batch)
            seconds = (time.perf_counter() - start) / passes
        s = pager.stats()
        print(f"model: GPT, {config.n_layer} blocks, {weight_bytes / 2**20:.1f} MiB of weights in {path.name}; "
              f"budget {pager.budget_bytes / 2**20:.1f} MiB ({pager.policy}, prefetch {pager.prefetch})")
        print(f"paged outputs equal resident outputs: {torch.equal(out, expected)}; {seconds * 1e3:.0f} ms per "
              f"forward (resident: {resident_seconds * 1e3:.0f} ms)")
        total = s.hits + s.misses
        print(f"stats: hit rate {s.hits / max(total, 1):.0%}, {s.misses} misses, {s.evictions} evictions, "
              f"{s.bytes_loaded / 2**20:.0f} MiB loaded in {s.load_seconds:.2f} s, stall {s.stall_seconds:.2f} s, "
              f"{s.prefetch_hits} prefetch hits, resident {pager.resident_bytes() / 2**20:.1f} MiB")
        del paged, pager


def stats_line(stats: dict) -> str:
    """One line of the figures a server operator looks at first."""
    calls = max(1, stats["calls"])
    return (f"calls {stats['calls']}, hits {stats['hits']} ({100 * stats['hits'] / calls:.0f}%), "
            f"misses {stats['misses']}, builds {stats['builds']} ({stats['build_seconds']:.2f} s), "
            f"padded {stats['padded_calls']} (+{stats['padded_elements']} rows), split {stats['split_calls']}, "
            f"fallback {stats['fallback_calls']}, evictions {stats['evictions']}, plans {stats['plans']} "
            f"({stats['plan_bytes'] / 2**20:.1f} MiB), mean hit lookup "
            f"{1e6 * stats['hit_lookup_seconds'] / max(1, stats['hits']):.2f} µs")


def demo_plan(progress) -> None:
    """A scripted transformer encoder served a stream of random batch sizes, with and without the
    plan cache (preloaded for sizes 1..32), requests interleaved so machine noise hits both alike."""
    torch.manual_seed(0)
    rng = random.Random(0)
    requests = [rng.randint(1, 32) for _ in range(300)]
    inputs = {n: torch.randn(n, 16, 64) for n in range(1, 33)}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a second OpenMP thread on a busy machine adds its own spikes
    from torch_ext import PlanCache

    try:
        scripted = torch.jit.script(EncoderClassifier().eval())
        cache = PlanCache(scripted)
        start = time.perf_counter()
        cache.preload(progress(range(1, 33), desc="preload"), example_inputs=(inputs[1],), progress=False)
        preload_seconds = time.perf_counter() - start
        latencies: dict[str, list[float]] = {"scripted module": [], "PlanCache (preloaded 1..32)": []}
        runs = {"scripted module": scripted, "PlanCache (preloaded 1..32)": cache.infer}
        with torch.no_grad():
            for n in progress(requests, desc="requests"):
                for name, run in runs.items():
                    t = time.perf_counter()
                    run(inputs[n])
                    latencies[name].append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    print(f"stream: {len(requests)} requests, batch sizes 1..32; preload of 32 plans took {preload_seconds:.1f} s")
    for name, values in latencies.items():
        ordered = sorted(values)
        print(f"{name:<28} total {sum(values):.2f} s, p50 {1e3 * ordered[len(ordered) // 2]:.2f} ms, "
              f"p99 {1e3 * ordered[int(0.99 * (len(ordered) - 1))]:.1f} ms, max {1e3 * ordered[-1]:.1f} ms")
    print("cache:", stats_line(cache.stats().as_dict()))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot; pip install matplotlib for one)")
        return
    path = os.path.join(os.environ.get("TORCH_EXT_DEMO_DIR", tempfile.gettempdir()), "plan_cache_latency.png")
    fig, ax = plt.subplots(figsize=(9, 4))
    for name, values in latencies.items():
        ax.plot([1e3 * v for v in values], label=name, linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("request index")
    ax.set_ylabel("latency (ms)")
    ax.set_title("Random batch sizes 1..32: latency by request")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


DEMO_SECTIONS: list[tuple[str, Callable]] = [
    ("CPU memory accounting", demo_memory),
    ("Segment checkpointing", demo_checkpoint),
    ("Weight paging", demo_paging),
    ("Lazy node cache", demo_cache),
    ("Dynamic-batch plan cache", demo_plan),
]
