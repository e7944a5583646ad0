"""The distributed tier (other processes) of the tests tests/unit/trainer/test_bench_regress.py describes: its docstring says what they check and how."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


PLANT = textwrap.dedent('''
    """Test plant: the hdp policy replaced by static CP (every process of the run imports this)."""
    import importlib, importlib.abc, importlib.machinery, sys

    class _Plant(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "hdp.packing.policies.hdp":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                module.assign = importlib.import_module("hdp.packing.policies.static_cp").assign

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Plant())
''')


def _planted_planner_rows(tmp_path: Path, plant_text: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`hdp bench regress --only planner --json` in a subprocess with ``plant_text`` as its
    ``sitecustomize``; asserts it exited 1 and returns (the process, its JSON report)."""
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(plant_text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plant), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-m", "hdp.trainer", "bench", "regress", "--preset", "ci", "--only", "planner",
                          "--json"], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 1, out.stderr[-3000:]
    return out, json.loads(out.stdout.strip().splitlines()[-1])


def test_a_planted_regression_exits_nonzero_naming_the_row(tmp_path: Path) -> None:
    """static CP in place of hdp's policy: the planner rows' plans are static CP's (less efficient), so
    ``planner-efficiency`` fails and the command names it (``planner-time`` then times another policy:
    not asserted)."""
    out, report = _planted_planner_rows(tmp_path, PLANT)
    verdicts = {r["row"]: r["verdict"] for r in report["rows"]}
    assert set(verdicts) == {"planner-time", "planner-efficiency"} and verdicts["planner-efficiency"] == "REGRESSION"
    assert "planner-efficiency" in report["failed"] and "regression: planner-efficiency" in out.stderr
    eff = next(r for r in report["rows"] if r["row"] == "planner-efficiency")
    assert eff["now"] < eff["baseline"] - 0.005  # beyond the row's tolerance
    clean = subprocess.run([sys.executable, "-m", "benchmarks", "regress", "--only", "planner-efficiency"],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert clean.returncode == 0, clean.stderr[-3000:]  # without the plant the same row holds


SLOW_PLANT = PLANT.replace(
    '"""Test plant: the hdp policy replaced by static CP (every process of the run imports this)."""',
    '"""Test plant: the hdp policy runs each assignment twice (the same plans, twice the CPU)."""',
).replace(
    'module.assign = importlib.import_module("hdp.packing.policies.static_cp").assign',
    'once = module.assign\n'
    '            module.assign = lambda *a, **k: (once(*a, **k), once(*a, **k))[1]',
)


def test_a_planted_slowdown_fails_the_planner_time_row(tmp_path: Path) -> None:
    """A planner that does its work twice: the plans are the same (``planner-efficiency`` holds) and
    ``planner-time`` (the planner's CPU time over the fixed scalar reference kernel) fails."""
    assert SLOW_PLANT != PLANT and "once(*a, **k)" in SLOW_PLANT
    out, report = _planted_planner_rows(tmp_path, SLOW_PLANT)
    verdicts = {r["row"]: r["verdict"] for r in report["rows"]}
    assert verdicts == {"planner-time": "REGRESSION", "planner-efficiency": "ok"}, report["rows"]
    assert report["failed"] == ["planner-time"]


def test_the_cli_prints_the_table_and_exits_zero_on_a_holding_flag() -> None:
    from helpers.cli_helper import hdp_main

    code, out, err = hdp_main("bench", "regress", "--preset", "ci", "--only", "attention-exact,device")
    assert code == 0, err[-3000:]
    for text in ("row", "baseline", "now", "tolerance", "verdict", "attention-exact", "must hold", "skipped: no device"):
        assert text in out, (text, out)
