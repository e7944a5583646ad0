"""The README's library example runs as written (2 gloo ranks), through ``HdpEngine.build``."""

from __future__ import annotations

import os
import re
from pathlib import Path

from helpers.dist_helper import run_distributed

README = Path(__file__).resolve().parents[3] / "README.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    return blocks[0]


def _run(rank: int, world: int, code: str, workdir: str) -> dict:
    os.chdir(workdir)  # the example saves "ckpt" relative to the working directory
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    m = scope["metrics"]
    return {"loss": m["loss"], "rounds": m["hdp/rounds"], "n": len(scope["logps"])}


def test_readme_library_example_runs(tmp_path) -> None:
    code = _example()
    assert len(code.strip().splitlines()) <= 22
    out = run_distributed(_run, 2, code, str(tmp_path), timeout=300)
    assert out[0]["loss"] == out[1]["loss"] and out[0]["n"] == 4 and out[0]["rounds"] >= 1
    assert (tmp_path / "ckpt" / "manifest.json").is_file()
