"""load_paged: a Hugging Face folder (config.json and model.safetensors or a sharded
model.safetensors.index.json) or a .safetensors file straight to a paged model, without reading
the weights: the model is built with its parameters on the meta device (its buffers computed as
its constructor computes them), then paged from the file. transformers is imported only here and
only when no model_fn is given."""
from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .install import page_weights
from .source import SafetensorsSource

__all__ = ["load_paged"]


def load_paged(path: str | os.PathLike, budget_bytes: Any, *, model_fn: Callable[[], nn.Module] | None = None,
               dtype: torch.dtype | None = None, device: Any = "cpu", **options: Any) -> nn.Module:
    """A paged model from a Hugging Face folder or a .safetensors file, in one call; returns the
    model in eval mode (torch_ext.pager_of(model) is its pager).

    path: a folder with model.safetensors or model.safetensors.index.json (and config.json unless
    model_fn is given), an index file, or a .safetensors file. budget_bytes: an int or float of
    bytes, "1GB", "512MiB", "30%" (of the file's weights), or a max_memory-style dict by device
    ({"cpu": "1GB"}, {0: "2GiB", "cpu": "8GB"}: the entry of `device` applies).
    model_fn: a constructor of the model (called with parameters created on the meta device);
    without it, transformers builds the class named in config.json's architectures (else
    AutoModelForCausalLM, else AutoModel) from the config, in `dtype` (default: as from_pretrained's
    dtype="auto", the config's dtype, else the file's).
    device: where the weights are used (the pager's device; buffers go there too).
    options: page_weights' (pinned, buffers, key_map, strip_prefix, add_prefix) and the pager's
    (prefetch, zero_copy, policy, ...). A transformers model's checkpoint keys are mapped to its
    parameters by transformers' own loading machinery (its renames and checkpoint conversion
    mappings, with or without the base_model_prefix). A parameter transformers builds by
    converting stored tensors (a layer's experts stacked and concatenated into one, a fused
    projection split) is paged as a composition of them (SafetensorsSource.composed), read from
    the file part by part each time it is paged in; a conversion that computes rather than lays
    tensors out is refused, naming the parameter and the conversion. Tied weights are one pager
    entry, the file may omit the tied copy. A file stored in another dtype than `dtype` is
    converted as it is paged in. A checkpoint quantized with transformers' fp8 method (FP8 weights
    and their block scales, DeepSeek-V3's format) or mxfp4 (gpt-oss's experts) is paged as
    from_pretrained loads it where it dequantizes (a machine without the method's kernels, or
    dequantize=True): each weight is dequantized as it is paged in (the file's quantized bytes
    stay on disk), in `dtype`; other quantization methods raise, naming the method. Nothing but
    the files' headers (and persistent buffers) is read."""
    source_path, folder = _locate(path)
    stored = SafetensorsSource(source_path)
    dequantized = _dequantizations(folder, stored)
    source = stored.composed(dequantized) if dequantized else stored
    if model_fn is None:
        model = _from_config(folder, dtype, stored)
    else:
        if not callable(model_fn):
            raise TypeError(f"load_paged: model_fn must be a callable returning an nn.Module, got "
                            f"{type(model_fn).__name__}")
        if dtype is not None:
            raise ValueError("load_paged: dtype applies to models built from config.json; build the model "
                             "in that dtype in model_fn")
        with parameters_on_meta():
            model = model_fn()
        if not isinstance(model, nn.Module):
            raise TypeError(f"load_paged: model_fn returned {type(model).__name__}, not an nn.Module")
    if not any(key in options for key in ("key_map", "strip_prefix", "add_prefix")) and _is_transformers_model(model):
        options["key_map"], programs = transformers_checkpoint_keys(model, source)
        if programs:
            source = source.composed(programs)
    _load_buffers(model, source, options.get("key_map"), torch.device(device), read=not options.get("buffers"))
    page_weights(model, source, budget_bytes, device=device, **options)
    return model.eval()


def _locate(path: Any) -> tuple[Path, Path]:
    """(what SafetensorsSource opens, the folder holding config.json)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load_paged: path must be a str or os.PathLike, got {type(path).__name__}")
    path = Path(path)
    if path.is_dir():
        return path, path
    if not path.exists():
        raise FileNotFoundError(f"load_paged: {path} does not exist (expected a folder with model.safetensors or "
                                f"model.safetensors.index.json, an index file, or a .safetensors file)")
    return path, path.parent


def _stored_dtype(source: SafetensorsSource) -> torch.dtype | None:
    """The dtype of the file's first floating-point tensor."""
    for name in source.names():
        dtype = source.dtype(name)
        if dtype.is_floating_point:
            return dtype
    return None


