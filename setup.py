"""Build torch_ext: setup.py drives the one CMake build (CMakeLists.txt) into the package.

    pip install --no-build-isolation -e .
    pip wheel --no-build-isolation --no-deps -w dist .

--no-build-isolation is required: the extension must build against the torch already
installed (torch==2.13.0), never one pip would resolve on its own. The package's metadata is in
pyproject.toml; this file adds what only the build knows: the C++ extension and the runtime
requirement on the torch minor version it was built against.
Environment: TORCH_EXT_BUILD_TESTS=1 also builds the GoogleTest suite and the C++ example
into the same build folder (build/), so `ctest --test-dir build` runs them without
compiling anything twice. MAX_JOBS caps parallel compile jobs.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    import torch
except ImportError as error:
    sys.exit(
        f"torch_ext: building needs torch installed in this Python ({sys.executable}): {error}.\n"
        "Install torch first (pip install torch==2.13.0), then build without build isolation:\n"
        "    pip install --no-build-isolation -e .   or   pip wheel --no-build-isolation --no-deps ."
    )

ROOT = Path(__file__).resolve().parent
CORE_LIBRARY = "libtorch_ext.so"


def torch_requirement() -> str:
    """The torch minor version this build compiles against: C++ extensions are not ABI-compatible
    across torch minor versions."""
    match = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if match is None:
        sys.exit(f"torch_ext: cannot read the torch version {torch.__version__!r}")
    major, minor = int(match[1]), int(match[2])
    return f"torch>={major}.{minor},<{major}.{minor + 1}"


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        package_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(os.environ.get("TORCH_EXT_BUILD_DIR", ROOT / "build"))
        with_tests = "ON" if os.environ.get("TORCH_EXT_BUILD_TESTS", "0") not in ("", "0") else "OFF"
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DTORCH_EXT_BUILD_TESTS={with_tests}",
            f"-DTORCH_EXT_BUILD_EXAMPLES={with_tests}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        self.built_core_library = package_dir / CORE_LIBRARY
        subprocess.check_call(configure)
        subprocess.check_call(["cmake", "--build", str(build_dir), "--parallel", jobs])
        package_dir.mkdir(parents=True, exist_ok=True)
        self.copy_file(str(build_dir / CORE_LIBRARY), str(self.built_core_library), level=self.verbose)
        self.copy_file(str(build_dir / Path(self.get_ext_filename(ext.name)).name),
                       self.get_ext_fullpath(ext.name), level=self.verbose)

    def copy_extensions_to_source(self) -> None:
        # Editable installs copy each extension into the source tree; the core library
        # that torch_ext._C links against goes with it.
        super().copy_extensions_to_source()
        package = Path(self.get_finalized_command("build_py").get_package_dir("torch_ext"))
        self.copy_file(str(self.built_core_library), str(package / CORE_LIBRARY), level=self.verbose)


# Name, version, packages and the rest of the metadata: pyproject.toml.
setup(
    # numpy: the checkpoint planner's search and the plan cache's traffic model (both imported by
    # `import torch_ext`). safetensors[torch]: safetensors.torch's save_* (torch_ext.save_pageable).
    install_requires=[torch_requirement(), "numpy>=1.22", "safetensors[torch]>=0.4.3", "tqdm>=4.0"],
    ext_modules=[CMakeExtension("torch_ext._C")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
