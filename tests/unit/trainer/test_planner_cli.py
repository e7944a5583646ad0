"""The planner's command-line parts: ``hdp simulate --pp``, a baseline skipped with a one-line reason
while hdp's result is still printed, ``--search-budget``, and ``hdp bench planner``."""

from __future__ import annotations

import json

from hdp.trainer.cli import main


def _json_out(capsys):
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out  # exactly one JSON object on stdout
    return json.loads(out)


def test_simulate_pp_compares_the_pp_aware_plan_with_the_plan_made_without_pp(capsys):
    rc = main(["simulate", "--workload", "ascend-short-tail", "--samples", "200", "-N", "16", "-B", "4096",
               "--profile", "ascend-910b-hccs", "--pp", "8", "--policies", "hdp,static-cp", "--no-peers", "--json"])
    assert rc == 0
    d = _json_out(capsys)
    assert d["pipeline_stages"] == 8
    by = {c["policy"]: c for c in d["cases"]}
    assert {"hdp", "hdp-no-pp", "static-cp"} <= set(by)
    assert by["hdp"]["step_time"] <= by["hdp-no-pp"]["step_time"] * (1 + 1e-9)
    assert by["hdp"]["step_time"] < by["static-cp"]["step_time"]


def test_simulate_skips_a_baseline_that_refuses_and_keeps_hdps_result(capsys, monkeypatch):
    import hdp.packing.policies.megatron_dcp as megatron_dcp

    monkeypatch.setattr(megatron_dcp, "MAX_WORK", 1.0)  # as if the batch were far too large for the port
    rc = main(["simulate", "--workload", "lognormal", "--samples", "64", "-N", "8", "-B", "8192",
               "--policies", "hdp,megatron-dcp,static-cp", "--no-peers", "--json"])
    assert rc == 0
    d = _json_out(capsys)
    by = {c["policy"]: c for c in d["cases"]}
    assert 0 < by["hdp"]["efficiency"] <= 1 + 1e-9 and "error" not in by["static-cp"]
    reason = by["megatron-dcp"]["error"]
    assert "\n" not in reason and "does not scale" in reason and "megatron-dcp" in reason
    assert any(n.startswith("megatron-dcp skipped:") for n in d["notes"])
    # the human table too: no traceback, hdp's row printed, the reason as a note
    rc = main(["simulate", "--workload", "lognormal", "--samples", "64", "-N", "8", "-B", "8192",
               "--policies", "hdp,megatron-dcp", "--no-peers"])
    out = capsys.readouterr().out
    assert rc == 0 and "hdp" in out and "does not scale" in out and "Traceback" not in out


def test_search_budget_flag(capsys):
    args = ["plan", "--workload", "lognormal", "--samples", "64", "-N", "8", "-B", "8192", "--json"]
    assert main(args + ["--search-budget", "off"]) == 0
    off = _json_out(capsys)["stats"]["step_time"]
    assert main(args + ["--search-budget", "construct=1000,search=100000,rivals=0"]) == 0
    _json_out(capsys)
    assert main(args) == 0
    assert _json_out(capsys)["stats"]["step_time"] <= off * (1 + 1e-9)
    assert main(args + ["--search-budget", "quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "search_budget" in err and "Traceback" not in err


def test_bench_planner_json(capsys):
    rc = main(["bench", "planner", "--small-only", "--repeats", "1", "--families", "rl-grouped-16,wikipedia",
               "--no-peers", "--json"])
    assert rc == 0
    d = _json_out(capsys)
    assert [(r["family"], r["samples"], r["ranks"]) for r in d["planner"]] == [
        ("rl-grouped-16", 1024, 64), ("rl-grouped-16", 8192, 512), ("wikipedia", 1024, 64), ("wikipedia", 8192, 512)]
    assert d["search_budget"] == {"construct": 20000, "search": 2000000, "rivals": 65536}
    for r in d["planner"]:
        assert r["median_ms"] > 0 and r["median_cpu_ms"] > 0 and 0.8 < r["efficiency"] <= 1.0
        assert r["target_ms"] == (100.0 if r["ranks"] == 64 else 50.0) and "megatron_core" not in r
    assert main(["bench", "planner", "--families", "nope", "--json"]) == 2
    assert "--families" in capsys.readouterr().err
