"""The distributed tier (other processes) of the tests tests/unit/trainer/test_bench_device.py describes: its docstring says what they check and how."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _hdp() -> list[str]:
    exe = Path(sys.executable).with_name("hdp")
    return [str(exe)] if exe.exists() else [sys.executable, "-c", "import sys; from hdp.trainer.cli import main; "
                                                                   "sys.exit(main())"]


def test_cli_bad_flags_name_the_fix(tmp_path):
    proc = subprocess.run(_hdp() + ["bench", "device", "--dry-run", "--rows", "kernel_speed,bogus"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--rows" in proc.stderr and "kernel_exactness" in proc.stderr
    f = tmp_path / "a_file"
    f.write_text("x")
    proc = subprocess.run(_hdp() + ["bench", "device", "--dry-run", "--out", str(f)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--out" in proc.stderr
