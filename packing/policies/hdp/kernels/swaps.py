"""The level pass's round swaps, compiled (`level._swap_rounds`, its docstring): a round's roof column
trades places with another round's work when the sum of the two rounds' maxima drops.

The rounds are held as a grid of ranks (`Grid`): per round the column on every rank, the heights along
the ranks with their prefix and suffix maxima (the tallest column outside any range of ranks), and the
round's roof.  Each scan (`_scan`) refreshes them; the rounds are visited by how far their roof stands
above the rest, and the first trade with a gain is made (`_trade`).

The field annotations are numba types (`jit.struct_type`), so this module does not postpone them.
"""

from typing import NamedTuple

import numpy as np

from hdp.packing.kernels.jit import BOOL, F8_1D, F8_2D, I64, I64_1D, I64_2D, helper, kernel
from hdp.packing.kernels.sort import argsort_stable
from hdp.packing.kernels.sums import pairwise_sum

__all__ = ["swap_rounds", "Grid"]


class Grid(NamedTuple):
    """The rounds as ranks: R rounds x N ranks, C columns; a column index of -1 (an idle rank) reads
    the last entry of the ``*_ext`` arrays (`_at`)."""

    cell: I64_2D
    """[R, N] the column on every rank of every round (-1: idle)."""
    h_ext: F8_1D
    """[C + 1] height of every column (unused ones 0), then 0 for an idle rank."""
    w_ext: I64_1D
    """[C + 1] width of every column, then 1: an idle rank trades like a single-rank column."""
    start_ext: I64_1D
    """[C + 1] first rank of every column, then N."""
    end_ext: I64_1D
    """[C + 1] rank after the last of every column, then 0."""
    hg: F8_2D
    """[R, N] height on every rank (`_scan`)."""
    pre: F8_2D
    """[R, N + 1] maximum height on ranks [0, j) (`_scan`)."""
    suf: F8_2D
    """[R, N + 1] maximum height on ranks [j, N) (`_scan`)."""
    top: F8_1D
    """[R] every round's maximum (`_scan`)."""
    roof: I64_1D
    """[R] every round's tallest column, the first rank's among equals (`_scan`)."""


@helper
def _at(a, c):
    """``a[c]`` with numpy's meaning of c = -1 (the last element): an idle rank's column in a grid."""
    return a[c] if c >= 0 else a[a.size - 1]


@kernel(I64_1D, I64_1D, I64_1D, F8_1D, I64, BOOL, I64)
def swap_rounds(col_round, col_start, widths, heights, num_ranks, pow2, max_swaps):
    """`level._swap_rounds` (its docstring), ``col_round`` and ``col_start`` in place; returns the scans
    for a trade it made (each is charged)."""
    N = num_ranks
    C = widths.size
    n_rounds = 0
    n_live = 0
    for c in range(C):
        if heights[c] >= 0:
            n_live += 1
            n_rounds = max(n_rounds, col_round[c] + 1)
    if n_live == 0 or n_rounds < 2:
        return 0
    R = n_rounds
    grid = _grid(col_round, col_start, widths, heights, N, R)
    top, pre, suf = grid.top, grid.pre, grid.suf
    rest = np.empty(R)
    outside = np.empty(R)
    seen = np.zeros(C, dtype=np.bool_)
    scans = 0
    for _ in range(max_swaps):
        scans += 1
        _scan(grid, col_start, widths, rest)
        eps = 1e-9 * pairwise_sum(top, 0, R)
        gap = np.empty(R)
        for r in range(R):
            gap[r] = rest[r] - top[r]
        found = False
        tp = tg = tq = ts2 = 0
        for p in argsort_stable(gap):  # tallest roof over the rest first
            if top[p] - rest[p] <= eps:
                break
            g = grid.roof[p]
            w, s = widths[g], col_start[g]
            e = s + w
            for q in range(R):
                outside[q] = max(pre[q, s], suf[q, e])
            best_gain, best_q = _same_ranks(grid, p, s, e, heights[g], rest[p], outside)
            best_s = s
            if w > 1:
                bgain, bq, bs = _single_ranks(grid, p, w, pow2, heights[g], rest[p])
                if bq >= 0 and bgain > best_gain:
                    best_gain, best_q, best_s = bgain, bq, bs
            if best_gain > eps:
                found = True
                tp, tg, tq, ts2 = p, g, best_q, best_s
                break
        if not found:
            break
        _trade(grid, col_round, col_start, widths, seen, tp, tg, tq, ts2)
    return scans


@helper
def _grid(col_round, col_start, widths, heights, N, R):
    """The `Grid` of the live columns (``heights`` >= 0) of R rounds on N ranks (its scan fields unset)."""
    C = widths.size
    cell = np.full((R, N), -1, dtype=np.int64)
    for c in range(C):
        if heights[c] >= 0:
            for o in range(widths[c]):
                cell[col_round[c], col_start[c] + o] = c
    h_ext = np.empty(C + 1)
    for c in range(C):
        h_ext[c] = max(heights[c], 0.0)
    h_ext[C] = 0.0
    w_ext = np.empty(C + 1, dtype=np.int64)
    w_ext[:C] = widths
    w_ext[C] = 1
    start_ext = np.empty(C + 1, dtype=np.int64)
    start_ext[:C] = col_start
    start_ext[C] = N
    end_ext = np.empty(C + 1, dtype=np.int64)
    for c in range(C):
        end_ext[c] = col_start[c] + widths[c]
    end_ext[C] = 0
    return Grid(cell, h_ext, w_ext, start_ext, end_ext, np.empty((R, N)), np.empty((R, N + 1)),
                np.empty((R, N + 1)), np.empty(R), np.empty(R, dtype=np.int64))


