"""The pager's own cost per paged module, run by bench_paging.py --hooks:

Models small enough that the hooks around each paged module's forward show: N nn.Linear(W, W)
modules in a row, and a Hugging Face Llama decoding one token at a time (use_cache, its default).
Each is paged at a 100% budget, so after the first call nothing is read and what is left over the
resident model is the pager's per-module work: the pre-hook acquiring the module's tensors and
setting them as its parameters, and the forward hook putting the placeholders back. On the CPU
with one torch thread, timed in interleaved rounds in one process (each round: CALLS calls of
each variant); the cost per module is (paged - resident) / modules from the per-round medians.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from harness import Report, measure_interleaved, paired_ratio, progress

FULL = dict(modules=64, width=64, batch=4, layers=4, hidden=128, calls=20, warmup=3, repeat=40)
QUICK = dict(FULL, modules=8, layers=1, calls=2, repeat=3)


def _linear_stack(folder: Path, sizes: dict) -> tuple[nn.Module, Path]:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(sizes["width"], sizes["width"]) for _ in range(sizes["modules"])])
    path = folder / "stack.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return model, path


def _llama(folder: Path, sizes: dict) -> Path:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=sizes["hidden"], intermediate_size=2 * sizes["hidden"],
                                      num_hidden_layers=sizes["layers"], num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(folder / "llama")
    return folder / "llama"


def _decoder(model: nn.Module, calls: int):
    """One call: `calls` decoding steps of one token each, from a 16-token prompt's cache."""
    prompt = torch.randint(3, 512, (1, 16), generator=torch.Generator().manual_seed(1))

    def call():
        with torch.no_grad():
            out = model(prompt)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(calls):
                out = model(token, past_key_values=cache)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return token

    return call


def run(args, command: str) -> None:
    import transformers

    import torch_ext

    sizes = QUICK if args.quick else FULL
    say = progress("paging --hooks")
    torch.set_num_threads(1)
    calls = sizes["calls"]
    x = torch.randn(sizes["batch"], sizes["width"], generator=torch.Generator().manual_seed(2))
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        stack, path = _linear_stack(Path(workdir), sizes)
        paged_stack = nn.Sequential(*[nn.Linear(sizes["width"], sizes["width"]) for _ in range(sizes["modules"])])
        torch_ext.page_weights(paged_stack, path, "100%")
        folder = _llama(Path(workdir), sizes)
        llama = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
        paged_llama = torch_ext.load_paged(folder, "100%")
        llama_modules = sum(1 for m in paged_llama.modules() if m._forward_pre_hooks) - 1  # the model's own hook

        def inference(model):
            def call():
                with torch.no_grad():
                    for _ in range(calls):
                        model(x)
            return call

        def training(model):
            def call():
                for _ in range(calls):
                    model(x.requires_grad_(True)).sum().backward()
            return call

        for p in stack.parameters():
            p.requires_grad_(False)
        variants = {"stack resident inference": inference(stack), "stack paged inference": inference(paged_stack),
                    "stack resident backward": training(stack), "stack paged backward": training(paged_stack),
                    "llama resident decode": _decoder(llama, calls), "llama paged decode": _decoder(paged_llama, calls)}
        equal = {"stack": torch.equal(stack(x), paged_stack(x)),
                 "llama": torch.equal(variants["llama resident decode"](), variants["llama paged decode"]())}
        say(f"{sizes['warmup'] + sizes['repeat']} interleaved rounds of {len(variants)} variants, {calls} calls each")
        timings = measure_interleaved(variants, warmup=sizes["warmup"], repeat=sizes["repeat"], alternate=True)
        loaded = {"stack": torch_ext.pager_of(paged_stack).stats(), "llama": torch_ext.pager_of(paged_llama).stats()}

    report = Report("paging_hooks", "Weight paging: the pager's cost per paged module at a 100% budget, CPU, 1 torch "
                    "thread", ["model", "run", "paged modules", "resident", "paged", "paged vs resident (median of "
                               "rounds, 95% interval)", "per paged module", "outputs"], command)
    rows = [("stack", "inference", f"{sizes['modules']} x nn.Linear({sizes['width']}, {sizes['width']}), batch "
             f"{sizes['batch']}", sizes["modules"], "forward"),
            ("stack", "backward", None, sizes["modules"], "forward and backward (input gradient)"),
            ("llama", "decode", f"Llama ({sizes['layers']} layers, width {sizes['hidden']}), from its folder",
             llama_modules, "one token with the cache")]
    for model, run_name, label, modules, what in rows:
        resident = timings[f"{model} resident {run_name}"]
        paged = timings[f"{model} paged {run_name}"]
        ratio, low, high = paired_ratio(paged, resident)
        per_module = (paged.median_seconds - resident.median_seconds) / calls / modules
        report.add_row({
            "model": label or "",
            "run": what,
            "paged modules": modules,
            "resident": f"{resident.median_seconds / calls * 1e3:.3f} ms",
            "paged": f"{paged.median_seconds / calls * 1e3:.3f} ms",
            "paged vs resident (median of rounds, 95% interval)": f"{ratio:.2f}x [{low:.2f}, {high:.2f}]",
            "per paged module": f"{per_module * 1e6:.1f} µs",
            "outputs": "equal" if equal[model] else "DIFFER",
        }, resident_seconds=resident.median_seconds / calls, paged_seconds=paged.median_seconds / calls,
            ratio=ratio, low=low, high=high, per_module_seconds=per_module)
    report.notes.append("")
    report.notes.append(f"Each cell is per call (forward, or forward and backward, or one decoding step), from the "
                        f"median of {sizes['repeat']} rounds of {calls} calls after {sizes['warmup']} warm-up rounds. "
                        f"After the warm-up nothing is read: bytes loaded {loaded['stack'].bytes_loaded} (stack) and "
                        f"{loaded['llama'].bytes_loaded} (Llama) in all, the first call's. \"Per paged module\" is the "
                        f"paged call's extra time over the modules that have paging hooks.")
    report.add_checks([("the paged models' outputs equal the resident ones'", all(equal.values()))])
    report.write()
