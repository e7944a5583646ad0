"""Definitions more than one test module needs (a test module never imports another), moved out of
test_planner_rivals.py; used by tests/unit/packing/test_planner_bound.py,
tests/unit/packing/test_planner_rivals.py."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import strategies as st

from hdp.packing import CostModel

COST_FIELDS = [f.name for f in dataclasses.fields(CostModel) if f.name != "unit_time_s" and f.type in ("float", float)]


def _magnitude(draw, lo: float, hi: float) -> float:
    """0, or a log-uniform value in [lo, hi]."""
    if draw(st.booleans()) and draw(st.booleans()):
        return 0.0
    return float(10 ** draw(st.floats(np.log10(lo), np.log10(hi))))


@st.composite
def cost_models(draw):
    """Every float field of CostModel (the unit aside) from 0 or 1e-3 .. 1e8 token^2 units, so a
    field's term ranges from negligible to dominating -- the per-token CP terms (``merge_per_token``,
    ``cp_per_token``) included, so large per-rank, per-token CP costs are drawn too."""
    values = {name: _magnitude(draw, 1e-3, 1e8) for name in COST_FIELDS}
    return CostModel(**values)


@st.composite
def batches(draw):
    n_ranks = draw(st.integers(1, 12))
    budget = draw(st.integers(8, 4096))
    n = draw(st.integers(1, 32))
    lengths = draw(
        st.lists(st.integers(1, n_ranks * (budget - 1)), min_size=n, max_size=n).map(
            lambda xs: [max(1, x // 7) if i % 3 else x for i, x in enumerate(xs)]
        )
    )
    return lengths, n_ranks, budget
