"""Compiled kernels of the hdp planner's inner loops (numba, ``nopython``): the one module that imports numba.

The polish pass's search (`polish_search`), the level pass's gap filling and round swaps
(`fill_gaps`, `fill_wide_gaps`, `swap_rounds`), the shelf layout (`shelf_layout`), the widening's size
choice (`best_sizes`) and the batch-wide cost figures (`sample_costs`, `rank_tokens`, `column_heights`,
`column_tokens`) are sequential loops over small arrays: in numpy every step is dozens of calls of a
microsecond or more each, in compiled code a few hundred nanoseconds.  The
kernels do the same arithmetic as the numpy formulas they replace, operation for operation:
`_padded` is `cost.padded_float`, `_tokens` `cost.max_rank_tokens`, `_group_cost`
`CostModel.group_cost`, `_pairwise_sum` numpy's pairwise summation of a float64 vector.  So plans
are the numpy passes' own, bit for bit.

Determinism: IEEE double arithmetic only -- no ``fastmath`` (no reassociation, no fused
multiply-add: numba emits plain ``fmul``/``fadd``, which LLVM does not contract), no parallel
reductions, ties broken by index with stable sorts.  The same inputs give the same plan in every
process (checked: the machine code of the kernels holds no ``vfmadd``), and the plans of the numpy
passes these replaced (checked on the bench's families and 300 random batches and configurations).

Compilation: ``cache=True`` keeps the machine code in ``__pycache__`` beside this file, or, where
that is read-only (a wheel in a system site-packages), in numba's per-user cache
(``$NUMBA_CACHE_DIR``, else ``~/.cache/numba``); a process with a warm cache loads the kernels in
about half a second, one with a cold cache compiles them once (20-40 s of CPU on a 2-core
machine); `warm_up` does either when the ``hdp`` policy is imported, and ``hdp bench planner``
reports the first plan's cost.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = [
    "cost_params", "int_array", "polish_search", "karmarkar_karp", "fill_gaps", "fill_wide_gaps", "lpt_waves", "balance", "shelf_layout",
    "best_sizes",
    "swap_rounds", "sample_costs", "rank_tokens", "column_heights", "column_tokens", "max_at", "warm_up",
]

def _kernel(fn):
    """``fn`` compiled (nopython, no GIL held), its machine code cached on disk; where numba finds no
    writable cache directory (``NUMBA_CACHE_DIR``, ``__pycache__`` beside this file, the per-user
    cache) it raises at decoration -- then ``fn`` is compiled in every process instead."""
    try:
        return njit(cache=True, nogil=True)(fn)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        return njit(nogil=True)(fn)


_TOL = 1e-9  # relative: a roof drop smaller than this is no drop (polish's own)
_WORK, _LEN, _SQ, _TOK = 0, 1, 2, 3  # the per-column sums: padded work, length, length**2, busiest-rank tokens
# `cost_params` order
_A, _STEP_OVERHEAD, _STEP_LATENCY, _COMM, _MERGE, _CP = range(6)


def cost_params(cost) -> np.ndarray:
    """[6] float64: the `CostModel` fields the kernels price groups with (``linear_coef``,
    ``step_overhead``, ``step_latency``, ``comm_per_token``, ``merge_per_token``, ``cp_per_token``)."""
    return np.array([cost.linear_coef, cost.step_overhead, cost.step_latency, cost.comm_per_token,
                     cost.merge_per_token, cost.cp_per_token], dtype=np.float64)


def int_array(a) -> np.ndarray:
    """``a`` as a writable, contiguous int64 array (a copy): one argument type per kernel, so one
    compilation (numba compiles a read-only array argument separately)."""
    return np.array(a, dtype=np.int64)


# ---------------------------------------------------------------------------------- the cost model


@_kernel
def _padded(length, k):
    """`cost.padded_float` of one sample: L rounded up to a multiple of 2k for k >= 2, as float64."""
    lf = float(length)
    if k > 1:
        two_k = 2.0 * float(k)
        return np.ceil(lf / two_k) * two_k
    return lf


@_kernel
def _tokens(length, k):
    """`cost.max_rank_tokens` of one sample: the busiest rank's tokens of L on k ranks (zigzag)."""
    if k <= 1:
        return length
    two_k = 2 * k
    q = length // two_k
    r = length - q * two_k
    if r == 0:
        return 2 * q
    if r > 2 and two_k % r != 0:
        return 2 * q + 2
    return 2 * q + 1


@_kernel
def _group_cost(p, sum_work, sum_len, sum_sq, k):
    """`CostModel.group_cost` of one group of k ranks from its sums (the same operations, in order;
    for k = 1 ``sum_work / 1.0 + 0.0``, which is ``sum_work``)."""
    if k == 1:
        return sum_work
    kf = float(k)
    local = sum_len / kf
    comm = p[_STEP_LATENCY] + p[_COMM] * local
    hidden = sum_sq / (kf * kf)
    d = comm - hidden
    per_step = p[_STEP_OVERHEAD] + (d if d > 0.0 else 0.0)
    if p[_MERGE] != 0.0:
        per_step = per_step + p[_MERGE] * local
    ring = (kf - 1.0) * per_step
    if p[_CP] != 0.0:
        ring = ring + p[_CP] * local
    return sum_work / kf + (ring if k > 1 else 0.0)


@_kernel
def _vals(p, length, k, out):
    """``out[:4]`` = padded work, padded length, its square and busiest-rank tokens of one sample on k
    ranks (`polish._State.vals`)."""
    lp = _padded(length, k)
    out[0] = p[_A] * lp + lp * lp
    out[1] = lp
    out[2] = lp * lp
    out[3] = float(_tokens(length, k))


@_kernel
def _ensure(tab, row_of, n_rows, p, lengths, k):
    """``tab`` [rows, n, 4] with a row for every sample's `_vals` on k ranks (``row_of[k]`` its row;
    ``n_rows[0]`` rows taken), its entries NaN until `_val` first reads them: a row costs a fill, an
    entry its arithmetic once -- an evaluation reads a few samples of a large batch, not every one.
    No table (``n`` = 0 columns) on large batches."""
    if tab.shape[1] == 0 or row_of[k] >= 0:
        return tab
    if n_rows[0] == tab.shape[0]:  # full: double the rows (the new ones unread)
        more = np.full((2 * tab.shape[0], tab.shape[1], 4), np.nan)
        for r in range(tab.shape[0]):
            for i in range(tab.shape[1]):
                for q in range(4):
                    more[r, i, q] = tab[r, i, q]
        tab = more
    row_of[k] = n_rows[0]
    n_rows[0] += 1
    return tab


@_kernel
def _val(tab, row_of, p, lengths, i, k, out):
    """`_vals` of sample i on k ranks: from the table when there is one (`_ensure`; computed and kept on
    the first read), else computed."""
    if tab.shape[1] == 0:
        _vals(p, lengths[i], k, out)
        return
    r = row_of[k]
    if tab[r, i, 0] != tab[r, i, 0]:  # NaN: not read before (a value itself is never NaN)
        _vals(p, lengths[i], k, out)
        for q in range(4):
            tab[r, i, q] = out[q]
        return
    for q in range(4):
        out[q] = tab[r, i, q]


@_kernel
def _sample_cost(p, length, k):
    """`CostModel.sample_cost` of one sample alone on k ranks."""
    lp = _padded(length, k)
    return _group_cost(p, p[_A] * lp + lp * lp, lp, lp * lp, k)


