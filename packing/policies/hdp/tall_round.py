"""The tall-round pass: another starting plan whose first round is built around the tallest samples.

When a few samples are far taller than a balanced round (a 32K sample among 1.5K ones), a round
that holds one of them lasts its height D while every other rank of the round can fill only B
tokens of shorter samples, which take less time: the rest of that round idles.  Widening the tall
sample lowers D but costs ring overhead (its K/V transfer stops hiding behind attention).  The
best trade puts *all* tall samples in one round and fills its other ranks with the samples that
do the most work per token -- the next longest, on their own groups -- so the idle time is paid
once.

`_shortlist` scans D over the tallest sample's heights on k = k_min .. 4 k_min ranks (at most
`_HEIGHTS` of them); for each D every sample, longest per-rank height first, takes the fewest ranks
that bring it under D while ranks remain.  A round's estimated waste is ``N * D`` minus the least
rank-time of the samples it holds, minus what its columns' spare time and tokens can still take of
the short samples.  The round of least waste is topped up with the longest samples that fit
under D, and the other samples are spread over the remaining rounds (`construct.spread`: multi-rank
samples over every round, single-rank ones up to each round's level); that start and the pass's
input then get half of the ``search`` pool each (`polish`).  The estimate only shortlists: the
runners-up (`_KEEP` in all) are built into starts too when the pool has room, and the fastest of
them is polished as well when it starts clearly (`_CLEARLY`) faster than the favourite -- on a
Wikipedia batch under a large per-token CP cost the favourite (32K documents on 9 ranks) started
at 0.75 efficiency and polished to 0.79, the runner-up (8 ranks) started at 0.81 and polished to
0.87.  The best of them is returned (never worse than the input): a plan that starts lower may
end higher, so none is judged before its search.
(A start whose other rounds came from the construct and level passes was tried too; its short
searches cost more than they won.)
"""

from __future__ import annotations

import numpy as np

from hdp.packing.cost import max_rank_tokens, padded_float
from hdp.packing.policies.common import left_starts
from hdp.packing.policies.hdp.columns import Columns
from hdp.packing.policies.hdp.construct import spread
from hdp.packing.policies.hdp.polish import polish
from hdp.packing.simulate import min_rounds

__all__ = ["tall_round", "needs_tall_round", "first_round_units"]

_TALL = 1.5  # a sample counts as tall above this multiple of a balanced round's height
_HEIGHTS = 12  # first-round heights scanned at most (the tallest sample on that many group sizes)
_CHUNK = 64  # samples scored at once by the top-up
_KEEP = 3  # first rounds (least estimated waste first) built into whole starts
_SHARE = 4  # the first rounds may take at most 1/4 of what is left of the ``search`` pool
_CLEARLY = 0.02  # a runner-up start is polished too when it starts this much faster than the favourite


def tall_round(cols: Columns, problem) -> Columns:
    """The tall-round pass (module docstring): the better of ``cols`` and the tall-first-round start,
    each after a local search with half the ``search`` pool; ``cols`` itself when no sample is tall
    or the pool cannot pay for the first round."""
    assert cols.complete, "tall_round needs every sample planned"
    meter = problem.meter
    units = first_round_units(problem) + 2 * problem.n  # the first round, the spread of the rest
    if not needs_tall_round(problem) or not meter.allows("search", _SHARE * units):
        return cols  # the starts' searches need the rest of the pool: a first round costing more is not worth it
    meter.charge("search", units)
    half = max(0, meter.left("search")) // 2  # for the input and the estimate's favourite start
    shortlist = _shortlist(problem)
    starts = [st for st in (_start(problem, *f) for f in shortlist[:1]) if st is not None]
    if not starts:
        return cols
    out = [polish(cols, problem, limit=half), polish(starts[0], problem, limit=half)]
    extra = first_round_units(problem, _KEEP) - first_round_units(problem) + 2 * (_KEEP - 1) * problem.n
    if len(shortlist) > 1 and meter.allows("search", extra):
        # the estimate only shortlists: the fastest of the next starts goes on with what is left
        meter.charge("search", extra)
        others = [st for st in (_start(problem, *f) for f in shortlist[1:_KEEP]) if st is not None]
        if others:
            other = problem.best(others)
            if problem.step_time(other) < problem.step_time(starts[0]) * (1 - _CLEARLY):
                out.append(polish(other, problem, limit=min(half, max(0, meter.left("search")))))
    return problem.best(out)


