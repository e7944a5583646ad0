"""The simulator: step time T(plan), the lower bound T*, efficiency and per-rank figures.

A step is the plan's rounds in order.  Without a pipeline its time is

    T = sum_r top_r + R * beta

where ``top_r`` is round r's slowest rank (its groups are disjoint, so its tallest group) and beta
the fixed cost of a round.  With a pipeline of PP stages every round is one micro-batch of the
1F1B schedule: each stage runs every micro-batch, and the pipeline's fill and drain put about
PP - 1 more micro-batches on the critical path, the slowest one at worst:

    T = sum_r top_r + R * beta + (PP - 1) * max_r top_r

so with PP the best plan may use more, smaller rounds.  (Times are per stage: a cost model
calibrated on a PP job measures a stage; a preset for the whole model scales every plan alike.)

On a domain over several nodes (``plan.node_of``) a group whose ranks span two or more nodes pays
the inter-node link on every ring step (`CostModel.group_cost`'s ``cross``), and the figures say
how much of the ring traffic crosses nodes: a group of k ranks over m >= 2 nodes moves its K/V
blocks over k ring edges, m of them between nodes (`hdp.packing.topology`), (k - 1) steps of
``sum Lp / k`` tokens each.  The bounds know that a group wider than the largest node crosses one.
"""

from __future__ import annotations

import functools

import numpy as np

from hdp.packing.cost import CostModel, min_group_size, padded_float
from hdp.packing.plan import Plan, PlanStats
from hdp.packing.topology import Nodes

__all__ = ["simulate", "lower_bound", "lower_bound_tight", "rank_time_floor", "min_rounds", "rank_loads", "round_times",
           "step_time", "ring_traffic"]


