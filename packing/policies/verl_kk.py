"""verl's balancing: Karmarkar–Karp over DP ranks, static CP, dynamic micro-batches.

verl (``verl/utils/seqlen_balancing.py``) balances a batch over DP ranks with
``get_seqlen_balanced_partitions`` — Karmarkar–Karp on the workload ``24576 * L + L**2`` (which
treats attention as non-causal and ignores CP overheads).  Samples that do not fit one rank run
with a static CP size k for everything: k = ``config.static_cp_size`` or the smallest power of two
fitting the longest sample, so DP = N // k aligned groups ``[g*k, (g+1)*k)``.  Each DP group then
cuts its samples into micro-batches (our rounds) with verl's dynamic batch size: the fewest
micro-batches of at most ``k * B`` tokens (here: per-rank zigzag tokens <= B), found by KK on the
same workload into ceil(tokens / (k*B)) parts and growing the count until the budget holds.
Micro-batches of a group run heaviest first; all groups take the same number of rounds (the max),
groups with fewer micro-batches idle in the last rounds.  KK over the DP groups costs O(n * dp)
memory and time; above ``KK_MAX_WORK`` (n * dp) the DP split is longest-processing-time greedy
instead (1M samples over 2K DP groups would otherwise need ~30 GiB).
"""

from __future__ import annotations

import numpy as np

from hdp.packing.config import PlannerConfig
from hdp.packing.cost import max_rank_tokens
from hdp.packing.policies.common import Assignment
from hdp.packing.policies.kk import bins_fit, first_fit_decreasing, karmarkar_karp, lpt_with_capacity, static_cp_size
from hdp.packing.policies.static_cp import KK_MAX_WORK

__all__ = ["assign", "verl_workload"]

VERL_LINEAR_COEF = 24576.0
"""verl's linear term of the workload estimate (24576 * L + L**2)."""


def verl_workload(lengths: np.ndarray) -> np.ndarray:
    """verl's workload estimate 24576 * L + L**2 (float64)."""
    length = np.asarray(lengths, dtype=np.float64)
    return VERL_LINEAR_COEF * length + length * length


def _micro_batches(work: np.ndarray, tokens: np.ndarray, budget: int) -> np.ndarray:
    """Fewest KK-balanced micro-batches whose per-rank tokens fit ``budget``; index per sample."""
    n = work.size
    m = max(1, -(-int(tokens.sum()) // budget))
    while m < n:
        parts = karmarkar_karp(work, m)
        if bins_fit(parts, tokens, m, budget):
            return parts
        ffd = first_fit_decreasing(tokens, budget)
        if int(ffd.max()) < m:
            return ffd
        m += 1
    return np.arange(n, dtype=np.int64)


def assign(lengths: np.ndarray, config: PlannerConfig) -> Assignment:
    """KK over N // k DP groups on verl's workload, then budgeted micro-batches per group."""
    lengths = np.asarray(lengths, dtype=np.int64)
    k = static_cp_size(lengths, config)
    dp = config.num_ranks // k
    work = verl_workload(lengths)
    tokens = max_rank_tokens(lengths, k)
    if lengths.size * dp <= KK_MAX_WORK:
        dp_rank = karmarkar_karp(work, dp)
    else:
        dp_rank = lpt_with_capacity(work, np.zeros(lengths.size), dp, 1.0)
    round_of = np.zeros(lengths.size, dtype=np.int64)
    members = np.split(np.argsort(dp_rank, kind="stable"), np.cumsum(np.bincount(dp_rank, minlength=dp))[:-1])
    for g in range(dp):
        idx = members[g]
        if idx.size == 0:
            continue
        mb = _micro_batches(work[idx], tokens[idx], config.max_tokens_per_rank)
        m = int(mb.max()) + 1
        mb_work = np.bincount(mb, weights=work[idx], minlength=m)
        order = np.lexsort((np.arange(m), -mb_work))  # heaviest micro-batch first
        rank_of_mb = np.empty(m, dtype=np.int64)
        rank_of_mb[order] = np.arange(m)
        round_of[idx] = rank_of_mb[mb]
    return Assignment(
        round_of=round_of,
        group_start=dp_rank * k,
        group_size=np.full(lengths.size, k, dtype=np.int64),
    )
