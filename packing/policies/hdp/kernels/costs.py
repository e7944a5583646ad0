"""The cost model's arithmetic, compiled, and the batch-wide figures built on it.

`padded`, `busiest_tokens`, `group_cost` and `sample_cost` do the operations of `cost.padded_float`,
`cost.max_rank_tokens`, `CostModel.group_cost` and `CostModel.sample_cost` in the same order, so
they return the same doubles (tests/unit/packing/test_planner_kernels.py
tests/distributed/packing/test_planner_kernels_dist.py compares them to the bit on random cost
models).  The parameters travel as one float64 vector (`cost_params`; `A` .. `NODE_RANKS` index it).
`sample_costs`, `rank_tokens`, `column_heights` and `column_tokens` are `Problem`'s figures over a
whole batch.

On a domain over several nodes a group's ring crosses a node boundary where it sits across one
(`group_cost_at`, given where); every kernel that prices a group by its size alone (`group_cost`)
takes it to cross exactly when it is wider than the largest node (``NODE_RANKS``): such a group
crosses wherever it sits, and a narrower one can sit inside a node -- which the placement
(`hdp.packing.policies.hdp.placement`) then arranges where it is cheaper.
"""

import numpy as np

from hdp.packing.kernels.jit import B1_1D, F8_1D, I64_1D, helper, kernel

__all__ = [
    "cost_params", "padded", "busiest_tokens", "group_cost", "sample_values", "sample_cost",
    "sample_costs", "rank_tokens", "column_heights", "column_tokens",
    "A", "STEP_OVERHEAD", "STEP_LATENCY", "COMM", "MERGE", "CP", "NODE_LATENCY", "NODE_COMM", "NODE_RANKS",
    "group_cost_at", "column_heights_at",
]

A, STEP_OVERHEAD, STEP_LATENCY, COMM, MERGE, CP, NODE_LATENCY, NODE_COMM, NODE_RANKS = range(9)
"""Positions in `cost_params`'s vector."""


def cost_params(cost, node_ranks: int | None = None) -> np.ndarray:
    """[9] float64: the `CostModel` fields the kernels price groups with (``linear_coef``,
    ``step_overhead``, ``step_latency``, ``comm_per_token``, ``merge_per_token``, ``cp_per_token``,
    ``node_step_latency``, ``node_comm_per_token``) and the ranks of the domain's largest node
    (``node_ranks``, else a `cost.SizePricedCost`'s; inf for one node: no group is wider)."""
    if node_ranks is None:
        node_ranks = getattr(cost, "node_ranks", None)
    return np.array([cost.linear_coef, cost.step_overhead, cost.step_latency, cost.comm_per_token,
                     cost.merge_per_token, cost.cp_per_token, cost.node_step_latency, cost.node_comm_per_token,
                     np.inf if node_ranks is None else float(node_ranks)], dtype=np.float64)


@helper
def padded(length, k):
    """`cost.padded_float` of one sample: L rounded up to a multiple of 2k for k >= 2, as float64."""
    lf = float(length)
    if k > 1:
        two_k = 2.0 * float(k)
        return np.ceil(lf / two_k) * two_k
    return lf


@helper
def busiest_tokens(length, k):
    """`cost.max_rank_tokens` of one sample: the busiest rank's tokens of L on k ranks (zigzag)."""
    if k <= 1:
        return length
    two_k = 2 * k
    q = length // two_k
    r = length - q * two_k
    if r == 0:
        return 2 * q
    if r > 2 and two_k % r != 0:
        return 2 * q + 2
    return 2 * q + 1


@helper
def group_cost(p, sum_work, sum_len, sum_sq, k):
    """`group_cost_at` of a group of k ranks that crosses a node boundary exactly when it is wider
    than the domain's largest node (module docstring)."""
    return group_cost_at(p, sum_work, sum_len, sum_sq, k, float(k) > p[NODE_RANKS])