# How transformers names the block scales of an FP8 checkpoint's weight "X.weight" (its FP8
# quantizer renames the other two spellings to the first).
_SCALE_SUFFIXES = (".weight_scale_inv", ".qscale_weight", ".scale")
_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.int8,
                     torch.float4_e2m1fn_x2)


def _dequantizations(folder: Path, source: SafetensorsSource) -> dict[str, list[str]]:
    """The compositions that serve a quantized checkpoint's weights dequantized, as from_pretrained
    dequantizes them while loading on a machine without the method's kernels; {} for a checkpoint
    whose config.json declares no quantization. Two methods are read:
    - "fp8" (transformers' FineGrainedFP8Config: DeepSeek-V3, Qwen3-FP8): each weight "X.weight"
      stored with its block scales "X.weight_scale_inv" is served dequantized under its own name;
    - "mxfp4" (gpt-oss): each pair "X_blocks" (packed FP4, [..., rows, groups, 16]) and
      "X_scales" (E8M0, one a group of 32 values) is served as "X", transposed as transformers
      lays gpt-oss's experts out ([experts, columns, rows]).
    Any other method is refused: its tensors are not the model's weights."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return {}
    try:
        quantization = json.loads(config_file.read_text()).get("quantization_config")
    except (ValueError, AttributeError):
        return {}  # transformers reports a malformed config when it builds the model
    if not quantization:
        return {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    programs = {}
    if method == "fp8":
        for name in source.names():
            suffix = next((s for s in _SCALE_SUFFIXES if name.endswith(s)), None)
            if suffix is None or name.endswith("_l2_clip.scale"):
                continue
            weight = name[:-len(suffix)] + ".weight"
            if weight in source and source.dtype(weight) in _QUANTIZED_DTYPES:
                programs[weight] = [f"tensor {weight}", f"tensor {name}", "dequantize"]
    elif method == "mxfp4":
        for name in source.names():
            weight = name.removesuffix("_blocks")
            if name.endswith("_blocks") and f"{weight}_scales" in source:
                *outer, groups, pairs = shape = tuple(source.shape(name))
                if len(outer) != 2 or tuple(source.shape(f"{weight}_scales")) != shape[:-1]:
                    raise ValueError(f"load_paged: {source.path()}: MXFP4 blocks {name!r} {shape} and scales "
                                     f"{tuple(source.shape(f'{weight}_scales'))} are not [experts, rows, groups, "
                                     f"bytes] and [experts, rows, groups] as transformers reads them")
                programs[weight] = [f"tensor {name}", f"reshape {outer[0]} {outer[1]} {groups * pairs}",
                                    f"tensor {weight}_scales", "dequantize", "transpose 1 2"]
    else:
        raise ValueError(f"load_paged: {config_file} declares {method!r} quantization; torch_ext pages checkpoints "
                         f"quantized with transformers' fp8 and mxfp4 methods (dequantizing their weights as they "
                         f"are paged in) and unquantized ones, not {method!r}: its stored tensors are not the "
                         f"model's weights")
    return programs


def _from_config(folder: Path, dtype: torch.dtype | None, source: SafetensorsSource) -> nn.Module:
    """The model of folder/config.json on the meta device, in `dtype`, else as from_pretrained's
    dtype="auto" chooses: the config's dtype, else the file's first floating-point tensor's."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"load_paged: {config_file} is missing: a model is built from the folder's config.json "
                                f"(pass model_fn=... to build it yourself)")
    try:
        import transformers
    except ImportError as error:
        raise RuntimeError(f"load_paged: building the model of {config_file} needs transformers "
                           f"(pip install transformers==5.23.0), or pass model_fn=... to build it yourself") from error
    config = transformers.AutoConfig.from_pretrained(folder)
    if dtype is None:
        dtype = getattr(config, "dtype", None) or _stored_dtype(source)
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    architecture = (getattr(config, "architectures", None) or [None])[0]
    with parameters_on_meta():
        if architecture and hasattr(transformers, architecture):
            model = getattr(transformers, architecture)._from_config(config, dtype=dtype)
        else:
            try:
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
            except ValueError:
                model = transformers.AutoModel.from_config(config, dtype=dtype)
    _keep_in_float32(model, dtype)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # its weights are served dequantized, as from_pretrained's are
    generation_file = folder / "generation_config.json"
    if generation_file.is_file() and getattr(model, "generation_config", None) is not None:
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    return model


