"""Build torch_ext: setup.py drives the one CMake build (CMakeLists.txt) into the package.

    pip install --no-build-isolation -e .

--no-build-isolation is required: the extension must build against the torch already
installed (torch==2.13.0), never one pip would resolve on its own.
Environment: TORCH_EXT_BUILD_TESTS=1 also builds the GoogleTest suite and the C++ example
into the same build folder (build/), so `ctest --test-dir build` runs them without
compiling anything twice. MAX_JOBS caps parallel compile jobs.
"""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CORE_LIBRARY = "libtorch_ext.so"


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


setup(
    name="torch_ext",
    version="0.1.0",
    description="Memory toolkit for PyTorch: segment checkpointing, weight paging, node caching, plan caching",
    packages=find_packages(include=["torch_ext", "torch_ext.*"]),
    python_requires=">=3.10",
    install_requires=["torch==2.13.0", "tqdm"],
    ext_modules=[CMakeExtension("torch_ext._C")],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
