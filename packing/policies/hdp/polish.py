"""The polish pass: local search on a finished plan -- samples move or trade places to lower the
round maxima.

The construction balances columns (groups) per size class and lays them out shelf by shelf,
which leaves gaps a construction cannot see: a round of short multi-rank groups under a roof set
by its tallest group, a round whose roof is one column a little taller than the rest.  `polish`
repeats the best of:

* **move**: a sample leaves a column at its round's roof for another column -- of any round and
  width -- or a new group of its fewest ranks on ranks a round leaves free, where it fits the token
  budget B and does not raise that round's roof.  A sample that joins a wider group is split over
  it (the group's exact cost, `CostModel.group_cost`); a group keeps the ranks its samples need;
* **trade**: when no sample of a roof column can move, one of them trades places with a shorter
  sample of another column (each split over its new group) whose round roof the trade does not
  raise;
* **widen**: a round's only roof column takes ranks its round leaves free, when that lowers the
  round's roof.

Targets are the roomiest columns of every round (`kernels.polish_survey.roomiest`: the few single-rank
columns with the most room under their round's roof -- a single-rank column's height is the sum of its samples'
work, so the roomiest fits every sample another one fits and levels best -- and the multi-rank
columns with the most room times width).  The best step lowers the step time the most (its
round's roof, and with PP stages the tallest round PP - 1 more times), then costs the least
rank-time, then levels most (lowers sum(width * height**2)).  Steps are taken together where their
figures stay exact (`kernels.polish_steps.pick`): a round either gives (its roof column steps down) or receives (steps
from other rounds, each into another column under that round's roof), and no column changes twice
-- so several rounds can feed one roomy round at once.  Every step lowers the step time, or keeps
it and lowers sum(width * height**2), so the search ends, and it never makes a plan worse.

The search runs compiled (`kernels.polish_search`, numba, its state in the structures of
`kernels.polish_state`): one evaluation is a sort of the live columns, a scan of the samples and a
loop over (sample, target) pairs, a few dozen floating-point operations each -- `CostModel.group_cost`'s
own, in its order (tests/unit/packing/test_planner_kernels.py tests/distributed/packing/test_planner_kernels_dist.py
checks that arithmetic to the bit; whole plans are
held to committed checksums by tests/unit/packing/test_planner_golden.py).

It is anytime: before each evaluation it checks the ``search`` pool of the budget -- every scored
(sample, target) pair costs one unit, every evaluation a fixed amount (`_CALL_UNITS`), and every step
the scan of its samples and columns -- and stops when the pool (or the call's ``limit``) would be
overspent.  Every unit is bounded compiled work (tens of nanoseconds; `hdp.packing.SearchBudget`), so
the pool bounds the time as well as the plan.
Deterministic: ties go to the lowest indices.
"""

from __future__ import annotations

import numpy as np

from hdp.packing.kernels.jit import int_array
from hdp.packing.policies.hdp.columns import Columns
from hdp.packing.policies.hdp.kernels.polish_search import polish_search
from hdp.packing.policies.hdp.kernels.polish_state import Batch, Settings

__all__ = ["polish"]

_PATIENCE_MIN, _PATIENCE_DIV, _PROGRESS, _WINDOWS = 32, 256, 1e-4, 8
"""The search stops when a window of max(32, n / 256) steps, or of an eighth of the units it may
spend, lowered the sum of the round roofs by less than 0.01% (it has settled; large batches
otherwise spend the whole pool on levelling -- at 131,072 samples a step's bookkeeping alone is
7% of the default pool)."""
_TARGETS = 4  # moves go to the this many roomiest single-rank and multi-rank columns of every round
_SOURCES = 1  # moves take samples off the this many tallest columns of every round
_TRADE_COLUMNS = 8  # trades look at the samples of the this many roomiest columns of every round
_TRADE_MOVERS = 32  # ... for this many of the longest samples of the roof columns
_TABLE_SAMPLES = 16_384  # batches up to this size keep every width's per-sample values in a table
_CALL_UNITS = 1_500  # fixed work of one evaluation (the survey of the columns, the scan of the samples), in pairs
_REPAIR = 16  # the search of a placed plan (a domain over nodes) may spend 1 / this of the pool beyond what is left


def polish(cols: Columns, problem, *, limit: int | None = None, placed: bool = False) -> Columns:
    """The polish pass: lower the step time of ``cols`` (every sample planned) by moves, trades and
    widenings (module docstring) until no step helps, the ``search`` pool is spent, or ``limit``
    units are.  Never a higher step time than ``cols``.  ``placed``: ``cols`` sit where they run on a
    domain over nodes, so every column is priced there (across nodes where it crosses) and keeps its
    place unless the search widens it or opens a column in its round (such a round is laid out again)."""
    assert cols.complete, "polish needs every sample planned"
    meter = problem.meter
    left = max(0, meter.left("search"))
    if placed:  # the search of a placed plan may go a share of the pool beyond it (`placement.repair`)
        left += problem.config.search_budget.search // _REPAIR
    stop_at = meter.spent["search"] + (left if limit is None else min(left, limit))
    setup = problem.n // 4 + cols.n_columns  # setting up the state
    if problem.n == 0 or meter.spent["search"] + setup > stop_at:
        return cols
    meter.charge("search", setup)
    c = cols.compact()
    spent0 = meter.spent["search"]
    batch = Batch(lengths=int_array(problem.lengths), k_min=int_array(problem.k_min), sizes=int_array(problem.sizes),
                  p=problem.params, num_ranks=int(problem.num_ranks), budget=int(problem.budget),
                  stages=int(problem.stages))
    settings = Settings(stop_at=int(stop_at), call_units=_CALL_UNITS,
                        patience=max(_PATIENCE_MIN, problem.n // _PATIENCE_DIV), windows=_WINDOWS,
                        progress=_PROGRESS, n_targets=_TARGETS, n_sources=_SOURCES, trade_columns=_TRADE_COLUMNS,
                        trade_movers=_TRADE_MOVERS, table_samples=_TABLE_SAMPLES)
    cross = (problem.nodes.crosses(c.start, c.width) if placed and problem.nodes is not None and c.n_columns
             else np.zeros(c.n_columns, dtype=bool))
    col_of, rnd, width, alive, opened, steps, spent = polish_search(
        batch, settings, int_array(c.col_of), int_array(c.round), int_array(c.width), np.array(cross, dtype=np.bool_),
        c.num_rounds, spent0)
    meter.charge("search", spent - spent0)
    if steps == 0:
        return cols
    live = np.flatnonzero(alive[:opened])
    remap = np.full(opened, -1, dtype=np.int64)
    remap[live] = np.arange(live.size)
    out = Columns.from_groups(remap[col_of], rnd[live], width[live])
    if placed:  # columns keep their ranks in rounds where the search neither widened nor opened one
        old = live < c.n_columns
        same = old.copy()
        same[old] = width[live[old]] == c.width[live[old]]
        redo = np.zeros(int(rnd[live].max(initial=0)) + 1, dtype=bool)
        redo[rnd[live][~same]] = True
        keep = ~redo[rnd[live]]
        start = np.where(keep, c.start[np.minimum(live, c.n_columns - 1)], out.start)
        out = Columns(col_of=out.col_of, round=out.round, start=start, width=out.width)
    return problem.better(out.compact(), cols)