def _start(problem, chosen: np.ndarray, widths: np.ndarray) -> Columns | None:
    """A whole starting plan: the first round's groups (topped up, `_top_up`) in round 0, the other
    samples spread over the rounds after it; None when the spread does not fit the budget."""
    chosen, group, width = _top_up(problem.lengths, chosen, widths, problem.cost, problem.budget, problem.k_min)
    first = np.full(problem.n, -1, dtype=np.int64)
    first[chosen] = group
    base = Columns(col_of=first, round=np.zeros(width.size, dtype=np.int64),
                   start=left_starts(np.zeros(width.size, dtype=np.int64), width), width=width)
    rest = np.flatnonzero(first < 0)
    if rest.size == 0:
        return base
    sub = problem.sub(rest)
    sp = spread(sub, min_rounds(sub.lengths, problem.num_ranks, problem.budget))
    return None if sp is None else base.plus(sp, rest)


def needs_tall_round(problem) -> bool:
    """Whether some sample, even on its fewest ranks, is far taller than a balanced round."""
    lengths, k_min = problem.lengths, problem.k_min
    cost, N, B = problem.cost, problem.num_ranks, problem.budget
    h = cost.sample_cost(lengths, k_min)
    rounds = min_rounds(lengths, N, B)
    level = float((k_min * h).sum()) / (N * rounds)
    return lengths.size > 1 and float(h.max()) > _TALL * level and rounds > 1


