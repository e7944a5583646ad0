"""The reshelve pass: the finished columns laid out into rounds again, tallest first.

The local search moves samples between columns and rounds one step at a time, and every step
must lower the step time.  It can end with each round holding one tall column -- a round's roof
-- above columns that are far lower (say two Wikipedia documents of 9-10K tokens on CP2 groups in
two different rounds, every other rank of both rounds well below them): moving one tall column
into the other round lowers nothing until all of them have moved, so no single step is taken.
Laying the same columns out again tallest first (`bins.layout`, first-fit decreasing: the shelf
layout the construction uses) puts the tall columns together; the rounds they leave are then low
and level, and a short search (`polish`, with what is left of the ``search`` pool) re-spreads the
work over the new rounds.  Kept only when the step time drops (1,024 Wikipedia documents, N = 64,
B = 8K, a large per-token CP cost: 0.796 -> 0.894 efficiency).
"""

from __future__ import annotations

import numpy as np

from hdp.packing.policies.hdp.bins import layout
from hdp.packing.policies.hdp.columns import Columns
from hdp.packing.policies.hdp.polish import polish

__all__ = ["reshelve"]


_WORTH = 0.005  # a relayout is searched again only when it alone lowers the step time this much


def reshelve(cols: Columns, problem) -> Columns:
    """The reshelve pass (module docstring): ``cols`` with its columns laid out again tallest first
    (searched once more when that alone lowers the step time by `_WORTH`), when that is faster;
    else ``cols``."""
    assert cols.complete, "reshelve needs every sample planned"
    meter = problem.meter
    c = cols.compact()
    units = problem.n + c.n_columns  # the heights and the estimate: one pass over samples and columns
    if problem.num_ranks < 2 or c.num_rounds < 2 or not meter.allows("search", units):
        return cols
    meter.charge("search", units)
    heights = problem.heights(c)  # the relayout moves columns, not their samples: computed once
    tops = problem.tops(c, heights)
    now = problem.objective(tops)
    if _sorted_roofs(c.width, heights, problem.num_ranks) >= float(tops.sum()) - _WORTH * now:
        return cols  # even a perfect tallest-first layout would not gain enough to be worth the layout
    rounds, starts = layout(c.width, heights, problem.num_ranks)
    shelved = Columns(col_of=c.col_of, round=rounds, start=starts, width=c.width)
    t = problem.step_time(shelved, heights)
    if t >= now * (1 - 1e-9):
        return cols
    if t > now * (1 - _WORTH):
        return shelved
    return problem.better(polish(shelved, problem), shelved)


def _sorted_roofs(widths: np.ndarray, heights: np.ndarray, num_ranks: int) -> float:
    """Sum of round roofs if the columns, tallest first, filled the rounds' ranks without gaps: a
    round starts at each column where the ranks before it reach a multiple of N.  No layout of
    these columns has lower roofs (the r-th round's roof is at least the height of the column
    that r rounds' ranks cannot all hold before it)."""
    order = np.lexsort((np.arange(widths.size), -heights))
    before = np.cumsum(widths[order]) - widths[order]  # ranks of the taller columns
    first = np.r_[True, (before[1:] // num_ranks) != (before[:-1] // num_ranks)]
    return float(heights[order][first].sum())
