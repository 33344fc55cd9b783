"""Quantized checkpoints paged and dequantized as they come in, run by bench_paging.py --quantized:

Two Hugging Face models built from their configs in bf16 and saved twice, as is and quantized as
the Hub holds such models: Llama as an FP8 checkpoint in transformers' fine-grained format (each
decoder projection float8_e4m3fn with one float32 scale per 128x128 block, "quant_method": "fp8":
DeepSeek-V3's and Qwen3-FP8's format), and gpt-oss with its experts in MXFP4 (packed FP4 with one
E8M0 exponent per 32 values, "quant_method": "mxfp4"). The writers are tests/python/
quantized_checkpoints.py's. One forward of 1xTOKENS tokens on the CPU with one torch thread, timed
in interleaved rounds in one process per model: the resident model from_pretrained(quantized
folder) gives (it dequantizes to bf16 while loading on a machine without the method's kernels;
the time reference), and torch_ext.load_paged from each folder at 25%, 50% and 100% of the bf16
weights. From the quantized folder each quantized weight is dequantized as it is paged in; from
the bf16 folder tensors are views of the mapped file. Logits are checked equal to
from_pretrained's from the same folder.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

from harness import Report, format_bytes, paired_ratio, progress
from paging_moe import page_and_time

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))
from quantized_checkpoints import fp8_folder, mxfp4_folder  # noqa: E402

LAYERS = dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=4, vocab_size=4096,
              max_position_embeddings=256)
FULL = dict(tokens=64, warmup=2, repeat=40, block=128, llama=dict(LAYERS, intermediate_size=1536),
            gpt_oss=dict(LAYERS, intermediate_size=512, head_dim=64, num_local_experts=8, num_experts_per_tok=2))
QUICK = dict(tokens=16, warmup=1, repeat=3, block=32,
             llama=dict(LAYERS, num_hidden_layers=2, hidden_size=64, intermediate_size=128, vocab_size=512),
             gpt_oss=dict(LAYERS, num_hidden_layers=2, hidden_size=64, intermediate_size=64, head_dim=16,
                          num_local_experts=4, num_experts_per_tok=2, vocab_size=512))


def _models(sizes):
    import transformers

    block = sizes["block"]
    return {
        "Llama, FP8": (transformers.LlamaForCausalLM, transformers.LlamaConfig(**sizes["llama"]),
                       lambda source, target: fp8_folder(source, target, block)),
        "gpt-oss, MXFP4 experts": (transformers.GptOssForCausalLM, transformers.GptOssConfig(**sizes["gpt_oss"]),
                                   mxfp4_folder),
    }


def run(args, command: str) -> None:
    import torch_ext

    sizes = QUICK if args.quick else FULL
    say = progress("paging --quantized")
    torch.set_num_threads(1)
    rounds = sizes["warmup"] + sizes["repeat"]
    report = Report("paging_quantized", f"Weight paging: quantized checkpoints dequantized as they are paged in, "
                    f"CPU, 1 torch thread, 1x{sizes['tokens']} tokens",
                    ["model", "folder", "on disk", "budget", "set-up", "forward",
                     "vs resident (median of rounds, 95% interval)", "read per forward",
                     "logits vs from_pretrained(folder)"], command)
    all_equal = True
    for label, (cls, config, write) in _models(sizes).items():
        with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
            folders = {"quantized": Path(workdir) / "quantized", "bf16": Path(workdir) / "bf16"}
            torch.manual_seed(0)
            say(f"{label}: writing the folders")
            cls(config).to(torch.bfloat16).save_pretrained(folders["bf16"])
            write(folders["bf16"], folders["quantized"])
            on_disk = {stored: os.path.getsize(folder / "model.safetensors") for stored, folder in folders.items()}
            say(f"{label}: from_pretrained of the quantized folder (dequantized while loading)")
            resident = cls.from_pretrained(folders["quantized"]).eval()
            weights = sum(t.numel() * t.element_size() for t in resident.state_dict().values())
            ids = torch.randint(3, config.vocab_size, (1, sizes["tokens"]), generator=torch.Generator().manual_seed(1))
            models, setup, equal, timings = page_and_time(
                resident, folders, lambda stored, folder: resident if stored == "quantized" else
                cls.from_pretrained(folder).eval(), ids, sizes, lambda what: say(f"{label}: {what}"))
        title = f"{label} ({config.num_hidden_layers} layers, width {config.hidden_size}, {format_bytes(weights)} bf16)"
        report.add_row({"model": title, "folder": "resident: from_pretrained(quantized folder), dequantized while "
                        "loading", "on disk": format_bytes(on_disk["quantized"]), "budget": "all",
                        "forward": f"{timings['resident'].median_seconds * 1e3:.2f} ms"},
                       model=label, forward_seconds=timings["resident"].median_seconds)
        for name, model in models.items():
            if name == "resident":
                continue
            pager = torch_ext.pager_of(model)
            stats = pager.stats()
            ratio, low, high = paired_ratio(timings[name], timings["resident"])
            stored, percent = name.split()
            report.add_row({
                "model": title,
                "folder": {"quantized": "quantized (dequantized as paged in)",
                           "bf16": "bf16 (views of the mapped file)"}[stored],
                "on disk": format_bytes(on_disk[stored]),
                "budget": f"{percent} ({format_bytes(pager.budget_bytes)})",
                "set-up": f"{setup[name]:.2f} s",
                "forward": f"{timings[name].median_seconds * 1e3:.2f} ms",
                "vs resident (median of rounds, 95% interval)": f"{ratio:.2f}x [{low:.2f}, {high:.2f}]",
                "read per forward": format_bytes(stats.bytes_loaded / rounds),
                "logits vs from_pretrained(folder)": "equal" if equal[name] else "DIFFER",
            }, model=label, setup_seconds=setup[name], forward_seconds=timings[name].median_seconds, ratio=ratio,
                low=low, high=high, bytes_loaded_per_forward=stats.bytes_loaded / rounds,
                on_disk_bytes=on_disk[stored])
        all_equal = all_equal and all(equal.values())
    report.notes.append("")
    report.notes.append(f"The budget is a share of the bf16 weights the model computes with. \"Read per forward\" is "
                        f"the pager's bytes_loaded per round over the {rounds} rounds (warm-up included): bf16 bytes "
                        f"paged in, dequantized from the quantized file or mapped from the bf16 one.")
    report.add_checks([("every paged model's logits equal from_pretrained's from the same folder", all_equal)])
    report.write()