def min_rounds(lengths: np.ndarray, num_ranks: int, budget: int) -> int:
    """Fewest rounds the token budget allows: ceil(total tokens / (N * B)), at least 1."""
    total = int(np.asarray(lengths, dtype=np.int64).sum())
    return max(1, -(-total // (num_ranks * budget)))


def step_time(tops: np.ndarray, cost: CostModel, pipeline_stages: int = 1) -> float:
    """T of rounds whose slowest ranks take ``tops`` (units): sum + rounds * beta + (PP - 1) * max."""
    tops = np.asarray(tops, dtype=np.float64)
    if tops.size == 0:
        return 0.0
    return float(tops.sum()) + tops.size * cost.round_cost + (pipeline_stages - 1) * float(tops.max())


def rank_time_floor(lengths: np.ndarray, num_ranks: int, budget: int, cost: CostModel) -> np.ndarray:
    """[n] a floor of each sample's share of any plan's rank-time, whatever group it shares.

    A group of k ranks holding samples X costs k * `CostModel.group_cost` rank-time:
    ``sum_X work(Lp) + [k >= 2] sum_X ((k - 1) merge + cp) Lp`` (additive over its samples) plus
    ``k (k - 1) (step_overhead + max(0, un-hidden transfer))``, which its samples share.  The shared
    part is at least ``step_overhead * sum_X d (d + 1)`` with ``d = ceil(L / B) - 1``: the group holds
    at most kB tokens and ``L > d B``, so ``sum_X d <= k - 1``.  So every sample adds at least
    ``e(L, k) = work(Lp) + [k >= 2] ((k - 1) merge + cp) Lp + step_overhead d (d + 1)`` on its group
    size k, and the floor is the least e over the sizes it fits (k >= its fewest ranks, up to N):
    scanned exactly at the fewest four, and beyond them bounded with ``Lp >= L`` (e then grows with k).
    The un-hidden transfer is left out: samples sharing a group share its latency and hide each
    other's transfer, so no per-sample share of it is a valid floor.
    """
    length = np.asarray(lengths, dtype=np.int64)
    N = int(num_ranks)
    L = length.astype(np.float64)
    k_min = np.minimum(min_group_size(length, budget, N), N)
    d = np.maximum(0, -(-length // budget) - 1).astype(np.float64)
    shared = cost.step_overhead * d * (d + 1.0)

    best = np.full(length.size, np.inf)
    for extra in range(4):
        k = np.minimum(k_min + extra, N).astype(np.float64)
        lp = padded_float(length, k)
        best = np.minimum(best, cost.work(lp) + cost.split_per_token(k) * lp)
    beyond = k_min + 4 <= N  # every larger size: e >= its value at k_min + 4 with Lp = L
    k = np.minimum(k_min + 4, N).astype(np.float64)
    best = np.where(beyond, np.minimum(best, cost.work(L) + cost.split_per_token(k) * L), best)
    return best + shared


def lower_bound(
    lengths: np.ndarray, num_ranks: int, budget: int, cost: CostModel, pipeline_stages: int = 1,
    node_ranks: int | None = None,
) -> float:
    """T* (units): no plan of these lengths under this budget is faster.

    Every sample at its least share of rank-time on any feasible group (`rank_time_floor`: its
    work and per-token CP terms on its cheapest size, and the part of the ring's fixed cost no
    group can avoid): W = their sum / N, plus the minimum rounds * beta.  With PP stages, R rounds also
    pay (PP - 1) times a round at least max(W / R, h) tall, h the longest sample's least height on
    any group -- minimised over R >= the minimum rounds.  The bound ignores shapes, so one T*
    serves every policy of a case.  ``node_ranks``: the largest node of the domain (``None``: one
    node); a group wider than it crosses nodes and is priced so (`CostModel.wide_cost`).
    """
    length = np.asarray(lengths, dtype=np.int64)
    k_min = np.minimum(min_group_size(length, budget, num_ranks), num_ranks)
    W = float(rank_time_floor(length, num_ranks, budget, cost).sum() / num_ranks)
    r_min = min_rounds(length, num_ranks, budget)
    beta = cost.round_cost
    if pipeline_stages == 1 or length.size == 0:
        return W + r_min * beta
    p = pipeline_stages - 1
    i = int(np.argmax(length))  # a sample's least height grows with its length: the longest decides
    ks = np.arange(int(k_min[i]), num_ranks + 1)
    h = float(cost.wide_cost(np.full(ks.size, length[i]), ks, node_ranks).min())
    cands = {r_min, max(r_min, int(np.floor(W / h))), max(r_min, int(np.ceil(W / h)))}
    if beta > 0:
        r0 = np.sqrt(p * W / beta)
        cands |= {max(r_min, int(np.floor(r0))), max(r_min, int(np.ceil(r0)))}
    return W + min(r * beta + p * max(h, W / r) for r in cands if r >= 1)


_TIGHT_GRID = 64  # rounds' heights the tight bound tries (geometric), fewer on huge batches


def lower_bound_tight(
    lengths: np.ndarray, num_ranks: int, budget: int, cost: CostModel, pipeline_stages: int = 1,
    node_ranks: int | None = None,
) -> float:
    """T*_tight (units): the largest of `lower_bound`, the bound below and
    `hdp.packing.round_bound.round_capacity_bound` (the token slots a tall round strands); every
    one is a lower bound of every plan's T.  Cached per batch (the suite asks once per policy).

    The bound below counts what tall samples force on every plan.

    `lower_bound` prices every sample at its cheapest group and lets the rounds absorb it
    perfectly.  Two costs no plan avoids are missing there: a sample whose round is at most t tall
    must run on a group where it is at most t tall -- for a long sample a wide group, which pays the
    per-token CP terms on every rank -- and the round holding the longest sample is as tall as that
    sample's group, but holds at most N * B tokens, which may not be enough work to fill its other
    ranks.  The bound (``n`` samples, rounds r with tops t_r, t = max_r t_r, S = sum_r t_r, so
    T = S + R * beta + (PP - 1) * t):

    1. *Per-sample rank-time.*  A group of k ranks holding samples X costs each rank at least
       ``sum_X [work(L) + [k >= 2] (cp + merge (k - 1)) L] / k + [k >= 2] (k - 1) * step_overhead``
       (`CostModel.group_cost` with the padding, the un-hidden transfer dropped: every dropped term
       is >= 0 and ``Lp >= L``).  Samples with ``L > B`` in a group satisfy ``sum_X d_s <= k - 1`` for
       ``d_s = ceil(L_s / B) - 1`` (the group holds at most kB tokens and ``L_s > d_s B``), so
       ``k (k - 1) >= sum_X d_s (d_s + 1)``: the group's fixed ring cost covers
       ``e_o(L) = step_overhead * d (d + 1)`` for each of them.  With
       ``e(L, k) = work(L) + [k >= 2] (cp + merge (k - 1)) L + e_o(L)`` the rank-time of every plan
       is at least ``sum_s e(L_s, k_s)``, k_s the size of s's group.
    2. *Heights.*  Adding a sample to a group never lowers its per-rank cost (the hidden-transfer
       credit it adds, (k - 1) Lp**2 / k**2, is less than its own attention work Lp**2 / k), so a
       group is at least as tall as any of its samples alone: ``h(L_s, k_s) <= t_{r(s)} <= t`` with
       h = `CostModel.sample_cost`.  Hence ``k_s >= k*(L_s, t) = min{k >= k_min : h(L_s, k) <= t}``
       and, e being non-decreasing in k, ``e(L_s, k_s) >= rho_s(t) = e(L_s, k*(L_s, t))``;
       rho_s is non-increasing in t.
    3. *The round of the longest sample* s* (any sample would do), r* with top t' <= t, holds
       samples of at most N * B tokens (every rank holds at most B).  Its ranks' time N t' covers its
       samples' rank-time and whatever they leave idle: with any lower bounds rho_s of the samples'
       rank-time, ``N t' >= sum_{r*} rho_s``, and the rank-time of all other rounds is at least the
       rest, so ``N S >= sum_{s != s*} rho_s + max(e(L*, k), N h(L*, k) - K)`` where k is s*'s group
       size (``t' >= h(L*, k)``) and K >= sum_{s in r*, s != s*} rho_s is the fractional knapsack of
       the other samples (value rho_s, weight L_s, capacity N B - L*).  Over all k with
       ``h(L*, k) <= t``, the least such term, m(t), bounds it.
    4. S >= t, and R >= max(min rounds, S / t).

    For t in an interval [t_i, t_{i+1}) every rho_s(t) >= rho_s(t_{i+1}), and those values are used
    throughout the interval (in the sum and in K alike), so the interval's bound is
    ``S_i = max(t_i, (sum_{s != s*} rho_s(t_{i+1}) + m_i) / N)``,
    ``T >= S_i + (PP - 1) t_i + beta * max(r_min, ceil(S_i / t_{i+1}))``; the last interval
    [t_G, inf) takes each sample's rho at its fewest ranks.  The plan's own t lies in one of the
    intervals (t >= the longest sample's least height t_0), so the least interval bound is a lower
    bound of T.  The intervals are geometric between t_0 and the height above which no sample needs
    a wider group; samples tall enough to vary are tabulated over every group size (at most
    `hdp.packing.round_bound.tabulated`'s cap; the rest keep rho at their fewest ranks, which is lower: still valid).

    On a domain over nodes (``node_ranks``: its largest node) every height h is that of a group
    wider than the largest node priced with the inter-node link (`CostModel.wide_cost`): such a
    group crosses a boundary wherever it sits, and one no wider may sit inside a node, so h stays
    a lower bound of the group's height and every step above holds as written.
    """
    length = np.ascontiguousarray(lengths, dtype=np.int64)
    nodes = None if node_ranks is None or node_ranks >= num_ranks else int(node_ranks)
    return _tight_cached(length.tobytes(), int(num_ranks), int(budget), cost, int(pipeline_stages), nodes)


@functools.lru_cache(maxsize=8)  # the suite asks once per policy of a case in turn; keys hold the lengths
def _tight_cached(data: bytes, N: int, B: int, cost: CostModel, pipeline_stages: int, node_ranks: int | None) -> float:
    """`lower_bound_tight` of the batch whose int64 lengths are ``data``."""
    from hdp.packing.round_bound import TallBatch, round_capacity_bound  # it imports this module

    length = np.frombuffer(data, dtype=np.int64)
    n = int(length.size)
    if n == 0:
        return 0.0
    plain = lower_bound(length, N, B, cost, pipeline_stages, node_ranks)
    p, beta = pipeline_stages - 1, cost.round_cost
    tb = TallBatch.of(length, N, B, cost, node_ranks)  # fewest ranks, floors, s* on every size, the varying samples
    r_min, L, k_min, star, e = tb.r_min, tb.L, tb.k_min, tb.star, tb.e
    ks, h_star, e_star, t0, rho0, var = tb.ks, tb.h_star, tb.e_star, tb.t0, tb.rho, tb.var
    h_kmin = cost.wide_cost(length[var], k_min[var], node_ranks)
    t_top = float(max(h_kmin.max(initial=t0), t0))
    grid_n = max(4, min(_TIGHT_GRID, (1 << 21) // n))
    grid = np.unique(np.concatenate([
        np.geomspace(t0, t_top, grid_n) if t_top > t0 else [t0], [t0, t_top],
        h_star[(h_star > t0) & (h_star < t_top)] if ks.size <= 256 else [],
    ]))
    his = np.r_[grid[1:], np.inf]  # [G] interval [grid[g], his[g])
    # rho of the varying samples at every interval's upper end: e at the first k >= k_min whose
    # prefix-minimum height is <= t (rows of -H are non-decreasing: one flat sorted search)
    rho_var = np.broadcast_to(rho0[var][:, None], (var.size, his.size)).copy()  # [V, G]
    feasible = np.ones(his.size, dtype=bool)
    if var.size:
        k_at, found = tb.var_fit(np.where(np.isfinite(his), his, t_top))
        feasible = found.all(axis=0)
        rho_var = e(var[:, None], k_at)
    # the fractional knapsack of the others (value rho, weight L, capacity N B - L*): the static
    # samples sorted once, truncated where they alone fill the capacity (the varying ones only push
    # static ones out), the varying ones merged in per interval
    cap = float(N) * B - float(L[star])
    static = np.ones(n, dtype=bool)
    static[star] = False
    static[var] = False
    st = np.flatnonzero(static)
    st = st[np.lexsort((st, -rho0[st] / L[st]))]
    w_st = np.cumsum(L[st])
    st = st[: int(np.searchsorted(w_st, cap, side="left")) + 1]
    ds, ws, vs = rho0[st] / L[st], L[st], rho0[st]
    ws_before = np.r_[0.0, np.cumsum(ws)[:-1]]
    rest_sum = float(rho0[static].sum())

    def knapsack(v_val: np.ndarray) -> float:
        if var.size == 0:
            take = np.clip((cap - ws_before) / ws, 0.0, 1.0)
            return float((take * vs).sum())
        dv = v_val / L[var]
        o = np.lexsort((var, -dv))
        dv, wv, vv = dv[o], L[var][o], v_val[o]
        pos = np.searchsorted(-ds, -dv, side="left")  # static items before each varying one
        cwv = np.r_[0.0, np.cumsum(wv)]
        v_before = np.r_[0.0, np.cumsum(ws)][pos] + cwv[:-1]  # [V]
        s_before = ws_before + cwv[np.searchsorted(pos, np.arange(ds.size), side="right")]  # [S]
        take_s = np.clip((cap - s_before) / ws, 0.0, 1.0)
        take_v = np.clip((cap - v_before) / wv, 0.0, 1.0)
        return float((take_s * vs).sum() + (take_v * vv).sum())

    best = np.inf
    for g, (lo, hi) in enumerate(zip(grid.tolist(), his.tolist())):
        if not feasible[g]:
            continue  # some sample is taller than hi on every group: no plan's t lies here
        ok = h_star < hi
        if not ok.any():
            continue
        K = knapsack(rho_var[:, g])
        m = float(np.min(np.maximum(e_star[ok], N * h_star[ok] - K)))
        S = max(lo, (rest_sum + float(rho_var[:, g].sum()) + m) / N)
        rounds = r_min if not np.isfinite(hi) else max(r_min, int(np.ceil(S / hi - 1e-12)))
        best = min(best, S + p * lo + beta * rounds)
    best = max(best, plain)
    return float(max(best, round_capacity_bound(length, N, B, cost, pipeline_stages, upper=best, batch=tb,
                                                node_ranks=node_ranks)))


def _groups(plan: Plan, cost: CostModel) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(round, first rank, size, per-rank cost) of every group of the plan (exact group costs, a ring
    across nodes on the inter-node link)."""
    N = plan.num_ranks
    if plan.num_samples == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, np.zeros(0)
    k = plan.group_size
    padded = padded_float(plan.lengths, k)
    key = plan.round_of * (N + 1) + plan.group_start
    uniq, inv = np.unique(key, return_inverse=True)
    n_groups = uniq.size
    sum_work = np.bincount(inv, weights=cost.work(padded), minlength=n_groups)
    sum_len = np.bincount(inv, weights=padded, minlength=n_groups)
    sum_sq = np.bincount(inv, weights=padded * padded, minlength=n_groups)
    g_k = np.zeros(n_groups, dtype=np.int64)
    g_k[inv] = k
    g_start = uniq % (N + 1)
    nodes = Nodes.of(plan.node_of, N)
    cross = False if nodes is None else nodes.crosses(g_start, g_k)
    g_cost = cost.group_cost(sum_work, sum_len, sum_sq, g_k, cross)
    return uniq // (N + 1), g_start, g_k, np.asarray(g_cost, dtype=np.float64)


def ring_traffic(plan: Plan) -> tuple[float, float, int]:
    """(ring traffic, the part of it between nodes, groups whose ring crosses nodes) of the plan, the
    traffic in token-steps: a group of k >= 2 ranks moves (k - 1) * sum Lp tokens over its k ring
    edges, m of them between nodes when it spans m >= 2 nodes (module docstring)."""
    k = plan.group_size
    multi = k > 1
    if not multi.any():
        return 0.0, 0.0, 0
    lp = padded_float(plan.lengths[multi], k[multi])
    km = k[multi].astype(np.float64)
    total = float(((km - 1.0) * lp).sum())
    nodes = Nodes.of(plan.node_of, plan.num_ranks)
    if nodes is None:
        return total, 0.0, 0
    m = nodes.spans(plan.group_start[multi], k[multi]).astype(np.float64)
    edges = np.where(m > 1, m, 0.0)
    crossing = float(((km - 1.0) * lp * edges / km).sum())
    keys = np.unique(plan.round_of[multi][m > 1] * (plan.num_ranks + 1) + plan.group_start[multi][m > 1])
    return total, crossing, int(keys.size)


def round_times(plan: Plan, cost: CostModel, groups: tuple[np.ndarray, ...] | None = None) -> np.ndarray:
    """[R] time of every round: its tallest group (units), computed exactly per group (``groups``:
    `_groups` of the plan when the caller has them)."""
    g_round, _, _, g_cost = groups if groups is not None else _groups(plan, cost)
    top = np.zeros(plan.num_rounds)
    np.maximum.at(top, g_round, g_cost)
    return top


def rank_loads(plan: Plan, cost: CostModel, groups: tuple[np.ndarray, ...] | None = None) -> np.ndarray:
    """[R, N] busy time of every rank in every round (units)."""
    R, N = plan.num_rounds, plan.num_ranks
    loads = np.zeros((R, N + 1), dtype=np.float64)
    g_round, g_start, g_k, g_cost = groups if groups is not None else _groups(plan, cost)
    # difference array along ranks: +c at start, -c after the last rank of the group
    np.add.at(loads, (g_round, g_start), g_cost)
    np.add.at(loads, (g_round, g_start + g_k), -g_cost)
    return np.cumsum(loads, axis=1)[:, :N]


def simulate(plan: Plan, cost: CostModel, planner_ms: float = 0.0, pipeline_stages: int = 1, *,
             tight: bool = False) -> PlanStats:
    """Evaluate ``plan`` under ``cost`` (with ``pipeline_stages`` PP stages): T, T*, efficiency,
    idle ratios, histogram, tokens; with ``tight`` also T*_tight and its efficiency (a diagnostic
    that costs as much as a plan on large batches, so :func:`hdp.packing.plan` leaves it out: the
    suite and the command line ask for it)."""
    if isinstance(pipeline_stages, bool) or not isinstance(pipeline_stages, int) or pipeline_stages < 1:
        raise ValueError(f"pipeline_stages={pipeline_stages!r}: pass the number of pipeline stages (>= 1)")
    groups = _groups(plan, cost)
    loads = rank_loads(plan, cost, groups)
    round_max = round_times(plan, cost, groups)
    compute_time = float(round_max.sum())
    fill = (pipeline_stages - 1) * float(round_max.max()) if round_max.size else 0.0
    total = step_time(round_max, cost, pipeline_stages)
    nodes = Nodes.of(plan.node_of, plan.num_ranks)
    cap = None if nodes is None else nodes.largest
    bound = lower_bound(plan.lengths, plan.num_ranks, plan.max_tokens_per_rank, cost, pipeline_stages, cap)
    tight_lb = (lower_bound_tight(plan.lengths, plan.num_ranks, plan.max_tokens_per_rank, cost, pipeline_stages, cap)
                if tight else None)
    traffic, crossing, crossing_groups = ring_traffic(plan)
    busy = loads.sum(axis=0) if plan.num_rounds else np.zeros(plan.num_ranks)
    idle = 1.0 - busy / compute_time if compute_time > 0 else np.zeros(plan.num_ranks)
    sizes, counts = np.unique(plan.group_size, return_counts=True)
    tokens = plan.tokens_per_rank()
    return PlanStats(
        step_time=total,
        lower_bound=bound,
        efficiency=bound / total if total > 0 else 1.0,
        step_time_s=total * cost.unit_time_s,
        lower_bound_s=bound * cost.unit_time_s,
        rounds=plan.num_rounds,
        min_rounds=min_rounds(plan.lengths, plan.num_ranks, plan.max_tokens_per_rank),
        busy=busy,
        idle_ratio=idle,
        max_idle_ratio=float(idle.max()) if idle.size else 0.0,
        cp_degree_hist={int(s): int(c) for s, c in zip(sizes, counts)},
        tokens_per_rank=tokens,
        max_tokens_per_rank=int(tokens.max()) if tokens.size else 0,
        planner_ms=planner_ms,
        pipeline_stages=pipeline_stages,
        pipeline_fill=fill,
        lower_bound_tight=tight_lb,
        efficiency_tight=None if tight_lb is None else (tight_lb / total if total > 0 else 1.0),
        token_budget=int(plan.max_tokens_per_rank),
        nodes=1 if nodes is None else nodes.count,
        cross_node_fraction=crossing / traffic if traffic > 0 else 0.0,
        cross_node_groups=crossing_groups,
    )
