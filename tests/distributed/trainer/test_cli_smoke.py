"""Every ``hdp bench`` benchmark (and the CI's ``python -m benchmarks`` ones) and ``hdp demo`` once through the command line, in its smallest mode:
does it run, and is its JSON complete (the keys each documents).  Not a timing check.

Run through the command's entry point, `hdp.trainer.cli.main` (tests/helpers/cli_helper.py: in this process, whose fork
server has the imports already; the console script runs in a subprocess in tests/slow/trainer/test_wheel.py and
tests/slow/verl/test_verl_main_ppo.py).  The other commands run through
the command line elsewhere: ``hdp plan`` / ``simulate`` (tests/distributed/trainer/test_cli_structure.py,
tests/distributed/trainer/test_cli_outputs.py), ``hdp calibrate`` (tests/distributed/trainer/test_cli_bad_input.py),
``python -m benchmarks faults``
(tests/slow/trainer/test_faults.py), ``hdp bench device --dry-run`` (tests/unit/trainer/test_bench_device.py
tests/distributed/trainer/test_bench_device_dist.py tests/slow/trainer/test_bench_device_slow.py), ``hdp bench
regress`` (tests/unit/trainer/test_bench_regress.py tests/distributed/trainer/test_bench_regress_dist.py
tests/slow/trainer/test_bench_regress_slow.py), ``hdp demo --verl`` (tests/slow/verl/test_verl_main_ppo.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from helpers.cli_helper import bench_json, hdp_json, hdp_main
from hdp.core.phases import PHASES


def _json(*args: str) -> dict[str, Any]:
    return hdp_json(*args)


def _has(d: dict[str, Any], keys: set[str], where: str) -> None:
    missing = keys - set(d)
    assert not missing, f"{where}: missing keys {sorted(missing)}"


def _phases(d: dict[str, Any], where: str) -> None:
    assert set(d) == set(PHASES), f"{where}: phases {sorted(d)}"
    assert d["rounds"] > 0.0, where


def test_bench_attention() -> None:
    r = bench_json("attention", "--ranks", "2", "--tokens", "1024", "--json")  # a CI bench: python -m benchmarks
    _has(r, {"algo", "ranks", "tokens", "t1_s", "tk_s", "efficiency", "max_abs_err", "load_1m", "cpu_efficiency",
             "t1_cpu_s", "tk_cpu_s"}, "bench attention")
    assert r["max_abs_err"] <= 1e-4 and r["ranks"] == 2 and r["tokens"] == 1024


def test_bench_exact_and_planner() -> None:
    r = bench_json("exact", "--instances", "3", "--json")
    _has(r, {"gaps", "instances", "mean_gap", "worst_gap", "proven_optimal"}, "bench exact")
    assert r["instances"] == 3 and len(r["gaps"]) == 3
    r = _json("bench", "planner", "--families", "lognormal", "--repeats", "1", "--small-only", "--no-peers", "--json")
    _has(r, {"planner", "passed", "notes", "megatron_core", "search_budget"}, "bench planner")
    assert r["planner"] and all(row["family"] == "lognormal" for row in r["planner"])
    for row in r["planner"]:
        _has(row, {"family", "ranks", "samples", "median_ms", "median_cpu_ms", "efficiency", "target_ms", "passed"},
             "bench planner row")


def test_bench_moe_smoke() -> None:
    r = bench_json("moe", "--smoke", "--json")
    _has(r, {"saved_bytes", "freed_fraction_of_full", "step_time_s", "step_overhead_vs_none",
             "step_overhead_paired_median", "step_cpu_overhead_paired_median", "layer_time_s", "flop_model",
             "targets", "shape", "config", "experts", "grouped_vs_sequential"}, "bench moe")
    assert set(r["freed_fraction_of_full"]) == {"level0", "level1"}
    # the grouped-expert rows beside SequentialMLP's, and the targets on them
    assert set(r["experts"]) == {"sequential", "te_grouped"}
    assert set(r["grouped_vs_sequential"]["step_paired_median"]) == {"none", "level0", "level1", "full_recompute"}
    _has(r["targets"]["grouped"], {"level0_frees_ge_70pct_of_full", "level1_frees_ge_90pct_of_full",
                                   "level0_not_slower_than_sequential_level0"}, "bench moe targets.grouped")


def test_bench_train_smoke() -> None:
    r = _json("bench", "train", "--ranks", "2", "--steps", "2", "--smoke", "--json")
    _has(r, {"spec", "results", "speedup", "speedup_cpu_time", "loss_match", "loss_max_rel_diff", "plans_differ",
             "environment",
             "plans", "calibration", "plan_ahead", "regressions"}, "bench train")
    assert r["loss_match"] and r["plans_differ"] and set(r["results"]) == {"static-cp", "hdp"}
    for policy, res in r["results"].items():
        _has(res, {"tokens_per_s", "step_time_s", "cpu_tokens_per_s", "losses", "rounds", "efficiency_planned",
                   "cp_degree_hist", "phases"}, f"bench train results.{policy}")
        _phases(res["phases"], f"bench train results.{policy}.phases")


def test_bench_memory_one_case() -> None:
    r = _json("bench", "memory", "--only", "dense-pp1-recompute-none", "--json")
    _has(r, {"cases", "passed", "tolerance", "measured"}, "bench memory")
    (case,) = r["cases"]
    _has(case, {"name", "predicted_bytes", "measured_bytes", "max_rel_err", "group_sizes", "passed", "phases"},
         "bench memory case")
    _phases(case["phases"], "bench memory case phases")


def test_bench_verl_smallest() -> None:
    pytest.importorskip("verl")
    r = bench_json("verl", "--ranks", "2", "--steps", "1", "--doors-steps", "2", "--json")
    _has(r, {"speedup", "speedup_cpu_time", "grad_match", "plans_differ", "plans", "phases", "rounds",
             "verl_micro_batches", "tokens_per_s", "step_s_median", "baseline", "doors", "passed"}, "bench verl")
    assert r["passed"] and r["grad_match"] and r["plans_differ"]
    for path in ("hdp", "baseline"):
        _has(r["plans"][path], {"plan_id", "rounds", "cp_degree_hist", "max_tokens_per_rank", "mean_tokens_per_rank"},
             f"bench verl plans.{path}")
        _phases(r["phases"][path], f"bench verl phases.{path}")
    assert r["plans"]["hdp"]["plan_id"] != r["plans"]["baseline"]["plan_id"]
    doors = r["doors"]
    _has(doors, {"same_plan", "loss_match", "verl_over_library", "verl_over_library_cpu", "plans", "phases",
                 "verl_minus_library_ms_per_round", "verl_minus_library_cpu_ms_per_round_rank",
                 "verl_over_library_paired", "verl_over_library_cpu_paired", "verl_tokens_over_library",
                 "verl_tokens_over_library_cpu", "verl_tokens_over_library_paired", "verl_over_library_paired_ci95"},
         "bench verl doors")
    assert doors["same_plan"] and doors["loss_match"] and set(doors["loss"]) == {"library", "verl", "verl_tokens"}
    assert doors["steps"] == 2 and all(len(v) == 2 for v in doors["step_s_all"].values())
    low, high = doors["verl_over_library_paired_ci95"]
    assert low <= doors["verl_over_library_paired"] <= high
    for door in ("library", "verl", "verl_tokens"):
        _phases(doors["phases"][door], f"bench verl doors.phases.{door}")
    assert doors["phases"]["verl"]["exchange"] > 0.0 and doors["phases"]["library"]["exchange"] == 0.0


def test_demo_smoke(tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """The demo's output starts with its table's title, says once what the warm-up step pays for, and
    prints no line twice among its warnings and notes: the cost model's fit (fitted twice in a run, on the
    warm-up records and on all of them) is reported once, after the table, and never logged by a rank."""
    code, out, err = hdp_main("demo", "--ranks", "2", "--steps", "2", "--smoke", "--out", str(tmp_path))
    ranks = capfd.readouterr()  # what the spawned ranks wrote to the process's stdout / stderr
    assert code == 0, err[-3000:] + ranks.err[-3000:]
    assert out.lstrip().startswith("hdp demo: static CP vs HDP on 2 gloo ranks"), out[:500]
    assert out.count("untimed warm-up") == 1, out
    lines = [ln.strip() for ln in (out + err + ranks.out + ranks.err).splitlines()]
    warned = [ln for ln in lines if ln.lower().startswith(("warning", "note:")) or "calibrate:" in ln]
    assert len(warned) == len(set(warned)), warned
    assert not [ln for ln in lines if ln.startswith("WARNING")], lines  # the fit's warnings are in the result
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]  # would print in a terminal
    assert not logged, logged
    result = json.loads((tmp_path / "demo_result.json").read_text())
    assert isinstance(result["calibration"].get("warnings", []), list) and result["calibration"]["planned_with"]
    written = {p.name for p in tmp_path.iterdir()}
    assert any(name.endswith(".json") for name in written), written
