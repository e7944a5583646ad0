"""The copyable example runs end to end: 4 spawned gloo ranks, two steps, forward, checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_trainer.py"


def test_custom_trainer_example_runs_two_steps(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONWARNINGS"] = "ignore"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "2", "--checkpoint-dir", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1"], proc.stdout
    assert all("loss" in line and "tok/s/rank" in line for line in lines)
    assert "checkpoint of step 2 saved to and restored from" in proc.stdout
    assert any((tmp_path / "ckpt").iterdir())


def test_custom_trainer_example_refuses_zero_steps() -> None:
    """--steps 0 is refused by its flag (it raised UnboundLocalError after spawning the ranks)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "0"], capture_output=True, text=True, timeout=240,
                          env=env)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "argument --steps: 0 is out of range" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
