"""The `hdp` policy: sequence-length-aware hybrid data/context parallel packing.

A plan is built from *columns*: a column is a group of k ranks (k = 1 is a plain data-parallel
rank) running a packed bin of samples for one round; its height is the per-rank time of the bin.
The construction, for a choice of group size per sample and a number of rounds R:

1. **Group sizes.**  Every sample needs at least k_min ranks (zigzag-exact ``ceil(L/B)``).  Three
   variants are tried: every sample at k_min; samples taller than what the other ranks of a round
   reach widened (`_grow_sizes`: the k minimising extra rank-time plus the idle time a too-tall
   group causes); and all samples on one common size (uniform plans, the static-CP family — so
   hdp is never worse than static CP under the same cost model).
2. **Bins per size.**  The R*N rank slots are shared among the sizes in proportion to their
   rank-time (at least what their tokens need under the budget B); the samples of each size are
   balanced over that size's bins — Karmarkar–Karp (largest differencing) when bins hold few
   samples, otherwise slot-sized slices of the tallest samples matched to the least-loaded bins
   and longest-processing-time for the last ones (`_lpt`, in numpy waves); when a tight token
   budget leaves a sample without room, every sample goes by LPT to the least-loaded bin with room.
3. **Rounds.**  Columns are laid out tallest first: each round takes the tallest remaining column
   and every further column that still fits its free ranks (shelf packing; for single-rank columns
   this minimises the sum of round maxima).  Wider columns sit left, so power-of-two blocks stay
   aligned with ``group_shape=pow2``.
4. **Levelling.**  Single-rank samples are re-spread so each round's single-rank columns reach
   that round's roof (`_rebalance_singles`); the last round's samples move into gaps under other
   rounds' maxima, into single-rank columns (`_fill_gaps`) or, split over the group, into
   multi-rank groups (`_fill_wide_gaps`); a partly filled last round is spread over its free ranks
   (`_spread_last_round`); a round's roof column trades places with another round's work when the
   sum of the two maxima drops (`_swap_rounds`).

Every candidate (variant x R from the token minimum upwards, stopping when T stops improving) is
scored by ``sum_r max column height + rounds * beta`` and the best kept; on batches up to 4,096
samples the rounds idling most are then planned again on their own (`_replan_rounds`), and a
round's tallest group merges with a partner into one wider group on the same ranks while that
lowers the round's maximum (`_merge_groups`; only the last round above 4,096 samples).

5. **Search** (batches up to ``config.search_max_samples``).  When some sample is far taller than
   a balanced round, further starting points put the tallest samples together in a first round
   (`tall_round`: widened to the height where the idle time of the round's other ranks and the
   extra ring overhead balance, the other ranks filled with the next longest samples), the rest
   planned as above or spread (`_spread`: multi-rank samples over every round, so no round holds
   only short multi-rank groups).  Every starting point gets a short local search (`polish`:
   samples move or trade places off each round's roof), the best two a longer one, and the best
   plan wins.

The cost model, not the group shape, decides: CP3/CP5/CP6 groups appear whenever they are
cheaper.  All steps are deterministic (ties broken by index).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from hdp.packing.config import GroupShape, PlannerConfig
from hdp.packing.cost import max_rank_tokens, min_group_size, padded_length
from hdp.packing.policies.common import Assignment, allowed_sizes, left_starts, pow2_ceil
from hdp.packing.simulate import min_rounds
from hdp.packing.policies.kk import karmarkar_karp, lpt_place
from hdp.packing.policies.polish import polish
from hdp.packing.policies.tall_round import needs_tall_round, tall_round

__all__ = ["assign"]

_log = logging.getLogger(__name__)

_KK_MAX_WORK = 2_000_000  # Karmarkar-Karp (O(n * m)) only while n * m stays small enough to be fast
_KK_MAX_ITEMS = 2048
_GAP_FILL_MAX_WORK = 20_000_000  # samples x columns searched when filling gaps
_POLISH_STEPS = 2  # local search (`polish`): at most this many steps per sample
_MAX_EXTRA_ROUNDS_LARGE = 0  # batches above 4,096 samples: one round count per variant


class _Infeasible(Exception):
    """The candidate cannot hold the batch under the token budget."""


def _size_classes(k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct group sizes, class of every sample): ``np.unique(k, return_inverse=True)``
    in O(n + max k) without a sort."""
    present = np.bincount(k) > 0
    sizes = np.flatnonzero(present)
    return sizes, (np.cumsum(present) - 1)[k]


def _grow_sizes(
    lengths: np.ndarray, k: np.ndarray, height: np.ndarray, reach: float,
    config: PlannerConfig, sizes: np.ndarray,
) -> None:
    """In place: widen the groups of samples taller than ``reach``, the height other ranks reach.

    A sample of height h(k) on k ranks in a round whose other N - k ranks only reach ``reach``
    idles them for about (N - k) * (h(k) - reach); a wider group costs k * h(k) - k0 * h(k0) extra
    rank-time (CP overhead).  Each tall sample takes the allowed k minimising the sum.
    """
    cost, N = config.cost, config.num_ranks
    tall = np.flatnonzero(height > reach * (1 + 1e-9))
    if tall.size == 0:
        return
    cand = _candidate_sizes(sizes, int(k[tall].max()))
    # past twice the size at which perfect scaling would reach ``reach``, more ranks only add overhead
    cand = cand[cand <= max(2, 2 * int(np.ceil((k[tall] * height[tall]).max() / max(reach, 1e-300))) + 2)]
    cand = cand[None, :]  # [1, K]
    h = cost.sample_cost(lengths[tall][:, None], cand)  # [S, K]
    score = cand * h + (N - cand) * np.maximum(0.0, h - reach)
    score = np.where(cand >= k[tall][:, None], score, np.inf)  # only sizes >= the current one
    j = np.argmin(score, axis=1)
    k[tall], height[tall] = cand[0, j], h[np.arange(tall.size), j]


def _candidate_sizes(sizes: np.ndarray, k_max: int) -> np.ndarray:
    """Group sizes worth widening to: every allowed size up to 32, then about 10% apart, up to
    8x the widest current group (wider groups only add ring overhead)."""
    sizes = sizes[sizes <= max(32, 8 * k_max)]
    small, large = sizes[sizes <= 32], sizes[sizes > 32]
    if large.size:
        keep = np.unique(np.searchsorted(large, np.geomspace(large[0], large[-1], 48)))
        large = large[np.minimum(keep, large.size - 1)]
    return np.unique(np.concatenate([small, large]))


def _partition(
    height: np.ndarray, tokens: np.ndarray, m: int, budget: int, offset: np.ndarray | None = None,
    exact: bool = False,
) -> np.ndarray:
    """Balance items (height, tokens) over m bins of token capacity ``budget``; bin of each item.

    Balances heights (`_balance`); when that leaves an item without token room -- a budget
    filled to the last percent -- every item goes by longest-processing-time to the least-loaded
    bin with room (`_lpt`; one by one once bins fill up when ``exact``), which fills tighter than
    the sliced balance (static CP's packer reaches such fills too).  Raises _Infeasible when
    neither fits.
    """
    try:
        return _balance(height, tokens, m, budget, offset)
    except _Infeasible:
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
    """`_lpt` one item at a time (`kk.lpt_place`); raises _Infeasible when an item fits no bin."""
    if not lpt_place(items, height, tokens, load, used, budget, out):
        raise _Infeasible


