"""The tall-round pass: more starting plans whose first round is built around the tallest samples.

When a few samples are far taller than a balanced round (a 32K sample among 1.5K ones), a round
that holds one of them lasts its height D while every other rank of the round can fill only B
tokens of shorter samples, which take less time: the rest of that round idles.  Widening the tall
sample lowers D but costs ring overhead (its K/V transfer stops hiding behind attention).  The
best trade puts *all* tall samples in one round and fills its other ranks with the samples that
do the most work per token -- the next longest, on their own groups -- so the idle time is paid
once.

`_first_rounds` scans D over the tallest sample's heights on k = k_min .. 4 k_min ranks; for each
D every sample, longest per-rank height first, takes the fewest ranks that bring it under D while
ranks remain.  A round's estimated waste is ``N * D`` minus the least rank-time of the samples it
holds, minus what its columns' spare time and tokens can still take of the short samples.  The
rounds with the least waste become starting plans: the remaining samples planned by the construct
and level passes, or spread (`construct.spread`: multi-rank samples over every round).  Every
starting plan, the pass's input among them, gets a short local search (`polish`, with a share of
the ``search`` pool), and the best one is returned (it is never worse than the input).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hdp.packing.config import SearchBudget
from hdp.packing.cost import max_rank_tokens, padded_length
from hdp.packing.policies.common import left_starts
from hdp.packing.policies.hdp.columns import Columns
from hdp.packing.policies.hdp.construct import construct, spread
from hdp.packing.policies.hdp.level import level
from hdp.packing.policies.hdp.polish import polish
from hdp.packing.policies.hdp.problem import Meter
from hdp.packing.simulate import min_rounds

__all__ = ["tall_round", "needs_tall_round"]

_TALL = 1.5  # a sample counts as tall above this multiple of a balanced round's height
_SHORT_SHARE = 0.5  # the short searches of the starting plans share this part of the search pool
_START_LEVEL = 3  # placements per sample a starting plan's levelling may spend


def tall_round(cols: Columns, problem) -> Columns:
    """The tall-round pass (module docstring): the best of ``cols`` and the tall-first-round
    starting plans after a short local search each; ``cols`` itself when no sample is tall or the
    search budget is spent."""
    assert cols.complete, "tall_round needs every sample planned"
    meter = problem.meter
    if meter.left("search") <= 0 or not needs_tall_round(problem):
        return cols
    starts = [cols]
    n = problem.n
    for chosen, group, width in _first_rounds(problem):
        # a start costs the search pool its construction: one candidate for the other samples and
        # the levelling of the plan (in placements, counted on a meter of its own), and the spread plan
        if not meter.allows("search", (2 + _START_LEVEL) * n):
            break
        first = np.full(n, -1, dtype=np.int64)
        first[chosen] = group
        base = Columns(col_of=first, round=np.zeros(width.size, dtype=np.int64),
                       start=left_starts(np.zeros(width.size, dtype=np.int64), width), width=width)
        rest = np.flatnonzero(first < 0)
        if rest.size == 0:
            starts.append(base)
            continue
        own = replace(problem, meter=Meter(SearchBudget(construct=_START_LEVEL * n, search=0, rivals=0)))
        starts.append(level(construct(base, own), own))
        meter.charge("search", 2 * n + own.meter.spent["construct"])
        sub = problem.sub(rest)
        sp = spread(sub, min_rounds(sub.lengths, problem.num_ranks, problem.budget))
        if sp is not None:
            starts.append(base.plus(sp, rest))
    if len(starts) == 1:
        return cols
    share = int(_SHORT_SHARE * max(0, meter.left("search")) / len(starts))
    polished = [polish(s, problem, limit=share) for s in starts]
    return problem.best(polished)


def needs_tall_round(problem) -> bool:
    """Whether some sample, even on its fewest ranks, is far taller than a balanced round."""
    lengths, k_min = problem.lengths, problem.k_min
    cost, N, B = problem.cost, problem.num_ranks, problem.budget
    h = cost.sample_cost(lengths, k_min)
    rounds = min_rounds(lengths, N, B)
    level = float((k_min * h).sum()) / (N * rounds)
    return lengths.size > 1 and float(h.max()) > _TALL * level and rounds > 1


def _first_rounds(problem, keep: int = 2) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Up to ``keep`` candidate first rounds, least estimated waste first: (samples [m], group of
    each [m], width of each group [g]); the caller lays the groups out."""
    lengths, k_min, sizes = problem.lengths, problem.k_min, problem.sizes
    cost, N, B = problem.cost, problem.num_ranks, problem.budget
    problem.meter.charge("search", lengths.size)  # scans of the batch, a few per candidate height
    h_min = cost.sample_cost(lengths, k_min)
    order = np.lexsort((np.arange(lengths.size), -h_min))  # tallest first
    cheapest = cost.cheapest_rank_time(lengths.astype(np.float64), k_min, N)
    t = int(order[0])
    # per-token rank-time of the short samples a column's spare room could still take (none: 0)
    single = k_min == 1
    rho = float(cheapest[single].sum() / max(1, lengths[single].sum())) if single.any() else 0.0
    ks = sizes[(sizes >= k_min[t]) & (sizes <= min(N, 4 * int(k_min[t])))]
    found: list[tuple[float, np.ndarray, np.ndarray]] = []
    for k_t in ks.tolist():
        D = float(cost.sample_cost(int(lengths[t]), k_t))
        chosen, widths = _fill(lengths, order, D, cost, sizes, N, B, k_min)
        if chosen.size == 0 or t not in set(chosen.tolist()):
            continue
        h = cost.sample_cost(lengths[chosen], widths)
        spare_time = widths * (D - h)
        spare_tok = widths * (B - max_rank_tokens(lengths[chosen], widths))
        topup = np.minimum(spare_time, spare_tok * rho)
        waste = N * D - float(cheapest[chosen].sum()) - float(topup.sum())
        found.append((waste, chosen, widths))
    found.sort(key=lambda f: f[0])
    out = []
    for _, chosen, widths in found[:keep]:
        out.append(_top_up(lengths, order, chosen, widths, cost, B, k_min))
    return out


