"""Group sizes worth giving a sample: widening samples that would stand above their round.

A sample of height h(k) on k ranks in a round whose other N - k ranks only reach ``reach`` idles
them for about (N - k) * (h(k) - reach); a wider group costs k * h(k) - k0 * h(k0) extra rank-time
(CP overhead).  `grow_sizes` gives each tall sample the allowed k minimising the sum.
"""

from __future__ import annotations

import functools

import numpy as np

from hdp.packing.kernels.jit import int_array
from hdp.packing.policies.hdp.kernels.costs import cost_params
from hdp.packing.policies.hdp.kernels.widening import best_sizes

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
    best_k, best_h = _best_sizes(lengths[tall], k[tall], cand, reach, cost, N)
    k[tall], height[tall] = best_k, best_h


def _best_sizes(
    lengths: np.ndarray, k0: np.ndarray, cand: np.ndarray, reach: float, cost, N: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Per sample the candidate size >= k0 of least ``k h(k) + (N - k) max(0, h(k) - reach)`` (the
    first among equals) and its height (`kernels.widening.best_sizes`: a size k can only win where its lower
    bound ``k h(k) >= work(L) + [k >= 2] ((k - 1) k step_overhead + ((k - 1) merge + cp) L)`` -- padding
    only adds tokens, every other term of `CostModel.group_cost` is >= 0 -- is below the best score so
    far; the bound grows with k, so a sample's scan ends at the first size past it)."""
    out_k = np.empty(lengths.size, dtype=np.int64)
    out_h = np.empty(lengths.size)
    best_sizes(cost_params(cost), N, int_array(lengths), int_array(k0), int_array(cand), float(reach), out_k, out_h)
    return out_k, out_h


def candidate_sizes(sizes: np.ndarray, k_max: int) -> np.ndarray:
    """Group sizes worth widening to: every allowed size up to 32, then about 10% apart, up to
    8x the widest current group (wider groups only add ring overhead)."""
    return _candidate_sizes(np.ascontiguousarray(sizes, dtype=np.int64).tobytes(), int(k_max)).copy()


@functools.lru_cache(maxsize=256)
def _candidate_sizes(sizes_bytes: bytes, k_max: int) -> np.ndarray:
    sizes = np.frombuffer(sizes_bytes, dtype=np.int64)
    sizes = sizes[sizes <= max(32, 8 * k_max)]
    small, large = sizes[sizes <= 32], sizes[sizes > 32]
    if large.size:
        keep = np.unique(np.searchsorted(large, np.geomspace(large[0], large[-1], 48)))
        large = large[np.minimum(keep, large.size - 1)]
    return np.unique(np.concatenate([small, large]))