def _keep_in_float32(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Parameters and persistent buffers (the tensors from_pretrained loads) that it keeps in
    float32 in a model of `dtype` (transformers' dtype plan: _keep_in_fp32_modules in float16,
    _keep_in_fp32_modules_strict in float16 and bfloat16; DeepSeek-V3's e_score_correction_bias
    is a buffer) are made float32 here too, matched by transformers' own patterns."""
    plan = model._get_dtype_plan(dtype) if dtype is not None and hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return
    from transformers.core_model_loading import build_glob_alternation

    alternation, group_patterns, _ = build_glob_alternation(list(plan))

    def kept(name: str) -> torch.dtype | None:
        match = alternation.search(name)
        return None if match is None else plan[group_patterns[match.lastgroup]]

    for name, param in model.named_parameters():
        if (dtype := kept(name)) is not None:
            param.data = param.data.to(dtype)
    for module_name, module in model.named_modules():
        for attr, buffer in module._buffers.items():
            persistent = buffer is not None and attr not in module._non_persistent_buffers_set
            if persistent and (dtype := kept(f"{module_name}.{attr}" if module_name else attr)) is not None:
                module._buffers[attr] = buffer.to(dtype)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Parameters registered while this is active move to the meta device as they are registered
    (their initialisation then runs on meta, at no cost); buffers and everything else are built as
    usual, so non-persistent buffers (rotary inv_freq, masks) get their real values. Patches
    nn.Module.register_parameter for the duration (process-wide, as accelerate's
    init_empty_weights(include_buffers=False) does)."""
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            kwargs = dict(param.__dict__)
            kwargs["requires_grad"] = param.requires_grad
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _is_transformers_model(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def transformers_checkpoint_keys(model: nn.Module, source: SafetensorsSource
                                 ) -> tuple[dict[str, str], dict[str, list[str]]]:
    """({parameter or buffer name: checkpoint key}, {parameter name: composition program}) as
    from_pretrained maps them: each key of the source is renamed by transformers' own machinery
    (the model's checkpoint conversion mapping, legacy renames, base_model_prefix added or
    removed), in the order from_pretrained reads them. A parameter transformers makes by converting
    stored tensors (a layer's experts stacked and concatenated into one, a fused projection split)
    gets the program of a SafetensorsSource composition: transformers' own conversion ops are run
    on stand-ins that record them (_Layout). Names in neither keep their own name. Raises naming
    the parameter and the conversion when a conversion does more than lay tensors out."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    expected = model.state_dict(keep_vars=True)
    prefix = getattr(model, "base_model_prefix", "") or None
    keys: dict[str, str] = {}
    converting: dict[str, tuple[WeightConverter, list[str]]] = {}
    for key in sorted(source.names(), key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if pattern is None:
            if name in expected:
                keys.setdefault(name, key)
        elif name in expected:
            # as from_pretrained: a converter of its own per parameter, its tensors in sorted key order
            if name not in converting:
                converting[name] = (copy.deepcopy(by_pattern[pattern]), [])
            converter, from_keys = converting[name]
            converter.add_tensor(name, key, pattern, _Layout.stored(source, key))
            from_keys.append(key)
    stored = set(keys) | {name for name in expected if name in source}
    programs: dict[str, list[str]] = {}
    for name, (converter, from_keys) in converting.items():
        if name not in stored:
            programs.update(_compositions(model, source, name, converter, from_keys, expected))
    return keys, programs


def _compositions(model: nn.Module, source: SafetensorsSource, name: str, converter: Any, from_keys: list[str],
                  expected: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """The programs of the parameters `converter` makes (one, or several for a split), checked
    against the model's shapes."""
    shown = ", ".join(repr(k) for k in from_keys[:4]) + (", ..." if len(from_keys) > 4 else "")
    what = (f"load_paged: parameter {name!r} of {type(model).__name__} is made by transformers' checkpoint "
            f"conversion {converter!r} from {shown} of {source.path()}")
    advice = ("Load the model with from_pretrained and save it with save_pretrained(folder, "
              "save_original_format=False), whose files hold the converted tensors, then load_paged that folder")
    try:
        converted = converter.convert(name, model=model, config=getattr(model, "config", None))
    except _Inexpressible as error:
        raise ValueError(f"{what}, which {error}: torch_ext pages tensors made from stored ones by stacking, "
                         f"concatenating, slicing, transposing and reshaping them, nothing else. {advice}") from None
    except Exception as error:  # stored shapes that do not fit, or a conversion that needs a real tensor
        raise ValueError(f"{what}, which fails on stand-ins of the stored tensors ({type(error).__name__}: "
                         f"{error}). {advice}") from error
    programs = {}
    for target, layout in converted.items():
        if not isinstance(layout, _Layout) or target not in expected:
            raise ValueError(f"{what}, which made {target!r} ({type(layout).__name__}), not a parameter of the "
                             f"model laid out from stored tensors. {advice}")
        if tuple(layout.shape) != tuple(expected[target].shape):
            raise ValueError(f"{what}: it lays them out as {tuple(layout.shape)} where the model's {target!r} is "
                             f"{tuple(expected[target].shape)}")
        programs[target] = layout.program
    return programs


class _Inexpressible(Exception):
    """A conversion applied something other than a layout op; the message says what."""


class _Layout:
    """A stand-in for a stored tensor, or for layout ops over stored tensors, that transformers'
    conversion ops (MergeModulelist, Concatenate, Chunk, Split, Transpose, Interleave) take for a
    tensor: torch.stack / cat / chunk / split / transpose / reshape and .contiguous() record
    themselves as a composition program (SafetensorsSource.composed) and give shapes through meta
    tensors; anything else raises _Inexpressible, naming it."""

    def __init__(self, meta: torch.Tensor, program: list[str]) -> None:
        self.meta = meta
        self.program = program

    @classmethod
    def stored(cls, source: SafetensorsSource, key: str) -> _Layout:
        return cls(source.meta(key), [f"tensor {key}"])

    @property
    def shape(self) -> torch.Size:
        return self.meta.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.meta.dtype

    @property
    def ndim(self) -> int:
        return self.meta.ndim

    def dim(self) -> int:
        return self.meta.dim()

    def size(self, dim: int | None = None) -> Any:
        return self.meta.size() if dim is None else self.meta.size(dim)

    def contiguous(self, *args: Any, **kwargs: Any) -> _Layout:
        return self  # the composition's result is contiguous, whatever the ops before

    def transpose(self, dim0: int, dim1: int) -> _Layout:
        return _Layout(self.meta.transpose(dim0, dim1), [*self.program, f"transpose {dim0} {dim1}"])

    def reshape(self, *shape: Any) -> _Layout:
        meta = self.meta.reshape(*shape)
        return _Layout(meta, [*self.program, "reshape " + " ".join(str(size) for size in meta.shape)])

    def chunk(self, chunks: int, dim: int = 0) -> tuple[_Layout, ...]:
        return self._pieces(torch.chunk(self.meta, chunks, dim), dim)

    def split(self, split_size: Any, dim: int = 0) -> tuple[_Layout, ...]:
        return self._pieces(torch.split(self.meta, split_size, dim), dim)

    def _pieces(self, metas: tuple[torch.Tensor, ...], dim: int) -> tuple[_Layout, ...]:
        pieces, start = [], 0
        for meta in metas:
            pieces.append(_Layout(meta, [*self.program, f"narrow {dim} {start} {meta.shape[dim]}"]))
            start += meta.shape[dim]
        return tuple(pieces)

    def __getattr__(self, name: str) -> Any:
        raise _Inexpressible(f"uses Tensor.{name}")

    @staticmethod
    def _joined(tensors: Any, dim: int = 0, *, op: str, join: Callable[..., torch.Tensor]) -> _Layout:
        tensors = list(tensors)
        if not all(isinstance(t, _Layout) for t in tensors):
            raise _Inexpressible(f"applies torch.{op} to tensors not read from the file")
        program = [item for t in tensors for item in t.program]
        return _Layout(join([t.meta for t in tensors], dim), [*program, f"{op} {dim} {len(tensors)}"])

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.stack:
            return cls._joined(*args, **kwargs, op="stack", join=torch.stack)
        if func in (torch.cat, torch.concat, torch.concatenate):
            return cls._joined(*args, **kwargs, op="cat", join=torch.cat)
        if func in (torch.chunk, torch.split, torch.transpose, torch.reshape) and isinstance(args[0], _Layout):
            return getattr(args[0], func.__name__)(*args[1:], **kwargs)
        raise _Inexpressible(f"applies {getattr(func, '__qualname__', func)}")


def _load_buffers(model: nn.Module, source: SafetensorsSource, key_map: Any, device: torch.device, read: bool) -> None:
    """Persistent buffers the file holds are read from it (read=False: buffers=True pages them);
    all buffers go to `device`."""
    to_key = key_map if callable(key_map) else (lambda name: key_map.get(name, name)) if key_map else (lambda n: n)
    for module_name, module in model.named_modules():
        for attr, buffer in module._buffers.items():
            if buffer is None:
                continue
            key = to_key(f"{module_name}.{attr}" if module_name else attr)
            stored = source.meta(key) if read and attr not in module._non_persistent_buffers_set and key in source \
                else None
            floating = stored is not None and stored.dtype.is_floating_point and buffer.dtype.is_floating_point
            if stored is not None and stored.shape == buffer.shape and (stored.dtype == buffer.dtype or floating):
                buffer = source.load(key).to(buffer.dtype)  # converted, as from_pretrained converts it
            module._buffers[attr] = buffer.to(device)
