"""`hdp bench regress`: the verdicts, the baseline file, tolerances derived from measured spread, the refusal to
record a slower figure, the job preset, and a planted regression through the CLI.

The verdict logic runs on stand-in runners (no benchmark) of the CI preset (`benchmarks.ci`, outside the wheel);
the planted regression runs the real ``planner`` rows in a subprocess where static CP's assignment replaces the
hdp policy's (a ``sitecustomize`` on the subprocess's path patches `hdp.packing.policies.hdp` when it is
imported): the command must exit 1 naming ``planner-efficiency``, and the same row holds without the plant.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import ci
from hdp.trainer.bench import regress as R

P = ci.PRESET
NOTE = {"cpu_model": "test", "commit": "abc"}
"""The machine recorded with a test's baseline (without it ``--update`` probes the machine, git included: a process)."""


def _fake(speedup: float, exact: bool = True, half_width: float = 0.0):
    return {"train-pp1": lambda: {"paired": {"hdp_vs_static-cp": {"cpu": {"median": speedup, "half_width": half_width}}},
                                  "loss_match": exact, "plans_differ": True}}


def _rows(path: Path) -> dict:
    return dict(R.load_baseline(path, P).rows)


def test_rows_name_their_bench_tolerance_and_meaning() -> None:
    names = [r.name for r in P.rows]
    assert len(names) == len(set(names))
    assert {r.bench for r in P.rows} == set(P.runners)
    for r in P.rows:
        assert r.meaning and r.tolerance_text()
        assert (r.tolerance == 0.0) == (r.better == "true"), r.name
    committed = R.load_baseline(ci.BASELINE_FILE, P)  # every row but the device ones has a committed figure
    assert set(committed.rows) == {r.name for r in P.rows if r.bench != "device"}


def test_verdicts_against_a_baseline(tmp_path: Path) -> None:
    base = tmp_path / "b.json"
    R.write_baseline(base, P, {"train-pp1-speedup": 1.40, "train-pp1-exact": True}, {"cpu_count": 2})
    ok = R.run_regress(preset=P, baseline=base, only=["train-pp1"], runners=_fake(1.25))  # -11%: within -15%
    assert ok["failed"] == [] and [r["verdict"] for r in ok["rows"]] == ["ok", "ok"]
    slow = R.run_regress(preset=P, baseline=base, only=["train-pp1"], runners=_fake(1.15))  # -18%
    assert slow["failed"] == ["train-pp1-speedup"]
    wrong = R.run_regress(preset=P, baseline=base, only=["train-pp1-exact"], runners=_fake(1.5, exact=False))
    assert wrong["failed"] == ["train-pp1-exact"] and wrong["rows"][0]["now"] is False

    def crash() -> dict:
        raise RuntimeError("rank 2 died")

    broke = R.run_regress(preset=P, baseline=base, only=["train-pp1"], runners={"train-pp1": crash})
    assert broke["failed"] == ["train-pp1-speedup", "train-pp1-exact"]
    assert broke["rows"][0]["verdict"].startswith("error: RuntimeError: rank 2 died")
    with pytest.raises(RuntimeError, match="train-pp1-exact"):  # a failing flag is never recorded as the baseline
        R.run_regress(preset=P, baseline=base, only=["train-pp1"], update=True, note=NOTE, runners=_fake(1.5, exact=False))
    up = R.run_regress(preset=P, baseline=base, only=["train-pp1-speedup"], update=True, note=NOTE, runners=_fake(1.6))
    assert up["failed"] == [] and _rows(base) == {"train-pp1-speedup": 1.6, "train-pp1-exact": True}