def _balance(
    height: np.ndarray, tokens: np.ndarray, m: int, budget: int, offset: np.ndarray | None = None
) -> np.ndarray:
    """Balance items by ``height`` over m bins of token capacity ``budget``; bin of each item.

    Karmarkar–Karp when the instance is small; otherwise slices of m items, tallest first, go to
    the bins sorted by load (largest to least loaded), and the last m..2m items plus those that
    overflowed a bin are placed tallest first on the least-loaded bin with room (`_lpt`).
    ``offset`` [m] starts the bins at unequal loads (a bin with offset -x has x more room).
    Raises _Infeasible when an item finds no room.
    """
    n = height.size
    out = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return out
    if m < 1:
        raise _Infeasible  # items but no bin
    if m >= n and offset is None:
        out[np.lexsort((np.arange(n), -height))] = np.arange(n)
        return out
    if offset is None and n <= _KK_MAX_ITEMS and n * m <= _KK_MAX_WORK:
        bins = karmarkar_karp(height, m)
        if np.bincount(bins, weights=tokens, minlength=m).max() <= budget:
            return bins
    order = np.lexsort((np.arange(n), -height))
    load = np.zeros(m) if offset is None else np.asarray(offset, dtype=np.float64).copy()
    used = np.zeros(m, dtype=np.int64)
    deferred: list[np.ndarray] = []
    pos = 0
    while n - pos >= 2 * m:  # the last m..2m items go one by one (exact LPT) for the fine levelling
        chunk = order[pos : pos + m]  # [m] tallest remaining items
        pos += chunk.size
        target = np.argsort(load, kind="stable")[: chunk.size]  # least-loaded bins first
        fits = used[target] + tokens[chunk] <= budget
        ok_i, ok_b = chunk[fits], target[fits]
        load[ok_b] += height[ok_i]
        used[ok_b] += tokens[ok_i]
        out[ok_i] = ok_b
        if not fits.all():
            deferred.append(chunk[~fits])
    rest = np.concatenate(deferred + [order[pos:]])
    if rest.size:
        rest = rest[np.lexsort((rest, -height[rest]))]  # tallest first (longest first within a size)
        _lpt(rest, height, tokens, load, used, budget, out)
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
    one-by-one LPT.  Raises _Infeasible when an item fits no bin.
    """
    m = load.size
    pos = 0
    while pos < items.size:
        it = items[pos : pos + m]  # [b] next items, tallest first
        elig = np.flatnonzero(used + int(tokens[it].max()) <= budget)  # bins any of them fits
        if exact and elig.size < m:
            _lpt_exact(items[pos:], height, tokens, load, used, budget, out)
            return
        if elig.size == 0:  # one item alone: the least-loaded bin with room
            i = int(it[0])
            room = np.flatnonzero(used + tokens[i] <= budget)
            if room.size == 0:
                raise _Infeasible
            it, bins = it[:1], room[np.lexsort((room, load[room]))[:1]]
        else:
            bins = elig[np.lexsort((elig, load[elig]))[: it.size]]  # least-loaded first
            it = it[: bins.size]
            low = load[bins]
            raised = np.minimum.accumulate(low + height[it])  # lowest bin the wave raised so far
            late = np.flatnonzero(low[1:] >= raised[:-1])
            if late.size:
                it, bins = it[: late[0] + 1], bins[: late[0] + 1]
        load[bins] += height[it]
        used[bins] += tokens[it]
        out[it] = bins
        pos += it.size


def _layout(widths: np.ndarray, heights: np.ndarray, num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Shelf layout of columns into rounds of ``num_ranks`` ranks; (round, first rank) of each.

    Each round takes the tallest remaining column, then every column in height order that still
    fits its free ranks.  Single-rank columns are taken in vectorised runs; wider columns (few)
    one by one.  Within a round wider columns go left (aligned power-of-two blocks stay aligned).
    """
    n = widths.size
    rnd = np.zeros(n, dtype=np.int64)
    start = np.zeros(n, dtype=np.int64)
    ones = np.flatnonzero(widths == 1)
    ones = ones[np.lexsort((ones, -heights[ones]))]  # [n1] tallest first
    wide = np.flatnonzero(widths > 1)
    wide = list(wide[np.lexsort((wide, -heights[wide]))])
    p = 0  # next single-rank column
    r = 0
    neg_ones_h = -heights[ones]  # ascending, for searchsorted
    while p < ones.size or wide:
        free = num_ranks
        members: list[int] = []
        runs: list[tuple[int, int]] = []
        skipped: list[int] = []
        wi = 0
        while free > 0 and (p < ones.size or wi < len(wide)):
            w_next = wide[wi] if wi < len(wide) else None
            if w_next is not None and (p >= ones.size or heights[w_next] >= heights[ones[p]]):
                if widths[w_next] <= free:
                    members.append(w_next)
                    free -= int(widths[w_next])
                else:
                    skipped.append(w_next)
                wi += 1
                continue
            # single-rank columns taller than the next wide one, as many as fit
            stop = ones.size
            if w_next is not None:
                stop = int(np.searchsorted(neg_ones_h, -heights[w_next], side="left"))
            take = max(1, min(free, stop - p))
            runs.append((p, p + take))
            p += take
            free -= take
        skipped.extend(wide[wi:])
        wide = skipped
        pos = 0
        if members:
            mem = np.asarray(members, dtype=np.int64)
            mem = mem[np.lexsort((mem, -widths[mem]))]  # wider groups left
            rnd[mem] = r
            start[mem] = np.cumsum(widths[mem]) - widths[mem]
            pos = int(widths[mem].sum())
        for a, b in runs:
            idx = ones[a:b]
            rnd[idx] = r
            start[idx] = pos + np.arange(b - a)
            pos += b - a
        r += 1
    return rnd, start


