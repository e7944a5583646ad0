"""Balancing items over bins and shelving columns into rounds, compiled (`bins`' inner loops).

`balance` is `bins._balance` past its small cases, `lpt_waves` the waves of exact
longest-processing-time placement (`bins._lpt`), `shelf_layout` the first-fit decreasing layout of
`bins.layout`.  tests/unit/packing/test_planner_kernels.py tests/distributed/packing/test_planner_kernels_dist.py keeps
the numpy waves these replaced and checks that
every item lands in the same bin, and that whole plans keep their checksums with them swapped in.
"""

import numpy as np

from hdp.packing.kernels.heap import heap_pop, heap_push
from hdp.packing.kernels.jit import BOOL, F8_1D, I64, I64_1D, kernel
from hdp.packing.kernels.sort import argsort_stable

__all__ = ["lpt_waves", "balance", "shelf_layout"]


@kernel(I64_1D, F8_1D, I64_1D, F8_1D, I64_1D, I64, I64_1D, BOOL)
def lpt_waves(items, height, tokens, load, used, budget, out, exact):
    """`bins._lpt`'s waves: ``items`` (tallest first) each to the least-loaded bin (ties: lowest index)
    with token room, a wave of up to m items at a time over the bins with room for its most tokens
    (`bins._lpt`'s docstring); ``load``, ``used``, ``out`` in place.  Returns ``items.size`` when every
    item is placed, -1 when one fits no bin, or -- with ``exact``, once some bin lacks room for a wave's
    most tokens -- the position from which the rest go one by one (`bins._lpt_exact`).

    The numpy waves (tests/unit/packing/test_planner_kernels.py tests/distributed/packing/test_planner_kernels_dist.py
    keeps them as the reference) sort every eligible bin
    by load; here the bins sit in a heap by (load, index) --
    the ones too full for the wave's most tokens set aside in a stash by room, back once a wave's
    tokens fit them -- and a wave pops only the bins it takes (and the one that ends it), so a wave
    costs its items' heap steps, not a sort of the m bins.  The wave's most tokens come from a sliding
    window maximum over the items."""
    m = load.size
    n = items.size
    heap = np.empty(m, dtype=np.int64)  # bins with room for the wave's most tokens (once checked), by load
    stash = np.empty(m, dtype=np.int64)  # bins short of room, fullest last out: by used tokens
    n_heap = 0
    n_stash = 0
    for b in range(m):
        n_heap = heap_push(heap, n_heap, load, b)
    max_used = 0
    for b in range(m):
        max_used = max(max_used, used[b])
    win = np.empty(n, dtype=np.int64)  # sliding-window maximum of the items' tokens: positions, tokens falling
    w_lo, w_hi = 0, 0
    nxt = 0  # the next position entering the window
    taken = np.empty(m, dtype=np.int64)  # the bins the wave took
    pos = 0
    while pos < n:
        end = min(pos + m, n)
        while nxt < end:
            while w_hi > w_lo and tokens[items[win[w_hi - 1]]] <= tokens[items[nxt]]:
                w_hi -= 1
            win[w_hi] = nxt
            w_hi += 1
            nxt += 1
        while win[w_lo] < pos:
            w_lo += 1
        t_max = tokens[items[win[w_lo]]]
        if exact and max_used + t_max > budget:  # some bin lacks room: the rest one by one
            return pos
        while n_stash > 0 and used[stash[0]] + t_max <= budget:  # room again for this wave
            n_heap = heap_push(heap, n_heap, load, heap_pop(stash, n_stash, used))
            n_stash -= 1
        while n_heap > 0 and used[heap[0]] + t_max > budget:  # no room for this wave
            n_stash = heap_push(stash, n_stash, used, heap_pop(heap, n_heap, load))
            n_heap -= 1
        if n_heap == 0:  # one item alone: the least-loaded bin with room
            i = items[pos]
            t = tokens[i]
            while n_stash > 0 and used[stash[0]] + t <= budget:
                n_heap = heap_push(heap, n_heap, load, heap_pop(stash, n_stash, used))
                n_stash -= 1
            while n_heap > 0 and used[heap[0]] + t > budget:
                n_stash = heap_push(stash, n_stash, used, heap_pop(heap, n_heap, load))
                n_heap -= 1
            if n_heap == 0:
                return -1
            b = heap_pop(heap, n_heap, load)
            n_heap -= 1
            load[b] += height[i]
            used[b] += t
            max_used = max(max_used, used[b])
            out[i] = b
            n_heap = heap_push(heap, n_heap, load, b)
            pos += 1
            continue
        n_taken = 0
        raised = np.inf  # the lowest bin the wave raised so far
        while pos + n_taken < end:
            while n_heap > 0 and used[heap[0]] + t_max > budget:  # no room for this wave
                n_stash = heap_push(stash, n_stash, used, heap_pop(heap, n_heap, load))
                n_heap -= 1
            if n_heap == 0:
                break
            b = heap[0]
            if n_taken > 0 and load[b] >= raised:  # the wave ends: a raised bin is as low
                break
            heap_pop(heap, n_heap, load)
            n_heap -= 1
            i = items[pos + n_taken]
            raised = min(raised, load[b] + height[i])
            taken[n_taken] = b
            n_taken += 1
        for q in range(n_taken):
            i, b = items[pos + q], taken[q]
            load[b] += height[i]
            used[b] += tokens[i]
            max_used = max(max_used, used[b])
            out[i] = b
        for q in range(n_taken):
            n_heap = heap_push(heap, n_heap, load, taken[q])
        pos += n_taken
    return n