def test_update_records_the_machine_and_derives_tolerances_from_spread(tmp_path: Path) -> None:
    """``--update --repeats 3``: the median of the repeats, a tolerance of 3 standard deviations of a new run against
    that median (the relative spread of the repeats, or the runs' own intervals when wider), the rule stated, and
    the machine, versions, commit and configuration in the file; a figure judged later against it uses it."""
    figures = iter([1.30, 1.40, 1.50])  # relative sd 0.1 / 1.4

    def run() -> dict:
        return _fake(next(figures), half_width=0.02)["train-pp1"]()

    base = tmp_path / "b.json"
    R.run_regress(preset=P, baseline=base, only=["train-pp1"], update=True, repeats=3, runners={"train-pp1": run},
                  note={"cpu_model": "test", "commit": "abc"})
    doc = json.loads(base.read_text())
    assert doc["rows"] == {"train-pp1-speedup": 1.40, "train-pp1-exact": True} and doc["preset"] == "ci"
    tol = doc["tolerances"]["train-pp1-speedup"]
    assert tol["repeats"] == 3 and tol["spread"] == pytest.approx(0.1 / 1.4)
    assert tol["tolerance"] == pytest.approx(3 * 0.1 / 1.4 * (1 + 1 / 3) ** 0.5) and "sqrt(1 + 1/R)" in tol["rule"]
    assert "train-pp1-exact" not in doc["tolerances"]  # a flag must hold: no tolerance
    assert doc["measured_on"] == {"cpu_model": "test", "commit": "abc"} and doc["config"]["train"]["steps"] > 2
    # judged with the derived tolerance (about -26%), not the row's default -15%
    assert R.run_regress(preset=P, baseline=base, only=["train-pp1"], runners=_fake(1.10))["failed"] == []
    assert R.run_regress(preset=P, baseline=base, only=["train-pp1"], runners=_fake(1.00))["failed"] == \
        ["train-pp1-speedup"]
    # a quiet row keeps a tight tolerance: its floor (2%) where neither the repeats nor the run spread
    quiet = R.derive_tolerance(next(r for r in P.rows if r.name == "train-pp1-speedup"), [1.4, 1.4], [])
    assert quiet is not None and quiet["tolerance"] == pytest.approx(0.02)


def test_update_refuses_a_slower_speed_figure_without_allow_lower(tmp_path: Path) -> None:
    base = tmp_path / "b.json"
    R.write_baseline(base, P, {"train-pp1-speedup": 1.40, "train-pp1-exact": True}, {"cpu_count": 2})
    refused = R.run_regress(preset=P, baseline=base, only=["train-pp1"], update=True, note=NOTE, runners=_fake(1.30))
    assert refused["failed"] == ["train-pp1-speedup"] and refused["refused"] == ["train-pp1-speedup (1.4 -> 1.3)"]
    assert refused["rows"][0]["now"] == 1.30 and "--allow-lower" in refused["rows"][0]["verdict"]  # what was measured
    assert _rows(base)["train-pp1-speedup"] == 1.40  # nothing written
    up = R.run_regress(preset=P, baseline=base, only=["train-pp1"], update=True, note=NOTE, runners=_fake(1.30), allow_lower=True)
    assert _rows(base)["train-pp1-speedup"] == 1.30 and up["lowered"] == ["train-pp1-speedup (1.4 -> 1.3)"]
    R.run_regress(preset=P, baseline=base, only=["train-pp1"], update=True, note=NOTE, runners=_fake(1.35))  # faster: recorded
    assert _rows(base)["train-pp1-speedup"] == 1.35


def test_the_job_preset_and_preset_files(tmp_path: Path, monkeypatch) -> None:
    from hdp.trainer.bench.train import TrainBenchSpec

    job = R.job_preset(TrainBenchSpec(ranks=2, policies=("static-cp", "verl-kk", "hdp")))
    assert [r.name for r in job.rows] == [
        "job-static-cp-tokens-per-s", "job-verl-kk-tokens-per-s", "job-hdp-tokens-per-s", "job-speedup-vs-static-cp",
        "job-speedup-vs-verl-kk", "job-static-cp-peak-memory", "job-verl-kk-peak-memory", "job-hdp-peak-memory",
        "job-exact"]
    assert job.baseline is None and job.config["ranks"] == 2
    with pytest.raises(ValueError, match="has no default baseline"):
        R.run_regress(preset=job)
    base = tmp_path / "ci.json"
    R.write_baseline(base, P, {"train-pp1-exact": True}, {})
    with pytest.raises(ValueError, match="holds preset 'ci'.s baseline, not 'job'.s"):
        R.load_baseline(base, job)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="no preset file 'benchmarks/nightly.py'"):
        R.load_preset("nightly")
    (tmp_path / "mine.py").write_text("PRESET = 1\n")
    with pytest.raises(ValueError, match="defines no PRESET"):
        R.load_preset(str(tmp_path / "mine.py"))


