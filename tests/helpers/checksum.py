"""Definitions more than one test module needs (a test module never imports another), moved out of test_checksum.py;
used by tests/distributed/hdp/test_checksum_dist.py, tests/unit/hdp/test_checksum.py."""

from __future__ import annotations

import numpy as np

from hdp.packing import PlannerConfig, plan as make_plan

LENGTHS = [30, 7, 12, 1, 19, 25, 3, 8]


def _plan(lengths, num_ranks=4):
    return make_plan(np.asarray(lengths), PlannerConfig(num_ranks=num_ranks, max_tokens_per_rank=16))


def _raises_naming(fn, *needles):
    try:
        fn()
    except ValueError as exc:
        for needle in needles:
            assert needle in str(exc), f"{needle!r} not in {exc}"
        return
    raise AssertionError(f"no ValueError (expected one naming {needles})")
