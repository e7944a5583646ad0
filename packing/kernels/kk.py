"""Karmarkar-Karp's largest differencing method into m parts, compiled (`hdp.packing.policies.kk`'s,
which the baseline policies and the hdp policy's small balances use)."""

import numpy as np

from hdp.packing.kernels.heap import heap_pop, heap_push
from hdp.packing.kernels.jit import F8_1D, I64, kernel
from hdp.packing.kernels.sort import argsort_stable

__all__ = ["karmarkar_karp"]


@kernel(F8_1D, I64)
def karmarkar_karp(w, m):
    """`hdp.packing.policies.kk.karmarkar_karp` compiled (the largest differencing method into m parts):
    the same merges in the same order -- a heap of entries by (-spread, index), `kk`'s tie counter being
    the entry's index (items 0..n-1, merges from n), each an m-vector of part sums (descending) and node
    ids; the heaviest part of one merged with the lightest of the other; the same stable sort of the
    merged sums -- so every item gets the same part.  ``w`` float64 [n], m >= 2."""
    n = w.size
    out = np.zeros(n, dtype=np.int64)
    if n == 0 or m == 1:
        return out
    cap = 2 * n - 1  # entries: n items, then one per merge
    sums = np.zeros((cap, m))
    ids = np.full((cap, m), -1, dtype=np.int64)
    key = np.empty(cap)
    left = np.full(n + (n - 1) * m, -1, dtype=np.int64)
    right = np.full(n + (n - 1) * m, -1, dtype=np.int64)
    step_lo = np.empty(n, dtype=np.int64)  # node id range created by each merge
    step_hi = np.empty(n, dtype=np.int64)
    n_steps = 0
    next_id = n
    heap = np.empty(cap, dtype=np.int64)
    size = 0
    for i in range(n):
        sums[i, 0] = w[i]
        ids[i, 0] = i
        key[i] = -w[i]
        size = heap_push(heap, size, key, i)
    e_new = n
    merged = np.empty(m)
    mids = np.empty(m, dtype=np.int64)
    neg = np.empty(m)
    while size > 1:
        e1 = heap_pop(heap, size, key)
        size -= 1
        e2 = heap_pop(heap, size, key)
        size -= 1
        lo = next_id
        for q in range(m):  # the heaviest part of one with the lightest of the other
            a = ids[e1, q]
            b = ids[e2, m - 1 - q]
            merged[q] = sums[e1, q] + sums[e2, m - 1 - q]
            if a >= 0 and b >= 0:
                left[next_id], right[next_id] = a, b
                mids[q] = next_id
                next_id += 1
            else:
                mids[q] = a if a >= 0 else b
        if next_id > lo:
            step_lo[n_steps], step_hi[n_steps] = lo, next_id
            n_steps += 1
        for q in range(m):
            neg[q] = -merged[q]
        order = argsort_stable(neg)
        for q in range(m):
            sums[e_new, q] = merged[order[q]]
            ids[e_new, q] = mids[order[q]]
        key[e_new] = -(merged[order[0]] - merged[order[m - 1]])
        size = heap_push(heap, size, key, e_new)
        e_new += 1
    last = heap[0]
    label = np.full(next_id, -1, dtype=np.int64)
    for q in range(m):
        if ids[last, q] >= 0:
            label[ids[last, q]] = q
    for s in range(n_steps - 1, -1, -1):  # children always have smaller ids than their parent
        for x in range(step_lo[s], step_hi[s]):
            label[left[x]] = label[x]
            label[right[x]] = label[x]
    for i in range(n):
        out[i] = label[i]
    return out
