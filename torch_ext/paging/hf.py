"""load_paged: a Hugging Face folder (config.json and model.safetensors or a sharded
model.safetensors.index.json) or a .safetensors file straight to a paged model, without reading
the weights: the model is built with its parameters on the meta device (its buffers computed as
its constructor computes them), then paged from the file. transformers is imported only here and
only when no model_fn is given."""
from __future__ import annotations

import contextlib
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
    AutoModelForCausalLM, else AutoModel) from the config, in `dtype` (default: the file's).
    device: where the weights are used (the pager's device; buffers go there too).
    options: page_weights' (pinned, buffers, key_map, strip_prefix, add_prefix) and the pager's
    (prefetch, zero_copy, policy, ...). A transformers model's checkpoint keys are mapped to its
    parameters by transformers' own loading machinery (its renames and checkpoint conversion
    mappings, with or without the base_model_prefix); a parameter transformers builds by
    transforming tensors (fusing or splitting them) cannot be paged from the file and is refused,
    naming it and the conversion. Tied weights are one pager entry, the file may omit the tied
    copy. A file stored in another dtype than `dtype` is converted as it is paged in. Nothing but
    the files' headers (and persistent buffers) is read."""
    source_path, folder = _locate(path)
    source = SafetensorsSource(source_path)
    if model_fn is None:
        model = _from_config(folder, dtype if dtype is not None else _stored_dtype(source))
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
        options["key_map"] = transformers_checkpoint_keys(model, source)
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
    """The dtype of the file's first floating-point tensor (the model is built in it)."""
    for name in source.names():
        dtype = source.dtype(name)
        if dtype.is_floating_point:
            return dtype
    return None


def _from_config(folder: Path, dtype: torch.dtype | None) -> nn.Module:
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
    generation_file = folder / "generation_config.json"
    if generation_file.is_file() and getattr(model, "generation_config", None) is not None:
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)
    return model


def _keep_in_float32(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Parameters from_pretrained keeps in float32 in a model of `dtype` (transformers' dtype plan:
    _keep_in_fp32_modules in float16, _keep_in_fp32_modules_strict in float16 and bfloat16) are
    made float32 here too, matched by transformers' own patterns."""
    plan = model._get_dtype_plan(dtype) if dtype is not None and hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return
    from transformers.core_model_loading import build_glob_alternation

    alternation, group_patterns, _ = build_glob_alternation(list(plan))
    for name, param in model.named_parameters():
        match = alternation.search(name)
        if match is not None:
            param.data = param.data.to(plan[group_patterns[match.lastgroup]])


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


def transformers_checkpoint_keys(model: nn.Module, source: SafetensorsSource) -> dict[str, str]:
    """{parameter or buffer name: checkpoint key} as from_pretrained maps them: each key of the
    source is renamed by transformers' own machinery (the model's checkpoint conversion mapping,
    legacy renames, base_model_prefix added or removed). Names not in the result keep their own
    name. Raises naming the parameter and the conversion when the model's tensors are made by a
    conversion that transforms stored tensors (a fused or split tensor is not one stored tensor)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    expected = model.state_dict(keep_vars=True)
    prefix = getattr(model, "base_model_prefix", "") or None
    keys: dict[str, str] = {}
    converted: dict[str, tuple[Any, list[str]]] = {}
    for key in source.names():
        name, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if pattern is None:
            if name in expected:
                keys.setdefault(name, key)
        else:
            converted.setdefault(name, (next(c for c in converters if pattern in c.source_patterns), []))[1].append(key)
    stored = set(keys) | {name for name in expected if name in source}
    for name, (converter, from_keys) in converted.items():
        if name in expected and name not in stored:
            shown = ", ".join(repr(k) for k in from_keys[:4]) + (", ..." if len(from_keys) > 4 else "")
            raise ValueError(
                f"load_paged: parameter {name!r} of {type(model).__name__} is made by transformers' checkpoint "
                f"conversion {converter!r} from {shown} of {source.path()}: a tensor transformers fuses or splits "
                f"while loading is not stored in the file, so it cannot be paged from it. Load the model with "
                f"from_pretrained and save it with save_pretrained(folder, save_original_format=False), whose "
                f"files hold the converted tensors, then load_paged that folder")
    return keys


def _load_buffers(model: nn.Module, source: SafetensorsSource, key_map: Any, device: torch.device, read: bool) -> None:
    """Persistent buffers the file holds are read from it (read=False: buffers=True pages them);
    all buffers go to `device`."""
    to_key = key_map if callable(key_map) else (lambda name: key_map.get(name, name)) if key_map else (lambda n: n)
    for module_name, module in model.named_modules():
        for attr, buffer in module._buffers.items():
            if buffer is None:
                continue
            key = to_key(f"{module_name}.{attr}" if module_name else attr)
            if read and attr not in module._non_persistent_buffers_set and key in source and \
                    source.shape(key) == buffer.shape and source.dtype(key) == buffer.dtype:
                buffer = source.load(key)
            module._buffers[attr] = buffer.to(device)
