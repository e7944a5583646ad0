"""The slow tier (over ~20 s) of the tests tests/unit/packing/test_calibrate.py describes: its docstring says what they check and how."""

from __future__ import annotations

from hdp.packing.calibrate import calibrate

from helpers.calibrate import PARAMETER_SETS, _base, _records


# ~14 s in one process
def test_a_long_jobs_records_are_subsampled():
    """10^5 records took 232 s; beyond MAX_FIT_RECORDS per kind they are subsampled (evenly spaced, weights
    scaled), so the fit costs what 8,192 records do; the fit is the truth's within the noise."""
    from hdp.packing.calibrate import MAX_FIT_RECORDS

    true = PARAMETER_SETS["cpu-gloo"]
    recs = _records(true, seed=6, n=3 * MAX_FIT_RECORDS, rounds=2 * MAX_FIT_RECORDS)
    res = calibrate(recs, base=_base())
    assert res.n_group_records <= MAX_FIT_RECORDS and res.n_round_records <= MAX_FIT_RECORDS
    assert any("subsampled" in w for w in res.warnings)
    assert abs(res.cost.unit_time_s / true.unit_time_s - 1) < 0.08
