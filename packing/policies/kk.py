"""Partitioning helpers shared by the baseline policies (pure, deterministic; numpy, and numba for
Karmarkar-Karp).

* `karmarkar_karp`: the largest differencing method into m parts (Karmarkar & Karp 1982; the
  multi-way form verl's ``get_seqlen_balanced_partitions`` uses).
* `lpt_place` / `lpt_with_capacity`: longest-processing-time greedy into m bins under a capacity.
* `first_fit_decreasing`: bin packing under a capacity, opening bins as needed.
* `rounds_from_bins`: lay m = G * R bins out as R rounds of G groups minimising sum of round maxima.
* `static_cp_size`: the CP size k of the static baselines.

Ties are broken by the item index everywhere, so equal inputs give identical outputs.
"""

from __future__ import annotations

import heapq

import numpy as np

from hdp.packing.config import PlannerConfig
from hdp.packing.cost import min_group_size
from hdp.packing.kernels import jit
from hdp.packing.kernels import kk as compiled_kk

__all__ = [
    "karmarkar_karp",
    "lpt_place",
    "lpt_with_capacity",
    "first_fit_decreasing",
    "bins_fit",
    "rounds_from_bins",
    "static_cp_size",
]

jit.warm_up(compiled_kk)  # loaded (or compiled) at import, not inside a baseline's first plan


def static_cp_size(lengths: np.ndarray, config: PlannerConfig) -> int:
    """config.static_cp_size, or the smallest power of two (<= N) fitting the longest sample.

    Raises ValueError when ``config.static_cp_size`` is too small for the longest sample.
    """
    N, B = config.num_ranks, config.max_tokens_per_rank
    k_need = int(min_group_size(np.asarray(lengths, dtype=np.int64), B, N).max(initial=1))
    if config.static_cp_size is not None:
        k = int(config.static_cp_size)
        if k < k_need:
            raise ValueError(
                f"config.static_cp_size={k}: the longest sample needs {k_need} ranks of "
                f"max_tokens_per_rank={B}; pass static_cp_size >= {k_need} or None"
            )
        return k
    if k_need > N:
        return k_need
    return int(min(int(min_group_size(np.asarray(lengths, dtype=np.int64), B, N, pow2=True).max()), N))


def karmarkar_karp(weights: np.ndarray, m: int) -> np.ndarray:
    """Largest differencing method: part index (0..m-1) of every item, balancing part sums.

    Every item starts as an m-tuple (w, 0, ..., 0); the two tuples with the largest spread
    (max - min) are merged by pairing the heaviest part of one with the lightest of the other,
    until one tuple remains (ties: the earlier tuple, items by index).  O(n m log m).  Parts are
    numbered by decreasing final sum.  Merged parts are recorded as nodes of a binary forest
    (leaves = items) and resolved top-down at the end, so a merge costs O(m) whatever the number
    of items.  Runs compiled (`hdp.packing.kernels.kk`; tests/unit/packing/test_planner_kernels.py
    tests/distributed/packing/test_planner_kernels_dist.py keeps the Python
    heap of numpy tuples it replaced as the reference).
    """
    w = np.ascontiguousarray(weights, dtype=np.float64)
    if m < 1:
        raise ValueError(f"m={m}: need at least one part")
    return compiled_kk.karmarkar_karp(w, int(m))


def bins_fit(bins: np.ndarray, sizes: np.ndarray, m: int, capacity: float) -> bool:
    """True when no bin's total size exceeds ``capacity``."""
    totals = np.bincount(bins, weights=np.asarray(sizes, dtype=np.float64), minlength=m)
    return bool(totals.max(initial=0.0) <= capacity)


def lpt_place(
    items: np.ndarray, costs: np.ndarray, sizes: np.ndarray, load: np.ndarray, used: np.ndarray,
    capacity: float, out: np.ndarray,
) -> bool:
    """Place ``items`` in the given order, each on the least-loaded bin with room (ties: lowest
    bin index); ``load``, ``used``, ``out`` updated in place.  False when an item fits no bin.

    A heap of (load, bin); bins too full for the current item wait in a stash ordered by room and
    come back when a smaller item fits them, so each item costs O(log m).
    """
    heap = [(float(load[b]), b) for b in range(load.size)]
    heapq.heapify(heap)
    stash: list[tuple[float, int]] = []  # (-room, bin): bins too full for the current item
    for i in np.asarray(items).tolist():
        t = sizes[i]
        while stash and -stash[0][0] >= t:  # a smaller item: stashed bins may fit again
            _, b = heapq.heappop(stash)
            heapq.heappush(heap, (float(load[b]), b))
        while heap and used[heap[0][1]] + t > capacity:
            _, b = heapq.heappop(heap)
            heapq.heappush(stash, (-(capacity - used[b]), b))
        if not heap:
            return False
        lb, b = heapq.heappop(heap)
        load[b], used[b], out[i] = lb + costs[i], used[b] + t, b
        heapq.heappush(heap, (float(load[b]), b))
    return True


def lpt_with_capacity(
    costs: np.ndarray, sizes: np.ndarray, m: int, capacity: float
) -> np.ndarray | None:
    """Greedy LPT: items by cost descending into the cheapest bin with room; None if one fails."""
    costs = np.asarray(costs, dtype=np.float64)
    sizes = np.asarray(sizes, dtype=np.float64)
    out = np.full(costs.size, -1, dtype=np.int64)
    order = np.lexsort((np.arange(costs.size), -sizes, -costs))
    return out if lpt_place(order, costs, sizes, np.zeros(m), np.zeros(m), capacity, out) else None


def first_fit_decreasing(sizes: np.ndarray, capacity: float) -> np.ndarray:
    """First-fit decreasing bin packing; returns each item's bin (bins opened as needed).

    Items larger than ``capacity`` get a bin of their own.
    """
    sizes = np.asarray(sizes, dtype=np.float64)
    out = np.full(sizes.size, -1, dtype=np.int64)
    used: list[float] = []
    for i in np.lexsort((np.arange(sizes.size), -sizes)):
        for b, u in enumerate(used):
            if u + sizes[i] <= capacity:
                out[i], used[b] = b, u + sizes[i]
                break
        else:
            out[i] = len(used)
            used.append(float(sizes[i]))
    return out


def rounds_from_bins(bin_cost: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Map m = groups * R bins to (round, group slot) minimising the sum of round maxima.

    Sorting bins by cost and filling rounds G at a time is optimal for that objective (the
    r-th round maximum is at least the (rG+1)-th largest cost under any arrangement).
    """
    bin_cost = np.asarray(bin_cost, dtype=np.float64)
    order = np.lexsort((np.arange(bin_cost.size), -bin_cost))
    rnd = np.empty(bin_cost.size, dtype=np.int64)
    slot = np.empty(bin_cost.size, dtype=np.int64)
    rnd[order] = np.arange(bin_cost.size) // groups
    slot[order] = np.arange(bin_cost.size) % groups
    return rnd, slot
