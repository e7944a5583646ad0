"""The level pass: re-spread work between the columns and rounds of a finished plan.

A shelf layout of balanced bins leaves idle time a construction cannot see.  `level` runs, in
order, each kept only when it lowers the step time:

* single-rank samples re-spread so each round's single-rank columns reach that round's roof
  (`_rebalance_singles`: a common level lambda with sum_r s_r * max(lambda, M_r) = single-rank work);
* the last round's single-rank samples moved into gaps under other rounds' maxima, into
  single-rank columns (`_fill_gaps`) or, split over the group, into multi-rank groups
  (`_fill_wide_gaps`);
* a partly filled last round's single-rank samples spread over all its free ranks
  (`_spread_last_round`);
* a round's roof column trading places with another round's work when the sum of the two maxima
  drops (`_swap_rounds`);
* with ``thorough`` (the pipeline's level pass; the construction scores its candidates without):
  the rounds idling most planned again on their own (`_replan_rounds`), and a round's tallest
  group merged with a partner into one wider group on the same ranks (`_merge_groups`).

Work is charged to the ``construct`` pool of the budget (samples moved or re-planned); a step
that does not fit what is left is skipped.
"""

from __future__ import annotations

import numpy as np

from hdp.packing.cost import max_rank_tokens, padded_float
from hdp.packing.policies.common import Assignment, pow2_ceil
from hdp.packing.kernels.jit import int_array
from hdp.packing.kernels.sums import max_at
from hdp.packing.policies.hdp import bins
from hdp.packing.policies.hdp.bins import Infeasible, partition
from hdp.packing.policies.hdp.columns import Columns
from hdp.packing.policies.hdp.kernels.costs import cost_params
from hdp.packing.policies.hdp.kernels.gaps import fill_gaps, fill_wide_gaps
from hdp.packing.policies.hdp.kernels.swaps import swap_rounds
from hdp.packing.policies.hdp.sizes import grow_sizes

__all__ = ["level"]

_GAP_FILL_MAX_PAIRS = 20_000_000  # samples x columns one gap-filling call may scan (memory and time cap)
_SCAN = 64  # columns a gap-filling placement scans for the price of one placement
_GRID = 16  # rounds x ranks a round swap scans for the price of one placement
_SWAP_UNITS = 2  # the round swaps of one levelling spend at most this many placements per sample and rank
_BUILD = 1024  # placements' worth of fixed work of a one-round build (re-planning a round one way)
_GRID_ROW = 8  # ranks of a round the re-planning's levelling scans for the price of one placement
_MERGE = 8  # placements per group the merging of a round costs (a Python step per merge tried)


def level(cols: Columns, problem, *, thorough: bool = True) -> Columns:
    """The level pass: ``cols`` (every sample planned) with work re-spread (module docstring);
    never a higher step time than ``cols``."""
    assert cols.complete, "level needs every sample planned"
    out = _quick(cols, problem)
    if thorough:
        out = _replan_rounds(out, problem)
        out = _merge_groups(out, problem)
    return problem.better(out, cols)


