"""The package's shape: what importing it loads."""
import subprocess
import sys


def test_importing_torch_ext_loads_no_demo_code_and_no_optional_integration():
    code = ("import sys, torch_ext; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch_ext.demos', 'transformers', 'accelerate'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_stubs_of_torch_ext_C_name_every_attribute_it_has():
    import ast
    from pathlib import Path

    import torch_ext

    tree = ast.parse((Path(torch_ext.__file__).parent / "_C.pyi").read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def names(body):
        return {node.name if isinstance(node, ast.FunctionDef) else node.target.id
                for node in body if isinstance(node, (ast.FunctionDef, ast.AnnAssign))}

    def public(obj):
        return {name for name in dir(obj) if not name.startswith("_")}

    # Module attributes are annotated assignments; a submodule is stubbed as the class it is annotated with.
    top = {node.target.id: ast.unparse(node.annotation) for node in tree.body if isinstance(node, ast.AnnAssign)}
    assert public(torch_ext._C) == set(top)
    for submodule in ("checkpoint", "cache", "paging", "plan"):
        assert public(getattr(torch_ext._C, submodule)) == names(classes[top[submodule]].body), submodule
    assert public(torch_ext._C.cache.PythonValues) == names(classes["PythonValues"].body) - {"__init__"}
    assert public(torch_ext._C.paging.Pager) == names(classes["Pager"].body) - {"__init__"}


# The shape of the code: no Python module over ~500 lines, no function over ~80 lines, unless a
# comment just above it says why ("long function: <reason>").
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _justified(lines, index):
    return any("long function:" in line for line in lines[max(0, index - 3):index])


def test_no_python_module_or_function_is_too_long():
    import ast

    too_long = []
    for path in sorted((ROOT / "torch_ext").rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        if len(lines) > MAX_MODULE_LINES and "long module:" not in text[:2000]:
            too_long.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - first + 1
                if length > MAX_FUNCTION_LINES and not _justified(lines, first - 1):
                    too_long.append(f"{path.relative_to(ROOT)}:{first} {node.name}: {length} lines")
    assert too_long == []


def _cpp_functions(text):
    """(first line index, line count, signature) of each function body in C++ source: a brace
    block opened after a parameter list, outside string and character literals and comments."""
    import re

    code = re.sub(r"//[^\n]*|/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)
    code = re.sub(r'"(\\.|[^"\\\n])*"|\'(\\.|[^\'\\\n])*\'', lambda m: " " * len(m.group()), code)
    lines = code.splitlines()
    found, depth, start, base = [], 0, None, 0
    for index, line in enumerate(lines):
        for column, char in enumerate(line):
            if char == "{":
                head = (" ".join(lines[max(0, index - 3):index]) + " " + line[:column]).rstrip()
                is_function = re.search(r"\)\s*(const|override|noexcept|final|mutable|\s)*(->\s*[\w:<>,\s*&]+)?$", head)
                control = re.search(r"\b(if|for|while|switch|catch)\s*\([^;{}]*\)\s*$", head)
                lambda_ = re.search(r"\]\s*\([^;{}]*\)[^;{}]*$", head)
                if start is None and is_function and not control and not lambda_:
                    start, base = index, depth
                depth += 1
            elif char == "}":
                depth -= 1
                if start is not None and depth == base:
                    found.append((start, index - start + 1, lines[start].strip()))
                    start = None
    return found


def test_no_cpp_function_is_too_long():
    too_long = []
    for path in sorted((ROOT / "csrc").rglob("*.[ch]*")):
        text = path.read_text()
        original = text.splitlines()
        for start, length, signature in _cpp_functions(text):
            if length > MAX_FUNCTION_LINES and not _justified(original, start):
                too_long.append(f"{path.relative_to(ROOT)}:{start + 1}: {length} lines: {signature[:80]}")
    assert too_long == []
