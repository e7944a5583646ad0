"""The polish search's state: the structures its kernels share, how they start, grow and change.

A search keeps a compact plan as columns (groups) of capacity ``cap`` -- more than it starts with, as
moves open new groups -- and every kernel takes the parts it reads as structures, not as arrays one
by one:

* `Batch` -- the batch and its constraints, fixed for the search;
* `Settings` -- the search's knobs and its budget;
* `Cols` -- the plan: every sample's column; every column's round, width, height and sums;
* `Survey` -- what the last survey of the columns found (`polish_survey.survey`): each round's roof;
* `Values` -- every sample's values per group size, kept in a table where the batch is small enough.

The field annotations are numba types (`jit.struct_type`), so this module does not postpone them.
"""

from typing import NamedTuple

import numpy as np

from hdp.packing.kernels.jit import F8_1D, F8_2D, F8_3D, I64, I64_1D, B1_1D, F8, helper, struct_type
from hdp.packing.policies.hdp.kernels.costs import A, NODE_RANKS, group_cost_at, sample_values

__all__ = [
    "TOL", "Batch", "Settings", "Cols", "Survey", "Values", "BATCH", "SETTINGS",
    "start", "grow", "ensure", "value", "move", "settle", "column_cost",
]

TOL = 1e-9
"""Relative: a roof drop smaller than this is no drop."""


class Batch(NamedTuple):
    """The batch and its constraints (fixed for a search)."""

    lengths: I64_1D
    """[n] tokens of every sample."""
    k_min: I64_1D
    """[n] the fewest ranks every sample fits on under the token budget."""
    sizes: I64_1D
    """[S] the allowed group sizes, ascending."""
    p: F8_1D
    """[6] the cost model's parameters (`costs.cost_params`)."""
    num_ranks: I64
    """N: ranks of the domain."""
    budget: I64
    """B: tokens per rank and round."""
    stages: I64
    """PP: pipeline stages (the tallest round counts PP - 1 more times)."""


class Settings(NamedTuple):
    """How far the search goes and where it looks (fixed for a search; `polish`'s constants)."""

    stop_at: I64
    """The search pool may be spent up to this many units."""
    call_units: I64
    """Fixed units of one evaluation."""
    patience: I64
    """Steps after which the search checks its progress."""
    windows: I64
    """The check also comes after every 1 / windows of the units the search may spend."""
    progress: F8
    """The search stops when a check finds the roofs' sum fell by less than this fraction."""
    n_targets: I64
    """Moves go to this many roomiest single-rank and multi-rank columns of every round."""
    n_sources: I64
    """Moves take samples off this many tallest columns of every round."""
    trade_columns: I64
    """Trades look at the samples of this many roomiest columns of every round ..."""
    trade_movers: I64
    """... for this many of the longest samples of the roof columns."""
    table_samples: I64
    """Batches of up to this many samples keep their values per group size in a table (`Values`)."""


class Cols(NamedTuple):
    """The plan being searched, changed in place; columns ``[:opened]`` are in use."""

    col_of: I64_1D
    """[n] column of every sample."""
    rnd: I64_1D
    """[cap] round of every column."""
    width: I64_1D
    """[cap] ranks of every column."""
    alive: B1_1D
    """[cap] the column holds samples."""
    h: F8_1D
    """[cap] height: the column's per-rank time (`CostModel.group_cost` of its sums)."""
    sums: F8_2D
    """[cap, 4] sums over the column's samples at its width: padded work, padded length, its square,
    busiest-rank tokens (`costs.sample_values`)."""
    count: I64_1D
    """[cap] samples of every column."""
    free: I64_1D
    """[R] ranks no column of the round takes."""
    cross: B1_1D
    """[cap] the column's ring crosses a node boundary where the plan put it (a domain over nodes; a
    column the search opens is priced inside a node, one it widens keeps its flag): priced so, beside
    every column wider than the largest node (`column_cost`)."""


