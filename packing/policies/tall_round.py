"""A first round built around the batch's tallest samples, for the `hdp` policy.

When a few samples are far taller than a balanced round (a 32K sample among 1.5K ones), a round
that holds one of them lasts its height D while every other rank of the round can fill only B
tokens of shorter samples, which take less time: the rest of that round idles.  Widening the tall
sample lowers D but costs ring overhead (its K/V transfer stops hiding behind attention).  The
best trade puts *all* tall samples in one round and fills its other ranks with the samples that
do the most work per token -- the next longest, on their own groups -- so the idle time is paid
once.

`tall_round` scans D over the tallest sample's heights on k = k_min .. 4 k_min ranks; for each D
every sample, longest per-rank height first, takes the fewest ranks that bring it under D while
ranks remain.  A round's estimated waste is ``N * D`` minus the least rank-time of the samples it
holds, minus what its columns' spare time and tokens can still take of the short samples (the
fill `polish` does later).  The rounds with the least waste are returned; the caller plans the
remaining samples and keeps the best whole plan.
"""

from __future__ import annotations

import numpy as np

from hdp.packing.config import PlannerConfig
from hdp.packing.cost import max_rank_tokens, padded_length
from hdp.packing.simulate import min_rounds

__all__ = ["tall_round", "needs_tall_round"]

_TALL = 1.5  # a sample counts as tall above this multiple of a balanced round's height


def needs_tall_round(lengths: np.ndarray, k_min: np.ndarray, config: PlannerConfig) -> bool:
    """Whether some sample, even on its fewest ranks, is far taller than a balanced round."""
    cost, N, B = config.cost, config.num_ranks, config.max_tokens_per_rank
    h = cost.sample_cost(lengths, k_min)
    rounds = min_rounds(lengths, N, B)
    level = float((k_min * h).sum()) / (N * rounds)
    return lengths.size > 1 and float(h.max()) > _TALL * level and rounds > 1


def tall_round(
    lengths: np.ndarray, k_min: np.ndarray, config: PlannerConfig, sizes: np.ndarray, keep: int = 2,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Up to ``keep`` candidate first rounds, least estimated waste first: (samples [m], group of
    each [m], width of each group [g]); the caller lays the groups out."""
    cost, N, B = config.cost, config.num_ranks, config.max_tokens_per_rank
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
