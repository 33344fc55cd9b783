import subprocess
import sys

import torch_ext


def run_cli(*args):
    out = subprocess.run([sys.executable, "-m", "torch_ext", *args], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_info_names_library_ops_and_versions():
    text = run_cli("info")
    assert torch_ext.library_path() in text
    assert "torch.ops.torch_ext.memory_stats" in text
    assert "2.13" in text
    for name in ("LayerPager", "NodeCache", "PlanCache", "SafetensorsSource"):
        assert f"torch.classes.torch_ext.{name}" in text


def test_demo_runs_every_section():
    from torch_ext.demos import DEMO_SECTIONS

    text = run_cli("demo")
    for title, _ in DEMO_SECTIONS:
        assert f"== {title} ==" in text
    assert "saved for backward" in text