class Survey(NamedTuple):
    """The columns as the last survey found them (`polish_survey.survey`)."""

    roof: F8_1D
    """[R] every round's height: its tallest column's."""
    second: F8_1D
    """[R] every round's second-tallest column's height (0 for none)."""
    at_roof: B1_1D
    """[cap] the column stands at its round's roof (within `TOL`)."""
    source: B1_1D
    """[cap] moves take samples off the column (at the roof, or among its round's tallest)."""
    depth: I64_1D
    """[cap] columns of its round taller than it (0: the roof column)."""
    below: F8_1D
    """[cap] height of the next lower column of its round (0 for none)."""


class Values(NamedTuple):
    """Every sample's values on a group size: a table for small batches, and scratch rows."""

    tab: F8_3D
    """[rows, n, 4] `costs.sample_values` of every sample on a group size (row ``row_of[k]``), NaN
    until first read; no columns (n = 0) on large batches, where every read computes them."""
    row_of: I64_1D
    """[N + 2] the table's row of every group size (-1: none yet)."""
    n_rows: I64_1D
    """[1] rows of the table taken."""
    work1: F8_1D
    """[n] every sample's work on one rank (a L + L**2)."""
    v: F8_1D
    """[4] scratch: one sample's values."""
    v2: F8_1D
    """[4] scratch: another sample's values."""


BATCH, SETTINGS = struct_type(Batch), struct_type(Settings)
"""The numba types of `Batch` and `Settings` (a kernel's declared arguments)."""


@helper
def column_cost(p, cols, c, sum_work, sum_len, sum_sq, k):
    """`costs.group_cost_at` of column c holding these sums on k ranks: across nodes where it crosses
    (`Cols.cross`) or is wider than the largest node."""
    return group_cost_at(p, sum_work, sum_len, sum_sq, k, cols.cross[c] or float(k) > p[NODE_RANKS])


@helper
def start(batch, col_of, rnd0, width0, cross0, n_rounds, table_samples):
    """The search's state of a compact plan -- ``col_of`` [n] column of every sample, ``rnd0`` / ``width0``
    / ``cross0`` [C] round, width and crossing of every column, ``n_rounds`` rounds -- with room for
    2 C + R + 8 columns: (`Cols`, `Survey`, `Values`)."""
    lengths, p, N = batch.lengths, batch.p, batch.num_ranks
    n = lengths.size
    R = n_rounds
    n_cols = rnd0.size
    cap = 2 * n_cols + R + 8
    col_of = col_of.copy()
    rnd = np.zeros(cap, dtype=np.int64)
    rnd[:n_cols] = rnd0
    width = np.ones(cap, dtype=np.int64)
    width[:n_cols] = width0
    alive = np.zeros(cap, dtype=np.bool_)
    alive[:n_cols] = True
    work1 = np.empty(n)
    for i in range(n):
        lf = float(lengths[i])
        work1[i] = p[A] * lf + lf * lf
    v = np.empty(4)
    v2 = np.empty(4)
    tab = np.full((4, n if n <= table_samples else 0, 4), np.nan)  # entries made on first read (`value`)
    row_of = np.full(N + 2, -1, dtype=np.int64)
    n_rows = np.zeros(1, dtype=np.int64)
    sums = np.zeros((cap, 4))
    count = np.zeros(cap, dtype=np.int64)
    for i in range(n):  # np.bincount(col_of, weights=...): in sample order
        c = col_of[i]
        sample_values(p, lengths[i], width[c], v)
        for q in range(4):
            sums[c, q] += v[q]
        count[c] += 1
    h = np.zeros(cap)
    cross = np.zeros(cap, dtype=np.bool_)
    cross[:n_cols] = cross0
    free = np.full(R, N, dtype=np.int64)
    for c in range(n_cols):
        free[rnd[c]] -= width[c]
    cols = Cols(col_of, rnd, width, alive, h, sums, count, free, cross)
    for c in range(n_cols):
        h[c] = column_cost(p, cols, c, sums[c, 0], sums[c, 1], sums[c, 2], width[c])
    surv = Survey(np.zeros(R), np.zeros(R), np.zeros(cap, dtype=np.bool_), np.zeros(cap, dtype=np.bool_),
                  np.zeros(cap, dtype=np.int64), np.zeros(cap))
    return cols, surv, Values(tab, row_of, n_rows, work1, v, v2)


