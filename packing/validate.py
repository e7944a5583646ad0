"""Input validation and plan invariant checks (DESIGN invariants 1 and 2)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hdp.packing.cost import max_rank_tokens, min_group_size
from hdp.packing.plan import Plan

__all__ = ["validate_lengths", "check_plan", "MAX_LENGTH"]

MAX_LENGTH = 1 << 40
"""Longest sample (tokens) the planner accepts: sums over a batch stay exact in int64 and float64."""


def validate_lengths(lengths: Sequence[int] | np.ndarray, num_ranks: int, budget: int) -> np.ndarray:
    """Return ``lengths`` as an int64 array or raise ValueError naming the problem and the fix."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths: expected a 1-D list of sample lengths, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError("lengths: the batch is empty; pass at least one sample length")
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ValueError(f"lengths: expected integers, got dtype {arr.dtype}")
    if np.issubdtype(arr.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"lengths[{i}]={float(arr[i])!r} is not an integer; token counts are whole numbers")
    if np.issubdtype(arr.dtype, np.floating) and np.any(np.abs(arr) > MAX_LENGTH):
        i = int(np.flatnonzero(np.abs(arr) > MAX_LENGTH)[0])
        raise ValueError(f"lengths[{i}]={float(arr[i])!r} is above {MAX_LENGTH} tokens (2^40); no sample is that long")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr > MAX_LENGTH)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"lengths[{i}]={int(arr[i])} is above {MAX_LENGTH} tokens (2^40); no sample is that long: "
            "check the lengths (tokens per sample, one per line)"
        )
    bad = np.flatnonzero(arr <= 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"lengths[{i}]={int(arr[i])}: every sample needs at least 1 token; drop empty samples")
    k_min = min_group_size(arr, budget, num_ranks)
    too_long = np.flatnonzero(k_min > num_ranks)
    if too_long.size:
        i = int(too_long[np.argmax(arr[too_long])])
        need = int(max_rank_tokens(arr[i : i + 1], np.array([num_ranks]))[0])
        raise ValueError(
            f"lengths[{i}]={int(arr[i])} does not fit the domain: {num_ranks} ranks x "
            f"max_tokens_per_rank={budget} tokens; raise max_tokens_per_rank to at least {need}, "
            "add ranks, or truncate the sample"
        )
    return arr


def check_plan(plan: Plan, *, pow2: bool = False) -> None:
    """Assert the plan invariants; raise AssertionError describing the first violation.

    1. every sample is in exactly one group of one round (columns are per sample, so checked by
       range checks), chunk boundaries cover it (zigzag bounds are exact by construction);
    2. groups of a round are disjoint and inside the domain; no rank holds more than B tokens;
    with ``pow2`` every group is an aligned power-of-two block.
    """
    n, N = plan.num_samples, plan.num_ranks
    assert plan.lengths.shape == plan.round_of.shape == plan.group_start.shape == plan.group_size.shape == (n,)
    assert np.all((plan.round_of >= 0) & (plan.round_of < plan.num_rounds)), "sample outside rounds"
    assert np.all(plan.group_size >= 1), "empty group size"
    assert np.all((plan.group_start >= 0) & (plan.group_start + plan.group_size <= N)), "group outside domain"
    if pow2:
        k = plan.group_size
        assert np.all((k & (k - 1)) == 0), "group size not a power of two"
        assert np.all(plan.group_start % k == 0), "group not aligned to its size"
    # disjointness: a (round, start) key has one size, and ranges of a round do not overlap
    key = plan.round_of * (N + 1) + plan.group_start
    uniq, first = np.unique(key, return_index=True)
    sizes = plan.group_size[first]
    same = plan.group_size == sizes[np.searchsorted(uniq, key)]
    assert same.all(), "two groups share a start rank in one round with different sizes"
    r, s = uniq // (N + 1), uniq % (N + 1)
    nxt_same_round = r[1:] == r[:-1]
    assert np.all(s[:-1][nxt_same_round] + sizes[:-1][nxt_same_round] <= s[1:][nxt_same_round]), (
        "overlapping groups in one round"
    )
    tokens = plan.tokens_per_rank()
    assert tokens.max(initial=0) <= plan.max_tokens_per_rank, (
        f"a rank holds {int(tokens.max())} > B={plan.max_tokens_per_rank} tokens in a round"
    )
    assert int(tokens.sum()) == int(plan.lengths.sum()), "tokens lost or duplicated"