@helper
def _scan(grid, col_start, widths, rest):
    """``grid``'s heights along the ranks, prefix and suffix maxima, maxima and roof columns of every
    round, from its cells; ``rest[r]``: round r's tallest rank outside its roof column."""
    cell, h_ext, hg, pre, suf, top, roof = grid.cell, grid.h_ext, grid.hg, grid.pre, grid.suf, grid.top, grid.roof
    R, N = cell.shape[0], cell.shape[1]
    for r in range(R):
        best_j = 0
        pre[r, 0] = 0.0
        for j in range(N):
            hg[r, j] = _at(h_ext, cell[r, j])
            pre[r, j + 1] = max(pre[r, j], hg[r, j]) if j > 0 else hg[r, j]
            if hg[r, j] > hg[r, best_j]:
                best_j = j
        suf[r, N] = 0.0
        for j in range(N - 1, -1, -1):
            suf[r, j] = max(suf[r, j + 1], hg[r, j]) if j < N - 1 else hg[r, j]
        top[r] = hg[r, best_j]
        roof[r] = cell[r, best_j]
    for r in range(R):
        g = roof[r]
        rest[r] = max(pre[r, _at(col_start, g)], suf[r, _at(col_start, g) + _at(widths, g)])


@helper
def _same_ranks(grid, p, s, e, h_g, rest_p, outside):
    """Trade (a) for round p's roof column G on ranks [s, e) (height ``h_g``; ``rest_p``: round p
    without it; ``outside[q]``: round q outside [s, e)): the work of another round q on the same ranks,
    when q's columns there lie inside [s, e).  Returns (the best gain, its round)."""
    cell, h_ext, start_ext, end_ext, top = grid.cell, grid.h_ext, grid.start_ext, grid.end_ext, grid.top
    best_gain, best_q = -np.inf, -1
    for q in range(top.size):
        gain = -np.inf
        if q != p:
            inside = True
            hb = 0.0
            for j in range(s, e):
                c = cell[q, j]
                if not (_at(start_ext, c) >= s and _at(end_ext, c) <= e):
                    inside = False
                    break
                hb = max(hb, _at(h_ext, c)) if j > s else _at(h_ext, c)
            if inside:
                gain = top[p] + top[q] - max(rest_p, hb) - max(outside[q], h_g)
        if best_q < 0 or gain > best_gain:
            best_gain, best_q = gain, q
    return best_gain, best_q


@helper
def _single_ranks(grid, p, w, pow2, h_g, rest_p):
    """Trade (b) for round p's roof column G of width w > 1 (height ``h_g``; ``rest_p``: round p without
    it): w consecutive single-rank or idle ranks of another round q (an aligned block under ``pow2``)
    take G, their columns go to G's ranks.  Returns (the best gain, its round, its first rank); round
    -1 when no round has such ranks."""
    cell, w_ext, hg, pre, suf, top = grid.cell, grid.w_ext, grid.hg, grid.pre, grid.suf, grid.top
    N = cell.shape[1]
    bgain, bq, bs = -np.inf, -1, 0
    for q in range(top.size):
        if q == p:
            continue
        run = 0  # single-rank or idle ranks ending at j
        for j in range(N):
            run = run + 1 if _at(w_ext, cell[q, j]) == 1 else 0
            s2 = j - w + 1
            if run < w or (pow2 and s2 % w != 0):
                continue
            wmax = hg[q, s2]
            for o in range(s2 + 1, j + 1):
                wmax = max(wmax, hg[q, o])
            out_q = max(pre[q, s2], suf[q, s2 + w])
            gain = top[p] + top[q] - max(rest_p, wmax) - max(out_q, h_g)
            if bq < 0 or gain > bgain or (gain == bgain and (q, s2) < (bq, bs)):
                bgain, bq, bs = gain, q, s2
    return bgain, bq, bs


@helper
def _trade(grid, col_round, col_start, widths, seen, p, g, q, s2):
    """Round p's roof column g and the columns of round q on ranks [s2, s2 + width) trade places
    (``col_round``, ``col_start`` and the grid in place; ``seen`` [C] all False, left so)."""
    cell, start_ext, end_ext = grid.cell, grid.start_ext, grid.end_ext
    ts = col_start[g]
    w = widths[g]
    te = ts + w
    a = cell[p, ts:te].copy()  # G (one column)
    b = cell[q, s2 : s2 + w].copy()  # columns of q that trade places with G
    cell[p, ts:te] = b
    cell[q, s2 : s2 + w] = a
    col_round[g], col_start[g] = q, s2
    for c in b:  # every column once (a wide one covers several ranks)
        if c >= 0 and not seen[c]:
            seen[c] = True
            col_round[c] = p
            col_start[c] += ts - s2
    for c in b:
        if c >= 0:
            seen[c] = False
    for c in b:  # the moved columns' ranks, as the next scans see them
        if c >= 0:
            start_ext[c], end_ext[c] = col_start[c], col_start[c] + widths[c]
    start_ext[g], end_ext[g] = col_start[g], col_start[g] + widths[g]
