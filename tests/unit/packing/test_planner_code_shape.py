"""The planner's code stays readable: no module under packing/ over 800 lines, no function there with more
than 12 parameters (a kernel's state travels as one structure, `hdp.packing.kernels.jit.struct_type`)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKING = Path(__file__).resolve().parents[3] / "packing"
MAX_LINES, MAX_PARAMS = 800, 12


def _sources() -> list[Path]:
    files = sorted(PACKING.rglob("*.py"))
    assert len(files) > 40 and any(f.name == "polish_search.py" for f in files)  # the tree itself
    return files


def test_no_module_over_800_lines():
    long = {str(f.relative_to(PACKING)): n for f in _sources() if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (lines): {long}"


def test_no_function_with_more_than_12_parameters():
    wide = {}
    for f in _sources():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
                if n > MAX_PARAMS:
                    wide[f"{f.relative_to(PACKING)}:{node.lineno} {node.name}"] = n
    assert not wide, f"pass a structure instead of these parameters: {wide}"
