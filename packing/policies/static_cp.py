"""Static CP: what users run today — one CP size k for every sample.

k = ``config.static_cp_size`` or the smallest power of two fitting the longest sample.  The domain
is cut into G = N // k aligned blocks ``[g*k, (g+1)*k)`` (ranks beyond G*k idle).  Samples are
packed into G * R bins (G groups x R rounds) with Karmarkar–Karp (largest differencing) on the
per-sample cost ``cost.sample_cost(L, k)``, subject to the per-rank token budget of a bin
(sum of ``max_rank_tokens(L, k)`` <= B); when KK breaks the budget, greedy LPT with capacity, then
first-fit decreasing, are tried.  KK costs O(n * m log m) time and O(n * m) memory for m bins, so
above ``KK_MAX_WORK`` (n * m) the bins are filled by LPT alone (O(n log m); at thousands of samples
per bin the two balance alike) -- 1M samples on 16K ranks would otherwise need ~500 GiB.  R starts at ceil(total / (G * B)) (per-rank tokens) and grows
until everything fits; the bins are then laid out as rounds so that the sum of round maxima is
smallest (`rounds_from_bins`).
"""

from __future__ import annotations

import numpy as np

from hdp.packing.config import PlannerConfig
from hdp.packing.cost import max_rank_tokens
from hdp.packing.policies.common import Assignment
from hdp.packing.policies.kk import (
    bins_fit,
    first_fit_decreasing,
    karmarkar_karp,
    lpt_with_capacity,
    rounds_from_bins,
    static_cp_size,
)

__all__ = ["assign", "KK_MAX_WORK"]

KK_MAX_WORK = 5_000_000
"""Largest n x m (samples x bins) balanced with Karmarkar-Karp; LPT above (time and memory)."""


def _pack(cost: np.ndarray, tokens: np.ndarray, groups: int, budget: int) -> tuple[np.ndarray, int]:
    """Bins (G * R of them, R minimal) of balanced cost whose tokens fit the budget."""
    n = cost.size
    rounds = max(1, -(-int(tokens.sum()) // (groups * budget)))
    while True:
        m = groups * rounds
        if m >= n:  # one sample per bin always fits (every sample fits k ranks)
            return np.arange(n, dtype=np.int64), rounds
        small = n * m <= KK_MAX_WORK
        if small:
            bins = karmarkar_karp(cost, m)
            if bins_fit(bins, tokens, m, budget):
                return bins, rounds
        lpt = lpt_with_capacity(cost, tokens, m, budget)
        if lpt is not None:
            return lpt, rounds
        if small:  # first-fit decreasing scans every open bin per sample
            ffd = first_fit_decreasing(tokens, budget)
            if int(ffd.max()) < m:
                return ffd, rounds
        rounds += 1


def assign(lengths: np.ndarray, config: PlannerConfig) -> Assignment:
    """One CP size for all samples; KK-balanced bins laid out as G groups x R rounds."""
    lengths = np.asarray(lengths, dtype=np.int64)
    k = static_cp_size(lengths, config)
    groups = config.num_ranks // k
    tokens = max_rank_tokens(lengths, k)
    cost = config.cost.sample_cost(lengths, k)
    bins, rounds = _pack(cost, tokens, groups, config.max_tokens_per_rank)
    m = groups * rounds
    bin_cost = np.bincount(bins, weights=cost, minlength=m)
    rnd, slot = rounds_from_bins(bin_cost, groups)
    return Assignment(
        round_of=rnd[bins],
        group_start=slot[bins] * k,
        group_size=np.full(lengths.size, k, dtype=np.int64),
    )
