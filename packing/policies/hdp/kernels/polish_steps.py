"""The polish search's steps, compiled: moves, trades and widenings, each evaluated over its
candidates and applied (`best_move`, `best_trade`, `widen`), the good steps of an evaluation taken
together (`pick`).

A step is good when it lowers the step time, or keeps it and lowers sum(width * height**2): its
source round's roof comes down (and with a pipeline the tallest round's) while no other round's roof
rises.  Work is counted in units of the search pool (`Settings`): one per scored pair, a fixed
amount per evaluation; an evaluation that would overspend is not made.
"""

from typing import NamedTuple

import numpy as np

from hdp.packing.kernels.jit import F8_2D, I64_2D, helper
from hdp.packing.kernels.sort import argsort_stable
from hdp.packing.policies.hdp.kernels.costs import busiest_tokens, sample_cost, sample_values
from hdp.packing.policies.hdp.kernels.polish_state import TOL, column_cost, move, settle, value
from hdp.packing.policies.hdp.kernels.polish_survey import max_roof, pipeline_gain

__all__ = ["Good", "good_buffers", "push", "pick", "best_move", "best_trade", "widen"]


class Good(NamedTuple):
    """The good steps an evaluation found, grown as they come (`push`)."""

    floats: F8_2D
    """[3, capacity] per step: the step time's change, the rank-time added, the levelling's change."""
    ints: I64_2D
    """[6, capacity] per step: its pair's flat index, source round, target round, source column,
    target column (-1 - r for a new group on round r's free ranks) and the source column's depth."""


@helper
def good_buffers(n):
    """`Good` buffers for n steps."""
    return Good(np.empty((3, max(n, 1))), np.empty((6, max(n, 1)), dtype=np.int64))



@helper
def _grow_good(good):
    """`good_buffers` of twice the size, holding ``good``'s steps."""
    fb, ib = good.floats, good.ints
    out = good_buffers(2 * fb.shape[1])
    fb2, ib2 = out.floats, out.ints
    for q in range(3):
        for j in range(fb.shape[1]):
            fb2[q, j] = fb[q, j]
    for q in range(6):
        for j in range(ib.shape[1]):
            ib2[q, j] = ib[q, j]
    return out



@helper
def push(good, n, d_obj, added, d_phi, flat, a_round, b_round, c1, c2, dep):
    """Good step ``n`` into ``good`` (grown when full: `good_buffers`); returns the buffers."""
    if n == good.floats.shape[1]:
        good = _grow_good(good)
    fb, ib = good.floats, good.ints
    fb[0, n], fb[1, n], fb[2, n] = d_obj, added, d_phi
    ib[0, n], ib[1, n], ib[2, n], ib[3, n], ib[4, n], ib[5, n] = flat, a_round, b_round, c1, c2, dep
    return good



@helper
def pick(good, n_good, scale, n_rounds, cap):
    """The good steps taken together, best first (the step time's change, then the rank-time it costs --
    both rounded to `TOL` of ``scale`` -- then the levelling, then the order found), as positions into
    ``good``: a round either gives -- one step per depth of its source columns, from its roof down --
    or receives (steps from other rounds), and no column changes twice, so every step's figures stay
    exact."""
    fb, ib = good.floats, good.ints
    d_obj, added, d_phi = fb[0], fb[1], fb[2]
    a_round, b_round, c1, c2, dep = ib[1], ib[2], ib[3], ib[4], ib[5]
    q = max(TOL * scale, 1e-300)
    k_obj = np.empty(n_good)
    k_add = np.empty(n_good)
    k_phi = np.empty(n_good)
    for g in range(n_good):
        k_obj[g] = np.rint(d_obj[g] / q)
        k_add[g] = np.rint(added[g] / q)
        k_phi[g] = d_phi[g]
    # np.lexsort((j, d_phi, rint(added / q), rint(d_obj / q))): stable sorts from the last key up
    # (good_j ascends, so the index tie-break is the starting order)
    o = argsort_stable(k_phi)
    o = o[argsort_stable(k_add[o])]
    o = o[argsort_stable(k_obj[o])]
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