@kernel(F8_1D, I64_1D, I64, F8_1D, I64_1D)
def balance(height, tokens, budget, load, out):
    """`bins._balance` past its small cases: slices of m items (m = ``load.size`` bins), tallest first
    (ties: lowest index), to the bins sorted by load (ties: lowest index) where their tokens fit; the
    last m..2m items and those that did not fit, tallest first (ties: lowest index), by `lpt_waves`.
    ``load`` (the bins' starting loads), ``out`` in place; returns False when an item fits no bin."""
    n, m = height.size, load.size
    neg = np.empty(n)
    for i in range(n):
        neg[i] = -height[i]
    order = argsort_stable(neg)
    used = np.zeros(m, dtype=np.int64)
    rest = np.zeros(n, dtype=np.bool_)  # the items left for the exact placement
    pos = 0
    while n - pos >= 2 * m:  # the last m..2m items go one by one (exact LPT) for the fine levelling
        target = argsort_stable(load)  # least-loaded bins first
        for q in range(m):
            i, b = order[pos + q], target[q]
            if used[b] + tokens[i] <= budget:
                load[b] += height[i]
                used[b] += tokens[i]
                out[i] = b
            else:
                rest[i] = True
        pos += m
    for q in range(pos, n):
        rest[order[q]] = True
    n_rest = 0
    for i in range(n):
        if rest[i]:
            n_rest += 1
    if n_rest == 0:
        return True
    items = np.empty(n_rest, dtype=np.int64)  # by index, then tallest first (stable)
    neg_r = np.empty(n_rest)
    n_rest = 0
    for i in range(n):
        if rest[i]:
            items[n_rest] = i
            neg_r[n_rest] = -height[i]
            n_rest += 1
    items = items[argsort_stable(neg_r)]
    return lpt_waves(items, height, tokens, load, used, budget, out, False) >= 0


@kernel(I64_1D, I64, I64)
def shelf_layout(widths, num_ranks, max_width):
    """`bins.layout`'s first-fit decreasing over columns of ``widths`` (already tallest first): the
    round of each, a new round when none has room; one pointer per width to the first round that may
    still hold it (free ranks only fall)."""
    n = widths.size
    placed = np.empty(n, dtype=np.int64)
    free = np.empty(n + 1, dtype=np.int64)  # free ranks of every round opened so far (at most one per column)
    n_rounds = 0
    first_fit = np.zeros(max_width + 1, dtype=np.int64)
    for j in range(n):
        w = widths[j]
        r = first_fit[w]
        while r < n_rounds and free[r] < w:
            r += 1
        first_fit[w] = r
        if r == n_rounds:
            free[n_rounds] = num_ranks
            n_rounds += 1
        free[r] -= w
        placed[j] = r
    return placed
