"""Input validation and plan invariant checks (docs/design.md, invariants 1 and 2)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hdp.packing.cost import max_rank_tokens, min_group_size
from hdp.packing.plan import Plan

__all__ = ["validate_lengths", "check_plan", "PlanError", "MAX_LENGTH"]

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


class PlanError(ValueError):
    """A plan breaks an invariant; the message names the field, the sample or round, and the fix."""


_FIX = "build plans with hdp.packing.plan (or Plan.from_columns from a valid assignment)"


def check_plan(plan: Plan, *, pow2: bool = False) -> None:
    """Raise :class:`PlanError` (a ``ValueError``) naming the first violated plan invariant.

    1. every sample is in exactly one group of one round (columns are per sample, so checked by
       range checks), chunk boundaries cover it (zigzag bounds are exact by construction);
    2. groups of a round are disjoint and inside the domain; no rank holds more than B tokens;
    with ``pow2`` every group is an aligned power-of-two block.  Messages say which column, which
    sample (caller index) or round, and domain ranks (the plan knows no other numbering).
    """
    n, N = plan.num_samples, plan.num_ranks
    cols = {"round_of": plan.round_of, "group_start": plan.group_start, "group_size": plan.group_size}
    for name, col in cols.items():
        if col.shape != (n,):
            raise PlanError(f"plan.{name} has shape {col.shape} but plan.lengths has {n} samples; {_FIX}")

    def first(mask: np.ndarray) -> int | None:
        bad = np.flatnonzero(mask)
        return int(bad[0]) if bad.size else None

    i = first((plan.round_of < 0) | (plan.round_of >= plan.num_rounds))
    if i is not None:
        raise PlanError(f"plan.round_of[{i}]={int(plan.round_of[i])}: sample {i} is outside the plan's rounds "
                        f"[0, {plan.num_rounds}); {_FIX}")
    i = first(plan.group_size < 1)
    if i is not None:
        raise PlanError(f"plan.group_size[{i}]={int(plan.group_size[i])}: sample {i} needs a group of >= 1 rank; {_FIX}")
    i = first((plan.group_start < 0) | (plan.group_start + plan.group_size > N))
    if i is not None:
        raise PlanError(f"plan.group_start[{i}]={int(plan.group_start[i])}, plan.group_size[{i}]={int(plan.group_size[i])}: "
                        f"the group of sample {i} spans domain ranks outside [0, {N}); {_FIX}")
    if pow2:
        k = plan.group_size
        i = first((k & (k - 1)) != 0)
        if i is not None:
            raise PlanError(f"plan.group_size[{i}]={int(k[i])}: sample {i}'s group is not a power of two "
                            "(pow2 plans); plan with group_shape='pow2'")
        i = first(plan.group_start % k != 0)
        if i is not None:
            raise PlanError(f"plan.group_start[{i}]={int(plan.group_start[i])}: sample {i}'s group of {int(k[i])} ranks "
                            "is not aligned to its size (pow2 plans); plan with group_shape='pow2'")
    # disjointness: a (round, start) key has one size, and ranges of a round do not overlap
    key = plan.round_of * (N + 1) + plan.group_start
    uniq, firsts = np.unique(key, return_index=True)
    sizes = plan.group_size[firsts]
    i = first(plan.group_size != sizes[np.searchsorted(uniq, key)])
    if i is not None:
        j = int(firsts[np.searchsorted(uniq, key[i])])
        raise PlanError(
            f"round {int(plan.round_of[i])}: samples {j} and {i} start a group at domain rank {int(plan.group_start[i])} "
            f"with sizes {int(plan.group_size[j])} and {int(plan.group_size[i])} (plan.group_size); samples of one group "
            f"share its start and size; {_FIX}")
    r, st = uniq // (N + 1), uniq % (N + 1)
    clash = first((r[1:] == r[:-1]) & (st[:-1] + sizes[:-1] > st[1:]))
    if clash is not None:
        a, b = int(firsts[clash]), int(firsts[clash + 1])
        raise PlanError(
            f"round {int(r[clash])}: the groups of samples {a} (domain ranks {int(st[clash])}..{int(st[clash] + sizes[clash] - 1)}) "
            f"and {b} (domain ranks {int(st[clash + 1])}..{int(st[clash + 1] + sizes[clash + 1] - 1)}) overlap; "
            f"groups of a round must be disjoint; {_FIX}")
    tokens = plan.tokens_per_rank()  # [R, N]
    if tokens.size and int(tokens.max()) > plan.max_tokens_per_rank:
        rnd, rank = (int(x) for x in np.unravel_index(int(np.argmax(tokens)), tokens.shape))
        held = [int(s) for s in np.flatnonzero((plan.round_of == rnd) & (plan.group_start <= rank)
                                                & (plan.group_start + plan.group_size > rank))]
        raise PlanError(
            f"round {rnd}: domain rank {rank} holds {int(tokens[rnd, rank])} tokens (samples {held}) > "
            f"plan.max_tokens_per_rank={plan.max_tokens_per_rank}; give those samples larger groups or more rounds, "
            "or raise the budget")
    if int(tokens.sum()) != int(plan.lengths.sum()):
        raise PlanError(f"the plan's ranks hold {int(tokens.sum())} tokens but its samples have "
                        f"{int(plan.lengths.sum())}; {_FIX}")
