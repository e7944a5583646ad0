"""The level pass's gap filling, compiled: the last round's single-rank samples placed into gaps of
earlier rounds, in single-rank columns (`fill_gaps`) or split over multi-rank groups (`fill_wide_gaps`)."""

from hdp.packing.kernels.jit import F8_1D, I64, I64_1D, kernel
from hdp.packing.policies.hdp.kernels.costs import A, busiest_tokens, group_cost, padded

__all__ = ["fill_gaps", "fill_wide_gaps"]


@kernel(I64_1D, F8_1D, I64_1D, F8_1D, F8_1D, I64_1D, I64_1D, F8_1D)
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


@kernel(F8_1D, I64, I64_1D, I64_1D, F8_1D, F8_1D, F8_1D, F8_1D, F8_1D, I64_1D, F8_1D)
def fill_wide_gaps(p, budget, lengths, widths, sw, sl, sq, tok, roof, chosen, new_h):
    """`level._fill_wide_gaps`'s placement: movers of ``lengths`` (longest first) each join the group
    of ``widths`` -- its sums ``sw``, ``sl``, ``sq`` and busiest-rank tokens ``tok``, in place --
    whose exact cost with it (split over the group) stays under its round's ``roof`` and every rank
    within ``budget`` tokens, leaving the least room (best fit; ties: the first).  ``chosen[m]``: the
    group mover m joined (-1: none); ``new_h[g]``: group g's height after the last join."""
    a = p[A]
    for m in range(lengths.size):
        length = lengths[m]
        best, best_gap, best_h = -1, 0.0, 0.0
        for j in range(widths.size):
            w = widths[j]
            if not (tok[j] + busiest_tokens(length, w) <= budget):
                continue
            lp = padded(length, w)
            h = group_cost(p, sw[j] + (a * lp + lp * lp), sl[j] + lp, sq[j] + lp * lp, w)
            if h <= roof[j] and (best < 0 or roof[j] - h < best_gap):
                best, best_gap, best_h = j, roof[j] - h, h
        chosen[m] = best
        if best < 0:
            continue
        w = widths[best]
        lp = padded(length, w)
        sw[best] += a * lp + lp * lp
        sl[best] += lp
        sq[best] += lp * lp
        tok[best] += busiest_tokens(length, w)
        new_h[best] = best_h
