"""NodeStore: the lazy node cache's outputs kept on disk, across processes.

One folder, shared by any number of processes:

    <folder>/manifest.json        {"format": 1, "clock": n, "entries": {key: {"file", "bytes", "blake2b", "last_use"}}}
    <folder>/entries/<key>-<id>.safetensors   the node's output tensors ("output.<i>") and the graph-input
                                  tensors of its key ("input.<i>"), its structure in the metadata
    <folder>/lock                 fcntl lock taken around every change of the manifest

An entry's key is a digest of: the graph's code, a fingerprint of the module's weights (every
parameter's and buffer's name, dtype, shape and content digest), the node's name, and the node's
graph inputs (dtype, shape, strides and content digest of each tensor; other values as they
are). So a changed model (its code or one weight) never finds an old entry. Entries are written
to a temporary file, then renamed into place and listed in the manifest (itself replaced by a
rename) under the lock; readers need no lock. A read checks the file's size and BLAKE2b digest
against the manifest (a changed or truncated file is a miss with a RuntimeWarning, and the
entry is dropped) and compares the stored input tensors with the call's (a digest collision is a
miss). Over budget_bytes on disk, the least recently used entries are deleted (use is a counter
in the manifest, not a clock). Only outputs computed with grad disabled, of CPU tensors (one, or
a tuple or list of them), are stored.

Thread safety: the LazyExecutor calls it under its own lock; processes coordinate through the
lock file (waits are bounded: TimeoutError after lock_timeout_seconds)."""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import tempfile
import time
import warnings
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

import safetensors.torch
import torch
from torch import nn

from .. import _C

_FORMAT = 1
_PLAIN = (type(None), bool, int, float, str)


@dataclass
class StoreStats:
    hits: int = 0  # lookups answered from disk
    misses: int = 0  # lookups that found no usable entry
    rejected: int = 0  # entries found changed or truncated (dropped, with a warning)
    writes: int = 0  # entries written
    evictions: int = 0  # entries deleted to stay within budget_bytes
    bytes_on_disk: int = 0  # bytes of the entries listed now

    def as_dict(self) -> dict:
        return asdict(self)


def _hashable(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.requires_grad and not t.is_conj()
            and not t.is_neg() and not t.is_quantized and t.is_contiguous())


