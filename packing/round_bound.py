"""A lower bound on the step time that counts the token slots a tall round strands.

`hdp.packing.simulate.lower_bound_tight` lets the round of the longest sample s* be filled by any
samples of at most N * B tokens in all.  A real round cannot mix that freely: every rank holds at
most B tokens *and* runs at most the round's top t, and a sample widened so that it is no taller
than t uses whole ranks' time while leaving half their token slots empty (a 32K document on 8
ranks under B = 8K), while short documents fill a rank's B tokens in far less than t.  The bound
here prices each sample by the ranks it uses in that round, in time and in tokens at once.

Let round r* hold s* and have top t' <= t'' (t'' the upper end of an interval of tops).  Group
its ranks by the size k of the group they belong to: n_k ranks, sum n_k <= N.  A group of k ranks
runs at most t'' and its rank-time covers ``e(L, k)`` of every sample it holds (`e`: work and
per-token CP terms, `hdp.packing.simulate.rank_time_floor`'s floor), and it holds at most kB
tokens.  So the samples s in size-k groups satisfy ``sum e(L_s, k) <= n_k t''`` and
``sum L_s <= n_k B``, and for any weight theta_k in [0, 1]

    sum_s [theta_k e(L_s, k) / t'' + (1 - theta_k) L_s / B] <= n_k.

A sample may be in r* only on a size k >= its fewest ranks where it alone is no taller than t''
(a group is at least as tall as any of its samples); ``u_s``, the least left-hand term over those
sizes, is therefore a lower bound on the ranks s uses, and ``sum_{s in r*} u_s <= N``.  With one
theta for k = 1 and one for k >= 2 the least term is at k = 1 or at the first size >= 2 that fits
(``e`` grows with k).  The samples other than s* in r* are then a fractional knapsack: values
``rho_s`` (each sample's rank-time at its fewest ranks), weights u_s, capacity ``N - u_{s*}``; M,
its optimum, bounds the rank-time r* can take off the other rounds.  Every other round holds the
rest, so

    N * S >= N * t' + sum_{s != s*} rho_s - M,

and T >= t' + max(0, (sum_{s != s*} rho_s - M) / N) + (PP - 1) t' + beta * (fewest rounds) for
t' in [t'_lo, t'').  Two cases of the tallest round's top t >= t' sharpen it: for t < t'' every
sample's rho may be taken on the sizes where it is no taller than t'' (case A); for t in
[c_j, c_{j+1}) above t'' that round is not r*, so S >= t' + t as well, with rho at c_{j+1}
(case B, cuts c_j geometric up to the grid's top).  An interval's bound is its least case; the
least over a cover of [s*'s least height, inf) by intervals is a lower bound of every plan's T.
Several (theta_1, theta_2) pairs are tried (each gives a valid bound: the largest is kept).  The
cover is refined by branch and bound: the lowest intervals are cut, a child keeping its parent's
bound where that is higher (it holds on the child too), until the lowest is narrow or the work
cap (knapsack columns x samples) is spent; case B columns that cannot be the lowest are not
evaluated (their cheap bound t' + PP c_j + beta r_min already is no lower).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hdp.packing.cost import CostModel, min_group_size
from hdp.packing.simulate import min_rounds

__all__ = ["round_capacity_bound", "FirstFit", "TallBatch", "tabulated"]

_THETAS = ((0.0, 1.0), (0.0, 0.5), (1.0, 1.0))
"""(theta for k = 1, theta for k >= 2) tried on every interval."""
_GRID = 12  # intervals of t' (geometric) the branch and bound starts from
_SPLIT = 4  # sub-intervals each of the lowest intervals is cut into
_BATCH = 4  # lowest intervals cut per step
_WIDTH = 1e-4  # an interval this narrow (relative) is not cut
_CUTS = 8  # intervals of the tallest round's top (case B) above each interval of t'
_ROWS = 1 << 18  # samples x group sizes tabulated at most (the others keep their smallest size: valid)
_MIN_COLUMNS = 48  # knapsack columns the work cap must allow for a start (fewer: no bound)
_WORK = 1 << 19  # knapsack columns x samples at most (the search stops there; too few for a start: no bound)


class FirstFit:
    """For samples (``length[i]``, sizes from ``k_lo[i]`` up to N), the first group size on which each
    sample alone is no taller than a given height: the [V, N] table of heights is built once (its
    rows' prefix minima), every query is one sorted search."""

    def __init__(self, length: np.ndarray, k_lo: np.ndarray, num_ranks: int, cost: CostModel,
                 node_ranks: int | None = None) -> None:
        N = int(num_ranks)
        V = int(length.size)
        self.V, self.N = V, N
        if V == 0:
            return
        kk = np.arange(1, N + 1)
        Lv = np.broadcast_to(np.asarray(length)[:, None], (V, N))
        H = cost.wide_cost(Lv, np.broadcast_to(kk, Lv.shape), node_ranks)  # [V, N]
        H = np.minimum.accumulate(np.where(kk[None, :] >= np.asarray(k_lo)[:, None], H, np.inf), axis=1)
        self.big = 4.0 * float(np.nanmax(np.where(np.isfinite(H), H, 0.0))) + 1.0
        self.span = 2.0 * self.big
        # rows of -H are non-decreasing (sizes below k_lo: -1, below every query): one flat sorted
        # search finds every row's first fit
        self.flat = (np.arange(V)[:, None] * self.span + np.where(np.isfinite(H), self.big - H, -1.0)).ravel()

    def __call__(self, heights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(k [V, G], found [V, G]) for heights [G] (inf: any size); k is N where none is found."""
        t = np.asarray(heights, dtype=np.float64)
        if self.V == 0:
            return np.zeros((0, t.size), dtype=np.int64), np.zeros((0, t.size), dtype=bool)
        t_q = np.where(np.isfinite(t), np.minimum(t, self.big), self.big)
        q = np.arange(self.V)[:, None] * self.span + (self.big - t_q)[None, :]  # [V, G]
        j = np.searchsorted(self.flat, q.ravel(), side="left").reshape(q.shape) - np.arange(self.V)[:, None] * self.N
        return np.minimum(j, self.N - 1) + 1, j < self.N


def tabulated(idx: np.ndarray, k_lo: np.ndarray, heights: np.ndarray, num_ranks: int) -> np.ndarray:
    """The samples ``idx`` (sizes from ``k_lo[idx]``) whose size tables fit `_ROWS` entries, tallest
    (``heights``) first, in index order; the rest keep their smallest size (a lower value: valid)."""
    if idx.size == 0:
        return idx
    width = (num_ranks + 1 - k_lo[idx]).astype(np.int64)
    order = np.lexsort((idx, -heights[idx]))
    return np.sort(idx[order[np.cumsum(width[order]) <= _ROWS]])


@dataclass(frozen=True, eq=False)
class TallBatch:
    """What the tight bounds derive from a batch: every sample's fewest ranks and rank-time floor
    there, the longest sample s* on every size, and the samples whose floor grows when rounds
    must be lower than their height at their fewest ranks (`var`, with their size table)."""

    length: np.ndarray  # [n] int64
    L: np.ndarray  # [n] float64
    k_min: np.ndarray  # [n] fewest ranks (at most N)
    fixed: np.ndarray  # [n] e(L, k) without the CP terms: work and the shared ring overhead's floor
    rho: np.ndarray  # [n] e at the fewest ranks
    star: int  # the longest sample (the first among equals)
    ks: np.ndarray  # [K*] s*'s sizes, k_min[s*] .. N
    h_star: np.ndarray  # [K*] s*'s height on each
    e_star: np.ndarray  # [K*] s*'s rank-time floor on each
    t0: float  # s*'s least height: every plan's tallest round is at least this tall
    r_min: int  # fewest rounds the budget allows
    var: np.ndarray  # samples (s* aside) taller than t0 at their fewest ranks, tabulated
    var_fit: FirstFit  # their first fitting size under a height
    cost: CostModel
    node_ranks: int | None = None  # the largest node (None: one): wider groups are priced across nodes

    @classmethod
    def of(cls, length: np.ndarray, num_ranks: int, budget: int, cost: CostModel,
           node_ranks: int | None = None) -> TallBatch:
        """The pieces of ``length`` (n >= 1) on ``num_ranks`` ranks of ``budget`` tokens (``node_ranks``:
        the largest node of the domain, None for one node: heights of wider groups on the inter-node link)."""
        N, B = int(num_ranks), int(budget)
        length = np.asarray(length, dtype=np.int64)
        L = length.astype(np.float64)
        k_min = np.minimum(min_group_size(length, B, N), N)
        d = np.maximum(0, -(-length // B) - 1).astype(np.float64)
        fixed = cost.work(L) + cost.step_overhead * d * (d + 1.0)
        star = int(np.argmax(length))
        ks = np.arange(int(k_min[star]), N + 1)
        h_star = cost.wide_cost(np.full(ks.size, length[star]), ks, node_ranks)
        t0 = float(h_star.min())
        h_kmin = cost.wide_cost(length, k_min, node_ranks)
        var = np.flatnonzero(h_kmin > t0)
        var = tabulated(var[var != star], k_min, h_kmin, N)
        return cls(length=length, L=L, k_min=k_min, fixed=fixed, rho=fixed + cost.split_per_token(k_min) * L,
                   star=star, ks=ks, h_star=h_star, e_star=fixed[star] + cost.split_per_token(ks) * L[star], t0=t0,
                   r_min=min_rounds(length, N, B), var=var,
                   var_fit=FirstFit(length[var], k_min[var], N, cost, node_ranks), cost=cost, node_ranks=node_ranks)

    def e(self, i: np.ndarray | int, k: np.ndarray) -> np.ndarray:
        """e(L_i, k): the rank-time floor of sample i on a group of k ranks."""
        return self.fixed[i] + self.cost.split_per_token(np.asarray(k, dtype=np.float64)) * self.L[i]

    def rho_at(self, heights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([n, E] each sample's least e on a size where it is no taller than each height, [E]
        whether every sample has one); the untabulated keep rho (lower: valid)."""
        vals = np.broadcast_to(self.rho[:, None], (self.rho.size, heights.size)).copy()
        ok = np.ones(heights.size, dtype=bool)
        if self.var.size:
            kv, found = self.var_fit(heights)
            vals[self.var] = self.e(self.var[:, None], kv)
            ok = found.all(axis=0)
        return vals, ok


def _knapsack(values: np.ndarray, weights: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """The fractional knapsack optimum of every row: values [C, n] (>= 0), weights [C, n] (>= 0;
    inf: the item is not allowed), capacity [C] -> [C] (the greedy by value per weight is exact)."""
    C, n = weights.shape
    if n == 0 or C == 0:
        return np.zeros(C)
    allowed = np.isfinite(weights)
    w = np.where(allowed, weights, 0.0)
    v = np.where(allowed, values, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(w > 0, v / np.where(w > 0, w, 1.0), np.inf)
    order = np.argsort(-np.where(v > 0, ratio, 0.0), axis=1, kind="stable")
    rows = np.arange(C)[:, None]
    w, v = w[rows, order], v[rows, order]
    room = capacity[:, None] - (np.cumsum(w, axis=1) - w)  # capacity left before each item
    take = np.where(w > 0, np.clip(room / np.where(w > 0, w, 1.0), 0.0, 1.0), 1.0)
    return (take * v).sum(axis=1)


def round_capacity_bound(
    lengths: np.ndarray, num_ranks: int, budget: int, cost: CostModel, pipeline_stages: int = 1,
    *, upper: float = 0.0, batch: TallBatch | None = None, node_ranks: int | None = None,
) -> float:
    """T (units) no plan beats, from the ranks the round of the longest sample can give the other
    samples (module docstring); ``-inf`` where it does not apply (one rank, fewer than two samples, a
    batch too large for its work cap).  The intervals of t' run geometrically from the longest
    sample's least height to ``max(4 x that, upper)`` (any ``upper`` gives a valid bound: a
    known lower bound is a good one), then one interval to infinity.  ``batch``: the batch's
    `TallBatch` when the caller has it (`lower_bound_tight` does); ``node_ranks``: the domain's largest
    node (None: one node), heights of wider groups priced on the inter-node link."""
    length = np.asarray(lengths, dtype=np.int64)
    n, N, B = int(length.size), int(num_ranks), int(budget)
    cols_left = _WORK // max(1, n)
    if n < 2 or N < 2 or cols_left < _MIN_COLUMNS:
        return -np.inf
    tb = TallBatch.of(length, N, B, cost, node_ranks) if batch is None else batch
    thetas = np.asarray(_THETAS, dtype=np.float64)  # [Th, 2]
    p, beta, r_min = pipeline_stages - 1, cost.round_cost, tb.r_min
    L, k_min, fixed, star = tb.L, tb.k_min, tb.fixed, tb.star
    others = np.flatnonzero(np.arange(n) != star)
    ks, h_star, e_star, t0 = tb.ks, tb.h_star, tb.e_star, tb.t0

    # option k = 1 (samples that fit one rank): e = work, height = work
    Lo, fo = L[others], fixed[others]
    one_ok = k_min[others] == 1
    # option k >= 2: the first size >= max(2, fewest) that fits; tabulated for samples taller than t0 there
    k2_lo = np.maximum(2, k_min[others])
    h2_lo = cost.wide_cost(length[others], k2_lo, node_ranks)
    tall = tabulated(np.flatnonzero(h2_lo > t0), k2_lo, h2_lo, N)
    fit2 = FirstFit(length[others][tall], k2_lo[tall], N, cost, node_ranks)

    cheap = beta * r_min  # every column's bound is at least t'_lo + (PP - 1) t_lo + this

    def interval_bounds(lo: np.ndarray, hi: np.ndarray, best: float) -> tuple[np.ndarray, int]:
        """([G] the bound of every interval [lo, hi) of t' (finite hi; inf where no plan's t' lies
        there), columns evaluated).  Cases of the tallest round's top t >= t': A, t in [t', hi) (the
        samples' rho at hi); B, t in [c_j, c_{j+1}) for cuts c_0 = hi < c_1 < ... < inf (rho at the
        upper end; r* and that round both count, so T >= t'_lo + c_j + ...).  A case B column whose
        cheap bound t'_lo + PP c_j + beta r_min is >= ``best`` keeps that bound (it cannot be the
        least) and is not evaluated."""
        G = lo.size
        # samples not tabulated fit at their smallest size >= 2 (no taller than t0 <= lo there, or
        # beyond the table's cap, where the smallest size only lowers e: still valid)
        k2 = np.broadcast_to(k2_lo[:, None], (others.size, G)).copy()
        ok2 = np.ones((others.size, G), dtype=bool)
        if tall.size:
            kt, found = fit2(hi)
            k2[tall], ok2[tall] = kt, found
        e2 = fo[:, None] + cost.split_per_token(k2) * Lo[:, None]  # [n-1, G]
        ok1 = one_ok[:, None] & (fo[:, None] <= hi[None, :])
        tok = Lo / B  # [n-1] ranks' worth of tokens
        fits_star = h_star[:, None] <= hi[None, :]  # [K*, G]
        any_star = fits_star.any(axis=0)
        cg, c_lo, c_end, cb = [], [], [], []
        for g in range(G):
            cuts = hi[g] * (t_top / hi[g]) ** (np.arange(1, _CUTS) / (_CUTS - 1)) if t_top > hi[g] else np.zeros(0)
            starts, ends = np.r_[lo[g], hi[g], cuts], np.r_[hi[g], cuts, np.inf]
            cg += [g] * starts.size
            c_lo += starts.tolist()
            c_end += ends.tolist()
            cb += [False] + [True] * (starts.size - 1)
        cg, c_lo, c_end, cb = np.asarray(cg), np.asarray(c_lo), np.asarray(c_end), np.asarray(cb)
        t_max = c_lo  # the tallest round's least top (t' itself in case A)
        floor = lo[cg] + np.where(cb, c_lo, 0.0) + p * t_max + cheap
        run = (floor < best) & any_star[cg]
        val = np.where(any_star[cg], floor, np.inf)
        idx = np.flatnonzero(run)
        if idx.size:
            ends_u, inv = np.unique(c_end[idx], return_inverse=True)
            rho_e, ok_e = tb.rho_at(ends_u)
            values = rho_e[others].T[inv]  # [C, n-1]
            rest_c = rho_e.sum(axis=0)[inv] - rho_e[star][inv]  # [C]
            gi = cg[idx]
            best_c = np.full(idx.size, -np.inf)
            for th1, th2 in thetas:
                u1 = np.where(ok1, th1 * fo[:, None] / hi[None, :] + (1 - th1) * tok[:, None], np.inf)
                u2 = np.where(ok2, th2 * e2 / hi[None, :] + (1 - th2) * tok[:, None], np.inf)
                u = np.minimum(u1, u2)  # [n-1, G]: ranks each sample uses at least in r*
                th_k = np.where(ks == 1, th1, th2)[:, None]
                u_star = th_k * e_star[:, None] / hi[None, :] + (1 - th_k) * (L[star] / B)
                u_star = np.where(fits_star, u_star, np.inf).min(axis=0)  # [G]
                cap = np.maximum(0.0, N - np.where(any_star, u_star, N))
                M = _knapsack(values, u.T[gi], cap[gi])
                others_s = np.maximum(0.0, (rest_c - M) / N)  # the other rounds' least time
                v = lo[gi] + np.where(cb[idx], np.maximum(c_lo[idx], others_s), others_s) + p * t_max[idx] + cheap
                best_c = np.maximum(best_c, v)  # every theta bounds M: the least M, the largest bound, counts
            val[idx] = np.where(ok_e[inv], np.maximum(best_c, floor[idx]), np.inf)
        out = np.full(G, np.inf)
        np.minimum.at(out, cg, val)  # an interval of t' is as low as its lowest case
        return out, int(idx.size)

    # branch and bound over t': a cover of [t0, inf) by intervals, each with a valid bound; the lowest
    # is cut into _SPLIT (a child keeps its parent's bound when that is higher: it holds there too)
    t_top = max(4.0 * t0, float(upper))
    edges = np.geomspace(t0, t_top, _GRID + 1)
    lo, hi = edges[:-1], edges[1:]
    vals, used = interval_bounds(lo, hi, np.inf)
    cols_left -= used
    lo, hi = np.r_[lo, t_top], np.r_[hi, np.inf]
    vals = np.r_[vals, t_top + p * t_top + cheap]  # t' >= t_top: T >= t' + (PP - 1) t'
    while cols_left > 0:
        pick = np.argsort(vals, kind="stable")[:_BATCH]
        pick = pick[np.isfinite(hi[pick]) & (hi[pick] > lo[pick] * (1 + _WIDTH)) & (vals[pick] < np.inf)]
        if pick.size == 0 or pick[0] != int(np.argmin(vals)):
            break  # the lowest interval is as fine as it gets (or holds no plan): its bound stands
        sub = np.geomspace(lo[pick], hi[pick], _SPLIT + 1, axis=1)  # [P, SPLIT + 1]
        rest_vals = np.delete(vals, pick)
        v_sub, used = interval_bounds(sub[:, :-1].ravel(), sub[:, 1:].ravel(),
                                      float(rest_vals.min()) if rest_vals.size else np.inf)
        cols_left -= max(used, 1)
        v_sub = np.maximum(v_sub, np.repeat(vals[pick], _SPLIT))
        lo, hi, vals = (np.r_[np.delete(lo, pick), sub[:, :-1].ravel()], np.r_[np.delete(hi, pick), sub[:, 1:].ravel()],
                        np.r_[rest_vals, v_sub])
    return float(vals.min())