def _quick(cols: Columns, problem, fill: bool = True) -> Columns:
    """The vectorised levelling steps (all but re-planning and merging)."""
    c = cols.compact()
    col_of, col_round, col_start, widths = c.col_of.copy(), c.round.copy(), c.start.copy(), c.width.copy()
    heights = problem.heights(c)  # [C] exact, kept up to date by the steps below
    k = widths[col_of]
    height, tokens = problem.sample_costs(k)
    N, B, meter = problem.num_ranks, problem.budget, problem.meter
    n = problem.n
    if meter.allows("construct", n):
        meter.charge("construct", n)
        col_of = _rebalance_singles(col_of, col_round, widths, heights, height, tokens, k, B)
    if fill:
        col_of = _fill_gaps(col_of, col_round, widths, heights, height, tokens, k, B, meter)
        col_of, k = _fill_wide_gaps(problem, col_of, col_round, widths, heights, k)
    col_of, col_round, col_start, widths, heights = _spread_last_round(
        col_of, col_round, col_start, widths, heights, height, tokens, k, N, B
    )
    used = np.bincount(col_of, minlength=widths.size) > 0
    n_rounds = int(col_round.max(initial=0)) + 1
    per_swap = 1 + n_rounds * N // _GRID  # one trade scans the rounds x ranks grid
    swaps = min(4 * n_rounds + 32, max(0, min(meter.left("construct"), _SWAP_UNITS * (n + N))) // per_swap)
    col_round, col_start = _swap_rounds(
        col_round, col_start, widths, np.where(used, heights, -1.0), N, problem.pow2, max_swaps=swaps,
        charge=lambda: meter.charge("construct", per_swap),
    )
    return Columns(col_of=col_of, round=col_round, start=col_start, width=widths).compact()


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
    max_at(multi_max, col_round[wide], heights[wide])
    s_r = np.bincount(col_round[ones], minlength=n_rounds)
    multi_max = _with_tallest(multi_max, s_r, float(height[singles].max()))
    if not np.any(multi_max > 0) or n_rounds == 1:
        return col_of  # no tall column: the balanced bins are already level
    level = _level(float(height[singles].sum()), s_r, multi_max)
    target = np.maximum(level, multi_max)[col_round[ones]]  # [c]
    try:  # least loaded with an offset of -target = most room below the target
        new_col = partition(height[singles], tokens[singles], ones.size, budget, offset=-target)
    except Infeasible:
        return col_of  # the budget does not allow this spread: keep the balanced bins
    load = np.bincount(new_col, weights=height[singles], minlength=ones.size)
    old_max = np.zeros(n_rounds)
    max_at(old_max, col_round, heights)
    new_heights = heights.copy()
    new_heights[ones] = load
    new_max = np.zeros(n_rounds)
    max_at(new_max, col_round, new_heights)
    if new_max.sum() >= old_max.sum():
        return col_of
    heights[:] = new_heights
    col_of = col_of.copy()
    col_of[singles] = ones[new_col]
    return col_of


def _fill_gaps(
    col_of: np.ndarray, col_round: np.ndarray, widths: np.ndarray, heights: np.ndarray,
    height: np.ndarray, tokens: np.ndarray, k: np.ndarray, budget: int, meter,
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
    max_at(round_max, col_round, heights)
    col_tok = np.bincount(col_of, weights=tokens, minlength=widths.size)
    target = (widths == 1) & (col_round != last)  # [C] columns that may receive samples
    cand = np.flatnonzero(target)
    units = movers.size * (1 + cand.size // _SCAN)  # a placement per mover, a scan of the columns each
    if movers.size * cand.size > _GAP_FILL_MAX_PAIRS or not meter.allows("construct", units):
        return col_of  # too large to search per sample, or over budget: the layout stands as it is
    meter.charge("construct", units)
    gap = round_max[col_round[cand]] - heights[cand]  # [c] room under each round's maximum
    room = budget - col_tok[cand]
    # tallest first, each to the least gap that holds it (best fit: keep large gaps for large samples)
    fill_gaps(movers[np.lexsort((movers, -height[movers]))], np.asarray(height, dtype=np.float64), int_array(tokens),
              gap, room, cand, col_of, heights)
    return col_of


def _fill_wide_gaps(
    problem, col_of: np.ndarray, col_round: np.ndarray, widths: np.ndarray, heights: np.ndarray, k: np.ndarray,
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
    units = movers.size * (4 + cand.size // _SCAN)  # a Python step per mover, a scan of the groups each
    if last == 0 or movers.size == 0 or cand.size == 0 or not problem.meter.allows("construct", units):
        return col_of, k
    problem.meter.charge("construct", units)
    lengths, cost, B = problem.lengths, problem.cost, problem.budget
    n_cols = widths.size
    padded = padded_float(lengths, k)
    sw = np.bincount(col_of, weights=cost.work(padded), minlength=n_cols)[cand]  # [c] group sums
    sl = np.bincount(col_of, weights=padded, minlength=n_cols)[cand]
    sq = np.bincount(col_of, weights=padded * padded, minlength=n_cols)[cand]
    tok = np.bincount(col_of, weights=max_rank_tokens(lengths, k), minlength=n_cols)[cand]
    round_max = np.zeros(last + 1)
    max_at(round_max, col_round, heights)
    roof = round_max[col_round[cand]]  # [c]
    col_of, k = col_of.copy(), k.copy()
    movers = movers[np.lexsort((movers, -lengths[movers]))]
    chosen = np.full(movers.size, -1, dtype=np.int64)  # [M] group each mover joins (-1: none)
    new_h = np.full(cand.size, np.nan)  # [c] each group's height after its last join
    fill_wide_gaps(cost_params(cost), B, int_array(lengths[movers]), int_array(widths[cand]), sw, sl, sq, tok, roof,
                   chosen, new_h)
    moved = chosen >= 0
    # a single-rank column's height is its work: the movers' own work leaves it, in their order
    np.subtract.at(heights, col_of[movers[moved]], cost.work(lengths[movers[moved]].astype(np.float64)))
    col_of[movers[moved]] = cand[chosen[moved]]
    k[movers[moved]] = widths[cand[chosen[moved]]]
    joined = ~np.isnan(new_h)
    heights[cand[joined]] = new_h[joined]
    return col_of, k


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
        b = partition(height[in_last], tokens[in_last], free.size, budget)
    except Infeasible:
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


def _swap_rounds(
    col_round: np.ndarray, col_start: np.ndarray, widths: np.ndarray, heights: np.ndarray,
    num_ranks: int, pow2: bool, max_swaps: int | None = None, charge=None,
) -> tuple[np.ndarray, np.ndarray]:
    """Lower round maxima by trading a round's roof column with work of another round.

    A round p's height is its tallest column G (ranks [s, e), width w).  Two trades are tried
    against every other round q: (a) q's work on the same ranks [s, e) when q's columns there lie
    inside [s, e); (b) any w consecutive single-rank (or idle) ranks of q -- G moves there (an
    aligned block under ``pow2``) and those single-rank columns move to [s, e) of round p.  The
    trade lowering max(p) + max(q) most is applied; rounds are visited by how far their roof
    stands above the rest, and the first round with a gain is taken (``charge()`` is called per
    scan).  Up to ``max_swaps``
    (default 4R + 32) trades.  ``heights`` < 0 marks unused columns.  Returns (round, start) of
    every column.  The scans run compiled (`kernels.swaps.swap_rounds`).
    """
    col_round, col_start = int_array(col_round), int_array(col_start)
    if max_swaps is None:
        max_swaps = 4 * (int(col_round[heights >= 0].max(initial=0)) + 1) + 32
    scans = swap_rounds(col_round, col_start, int_array(widths),
                                 np.asarray(heights, dtype=np.float64), num_ranks, pow2, max_swaps)
    if charge is not None:  # every scan for a trade counts, found or not
        for _ in range(scans):
            charge()
    return col_round, col_start


def _with_tallest(floor: np.ndarray, slots: np.ndarray, tallest: float) -> np.ndarray:
    """Round floors with the tallest single-rank sample's: whichever round holds it is at least that
    tall, so unless a round with free ranks already is, the one with the most free ranks (then the
    highest floor, then the first) gets ``tallest`` as its floor and levels its ranks up to it."""
    has = slots > 0
    if not has.any() or float(floor[has].max()) >= tallest:
        return floor
    r = int(np.lexsort((np.arange(floor.size), -floor, -slots))[0])
    out = np.asarray(floor, dtype=np.float64).copy()
    out[r] = tallest
    return out


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



def _replan_rounds(cols: Columns, problem, tries: int = 3) -> Columns:
    """Re-plan the rounds with the most idle rank-time on their own, as one-round problems.

    A round's samples are planned again for one round of N ranks, with every sample taller than
    the round's balanced level (its rank-time / N) widened as `grow_sizes` chooses, or on common
    sizes; kept when the round's height drops (the others do not change).  The rounds idling most
    are tried first, up to ``tries``, while the budget lasts (each option costs the round's
    samples).  Mostly it is the last round, whose shortest multi-rank groups the layout left next
    to too little work.
    """
    N, sizes, meter = problem.num_ranks, problem.sizes, problem.meter
    c = cols.compact()
    h = problem.heights(c)
    top = problem.tops(c, h)
    busy = np.bincount(c.round, weights=h * c.width, minlength=top.size)
    idle = top * N - busy
    round_of = c.round[c.col_of]
    col_of, rnd, start, width = c.col_of.copy(), list(c.round), list(c.start), list(c.width)
    changed = False
    for r in np.argsort(-idle, kind="stable")[:tries].tolist():
        if idle[r] <= 0.02 * top[r] * N:
            break
        sel = np.flatnonzero(round_of == r)
        sub = problem.sub(sel)
        sub_len = sub.lengths
        best_h, best_sub = float(top[r]), None
        k_now = c.width[c.col_of[sel]]
        k_top = int(k_now.max())
        options: list[tuple[str, int]] = [("grow-all", 0), ("grow-multi", 0)]
        for u in sorted({int(sizes[np.searchsorted(sizes, v)]) for v in (k_top, pow2_ceil(k_top), 2 * k_top)
                         if v <= sizes[-1]}):
            options += [("uniform", u), ("multi-uniform", u)]
        for how, u in options:
            units = _BUILD + sel.size + N // _GRID_ROW  # a one-round build and its levelling
            if not meter.allows("construct", units):
                break
            meter.charge("construct", units)
            k = k_now.copy()
            if how == "uniform":  # every sample of the round on u ranks, groups shared
                k[:] = u
            elif how == "multi-uniform":  # multi-rank samples on shared u-rank groups
                k[k > 1] = u
            hk = problem.cost.sample_cost(sub_len, k)
            if how.startswith("grow"):
                grow = np.arange(sel.size) if how == "grow-all" else np.flatnonzero(k > 1)
                kg, hg = k[grow], hk[grow]
                grow_sizes(sub_len[grow], kg, hg, float(busy[r]) / N, problem)
                k[grow], hk[grow] = kg, hg
            own = how.startswith("grow")
            try:
                cand = _quick(bins.build(sub, k, hk, max_rank_tokens(sub_len, k), 1, own), sub)
            except Infeasible:
                continue
            t = sub.tops(cand)
            if t.size == 1 and float(t[0]) < best_h * (1 - 1e-9):
                best_h, best_sub = float(t[0]), cand
        if best_sub is not None:
            base = len(rnd)
            col_of[sel] = best_sub.col_of + base
            rnd += [r] * best_sub.n_columns
            start += list(best_sub.start)
            width += list(best_sub.width)
            changed = True
    if not changed:
        return cols
    return Columns(col_of=col_of, round=np.array(rnd), start=np.array(start), width=np.array(width)).compact()


def _merge_groups(cols: Columns, problem) -> Columns:
    """Lower round maxima by merging a round's tallest group with its best partner.

    Two groups of w1 and w2 ranks in one round can run as one group of w1 + w2 ranks (their
    samples split over all of them): the merged height lies between the two (plus ring overhead),
    on the same ranks.  Per round, the tallest group merges with the partner giving the lowest
    merged height (equal widths under ``pow2``, so blocks stay aligned) while that lowers it and
    every rank keeps within B tokens; the round's merges are kept only when its maximum drops.
    Partners are ranked on unpadded sums (additive, so all at once), the chosen pair is checked
    exactly.  Groups are then laid out again, wider first.  Mostly for a last round of multi-rank
    groups of uneven heights, where no rank is free to widen them: that round goes first, the
    others while the budget lasts (each round costs its samples).
    """
    a = cols.assignment()
    lengths, N, B, cost = problem.lengths, problem.num_ranks, problem.budget, problem.cost
    pow2 = problem.pow2
    round_of, start, size = a.round_of, a.group_start.copy(), a.group_size.copy()
    changed = False
    last = int(round_of.max())
    by_round = np.split(np.argsort(round_of, kind="stable"), np.cumsum(np.bincount(round_of))[:-1])
    for r in [last] + list(range(last)):  # the last round first: where uneven groups are left most
        sel = by_round[r]  # [n_r] samples of the round
        units = sel.size + _MERGE * int(np.unique(start[sel]).size)  # the round's groups, scanned a few times each
        if not problem.meter.allows("construct", units):
            break
        problem.meter.charge("construct", units)
        lr = lengths[sel]
        gid, grp = np.unique(start[sel], return_inverse=True)  # groups of the round
        n_g = gid.size
        if n_g < 2:
            continue
        w = np.zeros(n_g, dtype=np.int64)
        w[grp] = size[sel]
        h = _group_heights(lr, grp, w, cost)  # [G] exact heights
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
                lpm = padded_float(lr[idx], wm)
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
    if not changed:
        return cols
    return Columns.from_assignment(Assignment(round_of=round_of, group_start=start, group_size=size), N)


def _group_heights(lengths: np.ndarray, group: np.ndarray, width: np.ndarray, cost) -> np.ndarray:
    """[G] exact per-rank cost of every group: sample i is in group ``group[i]`` of ``width[g]`` ranks."""
    n_g = width.size
    padded = padded_float(lengths, width[group])
    return cost.group_cost(
        np.bincount(group, weights=cost.work(padded), minlength=n_g),
        np.bincount(group, weights=padded, minlength=n_g),
        np.bincount(group, weights=padded * padded, minlength=n_g),
        width,
    )