def test_bad_baselines_and_rows_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'nope' unknown"):
        R.select_rows(P, ["nope"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": {"train-pp1-speedup": "fast"}}))
    with pytest.raises(ValueError, match="rows.train-pp1-speedup' is 'fast'"):
        R.load_baseline(bad, P)
    bad.write_text(json.dumps({"rows": {"warp-speed": 9.0}}))
    with pytest.raises(ValueError, match="row 'warp-speed' is unknown"):
        R.load_baseline(bad, P)
    bad.write_text(json.dumps({"rows": {}, "tolerances": {"train-pp1-speedup": {"tolerance": -1}}}))
    with pytest.raises(ValueError, match="tolerances.train-pp1-speedup"):
        R.load_baseline(bad, P)
    with pytest.raises(ValueError, match="no such file"):
        R.run_regress(preset=P, baseline=tmp_path / "missing.json", only=["train-pp1"], runners=_fake(1.0))


def test_every_measured_row_needs_a_baseline_figure_in_its_range(tmp_path: Path) -> None:
    """A row that ran without a baseline figure fails (``missing from the baseline``), never passes as new; a
    measured figure outside its row's range is an error of the row and is never recorded by ``--update``."""
    base = tmp_path / "b.json"
    R.write_baseline(base, P, {"train-pp1-speedup": 1.40, "train-pp1-exact": True}, {"cpu_count": 2})
    device = {"device": lambda: {"by_row": {"kernel_exactness": {"status": "ok"}, "engine_pp1": {"status": "ok"}},
                                 "kernel_speed_over_sdpa": 1.3}}
    out = R.run_regress(preset=P, baseline=base, only=["device"], runners=device)  # a device bench may skip: judged after it ran
    assert {r["verdict"] for r in out["rows"]} == {"missing from the baseline"}
    assert out["failed"] == ["device-kernel-exact", "device-kernel-speed", "device-engine"]
    for bad in (-1.5, 0.0, 1e300, float("nan"), float("inf")):
        got = R.run_regress(preset=P, baseline=base, only=["train-pp1-speedup"], runners=_fake(bad))
        assert got["failed"] == ["train-pp1-speedup"], (bad, got)
        assert got["rows"][0]["verdict"].startswith("error: the figure"), got["rows"][0]
        assert "outside the row's range (0, 100]" in got["rows"][0]["verdict"], got["rows"][0]
    with pytest.raises(RuntimeError, match="train-pp1-speedup"):
        R.run_regress(preset=P, baseline=base, only=["train-pp1-speedup"], update=True, note=NOTE, runners=_fake(-1.0))
    assert _rows(base)["train-pp1-speedup"] == 1.40  # unchanged
    for r in P.rows:  # every figure row states its range; the committed figures lie inside
        assert (r.bounds is None) == (r.better == "true"), r.name
    for name, value in R.load_baseline(ci.BASELINE_FILE, P).rows.items():
        row = next(r for r in P.rows if r.name == name)
        assert row.bounds is None or value in row.bounds, (name, value)


def test_device_rows_skip_without_a_device(tmp_path: Path) -> None:
    from hdp.device import select_device

    if select_device(None).type != "cpu":
        pytest.skip("an accelerator is present: the device rows run (minutes) instead of skipping")
    out = R.run_regress(preset=P, only=["device"])
    assert out["failed"] == [] and {r["verdict"] for r in out["rows"]} == {"skipped: no device"}


def test_the_reference_kernel_is_fixed_work() -> None:
    """The planner row's yardstick: a compiled scalar kernel, the same result every call, its time measured
    after compiling (a first call outside the timing)."""
    import numpy as np

    kernel = ci._reference_kernel()
    data = np.random.default_rng(0).random(1 << 12)
    assert kernel(data, 2) == kernel(data, 2) and kernel(data, 2) != kernel(data, 1)
    assert 0.0 < ci.reference_ms(repeats=1) < 10_000.0