@helper
def grow(cols, surv):
    """``cols`` and ``surv`` with twice the columns' capacity (the new columns unused: width 1, empty)."""
    cols = Cols(cols.col_of, _grow_i(cols.rnd, 0), _grow_i(cols.width, 1), _grow_b(cols.alive), _grow_f(cols.h),
                _grow_2(cols.sums), _grow_i(cols.count, 0), cols.free, _grow_b(cols.cross))
    surv = Survey(surv.roof, surv.second, _grow_b(surv.at_roof), _grow_b(surv.source), _grow_i(surv.depth, 0),
                  _grow_f(surv.below))
    return cols, surv


@helper
def ensure(values, k):
    """``values`` with a table row for group size k (`Values.tab`, its entries NaN until `value` first
    reads them: a row costs a fill, an entry its arithmetic once -- an evaluation reads a few samples
    of a large batch, not every one); the table doubles its rows when full."""
    tab, row_of, n_rows = values.tab, values.row_of, values.n_rows
    if tab.shape[1] == 0 or row_of[k] >= 0:
        return values
    if n_rows[0] == tab.shape[0]:  # full: double the rows (the new ones unread)
        more = np.full((2 * tab.shape[0], tab.shape[1], 4), np.nan)
        for r in range(tab.shape[0]):
            for i in range(tab.shape[1]):
                for q in range(4):
                    more[r, i, q] = tab[r, i, q]
        values = Values(more, row_of, n_rows, values.work1, values.v, values.v2)
    row_of[k] = n_rows[0]
    n_rows[0] += 1
    return values


@helper
def value(values, batch, i, k, out):
    """``out[:4]`` = `costs.sample_values` of sample i on k ranks: from the table when there is one (the
    row made by `ensure`; the entry computed and kept on its first read), else computed."""
    tab = values.tab
    if tab.shape[1] == 0:
        sample_values(batch.p, batch.lengths[i], k, out)
        return
    r = values.row_of[k]
    if tab[r, i, 0] != tab[r, i, 0]:  # NaN: not read before (a value itself is never NaN)
        sample_values(batch.p, batch.lengths[i], k, out)
        for q in range(4):
            tab[r, i, q] = out[q]
        return
    for q in range(4):
        out[q] = tab[r, i, q]


@helper
def move(batch, cols, values, i, src, dst):
    """Sample i leaves column ``src`` for ``dst``: both columns' sums and counts follow (heights: `settle`)."""
    width, sums, v = cols.width, cols.sums, values.v
    value(values, batch, i, width[src], v)
    for q in range(4):
        sums[src, q] -= v[q]
    value(values, batch, i, width[dst], v)
    for q in range(4):
        sums[dst, q] += v[q]
    cols.count[src] -= 1
    cols.count[dst] += 1
    cols.col_of[i] = dst


@helper
def settle(p, cols, c):
    """Column c's height from its sums after a change; an emptied column closes, freeing its ranks."""
    count, alive, width, sums = cols.count, cols.alive, cols.width, cols.sums
    if count[c] == 0 and alive[c]:
        alive[c] = False
        cols.free[cols.rnd[c]] += width[c]
    cols.h[c] = column_cost(p, cols, c, sums[c, 0], sums[c, 1], sums[c, 2], width[c]) if count[c] > 0 else 0.0


@helper
def _grow_i(a, fill):
    out = np.full(2 * a.size, fill, dtype=a.dtype)
    out[: a.size] = a
    return out


@helper
def _grow_f(a):
    out = np.zeros(2 * a.size, dtype=a.dtype)
    out[: a.size] = a
    return out


@helper
def _grow_b(a):
    out = np.zeros(2 * a.size, dtype=np.bool_)
    out[: a.size] = a
    return out


@helper
def _grow_2(a):
    out = np.zeros((2 * a.shape[0], a.shape[1]))
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            out[i, j] = a[i, j]
    return out
