"""The package's shape: what importing it loads."""
import subprocess
import sys


def test_importing_torch_ext_loads_no_demo_code_and_no_optional_integration():
    code = ("import sys, torch_ext; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch_ext.demos', 'transformers', 'accelerate'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