@helper
def best_move(batch, settings, cols, surv, values, movers, targets, spent, opened):
    """The best moves of ``movers`` (samples of the source columns) into ``targets`` (`polish_survey.roomiest`)
    or onto a new group of a sample's fewest ranks on a round's free ranks, evaluated and applied: every
    (sample, target) pair that fits the token budget and does not raise the target round's roof is
    scored -- by the step time's change (the source round's roof, and the tallest round's with a
    pipeline), then the rank-time it costs, then sum(width * height**2) -- and the good ones are taken
    together where their figures stay exact (`pick`).  Returns (steps taken, units spent so far,
    whether the budget covered the evaluation, columns opened so far)."""
    lengths, k_min, p, N, B, stages = batch.lengths, batch.k_min, batch.p, batch.num_ranks, batch.budget, batch.stages
    col_of, rnd, width, h, sums = cols.col_of, cols.rnd, cols.width, cols.h, cols.sums
    count, free, alive = cols.count, cols.free, cols.alive
    roof, below, depth = surv.roof, surv.below, surv.depth
    stop_at, call_units, v = settings.stop_at, settings.call_units, values.v
    R, cap = roof.size, rnd.size
    M, C = movers.size, targets.size
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
        value(values, batch, i, width[c], v)
        hs = column_cost(p, cols, c, sums[c, 0] - v[0], sums[c, 1] - v[1], sums[c, 2] - v[2], width[c])
        h_src[m] = hs if count[c] > 1 else 0.0
        base[m] = max(below[c], h_src[m])
        k0_min = min(k0_min, k_min[i])
    free_max = 0
    for r in range(R):
        free_max = max(free_max, free[r])
    rows = C + R if free_max >= k0_min else C
    scale = max_roof(roof, R)
    n_pairs = rows * M
    good = good_buffers(min(n_pairs, 256))  # the good steps' figures, grown as they come
    n_good = 0
    h0 = np.empty(M)
    if rows > C:
        for m in range(M):
            h0[m] = sample_cost(p, lengths[movers[m]], k_min[movers[m]])
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
                col = targets[t]
                w_c = width[col]
                if w_c < k0 or col == s:
                    continue
                value(values, batch, i, w_c, v)
                if not (sums[col, 3] + v[3] <= B):
                    continue
                h_new = column_cost(p, cols, col, sums[col, 0] + v[0], sums[col, 1] + v[1], sums[col, 2] + v[2], w_c)
                r_c = rnd[col]
                same = r_c == r_src
                lim = h_s * (1 - TOL) if same else roof[r_c]
                ok = h_new <= lim
                h_prev = h[col]
                tgt = col
            else:
                r_c = t - C
                w_c = k0
                h_new = h0[m]
                same = r_c == r_src
                lim = h_s * (1 - TOL) if same else roof[r_c]
                ok = free[r_c] >= k0 and h_new <= lim and busiest_tokens(lengths[i], k0) <= B
                h_prev = 0.0
                tgt = -1 - r_c
            if not ok:
                continue
            hs_new = h_src[m]
            roof_r = max(base[m], h_new) if same else base[m]
            gain = pipeline_gain(stages, roof, R, r_src, roof_r) if depth[s] == 0 else 0.0
            do = roof_r - h_s + gain
            dp = float(w_s) * (hs_new * hs_new - h_s * h_s) + float(w_c) * (h_new * h_new - h_prev * h_prev)
            if not (do < -TOL * scale or dp < -TOL * scale * scale):
                continue
            good = push(good, n_good, do, float(w_c) * (h_new - h_prev) - float(w_s) * (h_s - hs_new), dp,
                        t * M + m, r_src, r_c, s, tgt, depth[s])
            n_good += 1
    if n_good == 0:
        return 0, spent, True, opened
    chosen = pick(good, n_good, scale, R, cap)
    good_j = good.ints[0]
    for g in chosen:
        t, m = divmod(good_j[g], M)
        i = movers[m]
        s = src[m]
        if t < C:
            tgt = targets[t]
        else:  # a new group of the sample's fewest ranks on free ranks of round t - C
            tgt = opened
            opened += 1
            rnd[tgt], width[tgt], alive[tgt], cols.cross[tgt] = t - C, k_min[i], True, False
            free[t - C] -= k_min[i]
        move(batch, cols, values, i, s, tgt)
        settle(p, cols, s)
        settle(p, cols, tgt)
    return chosen.size, spent, True, opened