class NodeStore:
    """Cached node outputs on disk (see the module docstring); budget_bytes: the most bytes of
    entries to keep (None: no limit)."""

    def __init__(self, path: Union[str, os.PathLike], budget_bytes: Optional[int] = None,
                 lock_timeout_seconds: float = 60.0) -> None:
        if budget_bytes is not None and (not isinstance(budget_bytes, int) or budget_bytes < 0):
            raise ValueError(f"NodeStore({os.fspath(path)!r}): budget_bytes must be None or an int >= 0, "
                             f"got {budget_bytes!r}")
        self.path = Path(path)
        self.budget_bytes = budget_bytes
        self.lock_timeout_seconds = lock_timeout_seconds
        (self.path / "entries").mkdir(parents=True, exist_ok=True)
        self._stats = StoreStats()
        self._weights: dict[int, tuple] = {}  # id(tensor) -> (tensor, version) at the fingerprint
        self._fingerprint: Optional[str] = None
        self._codes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    # ---- keys ----
    def key(self, module: nn.Module, graph_module: torch.fx.GraphModule, node: str, key: list, n_inputs: int,
            cache: torch.ScriptObject) -> Optional[tuple[str, list]]:
        """(entry key, the graph-input tensors to store and compare) of a frontier lookup whose key
        is `key` (its first n_inputs items graph inputs, the rest weights and plain values); None
        when it is not stored: grad enabled, an input that cannot be hashed, a tensor that is not
        one of the module's weights, or where the NodeCache `cache`'s content-key rule says
        hashing the inputs does not pay for the work (keys_by_content)."""
        if torch.is_grad_enabled():
            return None
        parts: list = []
        tensors: list = []
        for value in key[:n_inputs]:
            if not self._describe(value, parts, tensors):
                return None
        weight_bytes = 0
        for value in key[n_inputs:]:
            if isinstance(value, torch.Tensor):
                if not self._is_weight(module, value):
                    return None
                weight_bytes += value.numel() * value.element_size()
            elif isinstance(value, _PLAIN):
                parts.append(repr(value))
            else:
                return None
        if not cache.keys_by_content(sum(t.numel() * t.element_size() for t in tensors), weight_bytes):
            return None
        code = self._codes.get(graph_module)
        if code is None:
            code = self._codes[graph_module] = hashlib.blake2b(graph_module.code.encode(), digest_size=16).hexdigest()
        text = json.dumps([_FORMAT, code, self._fingerprint, node, parts])
        return hashlib.blake2b(text.encode(), digest_size=20).hexdigest(), tensors

    def _describe(self, value: Any, parts: list, tensors: list) -> bool:
        if isinstance(value, torch.Tensor):
            if not _hashable(value):
                return False
            parts.append(["tensor", str(value.dtype), list(value.shape), list(value.stride()),
                          _C.cache.digest(value).hex()])
            tensors.append(value)
            return True
        if isinstance(value, (tuple, list)):
            parts.append([type(value).__name__, len(value)])
            return all(self._describe(v, parts, tensors) for v in value)
        if isinstance(value, (*_PLAIN, torch.dtype, torch.device)):
            parts.append(repr(value))
            return True
        return False

    def _is_weight(self, module: nn.Module, tensor: torch.Tensor) -> bool:
        """Whether tensor is one of the module's weights as fingerprinted (refreshing the
        fingerprint once when the weights changed since)."""
        for attempt in range(2):
            known = self._weights.get(id(tensor))
            if known is not None and known[0] is tensor and known[1] == tensor._version:
                return True
            if attempt == 0:
                self._refresh_fingerprint(module)
        return False

    def _refresh_fingerprint(self, module: nn.Module) -> None:
        digest = hashlib.blake2b(digest_size=20)
        digest.update(f"{type(module).__module__}.{type(module).__qualname__}".encode())
        weights = {}
        for name, tensor in (*module.named_parameters(remove_duplicate=False),
                             *module.named_buffers(remove_duplicate=False)):
            data = tensor.detach().cpu().contiguous()
            digest.update(json.dumps([name, str(data.dtype), list(data.shape)]).encode())
            digest.update(_C.cache.digest(data))
            weights[id(tensor)] = (tensor, tensor._version)
        self._weights = weights
        self._fingerprint = digest.hexdigest()

    # ---- reading ----
    def get(self, key: str, inputs: list) -> Any:
        """The stored output for this key whose stored inputs equal `inputs`, or None."""
        entry = self._read_manifest()["entries"].get(key)
        data = None
        if entry is not None:
            try:
                data = (self.path / "entries" / entry["file"]).read_bytes()
            except FileNotFoundError:
                pass  # deleted by another process since the manifest was read
        if data is None:
            self._stats.misses += 1
            return None
        problem = None
        if len(data) != entry["bytes"]:
            problem = f"has {len(data)} bytes, the manifest says {entry['bytes']} (truncated or changed)"
        elif hashlib.blake2b(data, digest_size=16).hexdigest() != entry["blake2b"]:
            problem = "does not match its BLAKE2b digest in the manifest (changed)"
        if problem is not None:
            warnings.warn(f"torch_ext NodeStore {self.path}: entry file {entry['file']} {problem}; "
                          f"dropping it and recomputing the node", RuntimeWarning, stacklevel=4)
            self._stats.rejected += 1
            self._stats.misses += 1
            self._update(drop=key)
            return None
        stored = safetensors.torch.load(data)
        for i, tensor in enumerate(inputs):
            if not torch.equal(stored[f"input.{i}"], tensor) or stored[f"input.{i}"].dtype != tensor.dtype:
                self._stats.misses += 1  # a digest collision: the bytes differ
                return None
        self._stats.hits += 1
        self._update(touch=key)
        outputs = [stored[f"output.{i}"] for i in range(sum(name.startswith("output.") for name in stored))]
        kind = _metadata(data).get("structure", "tensor")
        return outputs[0] if kind == "tensor" else (tuple(outputs) if kind == "tuple" else outputs)

    # ---- writing ----
    def put(self, key: str, inputs: list, value: Any) -> bool:
        """Store value (a CPU tensor, or a tuple or list of them) for key; False when it cannot be."""
        if type(value) is torch.Tensor:
            kind, outputs = "tensor", [value]
        elif type(value) in (tuple, list) and value and all(type(v) is torch.Tensor for v in value):
            kind, outputs = type(value).__name__, list(value)
        else:
            return False  # other types (named tuples, subclasses) would not come back as they were
        if any(t.device.type != "cpu" or t.requires_grad or t.layout != torch.strided for t in outputs):
            return False
        tensors = {f"output.{i}": t.detach().clone(memory_format=torch.contiguous_format) for i, t in enumerate(outputs)}
        tensors.update({f"input.{i}": t.detach().clone() for i, t in enumerate(inputs)})
        data = safetensors.torch.save(tensors, metadata={"structure": kind, "key": key})
        if self.budget_bytes is not None and len(data) > self.budget_bytes:
            return False
        digest = hashlib.blake2b(data, digest_size=16).hexdigest()
        fd, temporary = tempfile.mkstemp(dir=self.path / "entries", prefix=".writing-")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            # Renamed into place under the lock, with the manifest: a listed file always exists.
            # The name is this write's own, so no other writer's eviction can delete it.
            self._update(add=(key, {"file": f"{key}-{Path(temporary).name[len('.writing-'):]}.safetensors",
                                    "bytes": len(data), "blake2b": digest}), written=temporary)
        finally:
            Path(temporary).unlink(missing_ok=True)
        self._stats.writes += 1
        return True

    # ---- the manifest ----
    def _read_manifest(self) -> dict:
        try:
            manifest = json.loads((self.path / "manifest.json").read_text())
        except FileNotFoundError:
            return {"format": _FORMAT, "clock": 0, "entries": {}}
        except (OSError, ValueError) as error:
            warnings.warn(f"torch_ext NodeStore {self.path}: manifest.json cannot be read ({error}); "
                          f"starting an empty one", RuntimeWarning, stacklevel=4)
            return {"format": _FORMAT, "clock": 0, "entries": {}}
        if manifest.get("format") != _FORMAT:
            raise ValueError(f"torch_ext NodeStore {self.path}: manifest.json has format {manifest.get('format')!r}, "
                             f"expected {_FORMAT}")
        return manifest

    def _update(self, add: Optional[tuple] = None, touch: Optional[str] = None, drop: Optional[str] = None,
                written: Optional[str] = None) -> None:
        """One change of the manifest under the lock: add an entry (its file `written`, renamed
        into place; evicting the least recently used beyond the budget), mark one used, or drop one."""
        with self._locked():
            manifest = self._read_manifest()
            entries = manifest["entries"]
            manifest["clock"] += 1
            if touch is not None and touch in entries:
                entries[touch]["last_use"] = manifest["clock"]
            if drop is not None and drop in entries:
                (self.path / "entries" / entries.pop(drop)["file"]).unlink(missing_ok=True)
            if add is not None:
                key, entry = add
                os.replace(written, self.path / "entries" / entry["file"])
                entry["last_use"] = manifest["clock"]
                replaced = entries.get(key)
                if replaced is not None and replaced["file"] != entry["file"]:
                    (self.path / "entries" / replaced["file"]).unlink(missing_ok=True)
                entries[key] = entry
                total = sum(e["bytes"] for e in entries.values())
                for old in sorted(entries, key=lambda k: entries[k]["last_use"]):
                    if self.budget_bytes is None or total <= self.budget_bytes or old == key:
                        continue
                    total -= entries[old]["bytes"]
                    (self.path / "entries" / entries.pop(old)["file"]).unlink(missing_ok=True)
                    self._stats.evictions += 1
            self._stats.bytes_on_disk = sum(e["bytes"] for e in entries.values())
            fd, temporary = tempfile.mkstemp(dir=self.path, prefix=".manifest-")
            with os.fdopen(fd, "w") as file:
                json.dump(manifest, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.path / "manifest.json")

    def _locked(self):
        return _FileLock(self.path / "lock", self.lock_timeout_seconds)

    def stats(self) -> StoreStats:
        """Counters of this process's lookups and writes, and the bytes listed on disk now."""
        stats = StoreStats(**self._stats.as_dict())
        stats.bytes_on_disk = sum(e["bytes"] for e in self._read_manifest()["entries"].values())
        return stats


class _FileLock:
    """An exclusive fcntl lock on a file, waited for at most timeout seconds."""

    def __init__(self, path: Path, timeout: float) -> None:
        self.path, self.timeout = path, timeout

    def __enter__(self) -> "_FileLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except OSError as error:
                if error.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    os.close(self.fd)
                    raise TimeoutError(f"torch_ext NodeStore: could not lock {self.path} within "
                                       f"{self.timeout} s") from error
                time.sleep(0.005)

    def __exit__(self, *exc: Any) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _metadata(data: bytes) -> dict:
    """The __metadata__ of a safetensors file held in memory."""
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length]).get("__metadata__") or {}
