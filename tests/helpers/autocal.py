"""Definitions more than one test module needs (a test module never imports another), moved out of test_autocal.py;
used by tests/distributed/packing/test_autocal_dist.py, tests/slow/packing/test_autocal_slow.py,
tests/unit/packing/test_autocal.py."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from hdp.packing import cost_model
from hdp.packing.calibrate import group_seconds
from hdp.packing.cost import CostModel

# the "machine": CPU-like, CP expensive; the model the job starts with: the same without any CP cost
TRUE = dataclasses.replace(cost_model("cpu-tiny", "cpu-gloo"), merge_per_token=3000.0, cp_per_token=1500.0)
CP_FREE = dataclasses.replace(TRUE, step_overhead=0.0, step_latency=0.0, comm_per_token=0.0, merge_per_token=0.0,
                              cp_per_token=0.0)
N, B = 8, 2048


def _timed(p, machine: CostModel, rng: np.random.Generator, noise: float = 0.03, sigma: float = 0.0) -> np.ndarray:
    """[N, R] per-rank round seconds of plan ``p`` on ``machine``: each rank its group's time (+-noise)
    plus beta; idle ranks only beta.  With ``sigma`` > 0 each round as a whole also runs exp(N(0, sigma))
    slower or faster (other jobs on the cores: what a shared CPU does to every rank of a round at once)."""
    times = np.full((p.num_ranks, p.num_rounds), machine.round_cost * machine.unit_time_s)
    for rnd in p.rounds:
        f = math.exp(rng.normal(0.0, sigma)) if sigma > 0 else 1.0
        for g in rnd.groups:
            t = group_seconds(machine, g.lengths, g.size)
            times[g.start : g.start + g.size, rnd.index] += t * f * (1 + rng.uniform(-noise, noise, g.size))
    return times