def _top_up(
    lengths: np.ndarray, order: np.ndarray, chosen: np.ndarray, widths: np.ndarray, cost, B: int,
    k_min: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The remaining samples, longest first, join the round's groups (best fit) while the group
    stays within B tokens per rank and under the round's height: (samples [m], group of each [m],
    width of each group [g])."""
    g = chosen.size
    lp = padded_length(lengths[chosen], widths).astype(np.float64)
    sw, sl, sq = cost.work(lp), lp.copy(), lp * lp
    tok = max_rank_tokens(lengths[chosen], widths).astype(np.float64)
    h = cost.group_cost(sw, sl, sq, widths)
    D = float(h.max())
    col = list(range(g))
    members = list(chosen.tolist())
    taken = np.zeros(lengths.size, dtype=bool)
    taken[chosen] = True
    rest = order[~taken[order]]
    rest = rest[np.lexsort((rest, -lengths[rest]))]
    for i in rest.tolist():
        if float(tok.min()) + 1 > B:
            break
        L = np.full(g, lengths[i])
        lpi = padded_length(L, widths).astype(np.float64)
        h_new = cost.group_cost(sw + cost.work(lpi), sl + lpi, sq + lpi * lpi, widths)
        t_new = tok + max_rank_tokens(L, widths)
        ok = np.flatnonzero((h_new <= D) & (t_new <= B) & (widths >= k_min[i]))
        if ok.size == 0:
            continue
        j = int(ok[np.argmax(h_new[ok])])  # best fit: the group left with least room
        sw[j] += float(cost.work(lpi[j]))
        sl[j] += lpi[j]
        sq[j] += lpi[j] * lpi[j]
        tok[j] = t_new[j]
        members.append(i)
        col.append(j)
    return np.asarray(members, dtype=np.int64), np.asarray(col, dtype=np.int64), widths


def _fill(
    lengths: np.ndarray, order: np.ndarray, D: float, cost, sizes: np.ndarray, N: int, B: int,
    k_min: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Samples (tallest first) each on the fewest allowed ranks that bring it under D, while
    ranks remain."""
    free = N
    chosen: list[int] = []
    widths: list[int] = []
    for i in order.tolist():
        if free <= 0:
            break
        ks = sizes[(sizes >= k_min[i]) & (sizes <= free)]
        if ks.size == 0:
            continue
        h = cost.sample_cost(np.full(ks.size, lengths[i]), ks)
        fit = np.flatnonzero(h <= D * (1 + 1e-12))
        if fit.size == 0:
            continue
        k = int(ks[fit[0]])
        chosen.append(i)
        widths.append(k)
        free -= k
    return np.asarray(chosen, dtype=np.int64), np.asarray(widths, dtype=np.int64)