@helper
def group_cost_at(p, sum_work, sum_len, sum_sq, k, cross):
    """`CostModel.group_cost` of one group of k ranks from its sums (the same operations, in order;
    for k = 1 ``sum_work / 1.0 + 0.0``, which is ``sum_work``); ``cross``: its ring crosses a node
    boundary, so a step's transfer takes the slower link."""
    if k == 1:
        return sum_work
    kf = float(k)
    local = sum_len / kf
    comm = p[STEP_LATENCY] + p[COMM] * local
    if cross:
        slow = p[NODE_LATENCY] + p[NODE_COMM] * local
        if slow > comm:
            comm = slow
    hidden = sum_sq / (kf * kf)
    d = comm - hidden
    per_step = p[STEP_OVERHEAD] + (d if d > 0.0 else 0.0)
    if p[MERGE] != 0.0:
        per_step = per_step + p[MERGE] * local
    ring = (kf - 1.0) * per_step
    if p[CP] != 0.0:
        ring = ring + p[CP] * local
    return sum_work / kf + (ring if k > 1 else 0.0)


@helper
def sample_values(p, length, k, out):
    """``out[:4]`` = padded work, padded length, its square and busiest-rank tokens of one sample on k
    ranks: its share of a column's sums (`polish_state.Cols.sums`)."""
    lp = padded(length, k)
    out[0] = p[A] * lp + lp * lp
    out[1] = lp
    out[2] = lp * lp
    out[3] = float(busiest_tokens(length, k))


@helper
def sample_cost(p, length, k):
    """`CostModel.sample_cost` of one sample alone on k ranks."""
    lp = padded(length, k)
    return group_cost(p, p[A] * lp + lp * lp, lp, lp * lp, k)


@kernel(F8_1D, I64_1D, I64_1D, F8_1D, I64_1D)
def sample_costs(p, lengths, k, out_cost, out_tokens):
    """`CostModel.sample_cost` and `cost.max_rank_tokens` of every sample on ``k[i]`` ranks, into
    ``out_cost`` and ``out_tokens``."""
    for i in range(lengths.size):
        out_cost[i] = sample_cost(p, lengths[i], k[i])
        out_tokens[i] = busiest_tokens(lengths[i], k[i])


@kernel(I64_1D, I64_1D)
def rank_tokens(lengths, k):
    """`cost.max_rank_tokens` of every sample on ``k[i]`` ranks."""
    out = np.empty(lengths.size, dtype=np.int64)
    for i in range(lengths.size):
        out[i] = busiest_tokens(lengths[i], k[i])
    return out


@kernel(F8_1D, I64_1D, I64_1D, I64_1D)
def column_heights(p, lengths, col_of, width):
    """`Problem.heights`: every column's exact per-rank time from its samples' sums (accumulated in
    sample order, as ``np.bincount``), 0 for an empty column; samples with column -1 are left out."""
    C = width.size
    sums = np.zeros((C, 3))
    count = np.zeros(C, dtype=np.int64)
    for i in range(lengths.size):
        c = col_of[i]
        if c < 0:
            continue
        lp = padded(lengths[i], width[c])
        sums[c, 0] += p[A] * lp + lp * lp
        sums[c, 1] += lp
        sums[c, 2] += lp * lp
        count[c] += 1
    out = np.zeros(C)
    for c in range(C):
        if count[c] > 0:
            out[c] = group_cost(p, sums[c, 0], sums[c, 1], sums[c, 2], width[c])
    return out


@kernel(F8_1D, I64_1D, I64_1D, I64_1D, B1_1D)
def column_heights_at(p, lengths, col_of, width, cross):
    """`column_heights` with every column's ring crossing nodes where ``cross[c]`` says (its place)."""
    C = width.size
    sums = np.zeros((C, 3))
    count = np.zeros(C, dtype=np.int64)
    for i in range(lengths.size):
        c = col_of[i]
        if c < 0:
            continue
        lp = padded(lengths[i], width[c])
        sums[c, 0] += p[A] * lp + lp * lp
        sums[c, 1] += lp
        sums[c, 2] += lp * lp
        count[c] += 1
    out = np.zeros(C)
    for c in range(C):
        if count[c] > 0:
            out[c] = group_cost_at(p, sums[c, 0], sums[c, 1], sums[c, 2], width[c], cross[c])
    return out


@kernel(I64_1D, I64_1D, I64_1D)
def column_tokens(lengths, col_of, width):
    """`Problem.tokens`: every column's busiest-rank tokens (samples with column -1 left out)."""
    out = np.zeros(width.size, dtype=np.int64)
    for i in range(lengths.size):
        c = col_of[i]
        if c >= 0:
            out[c] += busiest_tokens(lengths[i], width[c])
    return out
