"""The copyable example runs end to end as users run it (its own interpreter): 2 spawned gloo ranks (its
``--ranks``; its default 4 plans the same single-rank rounds for its batch, 10 s slower here), two steps,
forward, checkpoint."""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "custom_trainer.py"


def test_custom_trainer_example_runs_two_steps(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "2", "--ranks", "2", "--checkpoint-dir", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1"], proc.stdout
    assert all("loss" in line and "tok/s/rank" in line for line in lines)
    assert "checkpoint of step 2 saved to and restored from" in proc.stdout
    assert any((tmp_path / "ckpt").iterdir())


def test_custom_trainer_example_refuses_zero_steps(monkeypatch) -> None:
    """--steps 0 is refused by its flag (it raised UnboundLocalError after spawning the ranks): the script run as
    ``__main__`` in this process (its imports are loaded here already), exit 2 before any rank starts."""
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--steps", "0"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    assert exit_.value.code == 2, err.getvalue()[-3000:]
    assert "argument --steps: 0 is out of range" in err.getvalue(), err.getvalue()[-3000:]
