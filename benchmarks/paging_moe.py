"""A mixture of experts stored one tensor per expert, run by bench_paging.py --moe:

Hugging Face Mixtral (from its config, fp32) saved twice with save_pretrained: in transformers'
original format (each expert's w1 / w2 / w3 its own tensor, as the Hub's checkpoints are) and with
save_original_format=False (each layer's experts fused, as the model holds them). One forward of
1xTOKENS tokens, on the CPU with one torch thread, for the resident model (from_pretrained) and for
torch_ext.load_paged from each folder at 25%, 50% and 100% of the weights, timed in interleaved
rounds in one process. From the per-expert folder each layer's fused experts are compositions of
the stored tensors, copied in part by part at each page-in; from the fused folder they are
zero-copy views of the mapped file. Logits are checked equal to from_pretrained's from the same
folder; the resident row, the time reference, is from_pretrained from the per-expert folder.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from harness import Report, format_bytes, measure_interleaved, paired_ratio, progress

FULL = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_local_experts=8, num_experts_per_tok=2,
            num_attention_heads=8, num_key_value_heads=4, vocab_size=4096, tokens=64, warmup=2, repeat=40)
QUICK = dict(FULL, num_hidden_layers=2, hidden_size=64, intermediate_size=128, vocab_size=512, tokens=16, repeat=3)
BUDGETS = (25, 50, 100)


def _write(folder: Path, config, original_format: bool) -> None:
    import transformers

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(config).eval()
    model.save_pretrained(folder, max_shard_size="20MB", save_original_format=original_format)


def page_and_time(resident, folders: dict[str, Path], reference_of, ids: torch.Tensor, sizes: dict, say):
    """load_paged of each folder at each of BUDGETS, its logits checked against
    reference_of(stored, folder)'s, then every paged model and `resident` timed in interleaved
    rounds on `ids`: ({name: model}, {name: set-up seconds}, {name: logits equal}, {name: Timing}),
    names "resident" and "<stored> <percent>%"."""
    import torch_ext

    models, setup, equal = {"resident": resident}, {}, {}
    for stored, folder in folders.items():
        with torch.no_grad():
            expected = reference_of(stored, folder)(ids).logits
        for percent in BUDGETS:
            name = f"{stored} {percent}%"
            say(f"load_paged {name}")
            start = time.perf_counter()
            models[name] = torch_ext.load_paged(folder, f"{percent}%")
            setup[name] = time.perf_counter() - start
            with torch.no_grad():
                equal[name] = torch.equal(models[name](ids).logits, expected)
            torch_ext.pager_of(models[name]).reset_stats()

    def forward(model):
        def call():
            with torch.no_grad():
                model(ids)
        return call

    say(f"{sizes['warmup'] + sizes['repeat']} interleaved rounds of {len(models)} variants")
    timings = measure_interleaved({name: forward(model) for name, model in models.items()},
                                  warmup=sizes["warmup"], repeat=sizes["repeat"], alternate=True)
    return models, setup, equal, timings


def run(args, command: str) -> None:
    import transformers

    import torch_ext

    sizes = QUICK if args.quick else FULL
    say = progress("paging --moe")
    torch.set_num_threads(1)
    config = transformers.MixtralConfig(**{k: v for k, v in sizes.items() if k not in ("tokens", "warmup", "repeat")},
                                        max_position_embeddings=256)
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        folders = {"per-expert": Path(workdir) / "per-expert", "fused": Path(workdir) / "fused"}
        for stored, folder in folders.items():
            _write(folder, config, original_format=stored == "per-expert")
        resident = transformers.MixtralForCausalLM.from_pretrained(folders["per-expert"]).eval()
        weights = sum(t.numel() * t.element_size() for t in resident.state_dict().values())
        largest = max(t.numel() * t.element_size() for t in resident.state_dict().values())
        ids = torch.randint(3, config.vocab_size, (1, sizes["tokens"]), generator=torch.Generator().manual_seed(1))
        # each folder's own from_pretrained is its reference: the same weights at another address
        # can round differently in torch's CPU matmul (from_pretrained maps the fused folder's file
        # too, at an offset that is not 64-byte aligned: its logits differ from the per-expert
        # folder's in the last bits)
        models, setup, equal, timings = page_and_time(
            resident, folders, lambda stored, folder: resident if stored == "per-expert" else
            transformers.MixtralForCausalLM.from_pretrained(folder).eval(), ids, sizes, say)
    rounds = sizes["warmup"] + sizes["repeat"]
    report = Report("paging_moe", f"Weight paging: a mixture of experts stored per expert (Mixtral, "
                    f"{config.num_hidden_layers} layers, width {config.hidden_size}, {config.num_local_experts} "
                    f"experts, {format_bytes(weights)} fp32), CPU, 1 torch thread, 1x{sizes['tokens']} tokens",
                    ["folder", "budget", "set-up", "forward", "vs resident (median of rounds, 95% interval)",
                     "read per forward", "resident at the end", "logits vs from_pretrained(folder)"], command)
    report.add_row({"folder": "resident (from_pretrained)", "budget": "all",
                    "forward": f"{timings['resident'].median_seconds * 1e3:.2f} ms"},
                   forward_seconds=timings["resident"].median_seconds)
    for name, model in models.items():
        if name == "resident":
            continue
        pager = torch_ext.pager_of(model)
        stats = pager.stats()
        ratio, low, high = paired_ratio(timings[name], timings["resident"])
        stored, percent = name.split()
        report.add_row({
            "folder": {"per-expert": "per expert (original format): compositions",
                       "fused": "fused (save_original_format=False): views"}[stored],
            "budget": f"{percent} ({format_bytes(pager.budget_bytes)})",
            "set-up": f"{setup[name]:.2f} s",
            "forward": f"{timings[name].median_seconds * 1e3:.2f} ms",
            "vs resident (median of rounds, 95% interval)": f"{ratio:.2f}x [{low:.2f}, {high:.2f}]",
            "read per forward": format_bytes(stats.bytes_loaded / rounds),
            "resident at the end": format_bytes(pager.resident_bytes()),
            "logits vs from_pretrained(folder)": "equal" if equal[name] else "DIFFER",
        }, setup_seconds=setup[name], forward_seconds=timings[name].median_seconds, ratio=ratio, low=low, high=high,
            bytes_loaded_per_forward=stats.bytes_loaded / rounds)
    report.notes.append("")
    report.notes.append(f"Largest tensor {format_bytes(largest)} (a layer's fused gate_up_proj). \"Read per forward\" "
                        f"is the pager's bytes_loaded per round over the {rounds} rounds (warm-up included): bytes "
                        f"paged in, copied from the file (compositions) or mapped (views).")
    report.add_checks([("every paged model's logits equal from_pretrained's from the same folder",
                        all(equal.values()))])
    report.write()
