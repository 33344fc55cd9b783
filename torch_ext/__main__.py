"""python -m torch_ext {info,demo}: what is installed, and a tour of what it does."""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch

import torch_ext


def registered_ops() -> list[str]:
    return sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith("torch_ext::"))


def registered_classes() -> list[str]:
    # Each custom-class method schema takes the class itself as its first argument (self).
    prefix = "__torch__.torch.classes.torch_ext."
    names = set()
    for schema in torch._C._jit_get_custom_class_schemas():
        if schema.arguments:
            self_type = str(schema.arguments[0].type)
            if self_type.startswith(prefix):
                names.add(self_type[len(prefix):])
    return sorted(names)


def info() -> None:
    build = dict(torch_ext._C.build_info)
    rows = [
        ("torch_ext", torch_ext.__version__),
        ("torch", f"{torch.__version__} (built against {build['torch_version']})"),
        ("python", platform.python_version()),
        ("machine", f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"),
        ("build", f"C++ {build['cplusplus']}, {build['compiler']}, CUDA {'on' if build['cuda'] else 'off'}"),
        ("cuda available", str(torch.cuda.is_available())),
        ("library", torch_ext.library_path()),
        ("counting allocator", "installed" if torch.ops.torch_ext.counting_allocator_installed() else "not installed"),
    ]
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print(f"ops ({len(registered_ops())}):")
    for name in registered_ops():
        print(f"  torch.ops.{name.replace('::', '.')}")
    print(f"classes ({len(registered_classes())}):")
    for name in registered_classes():
        print(f"  torch.classes.torch_ext.{name}")


def demo() -> None:
    from tqdm import tqdm

    from torch_ext.demos import DEMO_SECTIONS

    def progress(iterable, desc):
        return tqdm(iterable, desc=desc, leave=False, file=sys.stderr, disable=None)

    print(f"torch_ext {torch_ext.__version__} demo on torch {torch.__version__}, {os.cpu_count()} cores\n")
    for title, section in DEMO_SECTIONS:
        print(f"== {title} ==")
        start = time.perf_counter()
        section(progress)
        print(f"({time.perf_counter() - start:.1f} s)\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_ext", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="torch version, build flags, library path, registered ops and classes")
    commands.add_parser("demo", help="a tour of each capability on built-in models")
    args = parser.parse_args(argv)
    {"info": info, "demo": demo}[args.command]()
    return 0


if __name__ == "__main__":
    sys.exit(main())
