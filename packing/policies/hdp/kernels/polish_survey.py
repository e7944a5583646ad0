"""The polish search's view of its columns, compiled: the live columns in order, every round's roof,
the columns samples leave (sources) and the roomy columns they go to (targets)."""

import numpy as np

from hdp.packing.kernels.jit import helper
from hdp.packing.kernels.sort import argsort_stable, stable_by_round
from hdp.packing.policies.hdp.kernels.polish_state import TOL

__all__ = ["order_columns", "survey", "roomiest", "pipeline_gain", "max_roof"]


@helper
def _before(a, b, rnd, h):
    """Column a sorts before column b: by round, then height, then index (``np.lexsort((h, r))``
    over the live columns)."""
    if rnd[a] != rnd[b]:
        return rnd[a] < rnd[b]
    if h[a] != h[b]:
        return h[a] < h[b]
    return a < b


@helper
def order_columns(cols, prev, prev_opened, opened, R):
    """The live columns by round, then height, then index.  From scratch (``prev`` empty: a stable
    sort by height, regrouped by round) or from the last survey's order ``prev`` (of the columns
    opened before ``prev_opened``): its live columns, then those opened since, insertion-sorted --
    a step changes a few heights, so they move a few places (O(columns + places moved))."""
    alive, rnd, h = cols.alive, cols.rnd, cols.h
    if prev.size == 0:
        n_live = 0
        for c in range(opened):
            if alive[c]:
                n_live += 1
        live = np.empty(n_live, dtype=np.int64)
        hl = np.empty(n_live)
        n_live = 0
        for c in range(opened):
            if alive[c]:
                live[n_live] = c
                hl[n_live] = h[c]
                n_live += 1
        return stable_by_round(live[argsort_stable(hl)], rnd, R)
    n_live = 0
    for c in prev:
        if alive[c]:
            n_live += 1
    for c in range(prev_opened, opened):
        if alive[c]:
            n_live += 1
    order = np.empty(n_live, dtype=np.int64)
    j = 0
    for c in prev:
        if alive[c]:
            order[j] = c
            j += 1
    for c in range(prev_opened, opened):
        if alive[c]:
            order[j] = c
            j += 1
    for j in range(1, n_live):
        c = order[j]
        i = j - 1
        while i >= 0 and _before(c, order[i], rnd, h):
            order[i + 1] = order[i]
            i -= 1
        order[i + 1] = c
    return order


@helper
def survey(cols, surv, prev, prev_opened, opened, k_source):
    """``surv`` filled in from the live columns of ``cols``: every round's roof and second-tallest
    column, the roof columns, the source columns (at the roof, or fewer than ``k_source`` columns below
    it), every column's depth and next lower column.  Returns the live columns by round, then height,
    then index (`order_columns`, from the last survey's order ``prev`` of the columns opened before
    ``prev_opened``)."""
    rnd, h = cols.rnd, cols.h
    roof, second, at_roof = surv.roof, surv.second, surv.at_roof
    source, depth, below = surv.source, surv.depth, surv.below
    R = roof.size
    order = order_columns(cols, prev, prev_opened, opened, R)
    roof[:] = 0.0
    second[:] = 0.0
    nl = order.size
    for j in range(nl):
        c = order[j]
        r = rnd[c]
        if j == nl - 1 or rnd[order[j + 1]] != r:  # the tallest column of its round
            roof[r] = h[c]
            if j > 0 and rnd[order[j - 1]] == r:
                second[r] = h[order[j - 1]]
    for c in range(opened):
        at_roof[c] = False
        source[c] = False
    run_end = nl - 1
    for j in range(nl - 1, -1, -1):
        c = order[j]
        r = rnd[c]
        if j == nl - 1 or rnd[order[j + 1]] != r:
            run_end = j
        d = run_end - j  # 0 for the tallest column of its round
        depth[c] = d
        below[c] = h[order[j - 1]] if j > 0 and rnd[order[j - 1]] == r else 0.0
        at_roof[c] = h[c] >= roof[r] * (1 - TOL)
        source[c] = at_roof[c] or d < k_source
    return order


@helper
def roomiest(cols, surv, order, opened, k):
    """The columns moves and trades go to: in every round the k single-rank columns with the most room
    under the round's roof and the k multi-rank ones with the most room times width, in index order
    (``order``: the live columns by round, then height, from `survey`)."""
    rnd, width, h, roof = cols.rnd, cols.width, cols.h, surv.roof
    R = roof.size
    take = np.zeros(opened, dtype=np.bool_)
    taken = np.zeros(R, dtype=np.int64)
    n_multi = 0
    for c in order:  # ascending height within each round
        if width[c] == 1:
            if taken[rnd[c]] < k:
                take[c] = True
                taken[rnd[c]] += 1
        else:
            n_multi += 1
    if n_multi:
        # per round the k multi-rank columns of most room x width, ties to the lower index: one pass
        # over the live columns in index order, each round's best k kept sorted (``top``, ``top_gap``)
        live = np.zeros(opened, dtype=np.bool_)
        for c in order:
            live[c] = True
        top = np.full((R, k), -1, dtype=np.int64)
        top_gap = np.empty((R, k))
        for c in range(opened):
            if not live[c] or width[c] <= 1:
                continue
            r = rnd[c]
            gap = (roof[r] - h[c]) * width[c]
            j = k  # the place c takes among its round's best so far: after every one at least as roomy
            while j > 0 and (top[r, j - 1] < 0 or gap > top_gap[r, j - 1]):
                j -= 1
            if j == k:
                continue
            for q in range(k - 1, j, -1):
                top[r, q], top_gap[r, q] = top[r, q - 1], top_gap[r, q - 1]
            top[r, j], top_gap[r, j] = c, gap
        for r in range(R):
            for j in range(k):
                if top[r, j] >= 0:
                    take[top[r, j]] = True
    n_take = 0
    for c in range(opened):
        if take[c]:
            n_take += 1
    out = np.empty(n_take, dtype=np.int64)
    n_take = 0
    for c in range(opened):
        if take[c]:
            out[n_take] = c
            n_take += 1
    return out


@helper
def pipeline_gain(stages, roof, R, r, new_roof):
    """With PP ``stages``, the step time's change from the tallest round's (PP - 1 more times) when round
    r's roof becomes ``new_roof`` (0 or negative; 0 without a pipeline)."""
    if stages == 1 or R == 0:
        return 0.0
    top = 0
    for j in range(1, R):
        if roof[j] > roof[top]:
            top = j
    gmax = roof[top]
    sec = 0.0
    for j in range(R):
        if j != top and roof[j] > sec:
            sec = roof[j]
    d = (max(new_roof, sec) - gmax) if r == top else 0.0
    return float(stages - 1) * min(d, 0.0)


@helper
def max_roof(roof, R):
    """The tallest of the R roofs."""
    out = roof[0]
    for j in range(1, R):
        if roof[j] > out:
            out = roof[j]
    return out
