"""Balancing and shelf layout: the primitives the construction builds candidate plans from.

`build` turns a group size, a height and a token count per sample and a round count R into
columns: the R*N rank slots are shared among the group sizes in proportion to their rank-time
(at least what their tokens need under B); the samples of each size are balanced over that size's
bins (`partition`: Karmarkar-Karp on small instances, otherwise slot-sized slices of the tallest
samples matched to the least-loaded bins and longest-processing-time for the last ones, in numpy
waves; exact LPT where a tight token budget leaves a sample without room); the columns are then
shelved into rounds tallest first (`layout`).  Deterministic: ties go to the lowest index.
"""

from __future__ import annotations

import numpy as np

from hdp.packing.policies.common import left_starts
from hdp.packing.kernels.jit import int_array
from hdp.packing.policies.hdp.kernels import balance as compiled
from hdp.packing.policies.hdp.columns import Columns
from hdp.packing.policies.kk import karmarkar_karp, lpt_place

__all__ = ["Infeasible", "size_classes", "partition", "layout", "build"]

_KK_MAX_WORK = 4_096  # Karmarkar-Karp (a Python merge per item, O(n * m log m)) only on tiny instances


class Infeasible(Exception):
    """The candidate cannot hold the batch under the token budget."""


def size_classes(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct group sizes, class of every sample): ``np.unique(k, return_inverse=True)``
    in O(n + max k) without a sort."""
    present = np.bincount(k) > 0
    sizes = np.flatnonzero(present)
    return sizes, (np.cumsum(present) - 1)[k]


def partition(
    height: np.ndarray, tokens: np.ndarray, m: int, budget: int, offset: np.ndarray | None = None,
    exact: bool = False,
) -> np.ndarray:
    """Balance items (height, tokens) over m bins of token capacity ``budget``; bin of each item.

    Balances heights (`_balance`); when that leaves an item without token room -- a budget
    filled to the last percent -- every item goes by longest-processing-time to the least-loaded
    bin with room (`_lpt`; one by one once bins fill up when ``exact``), which fills tighter than
    the sliced balance (static CP's packer reaches such fills too).  Raises Infeasible when
    neither fits.
    """
    try:
        return _balance(height, tokens, m, budget, offset)
    except Infeasible:
        if offset is not None:
            raise
    n = height.size  # every item by LPT, none pre-placed in slices
    out = np.full(n, -1, dtype=np.int64)
    order = np.lexsort((np.arange(n), -height))
    _lpt(order, height, tokens, np.zeros(m), np.zeros(m, np.int64), budget, out, exact=exact)
    return out


def _lpt_exact(
    items: np.ndarray, height: np.ndarray, tokens: np.ndarray, load: np.ndarray, used: np.ndarray,
    budget: int, out: np.ndarray,
) -> None:
    """`_lpt` one item at a time (`kk.lpt_place`); raises Infeasible when an item fits no bin."""
    if not lpt_place(items, height, tokens, load, used, budget, out):
        raise Infeasible


def _balance(
    height: np.ndarray, tokens: np.ndarray, m: int, budget: int, offset: np.ndarray | None = None
) -> np.ndarray:
    """Balance items by ``height`` over m bins of token capacity ``budget``; bin of each item.

    Karmarkar–Karp when the instance is small; otherwise slices of m items, tallest first, go to
    the bins sorted by load (largest to least loaded), and the last m..2m items plus those that
    overflowed a bin are placed tallest first on the least-loaded bin with room (`_lpt`).
    ``offset`` [m] starts the bins at unequal loads (a bin with offset -x has x more room).
    Raises Infeasible when an item finds no room.
    """
    n = height.size
    out = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return out
    if m < 1:
        raise Infeasible  # items but no bin
    if m >= n and offset is None:
        out[np.lexsort((np.arange(n), -height))] = np.arange(n)
        return out
    if offset is None and n * m <= _KK_MAX_WORK:
        bins = karmarkar_karp(height, m)
        if np.bincount(bins, weights=tokens, minlength=m).max() <= budget:
            return bins
    load = np.zeros(m) if offset is None else np.array(offset, dtype=np.float64)
    if not compiled.balance(np.asarray(height, dtype=np.float64), _tokens(tokens), int(budget), load, out):
        raise Infeasible
    return out


def _lpt(
    items: np.ndarray, height: np.ndarray, tokens: np.ndarray, load: np.ndarray, used: np.ndarray,
    budget: int, out: np.ndarray, exact: bool = False,
) -> None:
    """Exact longest-processing-time placement, in waves: ``items`` (tallest first) each go to
    the least-loaded bin (ties: lowest index) with token room; ``load``, ``used``, ``out`` in place.

    One-by-one LPT would send item i of a wave to the i-th least-loaded bin as long as that bin is
    still below every bin the wave already raised; a wave takes that whole prefix at once (numpy),
    so a batch needs a few sorts instead of one heap operation per item.  A wave only uses bins
    with room for its largest item (a bin each at most, so every item fits); when no bin has, the
    item goes alone to the least-loaded bin with room.  With ``exact``, once some bin lacks room
    for a wave's largest item the rest go one by one (`_lpt_exact`), so the result is exactly
    one-by-one LPT.  Raises Infeasible when an item fits no bin.
    """
    pos = compiled.lpt_waves(int_array(items), np.asarray(height, dtype=np.float64), _tokens(tokens), load,
                             used, int(budget), out, exact)
    if pos < 0:
        raise Infeasible
    if pos < items.size:
        _lpt_exact(items[pos:], height, tokens, load, used, budget, out)


def _tokens(tokens: np.ndarray) -> np.ndarray:
    """Token counts as the kernels take them (int64; counts are whole tokens)."""
    assert np.issubdtype(np.asarray(tokens).dtype, np.integer), "token counts are integers"
    return int_array(tokens)


def layout(widths: np.ndarray, heights: np.ndarray, num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Shelf layout of columns into rounds of ``num_ranks`` ranks; (round, first rank) of each.

    Each round takes the tallest remaining column, then every column in height order that still
    fits its free ranks.  That is first-fit decreasing: columns tallest first (wider first among
    equals), each to the first round with room for it, a new round when none has -- done here with
    one pointer per width to the first round that may still hold it (free ranks only fall, so a
    round once too full for a width stays so): O(columns + rounds x widths).  Within a round wider
    columns go left (aligned power-of-two blocks stay aligned).
    """
    n = widths.size
    rnd = np.zeros(n, dtype=np.int64)
    if n == 0:
        return rnd, rnd.copy()
    order = np.lexsort((np.arange(n), -widths, -heights))  # tallest first, wider first among equals
    w = np.array(widths[order], dtype=np.int64)
    rnd[order] = compiled.shelf_layout(w, num_ranks, int(w.max()))
    return rnd, left_starts(rnd, widths)


def build(
    problem, k: np.ndarray, height: np.ndarray, tokens: np.ndarray, rounds: int, own_columns: bool,
    exact: bool = False,
) -> Columns:
    """Columns for ``rounds`` rounds of N ranks, laid out, from each sample's group size ``k``,
    per-rank ``height`` and busiest-rank ``tokens`` (module docstring).

    ``own_columns``: every multi-rank sample gets its own group (mixed sizes: few, tall samples);
    otherwise samples of a size share groups.  ``exact``: exact LPT where a size's token budget is
    tight.  Raises `Infeasible` when the rounds cannot hold the batch under B.
    """
    N, B = problem.num_ranks, problem.budget
    work = k * height
    sizes, cls = size_classes(k)
    slots = rounds * N
    # bins per size: enough for the tokens, otherwise in proportion to rank-time
    need = np.maximum(1, -(-np.bincount(cls, weights=tokens).astype(np.int64) // B))  # [S]
    share = np.bincount(cls, weights=work, minlength=sizes.size) / max(float(work.sum()), 1e-300)
    bins = np.maximum(need, np.floor(share * slots / sizes).astype(np.int64))
    count = np.bincount(cls, minlength=sizes.size)
    if own_columns:
        bins = np.where(sizes > 1, count, bins)
    bins = np.minimum(bins, count)
    if sizes[0] == 1:  # single-rank bins take every slot the wider sizes leave
        bins[0] = max(need[0], min(count[0], slots - int((bins[1:] * sizes[1:]).sum())))
    while int((bins * sizes).sum()) > slots:  # over budget: take bins from the most generous size
        spare = np.flatnonzero(bins > need)
        if spare.size == 0:
            raise Infeasible
        c = spare[np.argmax((bins[spare] - need[spare]) * sizes[spare])]
        bins[c] -= 1
    widths = np.repeat(sizes, bins)  # [C] bins of each size, in size order
    first = np.concatenate([[0], np.cumsum(bins)[:-1]])
    col_of = np.zeros(k.size, dtype=np.int64)
    order = np.argsort(cls, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(count)])
    for c in range(sizes.size):
        members = order[bounds[c] : bounds[c + 1]]
        col_of[members] = first[c] + partition(height[members], tokens[members], int(bins[c]), B, exact=exact)
    used = np.bincount(col_of, minlength=widths.size) > 0
    remap = np.cumsum(used) - 1  # drop empty bins
    widths, col_of = widths[used], remap[col_of]
    zeros = np.zeros(widths.size, dtype=np.int64)
    heights = problem.heights(Columns(col_of=col_of, round=zeros, start=zeros, width=widths))
    col_round, col_start = layout(widths, heights, N)
    return Columns(col_of=col_of, round=col_round, start=col_start, width=widths)
