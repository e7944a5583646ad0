"""Definitions more than one test module needs (a test module never imports another), moved out of
test_calibrate.py; used by tests/slow/packing/test_calibrate_slow.py, tests/unit/packing/test_calibrate.py."""

from __future__ import annotations

import dataclasses

import numpy as np

from hdp.packing import CostModel, cost_model
from hdp.packing.calibrate import group_seconds

NOISE = 0.03  # records are measured to +-3%


def _records(true: CostModel, *, seed: int = 0, n: int = 240, noise: float = NOISE,
             ks: tuple[int, ...] = (1, 2, 3, 4, 6, 8), budget: int = 8192, rounds: int = 40) -> list[dict]:
    """Group records of random packed groups (every rank within ``budget`` tokens) and round records
    of short groups (so that beta is a visible share of a round)."""
    rng = np.random.default_rng(seed)
    recs = []
    for _ in range(n):
        k = int(rng.choice(ks))
        m = int(rng.integers(1, 5))
        lengths = np.exp(rng.uniform(np.log(64), np.log(0.95 * k * budget / m), m)).astype(int).tolist()
        t = group_seconds(true, lengths, k) * (1 + rng.uniform(-noise, noise))
        recs.append({"lengths": lengths, "group_size": k, "seconds": t})
    for _ in range(rounds):
        groups = [{"lengths": np.exp(rng.uniform(np.log(16), np.log(512), 2)).astype(int).tolist(),
                   "group_size": int(rng.choice([1, 2, 4]))} for _ in range(3)]
        t = max(group_seconds(true, g["lengths"], g["group_size"]) for g in groups) + true.round_cost * true.unit_time_s
        recs.append({"kind": "round", "groups": groups, "seconds": t * (1 + rng.uniform(-noise, noise))})
    return recs


def _base():
    return cost_model("deepseek-v3", "h100-nvlink")


PARAMETER_SETS = {
    "cpu-gloo": cost_model("cpu-tiny", "cpu-gloo"),
    "h100-dense": cost_model("dense-8b", "h100-nvlink"),
    "ascend-moe": cost_model("qwen3-235b-a22b", "ascend-910b-hccs"),
    # a large per-token CP overhead on every rank (c * L per rank: about 40% of the work at CP8, 32K)
    "large-per-token": dataclasses.replace(cost_model("deepseek-v3", "h100-nvlink"), merge_per_token=5000.0,
                                           cp_per_token=5000.0),
    # no per-token CP overhead at all (the family before it had these terms)
    "no-per-token": dataclasses.replace(cost_model("deepseek-v3", "h100-nvlink"), merge_per_token=0.0,
                                        cp_per_token=0.0),
}
