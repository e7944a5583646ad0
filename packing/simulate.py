"""The simulator: step time T(plan), the lower bound T*, efficiency and per-rank figures."""

from __future__ import annotations

import numpy as np

from hdp.packing.cost import CostModel, min_group_size, padded_length
from hdp.packing.plan import Plan, PlanStats

__all__ = ["simulate", "lower_bound", "min_rounds", "rank_loads"]


def min_rounds(lengths: np.ndarray, num_ranks: int, budget: int) -> int:
    """Fewest rounds the token budget allows: ceil(total tokens / (N * B)), at least 1."""
    total = int(np.asarray(lengths, dtype=np.int64).sum())
    return max(1, -(-total // (num_ranks * budget)))


def lower_bound(lengths: np.ndarray, num_ranks: int, budget: int, cost: CostModel) -> float:
    """T* = sum of each sample's cheapest feasible rank-time / N + min rounds * beta (units).

    Group sizes from ceil(L/B) (zigzag-exact) up to N are feasible; the bound ignores shapes, so
    one T* serves every policy of a case.
    """
    length = np.asarray(lengths, dtype=np.int64)
    k_min = np.minimum(min_group_size(length, budget, num_ranks), num_ranks)
    rank_time = cost.cheapest_rank_time(length, k_min, num_ranks)
    return float(rank_time.sum() / num_ranks + min_rounds(length, num_ranks, budget) * cost.round_cost)


def rank_loads(plan: Plan, cost: CostModel) -> np.ndarray:
    """[R, N] busy time of every rank in every round (units)."""
    R, N = plan.num_rounds, plan.num_ranks
    loads = np.zeros((R, N + 1), dtype=np.float64)
    if plan.num_samples == 0:
        return loads[:, :N]
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
    g_round, g_start = uniq // (N + 1), uniq % (N + 1)
    # difference array along ranks: +c at start, -c after the last rank of the group
    np.add.at(loads, (g_round, g_start), g_cost)
    np.add.at(loads, (g_round, g_start + g_k), -g_cost)
    return np.cumsum(loads, axis=1)[:, :N]


def simulate(plan: Plan, cost: CostModel, planner_ms: float = 0.0) -> PlanStats:
    """Evaluate ``plan`` under ``cost``: T, T*, efficiency, idle ratios, histogram, tokens."""
    loads = rank_loads(plan, cost)
    round_max = loads.max(axis=1) if plan.num_rounds else np.zeros(0)
    compute_time = float(round_max.sum())
    step_time = compute_time + plan.num_rounds * cost.round_cost
    bound = lower_bound(plan.lengths, plan.num_ranks, plan.max_tokens_per_rank, cost)
    busy = loads.sum(axis=0) if plan.num_rounds else np.zeros(plan.num_ranks)
    idle = 1.0 - busy / compute_time if compute_time > 0 else np.zeros(plan.num_ranks)
    sizes, counts = np.unique(plan.group_size, return_counts=True)
    tokens = plan.tokens_per_rank()
    return PlanStats(
        step_time=step_time,
        lower_bound=bound,
        efficiency=bound / step_time if step_time > 0 else 1.0,
        step_time_s=step_time * cost.unit_time_s,
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
    )
