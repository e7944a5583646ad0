"""The slow tier (over ~20 s) of the tests tests/unit/trainer/test_bench_regress.py describes: its docstring says what they check and how."""

from __future__ import annotations

import json
from pathlib import Path


def test_the_job_preset_records_and_judges_a_job_through_the_cli(tmp_path: Path) -> None:
    """``hdp bench regress`` on a job (2 CPU ranks, smoke size): ``--update`` writes every row with the machine, the
    versions and the job's config; a second run judges every row against it (ok or REGRESSION: timings on a shared
    machine are not asserted), and a must-hold row holds."""
    from helpers.cli_helper import hdp_json

    job = ["--smoke", "--ranks", "2", "--steps", "3"]
    base = tmp_path / "job.json"
    up = hdp_json("bench", "regress", "--update", "--baseline", str(base), "--repeats", "2", *job, "--json")
    assert up["updated"] and up["failed"] == [], up
    doc = json.loads(base.read_text())
    assert doc["preset"] == "job" and doc["config"]["ranks"] == 2 and doc["config"]["num_layers"] == 1
    assert set(doc["rows"]) == {"job-static-cp-tokens-per-s", "job-hdp-tokens-per-s", "job-speedup-vs-static-cp",
                                "job-static-cp-peak-memory", "job-hdp-peak-memory", "job-exact"}
    assert doc["measured_on"]["torch"] and doc["measured_on"]["cpu_count"] and "commit" in doc["measured_on"]
    assert doc["tolerances"]["job-speedup-vs-static-cp"]["repeats"] == 2
    from helpers.cli_helper import hdp_main

    code, out, err = hdp_main("bench", "regress", "--baseline", str(base), *job, "--json")
    report = json.loads(out.strip().splitlines()[-1])
    assert {r["verdict"] for r in report["rows"]} <= {"ok", "REGRESSION"}, report["rows"]
    assert next(r for r in report["rows"] if r["row"] == "job-exact")["verdict"] == "ok"
    assert code == (1 if report["failed"] else 0), err[-2000:]