@helper
def best_trade(batch, settings, cols, surv, values, movers, roomy_cols, spent):
    """When no sample of a roof column can move: the best trades of one of ``movers`` (the roof columns'
    samples; the longest ``settings.trade_movers`` of them) with a shorter sample of ``roomy_cols``
    (`polish_survey.roomiest`), each then split over the other's group, where both fit the token budget,
    the roof column comes down and the other round's roof does not rise; scored and taken together
    as `best_move`'s.  Returns (steps taken, units spent so far, whether the budget covered it)."""
    lengths, k_min, p, B, stages = batch.lengths, batch.k_min, batch.p, batch.budget, batch.stages
    col_of, rnd, width, h, sums = cols.col_of, cols.rnd, cols.width, cols.h, cols.sums
    roof, below, depth = surv.roof, surv.below, surv.depth
    stop_at, call_units, trade_movers = settings.stop_at, settings.call_units, settings.trade_movers
    work1, v, v2 = values.work1, values.v, values.v2
    R, cap = roof.size, rnd.size
    if movers.size > trade_movers:  # the longest samples of the roof columns (longest first, then index)
        neg = np.empty(movers.size)
        for m in range(movers.size):
            neg[m] = -float(lengths[movers[m]])  # exact below 2**53 tokens
        movers = movers[argsort_stable(neg)[:trade_movers]]
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
    scale = max_roof(roof, R)
    n_pairs = J * M
    good = good_buffers(min(n_pairs, 256))  # the good steps' figures, grown as they come
    # c loses i and gains j (on c's width): its sums without i, per mover
    rest1 = np.empty((M, 4))
    src = np.empty(M, dtype=np.int64)  # per mover: its column, its length, its fewest ranks
    l_m = np.empty(M, dtype=np.int64)
    k_m = np.empty(M, dtype=np.int64)
    for m in range(M):
        i = movers[m]
        c = col_of[i]
        src[m], l_m[m], k_m[m] = c, lengths[i], k_min[i]
        value(values, batch, i, width[c], v)
        for q in range(4):
            rest1[m, q] = sums[c, q] - v[q]
    n_good = 0
    for t in range(J):
        j = cand[t]
        c2 = col_of[j]
        w2 = width[c2]
        l_j, k_j = lengths[j], k_min[j]
        value(values, batch, j, w2, v)
        r0, r1, r2, r3 = sums[c2, 0] - v[0], sums[c2, 1] - v[1], sums[c2, 2] - v[2], sums[c2, 3] - v[3]
        hc2 = h[c2]
        for m in range(M):  # the cheap tests first: each failed one rules the pair out
            c = src[m]
            if not (l_j < l_m[m]) or c2 == c:
                continue
            w1 = width[c]
            if not (k_j <= w1) or not (k_m[m] <= w2):
                continue
            value(values, batch, j, w1, v)
            if not (rest1[m, 3] + v[3] <= B):
                continue
            hc = h[c]
            h_c = column_cost(p, cols, c, rest1[m, 0] + v[0], rest1[m, 1] + v[1], rest1[m, 2] + v[2], w1)
            if not (h_c < hc * (1 - TOL)):
                continue
            value(values, batch, movers[m], w2, v2)
            if not (r3 + v2[3] <= B):
                continue
            h_c2 = column_cost(p, cols, c2, r0 + v2[0], r1 + v2[1], r2 + v2[2], w2)
            same = rnd[c2] == rnd[c]
            lim = hc * (1 - TOL) if same else roof[rnd[c2]]
            if not (h_c2 <= lim):
                continue
            base = max(below[c], h_c)
            roof_r = max(base, h_c2) if same else base
            gain = pipeline_gain(stages, roof, R, rnd[c], roof_r) if depth[c] == 0 else 0.0
            do = roof_r - hc + gain
            dp = float(w1) * (h_c * h_c - hc * hc) + float(w2) * (h_c2 * h_c2 - hc2 * hc2)
            if not (do < -TOL * scale or dp < -TOL * scale * scale):
                continue
            good = push(good, n_good, do, float(w1) * (h_c - hc) + float(w2) * (h_c2 - hc2), dp,
                        t * M + m, rnd[c], rnd[c2], c, c2, depth[c])
            n_good += 1
    if n_good == 0:
        return 0, spent, True
    chosen = pick(good, n_good, scale, R, cap)
    good_j, c1, c2s = good.ints[0], good.ints[3], good.ints[4]
    for g in chosen:
        t, m = divmod(good_j[g], M)
        i, j = movers[m], cand[t]
        c, cc = c1[g], c2s[g]
        move(batch, cols, values, i, c, cc)
        move(batch, cols, values, j, cc, c)
        settle(p, cols, c)
        settle(p, cols, cc)
    return chosen.size, spent, True


@helper
def widen(batch, settings, cols, surv, values, opened, spent):
    """A round's only roof column takes more of the ranks its round leaves free (an allowed size), when
    that lowers the round's roof and the column keeps within the token budget -- the width of the lowest
    roof, then of the least rank-time, then the fewest ranks; one column per round.  Returns (steps taken, units spent so far)."""
    lengths, p, B, sizes = batch.lengths, batch.p, batch.budget, batch.sizes
    col_of, rnd, width, sums, count, free = cols.col_of, cols.rnd, cols.width, cols.sums, cols.count, cols.free
    roof, second, at_roof = surv.roof, surv.second, surv.at_roof
    stop_at, call_units, v = settings.stop_at, settings.call_units, values.v
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
        if done[r] or free[r] <= 0 or other >= roof[r] * (1 - TOL):
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
                    sample_values(p, lengths[i], w2, v)
                    for q in range(4):
                        acc[q] += v[q]
            h2 = column_cost(p, cols, c, acc[0], acc[1], acc[2], w2)
            top = max(other, h2)
            if acc[3] <= B and top < roof[r] * (1 - TOL):
                key0 = np.rint(top / (TOL * roof[r]))
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
        settle(p, cols, c)
    return n_steps, spent
