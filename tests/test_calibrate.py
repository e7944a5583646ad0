"""calibrate() recovers a known CostModel from synthetic records with 1% noise."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hdp.packing import cost_model
from hdp.packing.calibrate import calibrate, group_seconds, load_records


def _synth(true, seed=0, n=200, noise=0.01):
    rng = np.random.default_rng(seed)
    recs = []
    for _ in range(n):
        k = int(rng.choice([1, 2, 4, 8]))
        lengths = np.exp(rng.uniform(np.log(64), np.log(32768), int(rng.integers(1, 5)))).astype(int).tolist()
        t = group_seconds(true, lengths, k) * (1 + noise * rng.standard_normal())
        recs.append({"lengths": lengths, "group_size": k, "seconds": t})
    for _ in range(20):  # short rounds, so beta is a sizeable part of the round time
        groups = [
            {"lengths": np.exp(rng.uniform(np.log(64), np.log(2048), 2)).astype(int).tolist(),
             "group_size": int(rng.choice([1, 2, 4]))}
            for _ in range(3)
        ]
        t = max(group_seconds(true, g["lengths"], g["group_size"]) for g in groups)
        t = (t + true.round_cost * true.unit_time_s) * (1 + noise * rng.standard_normal())
        recs.append({"kind": "round", "groups": groups, "seconds": t})
    return recs


# Tolerances (relative) with 1% multiplicative noise: unit time and a within 3%; the CP
# parameters within 10%; beta within 10%.
TOL = {"unit_time_s": 0.03, "linear_coef": 0.03, "step_overhead": 0.10, "step_latency": 0.10,
       "comm_per_token": 0.10, "round_cost": 0.10}


@pytest.mark.parametrize("model,profile", [("cpu-tiny", "cpu-gloo"), ("dense-8b", "h100-nvlink")])
def test_recovers_known_parameters(model, profile):
    true = cost_model(model, profile)
    res = calibrate(_synth(true))
    assert res.n_records == 220
    assert res.r2 > 0.999 and res.median_rel_err < 0.02
    for name, tol in TOL.items():
        fit, ref = getattr(res.cost, name), getattr(true, name)
        assert abs(fit - ref) <= tol * ref, f"{name}: fit {fit:.4g} vs true {ref:.4g}"


def test_exact_records_fit_exactly():
    true = cost_model("cpu-tiny", "cpu-gloo")
    res = calibrate(_synth(true, noise=0.0))
    assert res.median_rel_err < 1e-3


def test_single_rank_records_keep_base_overheads():
    true = cost_model("cpu-tiny", "cpu-gloo")
    recs = [r for r in _synth(true) if r.get("group_size") == 1]
    res = calibrate(recs, base=true)
    assert abs(res.cost.linear_coef / true.linear_coef - 1) < 0.03
    assert res.cost.step_overhead == true.step_overhead


def test_load_records_errors(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps({"lengths": [10, 20], "group_size": 1, "seconds": 0.1}) + "\n{bad\n")
    with pytest.raises(ValueError, match=r"r.jsonl:2: not valid JSON"):
        load_records(f)
    f.write_text(json.dumps({"lengths": [10], "group_size": 0, "seconds": 0.1}) + "\n")
    with pytest.raises(ValueError, match=r"r.jsonl:1.group_size"):
        load_records(f)
    f.write_text(json.dumps({"kind": "round", "seconds": 1.0, "groups": []}) + "\n")
    with pytest.raises(ValueError, match="groups"):
        load_records(f)
    with pytest.raises(ValueError, match="no group records"):
        calibrate([{"kind": "round", "seconds": 1.0, "groups": [{"lengths": [5], "group_size": 1}]}])
