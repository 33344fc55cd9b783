"""The wheel: built with `pip wheel --no-build-isolation --no-deps`, it installs into a fresh
virtual environment (torch installed there first) and runs from it.

The wheel reuses the existing CMake build folder with the setting it was configured with, so
nothing recompiles; the venv gets the same torch as this process (the CPU wheel through
PIP_FIND_LINKS here), the wheel's other dependencies come from the index.
"""
from __future__ import annotations

import ast
import email
import fcntl
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import torch

import torch_ext

ROOT = Path(__file__).resolve().parents[2]
BUILD_DIR = Path(os.environ.get("TORCH_EXT_BUILD_DIR", ROOT / "build"))
# The wheel must run against the torch it was built against: this process's, exactly.
TORCH_VERSION = str(torch.__version__)
TORCH_MINOR = tuple(int(part) for part in re.match(r"(\d+)\.(\d+)", TORCH_VERSION).groups())


def version_file() -> str:
    """__version__ as torch_ext/version.py states it, read without importing it."""
    tree = ast.parse((ROOT / "torch_ext" / "version.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("torch_ext/version.py sets no __version__")


def run(command: list, **kwargs) -> str:
    out = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=600, **kwargs)
    assert out.returncode == 0, (
        f"{' '.join(map(str, command))} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")
    return out.stdout


def configured_with_tests() -> str:
    """TORCH_EXT_BUILD_TESTS as the build folder was configured: passing the same keeps CMake
    from reconfiguring the targets and recompiling."""
    cache = BUILD_DIR / "CMakeCache.txt"
    if cache.is_file():
        match = re.search(r"^TORCH_EXT_BUILD_TESTS:BOOL=(\w+)$", cache.read_text(), re.MULTILINE)
        if match and match[1].upper() in ("ON", "1", "TRUE", "YES"):
            return "1"
    return "0"


def isolated_env() -> dict:
    """The environment for the venv's processes: nothing that would make its Python find this
    checkout or another environment's packages."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PYTHONUSERBASE")}
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # One wheel for the whole session, whichever pytest-xdist workers need it: setuptools stages
    # the wheel's files in the checkout's build/lib.* and build/bdist.*, so two workers building at
    # once empty them under each other (a wheel came out with the .so files and no Python files).
    session_tmp = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        session_tmp = session_tmp.parent  # shared by this session's workers
    wheel_dir = session_tmp / "torch_ext_wheel"
    with open(session_tmp / "torch_ext_wheel.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not wheel_dir.is_dir():
            # setuptools never empties its staging folders: a module removed from the source would
            # go into the wheel.
            for staged in [*(ROOT / "build").glob("lib.*"), *(ROOT / "build").glob("bdist.*")]:
                shutil.rmtree(staged)
            env = dict(os.environ, TORCH_EXT_BUILD_TESTS=configured_with_tests())
            # --no-cache-dir: pip would also keep a copy of each wheel built from the checkout in its cache.
            building = session_tmp / "torch_ext_wheel.partial"
            shutil.rmtree(building, ignore_errors=True)
            run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-cache-dir",
                 "--disable-pip-version-check", "-w", building, ROOT], env=env, cwd=ROOT)
            building.rename(wheel_dir)
    wheels = list(wheel_dir.glob("torch_ext-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """A fresh venv with this torch and the wheel (and its other dependencies) installed: its python."""
    home = tmp_path_factory.mktemp("venv")
    venv.create(home / "venv", with_pip=True)
    python = home / "venv" / "bin" / "python"
    env = isolated_env()
    run([python, "-m", "pip", "install", "--no-compile", f"torch=={TORCH_VERSION}"], env=env, cwd=home)
    # Installing the wheel must keep that torch, never resolve another one from the index.
    constraints = home / "constraints.txt"
    constraints.write_text(f"torch=={TORCH_VERSION}\n")
    run([python, "-m", "pip", "install", "--no-compile", "-c", constraints, wheel], env=env, cwd=home)
    yield python
    shutil.rmtree(home, ignore_errors=True)  # about 1 GB: torch


def test_wheel_metadata_and_files(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata_name = next(name for name in names if name.endswith(".dist-info/METADATA"))
        metadata = email.message_from_string(archive.read(metadata_name).decode())
    assert metadata["Name"] == "torch_ext"
    assert metadata["Version"] == version_file()
    requires = metadata.get_all("Requires-Dist")
    major, minor = TORCH_MINOR
    torch_requirement = next(r for r in requires if r.startswith("torch"))
    assert set(torch_requirement[len("torch"):].replace(" ", "").split(",")) == {
        f">={major}.{minor}", f"<{major}.{minor + 1}"}, torch_requirement
    assert any(r.startswith("numpy") and ">=" in r for r in requires), requires  # imported by `import torch_ext`
    assert any(r.startswith("safetensors[torch]") and ">=" in r for r in requires), requires
    assert any(r.startswith("tqdm") and ">=" in r for r in requires), requires
    assert not any("==" in r.split(";")[0] for r in requires), requires  # no exact pins
    assert "hf" in metadata.get_all("Provides-Extra")
    assert any(r.startswith("transformers") and 'extra == "hf"' in r for r in requires), requires
    assert any(r.startswith("accelerate") and 'extra == "hf"' in r for r in requires), requires
    for name in ("torch_ext/py.typed", "torch_ext/version.py", "torch_ext/libtorch_ext.so"):
        assert name in names
    assert any(re.fullmatch(r"torch_ext/_C\..*\.so", name) for name in names), names


def test_wheel_runs_from_a_fresh_venv(installed, tmp_path):
    env = isolated_env()
    info = run([installed, "-m", "torch_ext", "info"], env=env, cwd=tmp_path)
    rows = dict(line.split(None, 1) for line in info.splitlines() if line and not line[0].isspace() and " " in line)
    venv_dir = installed.parent.parent.resolve()
    library = Path(rows["library"].strip())
    assert library.is_relative_to(venv_dir), info
    assert rows["torch_ext"].strip() == version_file(), info
    assert "torch.ops.torch_ext.memory_stats" in info
    assert "torch.classes.torch_ext.PlanCache" in info

    # The declared dependencies are enough to save a safetensors file and page weights from it.
    probe = ("import torch, torch_ext; print(torch_ext.__version__, torch.__version__, torch_ext.__file__); "
             "torch.manual_seed(0); model = torch.nn.Linear(4, 3); x = torch.randn(2, 4); expected = model(x); "
             "torch_ext.save_pageable(model, 'w.safetensors'); "
             "torch_ext.page_weights(model, 'w.safetensors', budget_bytes=1 << 20); "
             "print(torch.equal(model(x), expected))")
    version, torch_version, package_init, paged_equal = run([installed, "-c", probe], env=env, cwd=tmp_path).split()
    assert version == version_file()
    assert torch_version == TORCH_VERSION
    assert Path(package_init).is_relative_to(venv_dir)
    assert paged_equal == "True"


def runpath_entries(binary: Path) -> dict[str, list[str]]:
    """RPATH and RUNPATH entries of an ELF file, by readelf -d."""
    dynamic = run(["readelf", "-d", binary])
    entries = {"RPATH": [], "RUNPATH": []}
    for tag, value in re.findall(r"\((RPATH|RUNPATH)\)\s+Library r\w*path: \[(.*)\]", dynamic):
        entries[tag] += value.split(":")
    return entries


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) is not installed")
def test_installed_binaries_carry_only_package_relative_runpaths(installed, tmp_path):
    site_packages = run([installed, "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
                        env=isolated_env(), cwd=tmp_path).strip()
    package = Path(site_packages) / "torch_ext"
    binaries = sorted(package.glob("*.so"))
    assert {binary.name for binary in binaries if binary.name.startswith("_C.")}, binaries
    assert package / "libtorch_ext.so" in binaries
    for binary in binaries:
        entries = runpath_entries(binary)
        assert entries["RPATH"] == [], (binary, entries)
        assert entries["RUNPATH"], (binary, entries)
        assert all(entry.startswith("$ORIGIN") for entry in entries["RUNPATH"]), (binary, entries)
        # $ORIGIN/../torch/lib is the venv's torch.
        resolved = [Path(entry.replace("$ORIGIN", str(package))).resolve() for entry in entries["RUNPATH"]]
        assert (package.parent / "torch" / "lib").resolve() in resolved, (binary, entries)


def test_import_leaves_optional_integrations_alone():
    # transformers and accelerate (the `hf` extra) are optional: importing torch_ext never imports them.
    probe = ("import sys, torch_ext; "
             "print(' '.join(name for name in ('transformers', 'accelerate') if name in sys.modules))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(torch_ext.__file__).parent.parent),
                                                                    os.environ.get("PYTHONPATH")])))
    assert run([sys.executable, "-c", probe], env=env).strip() == ""
