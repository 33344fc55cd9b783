"""Quantized checkpoints written from a save_pretrained folder, as the Hub holds them, for the
paging tests and benchmarks (nothing is downloaded): transformers' fine-grained FP8 (DeepSeek-V3's
and Qwen3-FP8's format) and gpt-oss's MXFP4 experts."""
import json
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

QUANTIZED = re.compile(r"\.layers\.\d+\..*(_proj|_proj_with_mqa|\.w[123])\.weight$")


def fp8(weight, block):
    """A weight as an FP8 checkpoint stores it: float8_e4m3fn values and one float32 scale per
    block x block tile (the tile's largest magnitude over e4m3's largest)."""
    rows, cols = weight.shape
    tiles = weight.float().reshape(rows // block, block, cols // block, block)
    scales = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    values = (tiles / scales[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
    return values, scales


def fp8_folder(source, target, block):
    """A copy of a save_pretrained folder (one file or sharded) as an FP8 checkpoint: each
    projection of the decoder layers (experts' included) whose shape the blocks divide is
    quantized; returns their names."""
    shutil.copytree(source, target)
    index_file = target / "model.safetensors.index.json"
    index = json.loads(index_file.read_text()) if index_file.exists() else None
    shards = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    quantized = []
    for shard in shards:
        tensors = load_file(target / shard)
        for key in list(tensors):
            weight = tensors[key]
            if QUANTIZED.search(key) and weight.dim() == 2 and weight.shape[0] % block == 0 == weight.shape[1] % block:
                tensors[key], tensors[key + "_scale_inv"] = fp8(weight, block)
                if index:
                    index["weight_map"][key + "_scale_inv"] = shard
                quantized.append(key)
        save_file(tensors, target / shard, metadata={"format": "pt"})
    if index:
        index_file.write_text(json.dumps(index))
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (target / "config.json").write_text(json.dumps(config))
    return quantized


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4(weight):
    """[experts, rows, columns] as MXFP4: the nearest FP4 (e2m1) value of each element over its
    group's power-of-two scale, two values a byte (low nibble first), [experts, rows, columns / 32,
    16] uint8; one E8M0 exponent a group of 32, [experts, rows, columns / 32] uint8."""
    experts, rows, columns = weight.shape
    groups = weight.float().reshape(experts, rows, columns // 32, 32)
    exponents = torch.ceil(torch.log2(groups.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -100) / 6.0))
    nearest = ((groups / torch.exp2(exponents)).unsqueeze(-1) - E2M1).abs().argmin(-1).to(torch.uint8)
    blocks = nearest[..., 0::2] | (nearest[..., 1::2] << 4)
    return blocks.contiguous(), (exponents.squeeze(-1) + 127).to(torch.uint8)


def mxfp4_folder(source, target):
    """A copy of a gpt-oss save_pretrained folder (one file) as the Hub's checkpoints hold it:
    each layer's experts' gate_up_proj and down_proj in MXFP4, stored transposed."""
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    experts = [key for key in tensors if key.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    for key in experts:
        tensors[key + "_blocks"], tensors[key + "_scales"] = mxfp4(tensors.pop(key).transpose(1, 2))
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (target / "config.json").write_text(json.dumps(config))
    return experts


