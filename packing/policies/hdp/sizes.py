"""Group sizes worth giving a sample: widening samples that would stand above their round.

A sample of height h(k) on k ranks in a round whose other N - k ranks only reach ``reach`` idles
them for about (N - k) * (h(k) - reach); a wider group costs k * h(k) - k0 * h(k0) extra rank-time
(CP overhead).  `grow_sizes` gives each tall sample the allowed k minimising the sum.
"""

from __future__ import annotations

import numpy as np

__all__ = ["grow_sizes", "candidate_sizes"]


def grow_sizes(
    lengths: np.ndarray, k: np.ndarray, height: np.ndarray, reach: float, problem, sizes: np.ndarray | None = None,
) -> None:
    """In place: widen the groups of samples taller than ``reach``, the height other ranks reach.

    A sample of height h(k) on k ranks in a round whose other N - k ranks only reach ``reach``
    idles them for about (N - k) * (h(k) - reach); a wider group costs k * h(k) - k0 * h(k0) extra
    rank-time (CP overhead).  Each tall sample takes the allowed k minimising the sum.
    """
    cost, N = problem.cost, problem.num_ranks
    sizes = problem.sizes if sizes is None else sizes
    tall = np.flatnonzero(height > reach * (1 + 1e-9))
    if tall.size == 0:
        return
    cand = candidate_sizes(sizes, int(k[tall].max()))
    # past twice the size at which perfect scaling would reach ``reach``, more ranks only add overhead
    cand = cand[cand <= max(2, 2 * int(np.ceil((k[tall] * height[tall]).max() / max(reach, 1e-300))) + 2)]
    cand = cand[None, :]  # [1, K]
    h = cost.sample_cost(lengths[tall][:, None], cand)  # [S, K]
    score = cand * h + (N - cand) * np.maximum(0.0, h - reach)
    score = np.where(cand >= k[tall][:, None], score, np.inf)  # only sizes >= the current one
    j = np.argmin(score, axis=1)
    k[tall], height[tall] = cand[0, j], h[np.arange(tall.size), j]


def candidate_sizes(sizes: np.ndarray, k_max: int) -> np.ndarray:
    """Group sizes worth widening to: every allowed size up to 32, then about 10% apart, up to
    8x the widest current group (wider groups only add ring overhead)."""
    sizes = sizes[sizes <= max(32, 8 * k_max)]
    small, large = sizes[sizes <= 32], sizes[sizes > 32]
    if large.size:
        keep = np.unique(np.searchsorted(large, np.geomspace(large[0], large[-1], 48)))
        large = large[np.minimum(keep, large.size - 1)]
    return np.unique(np.concatenate([small, large]))
