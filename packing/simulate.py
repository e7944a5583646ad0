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
"""

from __future__ import annotations

import numpy as np

from hdp.packing.cost import CostModel, min_group_size, padded_length
from hdp.packing.plan import Plan, PlanStats

__all__ = ["simulate", "lower_bound", "min_rounds", "rank_loads", "round_times", "step_time"]


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


def lower_bound(
    lengths: np.ndarray, num_ranks: int, budget: int, cost: CostModel, pipeline_stages: int = 1,
) -> float:
    """T* (units): no plan of these lengths under this budget is faster.

    Every sample at its cheapest feasible group size (from the zigzag-exact ceil(L/B) up to N):
    W = their summed rank-time / N, plus the minimum rounds * beta.  With PP stages, R rounds also
    pay (PP - 1) times a round at least max(W / R, h) tall, h the longest sample's least height on
    any group -- minimised over R >= the minimum rounds.  The bound ignores shapes, so one T*
    serves every policy of a case.
    """
    length = np.asarray(lengths, dtype=np.int64)
    k_min = np.minimum(min_group_size(length, budget, num_ranks), num_ranks)
    rank_time = cost.cheapest_rank_time(length, k_min, num_ranks)
    W = float(rank_time.sum() / num_ranks)
    r_min = min_rounds(length, num_ranks, budget)
    beta = cost.round_cost
    if pipeline_stages == 1 or length.size == 0:
        return W + r_min * beta
    p = pipeline_stages - 1
    i = int(np.argmax(length))  # a sample's least height grows with its length: the longest decides
    ks = np.arange(int(k_min[i]), num_ranks + 1)
    h = float(cost.sample_cost(np.full(ks.size, length[i]), ks).min())
    cands = {r_min, max(r_min, int(np.floor(W / h))), max(r_min, int(np.ceil(W / h)))}
    if beta > 0:
        r0 = np.sqrt(p * W / beta)
        cands |= {max(r_min, int(np.floor(r0))), max(r_min, int(np.ceil(r0)))}
    return W + min(r * beta + p * max(h, W / r) for r in cands if r >= 1)


def _groups(plan: Plan, cost: CostModel) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(round, first rank, size, per-rank cost) of every group of the plan (exact group costs)."""
    N = plan.num_ranks
    if plan.num_samples == 0:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, np.zeros(0)
    k = plan.group_size
    padded = padded_length(plan.lengths, k).astype(np.float64)
    key = plan.round_of * (N + 1) + plan.group_start
    uniq, inv = np.unique(key, return_inverse=True)
    n_groups = uniq.size
    sum_work = np.bincount(inv, weights=cost.work(padded), minlength=n_groups)
    sum_len = np.bincount(inv, weights=padded, minlength=n_groups)
    sum_sq = np.bincount(inv, weights=padded * padded, minlength=n_groups)
    g_k = np.zeros(n_groups, dtype=np.int64)
    g_k[inv] = k
    g_cost = cost.group_cost(sum_work, sum_len, sum_sq, g_k)
    return uniq // (N + 1), uniq % (N + 1), g_k, np.asarray(g_cost, dtype=np.float64)


def round_times(plan: Plan, cost: CostModel) -> np.ndarray:
    """[R] time of every round: its tallest group (units), computed exactly per group."""
    g_round, _, _, g_cost = _groups(plan, cost)
    top = np.zeros(plan.num_rounds)
    np.maximum.at(top, g_round, g_cost)
    return top


def rank_loads(plan: Plan, cost: CostModel) -> np.ndarray:
    """[R, N] busy time of every rank in every round (units)."""
    R, N = plan.num_rounds, plan.num_ranks
    loads = np.zeros((R, N + 1), dtype=np.float64)
    g_round, g_start, g_k, g_cost = _groups(plan, cost)
    # difference array along ranks: +c at start, -c after the last rank of the group
    np.add.at(loads, (g_round, g_start), g_cost)
    np.add.at(loads, (g_round, g_start + g_k), -g_cost)
    return np.cumsum(loads, axis=1)[:, :N]


def simulate(plan: Plan, cost: CostModel, planner_ms: float = 0.0, pipeline_stages: int = 1) -> PlanStats:
    """Evaluate ``plan`` under ``cost`` (with ``pipeline_stages`` PP stages): T, T*, efficiency,
    idle ratios, histogram, tokens."""
    if isinstance(pipeline_stages, bool) or not isinstance(pipeline_stages, int) or pipeline_stages < 1:
        raise ValueError(f"pipeline_stages={pipeline_stages!r}: pass the number of pipeline stages (>= 1)")
    loads = rank_loads(plan, cost)
    round_max = round_times(plan, cost)
    compute_time = float(round_max.sum())
    fill = (pipeline_stages - 1) * float(round_max.max()) if round_max.size else 0.0
    total = step_time(round_max, cost, pipeline_stages)
    bound = lower_bound(plan.lengths, plan.num_ranks, plan.max_tokens_per_rank, cost, pipeline_stages)
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
    )
