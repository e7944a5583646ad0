"""``tools/doors_profile.py``: the verl door's and the library door's step, function by function, runs
through its command line and reports every timed function with wall, CPU and calls per step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")

TOOL = Path(__file__).resolve().parents[3] / "tools" / "doors_profile.py"


def test_doors_profile_runs_and_times_both_doors() -> None:
    out = subprocess.run([sys.executable, str(TOOL), "--ranks", "2", "--steps", "1", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(ranks) == 2
    for res in ranks:
        assert set(res["step_s_median"]) == {"verl", "library"} and min(res["step_s_median"].values()) > 0
        per = res["per_step"]
        # the verl door's own work was timed, once per round, and the work both doors share on both
        for label in ("loss adapter: call", "sub-batch (select)", "verl's ppo_loss", "exchange", "collect"):
            assert per[label]["verl"]["wall"] > 0 and "library" not in per[label], label
        rounds = per["round losses"]["verl"]["calls"]
        assert rounds >= 1 and per["loss adapter: call"]["verl"]["calls"] == rounds
        for label in ("plan", "agree", "rounds", "round losses", "optimizer step"):
            assert per[label]["verl"]["wall"] > 0 and per[label]["library"]["wall"] > 0, label