@_kernel
def _block_sum(a, lo, n):
    """numpy's pairwise summation of a block of at most 128 values: eight running sums, then the rest."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r = np.empty(8)
    for j in range(8):
        r[j] = a[lo + j]
    i = 8
    while i < n - (n % 8):
        for j in range(8):
            r[j] += a[lo + i + j]
        i += 8
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@_kernel
def _pairwise_sum(a, lo, n):
    """numpy's pairwise summation of ``a[lo:lo + n]`` (what ``a.sum()`` returns for a float64 vector):
    blocks of up to 128 values, halves (rounded to multiples of 8) added.  Iterative: numba's cache
    cannot hold a recursive function (numba/numba#6061: a segmentation fault on loading it)."""
    los = np.empty(64, dtype=np.int64)  # a stack of halves: 2**64 values never come
    ns = np.empty(64, dtype=np.int64)
    stage = np.zeros(64, dtype=np.int64)  # 0: left half next, 1: right half next, 2: add them
    left = np.empty(64)
    los[0], ns[0], stage[0] = lo, n, 0
    top = 0
    ret = 0.0
    while top >= 0:
        m = ns[top]
        if m <= 128:
            ret = _block_sum(a, los[top], m)
            top -= 1
            continue
        n2 = m // 2
        n2 -= n2 % 8
        if stage[top] == 0:
            stage[top] = 1
            los[top + 1], ns[top + 1], stage[top + 1] = los[top], n2, 0
            top += 1
        elif stage[top] == 1:
            left[top] = ret
            stage[top] = 2
            los[top + 1], ns[top + 1], stage[top + 1] = los[top] + n2, m - n2, 0
            top += 1
        else:
            ret = left[top] + ret
            top -= 1
    return ret


# ---------------------------------------------------------------------------------- small helpers


@_kernel
def _stable_by_round(items, key_round, n_rounds):
    """``items`` stably regrouped by ``key_round[item]`` (a counting sort): round order, then the
    items' own order."""
    count = np.zeros(n_rounds + 1, dtype=np.int64)
    for x in items:
        count[key_round[x] + 1] += 1
    for r in range(n_rounds):
        count[r + 1] += count[r]
    out = np.empty(items.size, dtype=np.int64)
    for x in items:
        r = key_round[x]
        out[count[r]] = x
        count[r] += 1
    return out


_RADIX_MIN = 512  # from this many keys `_argsort_stable` sorts by radix (8 passes of a byte), below by merging


@_kernel
def _argsort_radix(keys):
    """``np.argsort(keys, kind="stable")`` of a float64 vector by least-significant-digit radix sort: the
    keys as unsigned integers that order as the floats do (-0.0 as 0.0, every NaN last as numpy puts
    them), a stable counting sort per byte, bytes all keys share skipped.  O(8 n) without comparisons."""
    n = keys.size
    u = np.empty(n, dtype=np.uint64)
    f = np.empty(1)
    bits = f.view(np.uint64)
    top = np.uint64(1) << np.uint64(63)
    for i in range(n):
        x = keys[i]
        if x != x:
            f[0] = np.inf
            u[i] = (bits[0] | top) + np.uint64(1)  # above +inf: NaN last, in their order
            continue
        f[0] = x + 0.0  # -0.0 -> 0.0
        b = bits[0]
        u[i] = ~b if b & top else b | top
    a = np.arange(n)
    tmp = np.empty(n, dtype=np.int64)
    count = np.empty(257, dtype=np.int64)
    for shift in range(0, 64, 8):
        sh = np.uint64(shift)
        count[:] = 0
        for i in range(n):
            count[((u[i] >> sh) & np.uint64(255)) + 1] += 1
        if count[((u[0] >> sh) & np.uint64(255)) + 1] == n:  # every key has this byte: nothing to move
            continue
        for d in range(256):
            count[d + 1] += count[d]
        for j in range(n):
            i = a[j]
            d = (u[i] >> sh) & np.uint64(255)
            tmp[count[d]] = i
            count[d] += 1
        a, tmp = tmp, a
    return a


@_kernel
def _argsort_stable(keys):
    """``np.argsort(keys, kind="stable")`` of a float64 vector: by radix from `_RADIX_MIN` keys
    (`_argsort_radix`), below that insertion-sorted runs of 16, merged bottom-up (equal keys keep their
    order; keys never NaN, which only the radix path orders).  Written out: numba's own sorts bring
    seconds of compilation with them."""
    n = keys.size
    if n >= _RADIX_MIN:
        return _argsort_radix(keys)
    a = np.arange(n)
    b = np.empty(n, dtype=np.int64)
    width = 16  # runs of 16 by insertion sort, then merges
    for lo in range(0, n, width):
        for j in range(lo + 1, min(lo + width, n)):
            x = a[j]
            i = j - 1
            while i >= lo and keys[x] < keys[a[i]]:
                a[i + 1] = a[i]
                i -= 1
            a[i + 1] = x
    while width < n:
        for lo in range(0, n, 2 * width):
            mid = min(lo + width, n)
            hi = min(lo + 2 * width, n)
            i, j, k = lo, mid, lo
            while i < mid and j < hi:
                if keys[a[j]] < keys[a[i]]:  # strictly less: the left run's equal keys go first
                    b[k] = a[j]
                    j += 1
                else:
                    b[k] = a[i]
                    i += 1
                k += 1
            while i < mid:
                b[k] = a[i]
                i += 1
                k += 1
            while j < hi:
                b[k] = a[j]
                j += 1
                k += 1
        a, b = b, a
        width *= 2
    return a


@_kernel
def _grow_i(a, fill):
    out = np.full(2 * a.size, fill, dtype=a.dtype)
    out[: a.size] = a
    return out


@_kernel
def _grow_f(a):
    out = np.zeros(2 * a.size, dtype=a.dtype)
    out[: a.size] = a
    return out


@_kernel
def _grow_b(a):
    out = np.zeros(2 * a.size, dtype=np.bool_)
    out[: a.size] = a
    return out


@_kernel
def _grow_2(a):
    out = np.zeros((2 * a.shape[0], a.shape[1]))
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            out[i, j] = a[i, j]
    return out


@_kernel
def _good_buffers(n):
    """Buffers of good steps: [3, n] floats (d_obj, added, d_phi) and [6, n] ints (flat index, source
    round, target round, source column, target column -- -1 - r for a new group of round r --, depth)."""
    return np.empty((3, max(n, 1))), np.empty((6, max(n, 1)), dtype=np.int64)


@_kernel
def _grow_good(fb, ib):
    """`_good_buffers` of twice the size, holding ``fb`` and ``ib``."""
    fb2, ib2 = _good_buffers(2 * fb.shape[1])
    for q in range(3):
        for j in range(fb.shape[1]):
            fb2[q, j] = fb[q, j]
    for q in range(6):
        for j in range(ib.shape[1]):
            ib2[q, j] = ib[q, j]
    return fb2, ib2


@_kernel
def _push(fb, ib, n, d_obj, added, d_phi, flat, a_round, b_round, c1, c2, dep):
    """Good step ``n`` into the buffers (`_good_buffers`, grown when full); returns them."""
    if n == fb.shape[1]:
        fb, ib = _grow_good(fb, ib)
    fb[0, n], fb[1, n], fb[2, n] = d_obj, added, d_phi
    ib[0, n], ib[1, n], ib[2, n], ib[3, n], ib[4, n], ib[5, n] = flat, a_round, b_round, c1, c2, dep
    return fb, ib


@_kernel
def _pick(n_good, fb, ib, scale, n_rounds, cap):
    """`polish._pick` on the ``n_good`` good steps (`_good_buffers`): the steps taken together, best
    first, as positions into the buffers."""
    d_obj, added, d_phi = fb[0], fb[1], fb[2]
    a_round, b_round, c1, c2, dep = ib[1], ib[2], ib[3], ib[4], ib[5]
    q = max(_TOL * scale, 1e-300)
    k_obj = np.empty(n_good)
    k_add = np.empty(n_good)
    k_phi = np.empty(n_good)
    for g in range(n_good):
        k_obj[g] = np.rint(d_obj[g] / q)
        k_add[g] = np.rint(added[g] / q)
        k_phi[g] = d_phi[g]
    # np.lexsort((j, d_phi, rint(added / q), rint(d_obj / q))): stable sorts from the last key up
    # (good_j ascends, so the index tie-break is the starting order)
    o = _argsort_stable(k_phi)
    o = o[_argsort_stable(k_add[o])]
    o = o[_argsort_stable(k_obj[o])]
    gives = np.full(n_rounds, -1, dtype=np.int64)  # giving round -> steps it took (-1: none)
    receives = np.zeros(n_rounds, dtype=np.bool_)
    changed = np.zeros(cap, dtype=np.bool_)  # columns changed
    changed_new = np.zeros(n_rounds, dtype=np.bool_)  # a new group of the round opened
    out = np.empty(n_good, dtype=np.int64)
    n_out = 0
    for g in o:
        a, b, x, y, d = a_round[g], b_round[g], c1[g], c2[g], dep[g]
        if changed[x] or (changed_new[-1 - y] if y < 0 else changed[y]):
            continue
        if (gives[a] if gives[a] >= 0 else 0) != d or receives[a] or (b != a and gives[b] >= 0):
            continue
        out[n_out] = g
        n_out += 1
        gives[a] = d + 1
        if b != a:
            receives[b] = True
        changed[x] = True
        if y < 0:
            changed_new[-1 - y] = True
        else:
            changed[y] = True
    return out[:n_out]


# ---------------------------------------------------------------------------------- the polish search


@_kernel
def polish_search(lengths, k_min, sizes, p, num_ranks, budget, stages, col_of, rnd0, width0, n_rounds,
                  spent, stop_at, patience, call_units, n_targets, n_sources, trade_columns, trade_movers,
                  windows, progress, table_samples):
    """The polish pass's search (`hdp.packing.policies.hdp.polish`, module docstring) on a compact
    plan: ``col_of`` [n] column of every sample, ``rnd0`` / ``width0`` [C] round and width of every
    column, ``n_rounds`` rounds; ``spent`` units of the search pool spent so far, ``stop_at`` the most
    it may reach.  Returns (col_of [n], round [cap], width [cap], alive [cap], steps taken, spent):
    the searched plan's columns (``alive`` marks those left) -- from the same start and pool the
    numpy search's plan exactly, with the same units charged.  Batches of up to ``table_samples``
    samples keep every sample's values per group size in a table, a row made when an evaluation
    first reads that size (a gather is cheaper than the padding arithmetic)."""
    n = lengths.size
    N, B = num_ranks, budget
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
    opened = n_cols
    work1 = np.empty(n)
    for i in range(n):
        lf = float(lengths[i])
        work1[i] = p[_A] * lf + lf * lf
    v = np.empty(4)
    v2 = np.empty(4)
    tab = np.full((4, n if n <= table_samples else 0, 4), np.nan)  # entries made on first read (`_val`)
    row_of = np.full(N + 2, -1, dtype=np.int64)
    n_rows = np.zeros(1, dtype=np.int64)
    sums = np.zeros((cap, 4))
    count = np.zeros(cap, dtype=np.int64)
    for i in range(n):  # np.bincount(col_of, weights=...): in sample order
        c = col_of[i]
        _vals(p, lengths[i], width[c], v)
        for q in range(4):
            sums[c, q] += v[q]
        count[c] += 1
    h = np.zeros(cap)
    for c in range(n_cols):
        h[c] = _group_cost(p, sums[c, 0], sums[c, 1], sums[c, 2], width[c])
    free = np.full(R, N, dtype=np.int64)
    for c in range(n_cols):
        free[rnd[c]] -= width[c]
    roof = np.zeros(R)
    second = np.zeros(R)
    at_roof = np.zeros(cap, dtype=np.bool_)
    source = np.zeros(cap, dtype=np.bool_)
    depth = np.zeros(cap, dtype=np.int64)
    below = np.zeros(cap)
    steps = 0
    stale = 0
    mark = -1.0
    mark_units = spent
    window = max(1, (stop_at - spent) // windows)
    order = np.empty(0, dtype=np.int64)  # the live columns at the last survey, sorted
    surveyed = 0  # columns opened at the last survey
    while True:
        units = n // 8 + opened  # the step's bookkeeping: roof samples, columns
        if spent + units > stop_at:
            break
        spent += units
        if opened + R + 1 >= cap:
            rnd = _grow_i(rnd, 0)
            width = _grow_i(width, 1)
            alive = _grow_b(alive)
            h = _grow_f(h)
            count = _grow_i(count, 0)
            at_roof = _grow_b(at_roof)
            source = _grow_b(source)
            depth = _grow_i(depth, 0)
            below = _grow_f(below)
            sums = _grow_2(sums)
            cap = rnd.size
        order = _survey(order, surveyed, opened, alive, rnd, h, R, roof, second, at_roof, source, depth, below,
                        n_sources)
        surveyed = opened
        if mark < 0.0:
            mark = _pairwise_sum(roof, 0, R)
        n_movers = 0
        for i in range(n):
            if source[col_of[i]]:
                n_movers += 1
        if n_movers == 0:
            break
        movers = np.empty(n_movers, dtype=np.int64)
        n_movers = 0
        for i in range(n):
            if source[col_of[i]]:
                movers[n_movers] = i
                n_movers += 1
        targets = _roomiest(order, opened, rnd, width, h, roof, R, n_targets)
        # the table's rows the evaluation reads: the movers' and targets' widths, new groups' sizes
        for m in range(n_movers):
            tab = _ensure(tab, row_of, n_rows, p, lengths, width[col_of[movers[m]]])
            tab = _ensure(tab, row_of, n_rows, p, lengths, k_min[movers[m]])
        for c in targets:
            tab = _ensure(tab, row_of, n_rows, p, lengths, width[c])
        found, spent, ok, opened = _best_move(lengths, k_min, p, N, B, stages, movers, targets, col_of, rnd, width,
                                              h, sums, count, free, roof, below, depth, alive, R, spent, stop_at,
                                              call_units, opened, cap, v, tab, row_of)
        if not ok:
            break
        if found == 0:
            n_roof = 0
            for m in range(movers.size):
                if at_roof[col_of[movers[m]]]:
                    n_roof += 1
            roof_movers = np.empty(n_roof, dtype=np.int64)
            n_roof = 0
            for m in range(movers.size):
                if at_roof[col_of[movers[m]]]:
                    roof_movers[n_roof] = movers[m]
                    n_roof += 1
            roomy = _roomiest(order, opened, rnd, width, h, roof, R, trade_columns)
            for c in roomy:
                tab = _ensure(tab, row_of, n_rows, p, lengths, width[c])
            found, spent, ok = _best_trade(lengths, k_min, p, B, stages, roof_movers, roomy, work1, col_of, rnd,
                                           width, h, sums, count, free, roof, below, depth, alive, R, spent,
                                           stop_at, call_units, trade_movers, cap, v, v2, tab, row_of)
            if not ok:
                break
        if found == 0:
            found, spent = _widen(lengths, p, B, sizes, col_of, rnd, width, h, sums, count, free, roof, second,
                                  at_roof, alive, opened, spent, stop_at, call_units, v)
        if found == 0:
            break
        steps += found
        stale += found
        if stale > patience or spent - mark_units > window:
            # a window of steps or of work: stop once the roofs barely came down over it
            order = _survey(order, surveyed, opened, alive, rnd, h, R, roof, second, at_roof, source, depth, below, 1)
            surveyed = opened
            now = _pairwise_sum(roof, 0, R)
            if now > mark * (1 - progress):
                break
            mark, stale, mark_units = now, 0, spent
    return col_of, rnd, width, alive, opened, steps, spent


@_kernel
def _before(a, b, rnd, h):
    """Column a sorts before column b: by round, then height, then index (``np.lexsort((h, r))``
    over the live columns)."""
    if rnd[a] != rnd[b]:
        return rnd[a] < rnd[b]
    if h[a] != h[b]:
        return h[a] < h[b]
    return a < b


@_kernel
def _order_columns(prev, prev_opened, opened, alive, rnd, h, R):
    """The live columns by round, then height, then index.  From scratch (``prev`` empty: a stable
    sort by height, regrouped by round) or from the last survey's order ``prev`` (of the columns
    opened before ``prev_opened``): its live columns, then those opened since, insertion-sorted --
    a step changes a few heights, so they move a few places (O(columns + places moved))."""
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
        return _stable_by_round(live[_argsort_stable(hl)], rnd, R)
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


@_kernel
def _survey(prev, prev_opened, opened, alive, rnd, h, R, roof, second, at_roof, source, depth, below, k_source):
    """`polish._State.survey`: roofs, second-tallest columns, roof and source columns, depths and the
    next lower column of every live column; returns the live columns by round, then height, then
    index (`_order_columns`, from the last survey's order ``prev`` of the columns opened before
    ``prev_opened``)."""
    order = _order_columns(prev, prev_opened, opened, alive, rnd, h, R)
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
        at_roof[c] = h[c] >= roof[r] * (1 - _TOL)
        source[c] = at_roof[c] or d < k_source
    return order


@_kernel
def _roomiest(order, opened, rnd, width, h, roof, R, k):
    """`polish._State.roomiest`: in every round the k single-rank columns with the most room and the k
    multi-rank ones with the most room times width, ascending."""
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


@_kernel
def _pipeline_gain(stages, roof, R, r, new_roof):
    """`polish._State.pipeline_gain` of one step."""
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


@_kernel
def _max_roof(roof, R):
    out = roof[0]
    for j in range(1, R):
        if roof[j] > out:
            out = roof[j]
    return out


@_kernel
def _move(p, lengths, i, src, dst, width, sums, count, col_of, v, tab, row_of):
    """`polish._State.move`: sample i leaves column ``src`` for ``dst``."""
    _val(tab, row_of, p, lengths, i, width[src], v)
    for q in range(4):
        sums[src, q] -= v[q]
    _val(tab, row_of, p, lengths, i, width[dst], v)
    for q in range(4):
        sums[dst, q] += v[q]
    count[src] -= 1
    count[dst] += 1
    col_of[i] = dst


@_kernel
def _settle(p, c, rnd, width, h, sums, count, alive, free):
    """`polish._State.settle` of one column (an emptied one closes, freeing its ranks)."""
    if count[c] == 0 and alive[c]:
        alive[c] = False
        free[rnd[c]] += width[c]
    h[c] = _group_cost(p, sums[c, 0], sums[c, 1], sums[c, 2], width[c]) if count[c] > 0 else 0.0


@_kernel
def _best_move(lengths, k_min, p, N, B, stages, movers, cols, col_of, rnd, width, h, sums, count, free, roof,
               below, depth, alive, R, spent, stop_at, call_units, opened, cap, v, tab, row_of):
    """`polish._best_move`, evaluated and applied: (steps taken, spent, whether the budget covered it,
    columns opened so far)."""
    M, C = movers.size, cols.size
    units = M * (C + R) + call_units
    if spent + units > stop_at:
        return 0, spent, False, opened
    spent += units
    src = np.empty(M, dtype=np.int64)
    h_src = np.empty(M)
    base = np.empty(M)
    k0_min = N + 1
    for m in range(M):
        i = movers[m]
        c = col_of[i]
        src[m] = c
        _val(tab, row_of, p, lengths, i, width[c], v)
        hs = _group_cost(p, sums[c, 0] - v[0], sums[c, 1] - v[1], sums[c, 2] - v[2], width[c])
        h_src[m] = hs if count[c] > 1 else 0.0
        base[m] = max(below[c], h_src[m])
        k0_min = min(k0_min, k_min[i])
    free_max = 0
    for r in range(R):
        free_max = max(free_max, free[r])
    rows = C + R if free_max >= k0_min else C
    scale = _max_roof(roof, R)
    n_pairs = rows * M
    fb, ib = _good_buffers(min(n_pairs, 256))  # the good steps' figures, grown as they come
    n_good = 0
    h0 = np.empty(M)
    if rows > C:
        for m in range(M):
            h0[m] = _sample_cost(p, lengths[movers[m]], k_min[movers[m]])
    r_src_m = np.empty(M, dtype=np.int64)  # per mover: its column's round, width, height, its fewest ranks
    w_s_m = np.empty(M, dtype=np.int64)
    h_s_m = np.empty(M)
    k0_m = np.empty(M, dtype=np.int64)
    for m in range(M):
        r_src_m[m], w_s_m[m], h_s_m[m], k0_m[m] = rnd[src[m]], width[src[m]], h[src[m]], k_min[movers[m]]
    for t in range(rows):
        for m in range(M):
            i = movers[m]
            s = src[m]
            r_src, w_s, h_s = r_src_m[m], w_s_m[m], h_s_m[m]
            k0 = k0_m[m]
            if t < C:
                col = cols[t]
                w_c = width[col]
                if w_c < k0 or col == s:
                    continue
                _val(tab, row_of, p, lengths, i, w_c, v)
                if not (sums[col, 3] + v[3] <= B):
                    continue
                h_new = _group_cost(p, sums[col, 0] + v[0], sums[col, 1] + v[1], sums[col, 2] + v[2], w_c)
                r_c = rnd[col]
                same = r_c == r_src
                lim = h_s * (1 - _TOL) if same else roof[r_c]
                ok = h_new <= lim
                h_prev = h[col]
                tgt = col
            else:
                r_c = t - C
                w_c = k0
                h_new = h0[m]
                same = r_c == r_src
                lim = h_s * (1 - _TOL) if same else roof[r_c]
                ok = free[r_c] >= k0 and h_new <= lim and _tokens(lengths[i], k0) <= B
                h_prev = 0.0
                tgt = -1 - r_c
            if not ok:
                continue
            hs_new = h_src[m]
            roof_r = max(base[m], h_new) if same else base[m]
            gain = _pipeline_gain(stages, roof, R, r_src, roof_r) if depth[s] == 0 else 0.0
            do = roof_r - h_s + gain
            dp = float(w_s) * (hs_new * hs_new - h_s * h_s) + float(w_c) * (h_new * h_new - h_prev * h_prev)
            if not (do < -_TOL * scale or dp < -_TOL * scale * scale):
                continue
            fb, ib = _push(fb, ib, n_good, do, float(w_c) * (h_new - h_prev) - float(w_s) * (h_s - hs_new), dp,
                           t * M + m, r_src, r_c, s, tgt, depth[s])
            n_good += 1
    if n_good == 0:
        return 0, spent, True, opened
    chosen = _pick(n_good, fb, ib, scale, R, cap)
    good_j = ib[0]
    for g in chosen:
        t, m = divmod(good_j[g], M)
        i = movers[m]
        s = src[m]
        if t < C:
            tgt = cols[t]
        else:  # a new group of the sample's fewest ranks on free ranks of round t - C
            tgt = opened
            opened += 1
            rnd[tgt], width[tgt], alive[tgt] = t - C, k_min[i], True
            free[t - C] -= k_min[i]
        _move(p, lengths, i, s, tgt, width, sums, count, col_of, v, tab, row_of)
        _settle(p, s, rnd, width, h, sums, count, alive, free)
        _settle(p, tgt, rnd, width, h, sums, count, alive, free)
    return chosen.size, spent, True, opened


@_kernel
def _best_trade(lengths, k_min, p, B, stages, movers, roomy_cols, work1, col_of, rnd, width, h, sums, count, free,
                roof, below, depth, alive, R, spent, stop_at, call_units, trade_movers, cap, v, v2, tab, row_of):
    """`polish._best_trade`, evaluated and applied: (steps taken, spent, whether the budget covered it)."""
    if movers.size > trade_movers:  # the longest samples of the roof columns (longest first, then index)
        neg = np.empty(movers.size)
        for m in range(movers.size):
            neg[m] = -float(lengths[movers[m]])  # exact below 2**53 tokens
        movers = movers[_argsort_stable(neg)[:trade_movers]]
    M = movers.size
    roomy = np.zeros(cap, dtype=np.bool_)
    for c in roomy_cols:
        roomy[c] = True
    l_max = 0
    w_min = np.inf
    for m in range(M):
        l_max = max(l_max, lengths[movers[m]])
        w_min = min(w_min, work1[movers[m]])
    n = lengths.size
    J = 0
    cand = np.empty(n, dtype=np.int64)
    for i in range(n):
        if roomy[col_of[i]] and lengths[i] < l_max:
            c = col_of[i]
            room = 2.0 * (roof[rnd[c]] - h[c]) * width[c]
            if work1[i] >= w_min - room:
                cand[J] = i
                J += 1
    if J == 0:
        return 0, spent, True
    units = M * J + call_units
    if spent + units > stop_at:
        return 0, spent, False
    spent += units
    scale = _max_roof(roof, R)
    n_pairs = J * M
    fb, ib = _good_buffers(min(n_pairs, 256))  # the good steps' figures, grown as they come
    # c loses i and gains j (on c's width): its sums without i, per mover
    rest1 = np.empty((M, 4))
    src = np.empty(M, dtype=np.int64)  # per mover: its column, its length, its fewest ranks
    l_m = np.empty(M, dtype=np.int64)
    k_m = np.empty(M, dtype=np.int64)
    for m in range(M):
        i = movers[m]
        c = col_of[i]
        src[m], l_m[m], k_m[m] = c, lengths[i], k_min[i]
        _val(tab, row_of, p, lengths, i, width[c], v)
        for q in range(4):
            rest1[m, q] = sums[c, q] - v[q]
    n_good = 0
    for t in range(J):
        j = cand[t]
        c2 = col_of[j]
        w2 = width[c2]
        l_j, k_j = lengths[j], k_min[j]
        _val(tab, row_of, p, lengths, j, w2, v)
        r0, r1, r2, r3 = sums[c2, 0] - v[0], sums[c2, 1] - v[1], sums[c2, 2] - v[2], sums[c2, 3] - v[3]
        hc2 = h[c2]
        for m in range(M):  # the cheap tests first: each failed one rules the pair out
            c = src[m]
            if not (l_j < l_m[m]) or c2 == c:
                continue
            w1 = width[c]
            if not (k_j <= w1) or not (k_m[m] <= w2):
                continue
            _val(tab, row_of, p, lengths, j, w1, v)
            if not (rest1[m, 3] + v[3] <= B):
                continue
            hc = h[c]
            h_c = _group_cost(p, rest1[m, 0] + v[0], rest1[m, 1] + v[1], rest1[m, 2] + v[2], w1)
            if not (h_c < hc * (1 - _TOL)):
                continue
            _val(tab, row_of, p, lengths, movers[m], w2, v2)
            if not (r3 + v2[3] <= B):
                continue
            h_c2 = _group_cost(p, r0 + v2[0], r1 + v2[1], r2 + v2[2], w2)
            same = rnd[c2] == rnd[c]
            lim = hc * (1 - _TOL) if same else roof[rnd[c2]]
            if not (h_c2 <= lim):
                continue
            base = max(below[c], h_c)
            roof_r = max(base, h_c2) if same else base
            gain = _pipeline_gain(stages, roof, R, rnd[c], roof_r) if depth[c] == 0 else 0.0
            do = roof_r - hc + gain
            dp = float(w1) * (h_c * h_c - hc * hc) + float(w2) * (h_c2 * h_c2 - hc2 * hc2)
            if not (do < -_TOL * scale or dp < -_TOL * scale * scale):
                continue
            fb, ib = _push(fb, ib, n_good, do, float(w1) * (h_c - hc) + float(w2) * (h_c2 - hc2), dp,
                           t * M + m, rnd[c], rnd[c2], c, c2, depth[c])
            n_good += 1
    if n_good == 0:
        return 0, spent, True
    chosen = _pick(n_good, fb, ib, scale, R, cap)
    good_j, c1, c2s = ib[0], ib[3], ib[4]
    for g in chosen:
        t, m = divmod(good_j[g], M)
        i, j = movers[m], cand[t]
        c, cc = c1[g], c2s[g]
        _move(p, lengths, i, c, cc, width, sums, count, col_of, v, tab, row_of)
        _move(p, lengths, j, cc, c, width, sums, count, col_of, v, tab, row_of)
        _settle(p, c, rnd, width, h, sums, count, alive, free)
        _settle(p, cc, rnd, width, h, sums, count, alive, free)
    return chosen.size, spent, True


@_kernel
def _widen(lengths, p, B, sizes, col_of, rnd, width, h, sums, count, free, roof, second, at_roof, alive, opened,
           spent, stop_at, call_units, v):
    """`polish._widen`, evaluated and applied: (steps taken, spent)."""
    n = lengths.size
    R = roof.size
    done = np.zeros(R, dtype=np.bool_)
    n_steps = 0
    step_col = np.empty(R, dtype=np.int64)
    step_w = np.empty(R, dtype=np.int64)
    step_v = np.empty((R, 4))
    acc = np.empty(4)
    best_v = np.empty(4)
    for c in range(opened):
        if not at_roof[c]:
            continue
        r, w = rnd[c], width[c]
        other = second[r]  # `others`: a roof column's round's tallest other column
        if done[r] or free[r] <= 0 or other >= roof[r] * (1 - _TOL):
            continue
        n_wider = 0
        for w2 in sizes:
            if w2 > w and w2 <= w + free[r]:
                n_wider += 1
        units = n_wider * count[c] + n // 8 + call_units // 4
        if spent + units > stop_at:
            break
        spent += units
        found = False
        best_top, best_rank, best_w = 0.0, 0.0, 0
        for w2 in sizes:
            if not (w2 > w and w2 <= w + free[r]):
                continue
            acc[:] = 0.0
            for i in range(n):  # the column's sums at width w2, in sample order
                if col_of[i] == c:
                    _vals(p, lengths[i], w2, v)
                    for q in range(4):
                        acc[q] += v[q]
            h2 = _group_cost(p, acc[0], acc[1], acc[2], w2)
            top = max(other, h2)
            if acc[3] <= B and top < roof[r] * (1 - _TOL):
                key0 = np.rint(top / (_TOL * roof[r]))
                key1 = w2 * h2
                if (not found or key0 < best_top or (key0 == best_top and key1 < best_rank)
                        or (key0 == best_top and key1 == best_rank and w2 < best_w)):
                    found, best_top, best_rank, best_w = True, key0, key1, w2
                    best_v[:] = acc
        if not found:
            continue
        done[r] = True
        step_col[n_steps] = c
        step_w[n_steps] = best_w
        step_v[n_steps] = best_v
        n_steps += 1
    for s in range(n_steps):
        c = step_col[s]
        r = rnd[c]
        free[r] -= step_w[s] - width[c]
        width[c] = step_w[s]
        sums[c] = step_v[s]
        _settle(p, c, rnd, width, h, sums, count, alive, free)
    return n_steps, spent


# ---------------------------------------------------------------------------------- construction


@_kernel
def fill_gaps(movers, height, tokens, gap, room, cand, col_of, heights):
    """`level._fill_gaps`'s placement: ``movers`` (tallest first) each to the single-rank column of
    ``cand`` with the least gap that holds its height and tokens (best fit; ties: the first);
    ``col_of``, ``heights``, ``gap`` and ``room`` in place."""
    for i in movers:
        best = -1
        for j in range(cand.size):
            if gap[j] >= height[i] and room[j] >= tokens[i] and (best < 0 or gap[j] < gap[best]):
                best = j
        if best < 0:
            continue
        heights[col_of[i]] -= height[i]
        col_of[i] = cand[best]
        heights[cand[best]] += height[i]
        gap[best] -= height[i]
        room[best] -= tokens[i]


@_kernel
def fill_wide_gaps(p, budget, lengths, widths, sw, sl, sq, tok, roof, chosen, new_h):
    """`level._fill_wide_gaps`'s placement: movers of ``lengths`` (longest first) each join the group
    of ``widths`` -- its sums ``sw``, ``sl``, ``sq`` and busiest-rank tokens ``tok``, in place --
    whose exact cost with it (split over the group) stays under its round's ``roof`` and every rank
    within ``budget`` tokens, leaving the least room (best fit; ties: the first).  ``chosen[m]``: the
    group mover m joined (-1: none); ``new_h[g]``: group g's height after the last join."""
    a = p[_A]
    for m in range(lengths.size):
        length = lengths[m]
        best, best_gap, best_h = -1, 0.0, 0.0
        for j in range(widths.size):
            w = widths[j]
            if not (tok[j] + _tokens(length, w) <= budget):
                continue
            lp = _padded(length, w)
            h = _group_cost(p, sw[j] + (a * lp + lp * lp), sl[j] + lp, sq[j] + lp * lp, w)
            if h <= roof[j] and (best < 0 or roof[j] - h < best_gap):
                best, best_gap, best_h = j, roof[j] - h, h
        chosen[m] = best
        if best < 0:
            continue
        w = widths[best]
        lp = _padded(length, w)
        sw[best] += a * lp + lp * lp
        sl[best] += lp
        sq[best] += lp * lp
        tok[best] += _tokens(length, w)
        new_h[best] = best_h


@_kernel
def _below(key, a, b):
    """Entry a sorts before entry b: by ``key``, then index."""
    return key[a] < key[b] or (key[a] == key[b] and a < b)


@_kernel
def _heap_push(heap, size, key, b):
    """Bin b into the binary min-heap ``heap[:size]`` ordered by (``key``, index); returns the new size."""
    j = size
    heap[j] = b
    while j > 0:
        up = (j - 1) >> 1
        if not _below(key, heap[j], heap[up]):
            break
        heap[j], heap[up] = heap[up], heap[j]
        j = up
    return size + 1


@_kernel
def _heap_pop(heap, size, key):
    """The first bin of the min-heap ``heap[:size]`` (by ``key``, then index) taken out; the new size is
    ``size - 1``.  A bin's key must not change while it is in the heap."""
    top = heap[0]
    size -= 1
    heap[0] = heap[size]
    j = 0
    while True:
        c = 2 * j + 1
        if c >= size:
            break
        if c + 1 < size and _below(key, heap[c + 1], heap[c]):
            c += 1
        if not _below(key, heap[c], heap[j]):
            break
        heap[j], heap[c] = heap[c], heap[j]
        j = c
    return top


@_kernel
def lpt_waves(items, height, tokens, load, used, budget, out, exact):
    """`bins._lpt`'s waves: ``items`` (tallest first) each to the least-loaded bin (ties: lowest index)
    with token room, a wave of up to m items at a time over the bins with room for its most tokens
    (`bins._lpt`'s docstring); ``load``, ``used``, ``out`` in place.  Returns ``items.size`` when every
    item is placed, -1 when one fits no bin, or -- with ``exact``, once some bin lacks room for a wave's
    most tokens -- the position from which the rest go one by one (`bins._lpt_exact`).

    The numpy waves sorted every eligible bin by load; here the bins sit in a heap by (load, index) --
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
        n_heap = _heap_push(heap, n_heap, load, b)
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
            n_heap = _heap_push(heap, n_heap, load, _heap_pop(stash, n_stash, used))
            n_stash -= 1
        while n_heap > 0 and used[heap[0]] + t_max > budget:  # no room for this wave
            n_stash = _heap_push(stash, n_stash, used, _heap_pop(heap, n_heap, load))
            n_heap -= 1
        if n_heap == 0:  # one item alone: the least-loaded bin with room
            i = items[pos]
            t = tokens[i]
            while n_stash > 0 and used[stash[0]] + t <= budget:
                n_heap = _heap_push(heap, n_heap, load, _heap_pop(stash, n_stash, used))
                n_stash -= 1
            while n_heap > 0 and used[heap[0]] + t > budget:
                n_stash = _heap_push(stash, n_stash, used, _heap_pop(heap, n_heap, load))
                n_heap -= 1
            if n_heap == 0:
                return -1
            b = _heap_pop(heap, n_heap, load)
            n_heap -= 1
            load[b] += height[i]
            used[b] += t
            max_used = max(max_used, used[b])
            out[i] = b
            n_heap = _heap_push(heap, n_heap, load, b)
            pos += 1
            continue
        n_taken = 0
        raised = np.inf  # the lowest bin the wave raised so far
        while pos + n_taken < end:
            while n_heap > 0 and used[heap[0]] + t_max > budget:  # no room for this wave
                n_stash = _heap_push(stash, n_stash, used, _heap_pop(heap, n_heap, load))
                n_heap -= 1
            if n_heap == 0:
                break
            b = heap[0]
            if n_taken > 0 and load[b] >= raised:  # the wave ends: a raised bin is as low
                break
            _heap_pop(heap, n_heap, load)
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
            n_heap = _heap_push(heap, n_heap, load, taken[q])
        pos += n_taken
    return n


@_kernel
def balance(height, tokens, budget, load, out):
    """`bins._balance` past its small cases: slices of m items (m = ``load.size`` bins), tallest first
    (ties: lowest index), to the bins sorted by load (ties: lowest index) where their tokens fit; the
    last m..2m items and those that did not fit, tallest first (ties: lowest index), by `lpt_waves`.
    ``load`` (the bins' starting loads), ``out`` in place; returns False when an item fits no bin."""
    n, m = height.size, load.size
    neg = np.empty(n)
    for i in range(n):
        neg[i] = -height[i]
    order = _argsort_stable(neg)
    used = np.zeros(m, dtype=np.int64)
    rest = np.zeros(n, dtype=np.bool_)  # the items left for the exact placement
    pos = 0
    while n - pos >= 2 * m:  # the last m..2m items go one by one (exact LPT) for the fine levelling
        target = _argsort_stable(load)  # least-loaded bins first
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
    items = items[_argsort_stable(neg_r)]
    return lpt_waves(items, height, tokens, load, used, budget, out, False) >= 0


@_kernel
def karmarkar_karp(w, m):
    """`hdp.packing.policies.kk.karmarkar_karp` compiled (the largest differencing method into m parts):
    the same merges in the same order -- a heap of entries by (-spread, index), `kk`'s tie counter being
    the entry's index (items 0..n-1, merges from n), each an m-vector of part sums (descending) and node
    ids; the heaviest part of one merged with the lightest of the other; the same stable sort of the
    merged sums -- so every item gets the same part.  ``w`` float64 [n], m >= 2."""
    n = w.size
    out = np.zeros(n, dtype=np.int64)
    if n == 0 or m == 1:
        return out
    cap = 2 * n - 1  # entries: n items, then one per merge
    sums = np.zeros((cap, m))
    ids = np.full((cap, m), -1, dtype=np.int64)
    key = np.empty(cap)
    left = np.full(n + (n - 1) * m, -1, dtype=np.int64)
    right = np.full(n + (n - 1) * m, -1, dtype=np.int64)
    step_lo = np.empty(n, dtype=np.int64)  # node id range created by each merge
    step_hi = np.empty(n, dtype=np.int64)
    n_steps = 0
    next_id = n
    heap = np.empty(cap, dtype=np.int64)
    size = 0
    for i in range(n):
        sums[i, 0] = w[i]
        ids[i, 0] = i
        key[i] = -w[i]
        size = _heap_push(heap, size, key, i)
    e_new = n
    merged = np.empty(m)
    mids = np.empty(m, dtype=np.int64)
    neg = np.empty(m)
    while size > 1:
        e1 = _heap_pop(heap, size, key)
        size -= 1
        e2 = _heap_pop(heap, size, key)
        size -= 1
        lo = next_id
        for q in range(m):  # the heaviest part of one with the lightest of the other
            a = ids[e1, q]
            b = ids[e2, m - 1 - q]
            merged[q] = sums[e1, q] + sums[e2, m - 1 - q]
            if a >= 0 and b >= 0:
                left[next_id], right[next_id] = a, b
                mids[q] = next_id
                next_id += 1
            else:
                mids[q] = a if a >= 0 else b
        if next_id > lo:
            step_lo[n_steps], step_hi[n_steps] = lo, next_id
            n_steps += 1
        for q in range(m):
            neg[q] = -merged[q]
        order = _argsort_stable(neg)
        for q in range(m):
            sums[e_new, q] = merged[order[q]]
            ids[e_new, q] = mids[order[q]]
        key[e_new] = -(merged[order[0]] - merged[order[m - 1]])
        size = _heap_push(heap, size, key, e_new)
        e_new += 1
    last = heap[0]
    label = np.full(next_id, -1, dtype=np.int64)
    for q in range(m):
        if ids[last, q] >= 0:
            label[ids[last, q]] = q
    for s in range(n_steps - 1, -1, -1):  # children always have smaller ids than their parent
        for x in range(step_lo[s], step_hi[s]):
            label[left[x]] = label[x]
            label[right[x]] = label[x]
    for i in range(n):
        out[i] = label[i]
    return out


@_kernel
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


@_kernel
def best_sizes(p, num_ranks, lengths, k0, cand, reach, out_k, out_h):
    """`sizes._best_sizes`: per sample the size of ``cand`` (ascending) >= ``k0`` of least
    ``k h(k) + (N - k) max(0, h(k) - reach)`` (the first among equals) and its height, into ``out_k``
    and ``out_h``.  A size whose lower bound ``work(L) + [k >= 2] ((k - 1) k step_overhead +
    ((k - 1) merge + cp) L)`` (`CostModel.group_cost`'s terms, padding aside) exceeds the best
    score so far ends the scan: the bound grows with k."""
    a = p[_A]
    for s in range(lengths.size):
        length = lengths[s]
        lf = float(length)
        work = a * lf + lf * lf
        best, best_k, best_h = np.inf, -1, 0.0
        for j in range(cand.size):
            k = cand[j]
            if k < k0[s]:
                continue
            if best_k >= 0 and k >= 2:
                kf = float(k)
                floor = work + (kf - 1.0) * kf * p[_STEP_OVERHEAD] + ((kf - 1.0) * p[_MERGE] + p[_CP]) * lf
                if floor > best * (1 + 1e-12):
                    break
            h = _sample_cost(p, length, k)
            sc = float(k) * h + float(num_ranks - k) * max(0.0, h - reach)
            if sc < best or best_k < 0:
                best, best_k, best_h = sc, k, h
        if best_k < 0:  # no size fits (never for `grow_sizes`'s candidates): the first, as numpy's argmin
            best_k, best_h = cand[0], _sample_cost(p, length, cand[0])
        out_k[s] = best_k
        out_h[s] = best_h


@_kernel
def _at(a, c):
    """``a[c]`` with numpy's meaning of c = -1 (the last element): an idle rank's column in a grid."""
    return a[c] if c >= 0 else a[a.size - 1]


@_kernel
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
    grid = np.full((R, N), -1, dtype=np.int64)  # [R, N] column on each rank (-1: idle)
    for c in range(C):
        if heights[c] >= 0:
            for o in range(widths[c]):
                grid[col_round[c], col_start[c] + o] = c
    h_ext = np.empty(C + 1)  # index -1 -> idle, height 0
    for c in range(C):
        h_ext[c] = max(heights[c], 0.0)
    h_ext[C] = 0.0
    w_ext = np.empty(C + 1, dtype=np.int64)  # idle ranks trade like single-rank columns
    w_ext[:C] = widths
    w_ext[C] = 1
    start_ext = np.empty(C + 1, dtype=np.int64)
    start_ext[:C] = col_start
    start_ext[C] = N
    end_ext = np.empty(C + 1, dtype=np.int64)
    for c in range(C):
        end_ext[c] = col_start[c] + widths[c]
    end_ext[C] = 0
    hg = np.empty((R, N))
    pre = np.empty((R, N + 1))
    suf = np.empty((R, N + 1))
    top = np.empty(R)
    roof = np.empty(R, dtype=np.int64)
    rest = np.empty(R)
    outside = np.empty(R)
    seen = np.zeros(C, dtype=np.bool_)
    scans = 0
    for _ in range(max_swaps):
        scans += 1
        for r in range(R):
            best_j = 0
            pre[r, 0] = 0.0
            for j in range(N):
                hg[r, j] = _at(h_ext, grid[r, j])
                pre[r, j + 1] = max(pre[r, j], hg[r, j]) if j > 0 else hg[r, j]
                if hg[r, j] > hg[r, best_j]:
                    best_j = j
            suf[r, N] = 0.0
            for j in range(N - 1, -1, -1):
                suf[r, j] = max(suf[r, j + 1], hg[r, j]) if j < N - 1 else hg[r, j]
            top[r] = hg[r, best_j]
            roof[r] = grid[r, best_j]
        for r in range(R):
            g = roof[r]
            rest[r] = max(pre[r, _at(col_start, g)], suf[r, _at(col_start, g) + _at(widths, g)])
        eps = 1e-9 * _pairwise_sum(top, 0, R)
        gap = np.empty(R)
        for r in range(R):
            gap[r] = rest[r] - top[r]
        found = False
        tp = tg = ts = te = tq = ts2 = 0
        for p in _argsort_stable(gap):  # tallest roof over the rest first
            if top[p] - rest[p] <= eps:
                break
            g = roof[p]
            w, s = widths[g], col_start[g]
            e = s + w
            for q in range(R):
                outside[q] = max(pre[q, s], suf[q, e])
            # (a) the same ranks of round q, when q's columns there stay inside [s, e)
            best_gain, best_q, best_s = -np.inf, -1, s
            for q in range(R):
                gain = -np.inf
                if q != p:
                    inside = True
                    hb = 0.0
                    for j in range(s, e):
                        cell = grid[q, j]
                        if not (_at(start_ext, cell) >= s and _at(end_ext, cell) <= e):
                            inside = False
                            break
                        hb = max(hb, _at(h_ext, cell)) if j > s else _at(h_ext, cell)
                    if inside:
                        gain = top[p] + top[q] - max(rest[p], hb) - max(outside[q], heights[g])
                if best_q < 0 or gain > best_gain:
                    best_gain, best_q = gain, q
            # (b) w single-rank or idle ranks of round q anywhere (aligned under pow2)
            if w > 1:
                bgain, bq, bs = -np.inf, -1, 0
                for q in range(R):
                    if q == p:
                        continue
                    run = 0  # single-rank or idle ranks ending at j
                    for j in range(N):
                        run = run + 1 if _at(w_ext, grid[q, j]) == 1 else 0
                        s2 = j - w + 1
                        if run < w or (pow2 and s2 % w != 0):
                            continue
                        wmax = hg[q, s2]
                        for o in range(s2 + 1, j + 1):
                            wmax = max(wmax, hg[q, o])
                        out_q = max(pre[q, s2], suf[q, s2 + w])
                        gain = top[p] + top[q] - max(rest[p], wmax) - max(out_q, heights[g])
                        if bq < 0 or gain > bgain or (gain == bgain and (q, s2) < (bq, bs)):
                            bgain, bq, bs = gain, q, s2
                if bq >= 0 and bgain > best_gain:
                    best_gain, best_q, best_s = bgain, bq, bs
            if best_gain > eps:
                found = True
                tp, tg, ts, te, tq, ts2 = p, g, s, e, best_q, best_s
                break
        if not found:
            break
        w = te - ts
        a = grid[tp, ts:te].copy()  # G (one column)
        b = grid[tq, ts2 : ts2 + w].copy()  # columns of q that trade places with G
        grid[tp, ts:te] = b
        grid[tq, ts2 : ts2 + w] = a
        col_round[tg], col_start[tg] = tq, ts2
        for c in b:  # every column once (a wide one covers several ranks)
            if c >= 0 and not seen[c]:
                seen[c] = True
                col_round[c] = tp
                col_start[c] += ts - ts2
        for c in b:
            if c >= 0:
                seen[c] = False
        for c in b:  # the moved columns' ranks, as the next scans see them
            if c >= 0:
                start_ext[c], end_ext[c] = col_start[c], col_start[c] + widths[c]
        start_ext[tg], end_ext[tg] = col_start[tg], col_start[tg] + widths[tg]
    return scans


# ---------------------------------------------------------------------------------- whole-batch figures


@_kernel
def sample_costs(p, lengths, k, out_cost, out_tokens):
    """`CostModel.sample_cost` and `cost.max_rank_tokens` of every sample on ``k[i]`` ranks, into
    ``out_cost`` and ``out_tokens``."""
    for i in range(lengths.size):
        out_cost[i] = _sample_cost(p, lengths[i], k[i])
        out_tokens[i] = _tokens(lengths[i], k[i])


@_kernel
def rank_tokens(lengths, k):
    """`cost.max_rank_tokens` of every sample on ``k[i]`` ranks."""
    out = np.empty(lengths.size, dtype=np.int64)
    for i in range(lengths.size):
        out[i] = _tokens(lengths[i], k[i])
    return out


@_kernel
def column_heights(p, lengths, col_of, width):
    """`Problem.heights`: every column's exact per-rank time from its samples' sums (accumulated in
    sample order, as ``np.bincount``), 0 for an empty column; samples with column -1 are left out."""
    C = width.size
    sums = np.zeros((C, 3))
    count = np.zeros(C, dtype=np.int64)
    for i in range(lengths.size):
        c = col_of[i]
        if c < 0:
            continue
        lp = _padded(lengths[i], width[c])
        sums[c, 0] += p[_A] * lp + lp * lp
        sums[c, 1] += lp
        sums[c, 2] += lp * lp
        count[c] += 1
    out = np.zeros(C)
    for c in range(C):
        if count[c] > 0:
            out[c] = _group_cost(p, sums[c, 0], sums[c, 1], sums[c, 2], width[c])
    return out


@_kernel
def column_tokens(lengths, col_of, width):
    """`Problem.tokens`: every column's busiest-rank tokens (samples with column -1 left out)."""
    out = np.zeros(width.size, dtype=np.int64)
    for i in range(lengths.size):
        c = col_of[i]
        if c >= 0:
            out[c] += _tokens(lengths[i], width[c])
    return out


@_kernel
def _group_max(out, idx, vals):
    """``np.maximum.at(out, idx, vals)`` (no NaN among the values)."""
    for i in range(idx.size):
        if vals[i] > out[idx[i]]:
            out[idx[i]] = vals[i]


def max_at(out: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> None:
    """``np.maximum.at(out, idx, vals)`` for a float64 ``out`` (in place) -- numpy's unbuffered ``at``
    takes ~1 us per element; the maximum does not depend on the order."""
    assert out.dtype == np.float64 and out.flags.c_contiguous and out.flags.writeable
    _group_max(out, int_array(idx), np.array(vals, dtype=np.float64))


# ---------------------------------------------------------------------------------- start-up


def warm_up() -> None:
    """Call every kernel once on a tiny input, so numba loads its machine code from the on-disk cache
    (or compiles it, cold) now and not inside the first plan: called when the ``hdp`` policy is
    imported, so a rank pays it once at start and ``stats.planner_ms`` is the plan's own time.  The
    argument types are those of the planner's calls (one compiled version each)."""
    i64 = lambda *x: np.array(x, dtype=np.int64)  # noqa: E731
    f8 = lambda *x: np.array(x, dtype=np.float64)  # noqa: E731
    p = f8(1.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    polish_search(i64(100, 200), i64(1, 1), i64(1, 2), p, 2, 4096, 1, i64(0, 0), i64(0), i64(1), 1, 0, 10_000, 32,
                  1_500, 4, 1, 8, 32, 8, 1e-4, 16_384)
    fill_gaps(i64(1), f8(1.0, 2.0), i64(1, 2), f8(5.0), f8(10.0), i64(0), i64(0, 1), f8(1.0, 2.0))
    fill_wide_gaps(p, 4096, i64(100), i64(2), f8(0.0), f8(0.0), f8(0.0), f8(0.0), f8(1e9), i64(-1), f8(np.nan))
    lpt_waves(i64(0, 1), f8(2.0, 1.0), i64(1, 1), f8(0.0, 0.0), i64(0, 0), 4096, i64(-1, -1), False)
    balance(f8(3.0, 2.0, 1.0, 1.0), i64(1, 1, 1, 1), 4096, f8(0.0), i64(-1, -1, -1, -1))
    karmarkar_karp(f8(3.0, 2.0, 1.0), 2)
    shelf_layout(i64(2, 1), 4, 2)
    best_sizes(p, 4, i64(100), i64(1), i64(1, 2), 1.0, i64(0), f8(0.0))
    swap_rounds(i64(0, 1), i64(0, 0), i64(1, 1), f8(1.0, 2.0), 2, False, 1)
    sample_costs(p, i64(100), i64(1), f8(0.0), i64(0))
    rank_tokens(i64(100), i64(2))
    column_heights(p, i64(100), i64(0), i64(1))
    column_tokens(i64(100), i64(0), i64(1))
    _group_max(f8(0.0), i64(0), f8(1.0))