def first_round_units(problem, keep: int = 1) -> int:
    """Work of `_shortlist` and ``keep`` top-ups in ``search`` units: the candidate heights' fills over the 2N
    tallest samples and the top-ups of the kept rounds, every sample against every group."""
    n, N = problem.n, problem.num_ranks
    return int(_HEIGHTS * min(n, 2 * N) * 16 + keep * n * min(n, N) // 4)


def _shortlist(problem) -> list[tuple[np.ndarray, np.ndarray]]:
    """Candidate first rounds before their top-up, least estimated waste first: (the tall samples
    [g], the width of each one's group [g])."""
    lengths, k_min, sizes = problem.lengths, problem.k_min, problem.sizes
    cost, N, B = problem.cost, problem.num_ranks, problem.budget
    h_min = cost.sample_cost(lengths, k_min)
    order = np.lexsort((np.arange(lengths.size), -h_min))  # tallest first
    cheapest = cost.cheapest_rank_time(lengths.astype(np.float64), k_min, N)
    t = int(order[0])
    # per-token rank-time of the short samples a column's spare room could still take (none: 0)
    single = k_min == 1
    rho = float(cheapest[single].sum() / max(1, lengths[single].sum())) if single.any() else 0.0
    ks = sizes[(sizes >= k_min[t]) & (sizes <= min(N, 4 * int(k_min[t])))]
    if ks.size > _HEIGHTS:  # a geometric selection of the tallest sample's group sizes
        ks = np.unique(ks[np.round(np.geomspace(1, ks.size, _HEIGHTS)).astype(np.int64) - 1])
    # the samples a first round can hold: each takes a rank at least, so the 2N tallest; their
    # height on every size up to 4x the widest candidate [S, K]
    top = order[: min(order.size, 2 * N)]
    kc = sizes[sizes <= min(N, 4 * int(ks[-1]))]
    H = cost.sample_cost(lengths[top][:, None], kc[None, :])
    H = np.where(kc[None, :] >= k_min[top][:, None], H, np.inf)
    found: list[tuple[float, np.ndarray, np.ndarray]] = []
    for k_t in ks.tolist():
        D = float(cost.sample_cost(int(lengths[t]), k_t))
        chosen, widths = _fill(top, H, kc, D, N)
        if chosen.size == 0 or chosen[0] != t:
            continue
        h = cost.sample_cost(lengths[chosen], widths)
        spare_time = widths * (D - h)
        spare_tok = widths * (B - max_rank_tokens(lengths[chosen], widths))
        topup = np.minimum(spare_time, spare_tok * rho)
        waste = N * D - float(cheapest[chosen].sum()) - float(topup.sum())
        found.append((waste, chosen, widths))
    found.sort(key=lambda f: f[0])
    return [(chosen, widths) for _, chosen, widths in found]


def _top_up(
    lengths: np.ndarray, chosen: np.ndarray, widths: np.ndarray, cost, B: int, k_min: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The remaining samples, longest first, join the round's groups (best fit) while the group
    stays within B tokens per rank and under the round's height: (samples [m], group of each [m],
    width of each group [g]).

    Groups only fill up, so a sample that fits no group now never will: each step scores the
    next samples against every group at once, places the first that fits and drops those before it.
    """
    g = chosen.size
    lp = padded_float(lengths[chosen], widths)
    sw, sl, sq = cost.work(lp), lp.copy(), lp * lp
    tok = max_rank_tokens(lengths[chosen], widths).astype(np.float64)
    D = float(cost.group_cost(sw, sl, sq, widths).max())
    col = list(range(g))
    members = list(chosen.tolist())
    taken = np.zeros(lengths.size, dtype=bool)
    taken[chosen] = True
    rest = np.flatnonzero(~taken)
    rest = rest[np.lexsort((rest, -lengths[rest]))]
    p = 0
    while p < rest.size and float(tok.min()) + 1 <= B:
        chunk = rest[p : p + _CHUNK]  # [S] the next samples
        L = np.broadcast_to(lengths[chunk][:, None], (chunk.size, g))
        W = np.broadcast_to(widths[None, :], L.shape)
        lpi = padded_float(L, W)  # [S, G]
        h_new = cost.group_cost(sw + cost.work(lpi), sl + lpi, sq + lpi * lpi, W)
        t_new = tok + max_rank_tokens(L.ravel(), W.ravel()).reshape(L.shape)
        ok = (h_new <= D) & (t_new <= B) & (W >= k_min[chunk][:, None])
        hit = np.flatnonzero(ok.any(axis=1))
        if hit.size == 0:
            p += chunk.size
            continue
        s = int(hit[0])
        cand = np.flatnonzero(ok[s])
        j = int(cand[np.argmax(h_new[s, cand])])  # best fit: the group left with least room
        sw[j] += float(cost.work(lpi[s, j]))
        sl[j] += lpi[s, j]
        sq[j] += lpi[s, j] * lpi[s, j]
        tok[j] = t_new[s, j]
        members.append(int(chunk[s]))
        col.append(j)
        p += s + 1
    return np.asarray(members, dtype=np.int64), np.asarray(col, dtype=np.int64), widths


def _fill(top: np.ndarray, H: np.ndarray, kc: np.ndarray, D: float, N: int) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``top`` (tallest first) each on the fewest of the sizes ``kc`` whose height ``H``
    [S, K] brings it under D, while ranks remain (a sample whose size does not fit what is left is
    skipped)."""
    fits = H <= D * (1 + 1e-12)
    need = np.where(fits.any(axis=1), kc[np.argmax(fits, axis=1)], N + 1).tolist()  # [S] fewest ranks
    free = N
    chosen: list[int] = []
    widths: list[int] = []
    for i, k in zip(top.tolist(), need):
        if free <= 0:
            break
        if k <= free:
            chosen.append(i)
            widths.append(k)
            free -= k
    return np.asarray(chosen, dtype=np.int64), np.asarray(widths, dtype=np.int64)
