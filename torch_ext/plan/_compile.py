"""Compiling one bucket's plan of an exported program into an AOTInductor package.

Imports only torch, so it also runs as a script in a separate process (background builds: the
compile's Python work then never holds the serving process's GIL):

    python _compile.py REQUEST.pt        # REQUEST: see write_request

The request file holds only tensors and plain values and is read with weights_only=True, so
reading it runs no code of the file's.
"""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.utils._pytree as pytree


def bucket_dynamic_shapes(program: torch.export.ExportedProgram, dim_of: Sequence[dict],
                          lower: Sequence[int], upper: Sequence[int], dynamic: bool) -> Any:
    """dynamic_shapes for re-exporting program.module() over one bucket, in its call's structure.
    dim_of[i] maps input i's tensor dimensions to dynamic dimensions (batch first)."""
    if not dynamic:
        return None
    dims = [torch.export.Dim(f"d{k}", min=lo, max=hi) if hi > lo else None for k, (lo, hi) in enumerate(zip(lower, upper))]
    leaves = [{d: dims[k] for d, k in dim_of_input.items() if dims[k] is not None} or None for dim_of_input in dim_of]
    args, kwargs = pytree.tree_unflatten(leaves, program.call_spec.in_spec)
    module = program.module()
    bound = inspect.signature(module.forward).bind(*args, **kwargs)
    return dict(bound.arguments)


def traced_size(lower: int, upper: int) -> int:
    """The size a dynamic dimension over lower..upper is traced at: inside the range, below its
    largest. Traced at its largest, AOTInductor (torch 2.13, CPU) can compile a package whose
    outputs keep that size whatever the input's (a convolution net's batch did: 16 rows out for 10
    in); 1 would be specialised. A range of 1..2 has no other choice than 2: the cache checks
    every plan's output sizes, so a package that got it wrong raises instead of answering."""
    size = min(upper - 1, max(2, (lower + upper) // 2))
    return size if size >= max(lower, 2) else upper


def compile_bucket(program: torch.export.ExportedProgram, dim_of: Sequence[dict], upper: Sequence[int],
                   lower: Sequence[int], dynamic: bool, example: Sequence[torch.Tensor], package_path: str,
                   inductor_configs: Optional[dict] = None) -> str:
    """Re-export program at one bucket (its sizes static, or a range over it) and compile it. A
    dynamic bucket is traced with the example narrowed to traced_size in each ranged dimension."""
    import torch._inductor  # noqa: F401  (imported here: loading a saved cache never needs it)

    if dynamic:
        example = list(example)
        for i, dims in enumerate(dim_of):
            for d, k in dims.items():
                if upper[k] > lower[k] and isinstance(example[i], torch.Tensor):
                    # Contiguous: a narrowed view's stride (the largest size) would make export guard
                    # on it (an HF BERT's sequence got "!= 32" over 2..32, refusing the range).
                    example[i] = example[i].narrow(int(d), 0, traced_size(lower[k], upper[k])).contiguous()
    args, kwargs = pytree.tree_unflatten(list(example), program.call_spec.in_spec)
    shapes = bucket_dynamic_shapes(program, dim_of, lower, upper, dynamic)
    exported = torch.export.export(program.module(), tuple(args), kwargs, dynamic_shapes=shapes)
    return torch._inductor.aoti_compile_and_package(exported, package_path=package_path,
                                                    inductor_configs=dict(inductor_configs or {}))


_PLAIN = (str, int, float, bool, type(None))


def _check_plain(value: Any, where: str) -> None:
    if isinstance(value, (torch.Tensor,) + _PLAIN):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, f"{where} key {key!r}")
            _check_plain(item, f"{where}[{key!r}]")
        return
    raise TypeError(f"compile request: {where} is a {type(value).__name__}; a request holds only tensors and plain "
                    "values (str, int, float, bool, None, and lists, tuples and dicts of them), since the compiler "
                    "process reads it with weights_only=True")


def write_request(path: str, request: dict) -> None:
    """Saves a compile request, refusing anything but tensors and plain values (naming where)."""
    _check_plain(request, "request")
    torch.save(request, path)


def read_request(path: str) -> dict:
    """Loads a compile request with weights_only=True: tensors and plain values, no code."""
    return torch.load(path, weights_only=True)


def compile_in_subprocess(program_path: str, dim_of: Sequence[dict], upper: Sequence[int], lower: Sequence[int],
                          dynamic: bool, example: Sequence[torch.Tensor], package_path: str,
                          inductor_configs: Optional[dict], threads: int,
                          cancelled: Callable[[], bool] = lambda: False) -> None:
    """compile_bucket in a separate Python process; gives up (killing it) once cancelled()."""
    with tempfile.TemporaryDirectory(prefix="torch_ext_compile_") as scratch:
        request = os.path.join(scratch, "request.pt")
        write_request(request, dict(program=program_path, dim_of=list(dim_of), upper=list(upper), lower=list(lower),
                                    dynamic=dynamic, example=[t.detach().cpu() for t in example],
                                    devices=[str(t.device) for t in example], package=package_path,
                                    inductor_configs=dict(inductor_configs or {}), threads=threads))
        log = os.path.join(scratch, "log.txt")
        with open(log, "w") as out:
            process = subprocess.Popen([sys.executable, os.path.abspath(__file__), request], stdout=out,
                                       stderr=subprocess.STDOUT)
            while True:
                try:
                    process.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    if cancelled():
                        process.kill()
                        process.wait()
                        raise RuntimeError(f"compiling {package_path} was cancelled: the cache is going away")
        if process.returncode != 0:
            with open(log) as f:
                tail = f.read()[-3000:]
            raise RuntimeError(f"the compiler process for {package_path} exited with {process.returncode}:\n{tail}")


def _main(request_path: str) -> None:
    request = read_request(request_path)
    torch.set_num_threads(request["threads"])  # Inductor's CPU kernels use the count set at compile time
    program = torch.export.load(request["program"])
    example = [t.to(device) for t, device in zip(request["example"], request["devices"])]
    start = time.perf_counter()
    compile_bucket(program, request["dim_of"], request["upper"], request["lower"], request["dynamic"], example,
                   request["package"], request["inductor_configs"])
    print(f"compiled {request['package']} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    _main(sys.argv[1])