def _build(
    lengths: np.ndarray, k: np.ndarray, height: np.ndarray, rounds: int, config: PlannerConfig,
    own_columns: bool, tokens: np.ndarray, exact: bool = False,
) -> tuple[Assignment, float]:
    """Columns for ``rounds`` rounds of N ranks given each sample's group size, height and
    tokens per rank (``exact``: exact LPT where a size's token budget is tight, `_partition`)."""
    N, B = config.num_ranks, config.max_tokens_per_rank
    work = k * height
    sizes, cls = _size_classes(k)
    slots = rounds * N
    # bins per size: enough for the tokens, otherwise in proportion to rank-time
    need = np.maximum(1, -(-np.bincount(cls, weights=tokens).astype(np.int64) // B))  # [C]
    share = np.bincount(cls, weights=work, minlength=sizes.size) / max(float(work.sum()), 1e-300)
    bins = np.maximum(need, np.floor(share * slots / sizes).astype(np.int64))
    count = np.bincount(cls, minlength=sizes.size)
    if own_columns:  # every multi-rank sample its own group (mixed sizes: few, tall samples)
        bins = np.where(sizes > 1, count, bins)
    bins = np.minimum(bins, count)
    if sizes[0] == 1:  # single-rank bins take every slot the wider sizes leave
        bins[0] = max(need[0], min(count[0], slots - int((bins[1:] * sizes[1:]).sum())))
    while int((bins * sizes).sum()) > slots:  # over budget: take bins from the most generous size
        spare = np.flatnonzero(bins > need)
        if spare.size == 0:
            raise _Infeasible
        c = spare[np.argmax((bins[spare] - need[spare]) * sizes[spare])]
        bins[c] -= 1
    col_width, col_height = [], []
    col_of = np.zeros(lengths.size, dtype=np.int64)
    base = 0
    for c in range(sizes.size):
        members = np.flatnonzero(cls == c)
        b = _partition(height[members], tokens[members], int(bins[c]), B, exact=exact)
        col_of[members] = base + b
        col_height.append(np.bincount(b, weights=height[members], minlength=int(bins[c])))
        col_width.append(np.full(int(bins[c]), sizes[c], dtype=np.int64))
        base += int(bins[c])
    widths = np.concatenate(col_width)
    heights = np.concatenate(col_height)
    used = heights > 0
    heights = _group_heights(lengths, col_of, widths, config)  # exact per-rank cost of each column
    remap = np.cumsum(used) - 1  # drop empty bins
    widths, heights = widths[used], heights[used]
    col_of = remap[col_of]
    col_round, col_start = _layout(widths, heights, N)
    if lengths.size <= 32768:  # cluster-scale batches: the balanced bins stand (time budget)
        col_of = _rebalance_singles(col_of, col_round, widths, heights, height, tokens, k, B)
    col_of = _fill_gaps(col_of, col_round, widths, heights, height, tokens, k, B)
    if lengths.size <= 4096:  # a Python loop over the last round's samples
        col_of, k = _fill_wide_gaps(lengths, col_of, col_round, widths, heights, k, config)
    col_of, col_round, col_start, widths, heights = _spread_last_round(
        col_of, col_round, col_start, widths, heights, height, tokens, k, N, B
    )
    used = np.bincount(col_of, minlength=widths.size) > 0
    col_round, col_start = _swap_rounds(
        col_round, col_start, widths, np.where(used, heights, -1.0), N,
        config.group_shape is GroupShape.POW2,
    )
    rounds_used = np.unique(col_round[used])
    renum = np.zeros(int(col_round.max(initial=0)) + 1, dtype=np.int64)
    renum[rounds_used] = np.arange(rounds_used.size)
    col_round = renum[col_round]
    heights = np.where(used, heights, 0.0)
    round_max = np.zeros(rounds_used.size)
    np.maximum.at(round_max, col_round[used], heights[used])
    step = float(round_max.sum()) + rounds_used.size * config.cost.round_cost
    a = Assignment(round_of=col_round[col_of], group_start=col_start[col_of], group_size=k)
    return a, step


def _window_max(hg: np.ndarray, w: int) -> np.ndarray:
    """[R, N - w + 1]: max of every window of w consecutive ranks of each row (log-doubling)."""
    out, span = hg, 1
    while 2 * span <= w:
        out = np.maximum(out[:, :-span], out[:, span:])
        span *= 2
    if span < w:  # two overlapping windows of ``span`` cover w
        out = np.maximum(out[:, : hg.shape[1] - w + 1], out[:, w - span :])
    return out[:, : hg.shape[1] - w + 1]


def _swap_rounds(
    col_round: np.ndarray, col_start: np.ndarray, widths: np.ndarray, heights: np.ndarray,
    num_ranks: int, pow2: bool, max_swaps: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Lower round maxima by trading a round's roof column with work of another round.

    A round p's height is its tallest column G (ranks [s, e), width w).  Two trades are tried
    against every other round q: (a) q's work on the same ranks [s, e) when q's columns there lie
    inside [s, e); (b) any w consecutive single-rank (or idle) ranks of q -- G moves there (an
    aligned block under ``pow2``) and those single-rank columns move to [s, e) of round p.  The
    trade lowering max(p) + max(q) most is applied; rounds are visited by how far their roof
    stands above the rest, and the first round with a gain is taken.  Up to ``max_swaps``
    (default 4R + 32) trades.  ``heights`` < 0 marks unused columns.  Returns (round, start) of
    every column.
    """
    live = np.flatnonzero(heights >= 0)
    col_round, col_start = col_round.copy(), col_start.copy()
    if live.size == 0:
        return col_round, col_start
    n_rounds = int(col_round[live].max()) + 1
    if n_rounds < 2:
        return col_round, col_start
    grid = np.full((n_rounds, num_ranks), -1, dtype=np.int64)  # [R, N] column on each rank
    span = np.repeat(live, widths[live])  # [sum w] column of every covered rank
    offs = np.arange(span.size) - np.repeat(np.cumsum(widths[live]) - widths[live], widths[live])
    grid[col_round[span], col_start[span] + offs] = span
    h_ext = np.append(np.maximum(heights, 0.0), 0.0)  # index -1 -> idle, height 0
    w_ext = np.append(widths, 1)  # idle ranks trade like single-rank columns
    zeros = np.zeros((n_rounds, 1))
    for _ in range(max_swaps if max_swaps is not None else 4 * n_rounds + 32):
        hg = h_ext[grid]  # [R, N]
        pre = np.concatenate([zeros, np.maximum.accumulate(hg, axis=1)], axis=1)  # [R, N+1]
        suf = np.concatenate([np.maximum.accumulate(hg[:, ::-1], axis=1)[:, ::-1], zeros], axis=1)
        top = hg.max(axis=1)  # [R]
        roof = grid[np.arange(n_rounds), np.argmax(hg, axis=1)]  # [R] roof column of each round
        rest = np.maximum(pre[np.arange(n_rounds), col_start[roof]], suf[np.arange(n_rounds), col_start[roof] + widths[roof]])
        eps = 1e-9 * float(top.sum())
        trade = None
        for p in np.argsort(rest - top, kind="stable").tolist():  # tallest roof over the rest first
            if top[p] - rest[p] <= eps:
                break
            g = int(roof[p])
            w, s = int(widths[g]), int(col_start[g])
            e = s + w
            outside = np.maximum(pre[:, s], suf[:, e])  # [R]
            # (a) the same ranks of round q, when q's columns there stay inside [s, e)
            block = grid[:, s:e]  # [R, w]
            inside = ((np.append(col_start, num_ranks)[block] >= s)
                      & (np.append(col_start + widths, 0)[block] <= e)).all(axis=1)
            inside[p] = False
            gain_a = np.where(
                inside,
                top[p] + top - np.maximum(rest[p], h_ext[block].max(axis=1))
                - np.maximum(outside, heights[g]),
                -np.inf,
            )
            best_q = int(np.argmax(gain_a))
            best = (float(gain_a[best_q]), best_q, s)
            # (b) w single-rank or idle ranks of round q anywhere (aligned under pow2)
            if w > 1:
                single = (w_ext[grid] == 1).astype(np.int64)  # [R, N]
                csum = np.concatenate([np.zeros((n_rounds, 1), np.int64), np.cumsum(single, axis=1)], axis=1)
                ok = (csum[:, w:] - csum[:, :-w]) == w  # [R, N-w+1] window of singles only
                if pow2:
                    ok[:, np.arange(ok.shape[1]) % w != 0] = False
                ok[p] = False
                if ok.any():
                    wmax = _window_max(hg, w)  # [R, N-w+1]
                    out_q = np.maximum(pre[:, : num_ranks - w + 1], suf[:, w:])
                    gain_b = np.where(
                        ok,
                        top[p] + top[:, None] - np.maximum(rest[p], wmax) - np.maximum(out_q, heights[g]),
                        -np.inf,
                    )
                    q, s2 = np.unravel_index(int(np.argmax(gain_b)), gain_b.shape)
                    if gain_b[q, s2] > best[0]:
                        best = (float(gain_b[q, s2]), int(q), int(s2))
            if best[0] > eps:
                trade = (p, g, s, e) + best[1:]
                break
        if trade is None:
            break
        p, g, s, e, q, s2 = trade
        a = grid[p, s:e].copy()  # G (one column)
        b = grid[q, s2 : s2 + (e - s)].copy()  # columns of q that trade places with G
        grid[p, s:e] = b
        grid[q, s2 : s2 + (e - s)] = a
        col_round[g], col_start[g] = q, s2
        bl = b[b >= 0]
        col_round[bl] = p
        col_start[bl] += s - s2  # same offsets inside the block
    return col_round, col_start


def _level(work: float, slots: np.ndarray, floor: np.ndarray) -> float:
    """The common level lambda with ``sum_r slots_r * max(lambda, floor_r) = work`` (bisection):
    rounds whose floor is below it rise to lambda, the others stay at their floor."""
    lo, hi = 0.0, work / max(1, int(slots.sum())) + float(floor.max(initial=0.0))
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if float((slots * np.maximum(mid, floor)).sum()) < work:
            lo = mid
        else:
            hi = mid
    return hi


def _spread(lengths: np.ndarray, k_min: np.ndarray, config: PlannerConfig, rounds: int) -> Assignment | None:
    """A plan of ``rounds`` rounds with the multi-rank samples spread over every round.

    Multi-rank samples (own groups of k_min ranks), tallest first, fill each round up to its share
    of their ranks, so samples of similar height share a round; single-rank samples then go
    tallest first to the single rank with the most room below its round's level (the taller of
    the round's multi-rank groups and the common level, `_level`), within B tokens.  Unlike the
    shelf layout of `_build` no round ends up holding only multi-rank groups of uneven height;
    the result is rough (its rounds are levelled by `polish`).  None when the budget does not
    hold the singles in these rounds.
    """
    N, B, cost = config.num_ranks, config.max_tokens_per_rank, config.cost
    h = cost.sample_cost(lengths, k_min)
    multi = np.flatnonzero(k_min > 1)
    multi = multi[np.lexsort((multi, -h[multi]))]
    cap = max(1, -(-int(k_min[multi].sum()) // rounds))
    round_of = np.zeros(lengths.size, dtype=np.int64)
    used: list[int] = [0]
    top: list[float] = [0.0]
    for i in multi.tolist():
        w = int(k_min[i])
        if used[-1] > 0 and (used[-1] + w > N or (used[-1] + w > cap and len(used) < rounds)):
            used.append(0)
            top.append(0.0)
        round_of[i] = len(used) - 1
        used[-1] += w
        top[-1] = max(top[-1], float(h[i]))
    n_rounds = max(rounds, len(used))
    used_a = np.zeros(n_rounds, dtype=np.int64)
    used_a[: len(used)] = used
    floor = np.zeros(n_rounds)
    floor[: len(top)] = top
    start = np.zeros(lengths.size, dtype=np.int64)
    start[multi] = left_starts(round_of[multi], k_min[multi])
    singles = np.flatnonzero(k_min == 1)
    if singles.size:
        slots = N - used_a  # [R] single ranks per round
        target = np.maximum(_level(float(h[singles].sum()), slots, floor), floor)
        slot_round = np.repeat(np.arange(n_rounds), slots)
        slot_rank = np.concatenate([used_a[r] + np.arange(slots[r]) for r in range(n_rounds)])
        try:
            b = _partition(h[singles], lengths[singles], slot_round.size, B, offset=-target[slot_round])
        except _Infeasible:
            return None
        round_of[singles], start[singles] = slot_round[b], slot_rank[b]
    return Assignment(round_of=round_of, group_start=start, group_size=k_min.copy())


def _rebalance_singles(
    col_of: np.ndarray, col_round: np.ndarray, widths: np.ndarray, heights: np.ndarray,
    height: np.ndarray, tokens: np.ndarray, k: np.ndarray, budget: int,
) -> np.ndarray:
    """Re-spread single-rank samples so each round's single-rank columns reach that round's roof.

    Balanced bins give every single-rank column the same height, but a round holding a tall
    multi-rank group idles its other ranks below the group.  With M_r the tallest multi-rank column
    of round r, the level lambda solving sum_r s_r * max(lambda, M_r) = single-rank work (s_r the
    round's single-rank columns) gives each column the target max(lambda, M_r); samples are placed
    tallest first on the column with the most room below its target (and token room).  Kept only
    when the sum of round maxima drops.  ``heights`` is updated in place; returns the columns.
    """
    singles = np.flatnonzero(k == 1)
    ones = np.flatnonzero(widths == 1)
    if singles.size == 0 or ones.size == 0:
        return col_of
    n_rounds = int(col_round.max()) + 1
    multi_max = np.zeros(n_rounds)
    wide = widths > 1
    np.maximum.at(multi_max, col_round[wide], heights[wide])
    if not np.any(multi_max > 0):
        return col_of  # no tall groups: the balanced bins are already level
    s_r = np.bincount(col_round[ones], minlength=n_rounds)
    level = _level(float(height[singles].sum()), s_r, multi_max)
    target = np.maximum(level, multi_max)[col_round[ones]]  # [c]
    try:  # least loaded with an offset of -target = most room below the target
        new_col = _partition(height[singles], tokens[singles], ones.size, budget, offset=-target)
    except _Infeasible:
        return col_of  # the budget does not allow this spread: keep the balanced bins
    load = np.bincount(new_col, weights=height[singles], minlength=ones.size)
    old_max = np.zeros(n_rounds)
    np.maximum.at(old_max, col_round, heights)
    new_heights = heights.copy()
    new_heights[ones] = load
    new_max = np.zeros(n_rounds)
    np.maximum.at(new_max, col_round, new_heights)
    if new_max.sum() >= old_max.sum():
        return col_of
    heights[:] = new_heights
    col_of = col_of.copy()
    col_of[singles] = ones[new_col]
    return col_of


def _spread_last_round(
    col_of: np.ndarray, col_round: np.ndarray, col_start: np.ndarray, widths: np.ndarray,
    heights: np.ndarray, height: np.ndarray, tokens: np.ndarray, k: np.ndarray,
    num_ranks: int, budget: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Re-balance the single-rank samples of a partly filled last round over all its free ranks.

    Balanced bins make equal-height columns; when the layout leaves the last round only partly
    filled, its height is that of a full column while other ranks idle.  The round's multi-rank
    groups stay where they are; its single-rank samples are spread over every rank no group
    covers.  Kept only when the round's maximum drops.
    """
    last = int(col_round.max(initial=0))
    in_last = np.flatnonzero((col_round[col_of] == last) & (k == 1))
    if in_last.size == 0:
        return col_of, col_round, col_start, widths, heights
    last_cols = np.flatnonzero(col_round == last)
    wide = last_cols[widths[last_cols] > 1]
    covered = np.zeros(num_ranks, dtype=bool)
    for c in wide.tolist():
        covered[col_start[c] : col_start[c] + widths[c]] = True
    free = np.flatnonzero(~covered)  # [F] ranks the round's groups leave
    cols = np.unique(col_of[in_last])
    if free.size <= cols.size:
        return col_of, col_round, col_start, widths, heights
    try:
        b = _partition(height[in_last], tokens[in_last], free.size, budget)
    except _Infeasible:
        return col_of, col_round, col_start, widths, heights
    new_h = np.bincount(b, weights=height[in_last], minlength=free.size)
    roof = float(heights[wide].max()) if wide.size else 0.0
    if max(roof, float(new_h.max())) >= float(heights[last_cols].max()):
        return col_of, col_round, col_start, widths, heights
    base = widths.size
    col_of = col_of.copy()
    col_of[in_last] = base + b
    heights = np.concatenate([np.where(np.isin(np.arange(base), cols), 0.0, heights), new_h])
    widths = np.concatenate([widths, np.ones(free.size, dtype=np.int64)])
    col_round = np.concatenate([col_round, np.full(free.size, last, dtype=np.int64)])
    col_start = np.concatenate([col_start, free])
    return col_of, col_round, col_start, widths, heights


def _fill_wide_gaps(
    lengths: np.ndarray, col_of: np.ndarray, col_round: np.ndarray, widths: np.ndarray,
    heights: np.ndarray, k: np.ndarray, config: PlannerConfig,
) -> tuple[np.ndarray, np.ndarray]:
    """Move the last round's single-rank samples into multi-rank groups of earlier rounds.

    A group of w ranks can run more samples, each split over its w ranks: a sample joins when the
    group's exact cost with it (`CostModel.group_cost`) stays under its round's maximum and every
    rank of the group keeps within B tokens.  Tallest first, best fit (the group left with the
    least room).  The last round disappears when it empties.  ``heights`` is updated in place;
    returns the new column and group size of every sample.
    """
    last = int(col_round.max(initial=0))
    movers = np.flatnonzero((col_round[col_of] == last) & (k == 1))
    cand = np.flatnonzero((widths > 1) & (col_round != last))  # [c] groups that may take samples
    if last == 0 or movers.size == 0 or cand.size == 0:
        return col_of, k
    cost, B = config.cost, config.max_tokens_per_rank
    n_cols = widths.size
    padded = padded_length(lengths, k).astype(np.float64)
    sw = np.bincount(col_of, weights=cost.work(padded), minlength=n_cols)[cand]  # [c] group sums
    sl = np.bincount(col_of, weights=padded, minlength=n_cols)[cand]
    sq = np.bincount(col_of, weights=padded * padded, minlength=n_cols)[cand]
    tok = np.bincount(col_of, weights=max_rank_tokens(lengths, k), minlength=n_cols)[cand]
    round_max = np.zeros(last + 1)
    np.maximum.at(round_max, col_round, heights)
    roof = round_max[col_round[cand]]  # [c]
    w = widths[cand]
    col_of, k = col_of.copy(), k.copy()
    for i in movers[np.lexsort((movers, -lengths[movers]))].tolist():
        lp = padded_length(np.full(w.size, lengths[i]), w).astype(np.float64)  # [c]
        new_h = cost.group_cost(sw + cost.work(lp), sl + lp, sq + lp * lp, w)
        ok = np.flatnonzero((new_h <= roof) & (tok + max_rank_tokens(np.full(w.size, lengths[i]), w) <= B))
        if ok.size == 0:
            continue
        j = ok[np.argmin(roof[ok] - new_h[ok])]  # best fit
        heights[col_of[i]] -= cost.work(float(lengths[i]))  # a single-rank column: its work
        c = cand[j]
        col_of[i], k[i] = c, w[j]
        sw[j] += cost.work(lp[j])
        sl[j] += lp[j]
        sq[j] += lp[j] * lp[j]
        tok[j] += max_rank_tokens(np.array([lengths[i]]), np.array([w[j]]))[0]
        heights[c] = new_h[j]
    return col_of, k


def _fill_gaps(
    col_of: np.ndarray, col_round: np.ndarray, widths: np.ndarray, heights: np.ndarray,
    height: np.ndarray, tokens: np.ndarray, k: np.ndarray, budget: int,
) -> np.ndarray:
    """Move the last round's single-rank samples into gaps below other rounds' maxima.

    The last round of a shelf layout is often partly filled.  Its samples, tallest first, move
    (best fit) into single-rank columns of earlier rounds whose height stays under their round's
    maximum and whose token room allows; the last round disappears when it empties.  ``heights``
    is updated in place; returns the new column of every sample.
    """
    last = int(col_round.max(initial=0))
    if last == 0:
        return col_of
    col_of = col_of.copy()
    movers = np.flatnonzero((col_round[col_of] == last) & (k == 1))
    if movers.size == 0:
        return col_of
    n_rounds = last + 1
    round_max = np.zeros(n_rounds)
    np.maximum.at(round_max, col_round, heights)
    col_tok = np.bincount(col_of, weights=tokens, minlength=widths.size)
    target = (widths == 1) & (col_round != last)  # [C] columns that may receive samples
    cand = np.flatnonzero(target)
    if movers.size * cand.size > _GAP_FILL_MAX_WORK:
        return col_of  # too large to search per sample; the layout stands as it is
    gap = round_max[col_round[cand]] - heights[cand]  # [c] room under each round's maximum
    room = budget - col_tok[cand]
    for i in movers[np.lexsort((movers, -height[movers]))].tolist():
        ok = np.flatnonzero((gap >= height[i]) & (room >= tokens[i]))
        if ok.size == 0:
            continue
        j = ok[np.argmin(gap[ok])]  # best fit: keep large gaps for large samples
        src = col_of[i]
        heights[src] -= height[i]
        col_of[i] = cand[j]
        heights[cand[j]] += height[i]
        gap[j] -= height[i]
        room[j] -= tokens[i]
    return col_of


def _group_heights(lengths: np.ndarray, group: np.ndarray, width: np.ndarray, config: PlannerConfig) -> np.ndarray:
    """[G] exact per-rank cost of every group: sample i is in group ``group[i]`` of ``width[g]``
    ranks (its samples share the ring steps, `CostModel.group_cost`)."""
    cost, n_g = config.cost, width.size
    padded = padded_length(lengths, width[group]).astype(np.float64)
    return cost.group_cost(
        np.bincount(group, weights=cost.work(padded), minlength=n_g),
        np.bincount(group, weights=padded, minlength=n_g),
        np.bincount(group, weights=padded * padded, minlength=n_g),
        width,
    )


def _round_heights(lengths: np.ndarray, a: Assignment, config: PlannerConfig) -> tuple[np.ndarray, np.ndarray]:
    """([R] height, [R] rank-time) of every round of an assignment, from exact group costs."""
    N = config.num_ranks
    gid, gi = np.unique(a.round_of * N + a.group_start, return_inverse=True)  # groups
    size = np.zeros(gid.size, dtype=np.int64)
    size[gi] = a.group_size
    h = _group_heights(lengths, gi, size, config)
    rnd = gid // N
    n_rounds = int(rnd.max()) + 1
    top = np.zeros(n_rounds)
    np.maximum.at(top, rnd, h)
    return top, np.bincount(rnd, weights=h * size, minlength=n_rounds)


def _merge_groups(
    lengths: np.ndarray, a: Assignment, config: PlannerConfig, last_only: bool = False
) -> Assignment:
    """Lower round maxima by merging a round's tallest group with its best partner.

    Two groups of w1 and w2 ranks in one round can run as one group of w1 + w2 ranks (their
    samples split over all of them): the merged height lies between the two (plus ring overhead),
    on the same ranks.  Per round, the tallest group merges with the partner giving the lowest
    merged height (equal widths under ``pow2``, so blocks stay aligned) while that lowers it and
    every rank keeps within B tokens; the round's merges are kept only when its maximum drops.
    Partners are ranked on unpadded sums (additive, so all at once), the chosen pair is checked
    exactly.  Groups are then laid out again, wider first.  Mostly for a last round of multi-rank
    groups of uneven heights, where no rank is free to widen them (``last_only``: that round only).
    """
    N, B, cost = config.num_ranks, config.max_tokens_per_rank, config.cost
    pow2 = config.group_shape is GroupShape.POW2
    round_of, start, size = a.round_of, a.group_start.copy(), a.group_size.copy()
    changed = False
    last = int(round_of.max())
    for r in range(last if last_only else 0, last + 1):
        sel = np.flatnonzero(round_of == r)  # [n_r] samples of the round
        lr = lengths[sel]
        gid, grp = np.unique(start[sel], return_inverse=True)  # groups of the round
        n_g = gid.size
        if n_g < 2:
            continue
        w = np.zeros(n_g, dtype=np.int64)
        w[grp] = size[sel]
        h = _group_heights(lr, grp, w, config)  # [G] exact heights
        top0 = float(h.max())
        if top0 * N - float((h * w).sum()) < 0.01 * top0 * N:
            continue  # the round idles under 1%: nothing worth merging
        lf = lr.astype(np.float64)
        u_sw = np.bincount(grp, weights=cost.work(lf), minlength=n_g)  # [G] unpadded sums
        u_sl = np.bincount(grp, weights=lf, minlength=n_g)
        u_sq = np.bincount(grp, weights=lf * lf, minlength=n_g)
        n_s = np.bincount(grp, minlength=n_g)
        members = [list(m) for m in np.split(np.argsort(grp, kind="stable"), np.cumsum(n_s)[:-1])]
        alive = np.ones(n_g, dtype=bool)
        h_cur = h.copy()
        bad: set[tuple[int, int]] = set()
        for _ in range(4 * n_g):
            t = int(np.argmax(np.where(alive, h_cur, -np.inf)))
            part = alive.copy()
            part[t] = False
            if pow2:
                part &= w == w[t]
            wn = w[t] + w  # [G] merged widths
            est = cost.group_cost(u_sw[t] + u_sw, u_sl[t] + u_sl, u_sq[t] + u_sq, wn)
            # tokens: ceil(L / w) + 2 bounds a sample's busiest-rank count (`max_rank_tokens`)
            tok_est = (u_sl[t] + u_sl) / wn + 2 * (n_s[t] + n_s)
            est = np.where(part & (tok_est <= B) & (est < h_cur[t]), est, np.inf)
            s_best, h_best = -1, h_cur[t]
            for s in np.argsort(est, kind="stable")[:4].tolist():  # check the best few exactly
                if not np.isfinite(est[s]) or (t, s) in bad:
                    continue
                idx = np.asarray(members[t] + members[s])
                wm = int(w[t] + w[s])
                lpm = padded_length(lr[idx], wm).astype(np.float64)
                hm = float(cost.group_cost(cost.work(lpm).sum(), lpm.sum(), (lpm * lpm).sum(), wm))
                if max_rank_tokens(lr[idx], wm).sum() <= B and hm < h_best * (1 - 1e-9):
                    s_best, h_best = s, hm
                    break
                bad.add((t, s))
            if s_best < 0:
                break
            members[t] += members[s_best]
            members[s_best] = []
            for arr in (u_sw, u_sl, u_sq, n_s):
                arr[t] += arr[s_best]
            w[t] += w[s_best]
            alive[s_best] = False
            h_cur[t], h_cur[s_best] = h_best, -np.inf
        if not alive.all() and float(h_cur[alive].max()) < top0 * (1 - 1e-9):
            keep = np.flatnonzero(alive)
            keep = keep[np.lexsort((keep, -w[keep]))]  # wider groups left
            first = np.zeros(n_g, dtype=np.int64)
            first[keep] = np.cumsum(w[keep]) - w[keep]
            owner = np.empty(sel.size, dtype=np.int64)
            for gi in keep.tolist():
                owner[members[gi]] = gi
            start[sel], size[sel] = first[owner], w[owner]
            changed = True
    return Assignment(round_of=round_of, group_start=start, group_size=size) if changed else a


def _replan_rounds(
    lengths: np.ndarray, a: Assignment, config: PlannerConfig, sizes: np.ndarray, tries: int = 3,
) -> Assignment:
    """Re-plan the rounds with the most idle rank-time on their own, as one-round problems.

    A round's samples are planned again for one round of N ranks, with every sample taller than
    the round's balanced level (its rank-time / N) widened as `_grow_sizes` chooses; kept when
    the round's height drops (the others do not change).  The rounds idling most are tried
    first, up to ``tries``.  Mostly it is the last round, whose shortest multi-rank groups the
    layout left next to too little work.
    """
    N = config.num_ranks
    top, busy = _round_heights(lengths, a, config)
    idle = top * N - busy
    round_of, start, size = a.round_of.copy(), a.group_start.copy(), a.group_size.copy()
    changed = False
    for r in np.argsort(-idle, kind="stable")[:tries].tolist():
        if idle[r] <= 0.02 * top[r] * N:
            break
        sel = np.flatnonzero(round_of == r)
        sub_len = lengths[sel]
        best_h, best_sub = float(top[r]), None
        k_top = int(size[sel].max())
        options: list[tuple[str, int]] = [("grow-all", 0), ("grow-multi", 0)]
        for u in sorted({int(sizes[np.searchsorted(sizes, v)]) for v in (k_top, pow2_ceil(k_top), 2 * k_top)
                         if v <= sizes[-1]}):
            options += [("uniform", u), ("multi-uniform", u)]
        for how, u in options:
            k = size[sel].copy()
            if how == "uniform":  # every sample of the round on u ranks, groups shared
                k[:] = u
            elif how == "multi-uniform":  # multi-rank samples on shared u-rank groups
                k[k > 1] = u
            h = config.cost.sample_cost(sub_len, k)
            if how.startswith("grow"):
                grow = np.arange(sel.size) if how == "grow-all" else np.flatnonzero(k > 1)
                kg, hg = k[grow], h[grow]
                _grow_sizes(sub_len[grow], kg, hg, float(busy[r]) / N, config, sizes)
                k[grow], h[grow] = kg, hg
            own = how.startswith("grow")
            try:
                sub, step = _build(sub_len, k, h, 1, config, own, max_rank_tokens(sub_len, k))
            except _Infeasible:
                continue
            if int(sub.round_of.max()) == 0 and step - config.cost.round_cost < best_h * (1 - 1e-9):
                best_h, best_sub = step - config.cost.round_cost, sub
        if best_sub is not None:
            start[sel], size[sel] = best_sub.group_start, best_sub.group_size
            changed = True
    return Assignment(round_of=round_of, group_start=start, group_size=size) if changed else a


def _variants(
    lengths: np.ndarray, k_min: np.ndarray, config: PlannerConfig, sizes: np.ndarray,
) -> list[tuple[str, Callable[[int], tuple[np.ndarray, np.ndarray]]]]:
    """(name, R -> (group size, height) of every sample) for each variant worth trying.

    ``grow-tau`` widens samples taller than tau(R) = rank-time / (N * R), the height a round of R
    reaches when perfectly balanced (``grow-1.25tau`` / ``grow-1.5tau``: taller than 1.25 / 1.5 tau,
    for rounds that a tight token budget keeps below tau); ``grow-single`` only those taller than
    max(tau(R), tallest single-rank sample); ``uniform-u`` puts every sample on u ranks.
    """
    cost, N = config.cost, config.num_ranks
    h0 = cost.sample_cost(lengths, k_min)
    single = h0[k_min == 1]
    h1max = float(single.max()) if single.size else 0.0
    total = float((k_min * h0).sum())

    def grown(reach_of: Callable[[float], float]) -> Callable[[int], tuple[np.ndarray, np.ndarray]]:
        memo: dict[int, tuple[np.ndarray, np.ndarray]] = {}

        def at(rounds: int) -> tuple[np.ndarray, np.ndarray]:
            if rounds not in memo:
                k, h = k_min.copy(), h0.copy()
                _grow_sizes(lengths, k, h, reach_of(total / (N * rounds)), config, sizes)
                memo[rounds] = (k, h)
            return memo[rounds]
        return at

    out: list[tuple[str, Callable[[int], tuple[np.ndarray, np.ndarray]]]] = [
        ("k_min", lambda rounds: (k_min, h0)),
        ("grow-single", grown(lambda tau: max(tau, h1max))),
        ("grow-tau", grown(lambda tau: tau)),
    ]
    if lengths.size <= 4096:  # looser reaches: worth their time on smaller batches
        out += [("grow-1.25tau", grown(lambda tau: 1.25 * tau)), ("grow-1.5tau", grown(lambda tau: 1.5 * tau))]
    need = int(k_min.max())
    for u in sizes[(sizes >= need) & (sizes <= 4 * need)]:
        u = int(u)
        if config.group_shape is GroupShape.ANY and u != need and u & (u - 1):
            continue  # uniform plans: the smallest fitting size and powers of two above it
        ku = np.full(lengths.size, u, dtype=np.int64)
        hu = cost.sample_cost(lengths, ku)
        out.append((f"uniform-{u}", lambda rounds, ku=ku, hu=hu: (ku, hu)))
    return out


def _floor(lengths: np.ndarray, k: np.ndarray, config: PlannerConfig) -> float:
    """A lower bound of the compute time of any plan with these group sizes (units).

    Every group of k > 1 ranks pays sum work(Lp)/k plus (k-1) un-hidable ring-step overheads per
    rank, and a size needs at least (its tokens per rank) / B groups; packing can share the rest.
    """
    cost, N, B = config.cost, config.num_ranks, config.max_tokens_per_rank
    padded = padded_length(lengths, k)
    rank_time = float(cost.work(padded).sum())
    sizes, cls = _size_classes(k)
    groups = -(-np.bincount(cls, weights=max_rank_tokens(lengths, k)).astype(np.int64) // B)
    rank_time += float((groups * sizes * (sizes - 1)).sum()) * cost.step_overhead
    return rank_time / N


def _sizes(lengths: np.ndarray, config: PlannerConfig) -> tuple[np.ndarray, np.ndarray]:
    """(fewest ranks of every sample, allowed group sizes); raises ValueError when a sample needs
    more than the largest power-of-two block under ``group_shape=pow2``."""
    N, B = config.num_ranks, config.max_tokens_per_rank
    pow2 = config.group_shape is GroupShape.POW2
    k_min = min_group_size(lengths, B, N, pow2=pow2)
    sizes = allowed_sizes(N, config.group_shape)
    if pow2:
        if int(k_min.max()) > int(sizes[-1]):
            i = int(np.argmax(k_min))
            raise ValueError(
                f"lengths[{i}]={int(lengths[i])} needs {int(k_min[i])} ranks, more than the largest "
                f"power-of-two block of the domain ({int(sizes[-1])} of {N} ranks); use "
                "group_shape='any' or a larger max_tokens_per_rank"
            )
    return k_min, sizes


def _step(lengths: np.ndarray, a: Assignment, config: PlannerConfig) -> float:
    """T of an assignment: sum of round maxima plus rounds * beta."""
    top, _ = _round_heights(lengths, a, config)
    return float(top.sum()) + top.size * config.cost.round_cost


def _rough_plans(
    lengths: np.ndarray, config: PlannerConfig, k_min: np.ndarray, sizes: np.ndarray,
) -> list[Assignment]:
    """Starting points for `polish` for the samples after a tall first round: the levelled
    candidate of `_construct` and the spread plan (`_spread`) at the fewest rounds the tokens
    allow."""
    out = [_construct(lengths, config, k_min, sizes)]
    rounds = min_rounds(lengths, config.num_ranks, config.max_tokens_per_rank)
    spread = _spread(lengths, k_min, config, rounds)
    if spread is not None:
        out.append(spread)
    return out


def _with_tall_round(
    lengths: np.ndarray, config: PlannerConfig, k_min: np.ndarray, sizes: np.ndarray,
) -> list[Assignment]:
    """Plans whose first round holds the tallest samples (`tall_round`), the rest planned as in
    `_rough_plans`."""
    out = []
    for chosen, group, width in tall_round(lengths, k_min, config, sizes):
        rest = np.setdiff1d(np.arange(lengths.size), chosen)
        round_of = np.zeros(lengths.size, dtype=np.int64)
        start = np.zeros(lengths.size, dtype=np.int64)
        size = np.zeros(lengths.size, dtype=np.int64)
        first = left_starts(np.zeros(width.size, dtype=np.int64), width)
        start[chosen], size[chosen] = first[group], width[group]
        subs = _rough_plans(lengths[rest], config, k_min[rest], sizes) if rest.size else [None]
        for sub in subs:
            if sub is not None:
                round_of[rest] = sub.round_of + 1
                start[rest], size[rest] = sub.group_start, sub.group_size
            out.append(Assignment(round_of=round_of.copy(), group_start=start.copy(), group_size=size.copy()))
    return out


def assign(lengths: np.ndarray, config: PlannerConfig) -> Assignment:
    """Plan ``lengths`` with the hdp policy (see module docstring)."""
    k_min, sizes = _sizes(lengths, config)
    if lengths.size > config.search_max_samples:
        return _construct(lengths, config, k_min, sizes)
    options = [_construct(lengths, config, k_min, sizes)]
    if needs_tall_round(lengths, k_min, config):
        options += _with_tall_round(lengths, config, k_min, sizes)
    # a short search from every starting point, then longer ones from the best two
    n = lengths.size
    options = [polish(lengths, o, config, k_min, max_steps=max(8, n // 4)) for o in options]
    order = np.argsort([_step(lengths, o, config) for o in options], kind="stable")[:2]
    final = [polish(lengths, options[i], config, k_min, max_steps=_POLISH_STEPS * n) for i in order]
    return final[int(np.argmin([_step(lengths, o, config) for o in final]))]


def _construct(lengths: np.ndarray, config: PlannerConfig, k_min: np.ndarray, sizes: np.ndarray) -> Assignment:
    """The best candidate plan of the variants x round counts, levelled (module docstring)."""
    N, B = config.num_ranks, config.max_tokens_per_rank
    r_min = min_rounds(lengths, N, B)
    extra = config.max_extra_rounds
    if lengths.size > 4096:
        extra = min(extra, _MAX_EXTRA_ROUNDS_LARGE)
    if lengths.size > 32768:  # cluster-scale batches: one round count per variant
        extra = 0
    best: tuple[float, Assignment, str] | None = None
    best_rounds = 0
    variants = _variants(lengths, k_min, config, sizes)
    tok_cache: dict[bytes, np.ndarray] = {}  # tokens per rank of each group-size vector
    built: dict[bytes, float | None] = {}  # (columns, sizes, rounds) -> step time (None: infeasible)
    # a lower bound of each variant's step time (at the minimum rounds): try the cheapest first
    # and skip those that cannot beat the best plan found
    floor_t = [
        _floor(lengths, fn(r_min)[0], config) + r_min * config.cost.round_cost for _, fn in variants
    ]

    def sizing(fn: Callable[[int], tuple[np.ndarray, np.ndarray]], rounds: int, own: bool) -> tuple:
        """(group sizes, heights, tokens per rank, rounds >= ``rounds`` their tokens need)."""
        k, height = fn(rounds)
        key_k = k.tobytes()
        if key_k not in tok_cache:
            tok_cache[key_k] = max_rank_tokens(lengths, k)
        tok = tok_cache[key_k]
        sz, cls = _size_classes(k)
        need = -(-np.bincount(cls, weights=tok).astype(np.int64) // B)
        if own:  # multi-rank samples each take their own group
            need = np.where(sz > 1, np.bincount(cls), need)
        return k, height, tok, max(rounds, -(-int((need * sz).sum()) // N))

    def too_many(rounds: int) -> bool:
        """Large batches: far more rounds than the best plan so far is not worth a build."""
        return lengths.size > 4096 and best is not None and rounds > 1.25 * best_rounds

    for vi in np.argsort(floor_t, kind="stable"):
        name, fn = variants[vi]
        if best is not None and floor_t[vi] >= best[0]:
            continue
        own = not name.startswith("uniform")
        r = r_min
        tried, worse, misses = 0, 0, 0
        seen: set[bytes] = set()  # candidates of this variant
        own_key = b"o" if own else b"u"
        # uniform plans are cheap to build and their best round count varies: always try two
        v_extra = max(extra, 1) if not own and lengths.size <= 16384 else extra
        # beyond v_extra only while each build still improved (smaller batches, at most 8 builds)
        while (tried <= v_extra or (worse == 0 and tried < 8 and lengths.size <= 4096)) and misses <= 8:
            # group sizes for r rounds, then the rounds their tokens need; on smaller batches also
            # the sizes re-chosen for those rounds (fixed point), on large ones only the latter
            cands = [sizing(fn, r, own)]
            while cands[-1][3] > r and len(cands) < 4 and not too_many(cands[-1][3]):
                r = cands[-1][3]
                cands.append(sizing(fn, r, own))
            if lengths.size > 4096:
                cands = cands[-1:]
            stop = False
            for k, height, tok, r_c in cands:
                key = own_key + k.tobytes() + r_c.to_bytes(8, "little")
                if key in seen:
                    continue
                if too_many(r_c):
                    stop = True
                    break
                seen.add(key)
                step = built.get(key, -1.0)
                if step == -1.0:  # not built by an earlier variant yet
                    try:
                        a, step = _build(lengths, k, height, r_c, config, own, tok)
                        if not own and (best is None or step < best[0] * 1.005):
                            # a competitive shared-group plan: exact LPT where the budget is tight
                            a2, step2 = _build(lengths, k, height, r_c, config, own, tok, exact=True)
                            if step2 < step:
                                a, step = a2, step2
                        if best is None or step < best[0] * (1 - 1e-9):
                            best, worse, best_rounds = (step, a, f"{name} R={r_c}"), -1, r_c
                    except _Infeasible:
                        step = None
                    built[key] = step
                if step is None:
                    misses += 1
                    continue
                tried += 1
                worse += 1
                if worse >= 2:
                    stop = True
                    break
            if stop:
                break
            r = cands[0][3] + 1
    if best is None:  # every variant overflowed the budget: one sample per column always fits
        a, step = _build(
            lengths, k_min, config.cost.sample_cost(lengths, k_min), lengths.size, config, True,
            max_rank_tokens(lengths, k_min),
        )
        best = (step, a, "one-per-column")
    a = best[1]
    if lengths.size <= 4096:  # larger batches: the time budget goes to the candidates above
        a = _replan_rounds(lengths, a, config, sizes)
    a = _merge_groups(lengths, a, config, last_only=lengths.size > 4096)  # time budget
    _log.debug("hdp: chose %s, estimated step %.4g", best[2], best[0])
    return a
