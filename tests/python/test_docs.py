"""The documentation a user follows: every Python snippet in README.md and docs/ runs as written,
and every option of every class is documented where that capability is."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_ext  # noqa: F401  (registers torch.classes.torch_ext.*)

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_snippets(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


@pytest.mark.parametrize("path", DOCUMENTS, ids=[p.name for p in DOCUMENTS])
def test_every_python_snippet_runs_as_written(path, tmp_path):
    snippets = python_snippets(path)
    if not snippets:
        pytest.skip(f"{path.name} has no Python snippet")
    # The snippets of one file run in order in one process, as a reader would paste them.
    script = tmp_path / f"{path.stem}_snippets.py"
    script.write_text("\n\n".join(snippets))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{path.relative_to(ROOT)}: a snippet failed:\n{out.stderr[-4000:]}"


def keyword_options(class_name: str, positional: int) -> list[str]:
    """The keyword options of torch.classes.torch_ext.<class_name>'s constructor (generated from
    its C++ Options struct), after its positional arguments."""
    for schema in torch._C._jit_get_custom_class_schemas():
        if schema.name == "__init__" and str(schema.arguments[0].type).endswith(f"torch_ext.{class_name}"):
            return [a.name for a in schema.arguments[1 + positional:]]
    raise AssertionError(f"no constructor of torch.classes.torch_ext.{class_name}")


@pytest.mark.parametrize("class_name, positional, document", [
    ("CheckpointOptions", 0, "checkpoint.md"),
    ("SafetensorsSource", 1, "paging.md"),
    ("LayerPager", 1, "paging.md"),
    ("NodeCache", 0, "cache.md"),
    ("PlanCache", 1, "plan.md"),
])
def test_every_option_is_documented_with_its_capability(class_name, positional, document):
    text = (ROOT / "docs" / document).read_text()
    options = keyword_options(class_name, positional)
    assert options, class_name
    assert [name for name in options if f"`{name}`" not in text] == []
