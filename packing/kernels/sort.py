"""Stable orders (compiled): numpy's stable argsort of a float64 vector, and a counting regroup.

Written out rather than numba's own sorts, which bring seconds of compilation with them.
"""

import numpy as np

from hdp.packing.kernels.jit import helper

__all__ = ["argsort_stable", "stable_by_round", "RADIX_MIN"]


@helper
def stable_by_round(items, key_round, n_rounds):
    """``items`` stably regrouped by ``key_round[item]`` (a counting sort): round order, then the
    items' own order."""
    count = np.zeros(n_rounds + 1, dtype=np.int64)
    for x in items:
        count[key_round[x] + 1] += 1
    for r in range(n_rounds):
        count[r + 1] += count[r]
    out = np.empty(items.size, dtype=np.int64)
    for x in items:
        r = key_round[x]
        out[count[r]] = x
        count[r] += 1
    return out


RADIX_MIN = 512  # from this many keys `argsort_stable` sorts by radix (8 passes of a byte), below by merging


@helper
def _argsort_radix(keys):
    """``np.argsort(keys, kind="stable")`` of a float64 vector by least-significant-digit radix sort: the
    keys as unsigned integers that order as the floats do (-0.0 as 0.0, every NaN last as numpy puts
    them), a stable counting sort per byte, bytes all keys share skipped.  O(8 n) without comparisons."""
    n = keys.size
    u = np.empty(n, dtype=np.uint64)
    f = np.empty(1)
    bits = f.view(np.uint64)
    top = np.uint64(1) << np.uint64(63)
    for i in range(n):
        x = keys[i]
        if x != x:
            f[0] = np.inf
            u[i] = (bits[0] | top) + np.uint64(1)  # above +inf: NaN last, in their order
            continue
        f[0] = x + 0.0  # -0.0 -> 0.0
        b = bits[0]
        u[i] = ~b if b & top else b | top
    a = np.arange(n)
    tmp = np.empty(n, dtype=np.int64)
    count = np.empty(257, dtype=np.int64)
    for shift in range(0, 64, 8):
        sh = np.uint64(shift)
        count[:] = 0
        for i in range(n):
            count[((u[i] >> sh) & np.uint64(255)) + 1] += 1
        if count[((u[0] >> sh) & np.uint64(255)) + 1] == n:  # every key has this byte: nothing to move
            continue
        for d in range(256):
            count[d + 1] += count[d]
        for j in range(n):
            i = a[j]
            d = (u[i] >> sh) & np.uint64(255)
            tmp[count[d]] = i
            count[d] += 1
        a, tmp = tmp, a
    return a


@helper
def argsort_stable(keys):
    """``np.argsort(keys, kind="stable")`` of a float64 vector: by radix from `RADIX_MIN` keys
    (`_argsort_radix`), below that insertion-sorted runs of 16, merged bottom-up (equal keys keep their
    order; keys never NaN, which only the radix path orders).  Written out: numba's own sorts bring
    seconds of compilation with them."""
    n = keys.size
    if n >= RADIX_MIN:
        return _argsort_radix(keys)
    a = np.arange(n)
    b = np.empty(n, dtype=np.int64)
    width = 16  # runs of 16 by insertion sort, then merges
    for lo in range(0, n, width):
        for j in range(lo + 1, min(lo + width, n)):
            x = a[j]
            i = j - 1
            while i >= lo and keys[x] < keys[a[i]]:
                a[i + 1] = a[i]
                i -= 1
            a[i + 1] = x
    while width < n:
        for lo in range(0, n, 2 * width):
            mid = min(lo + width, n)
            hi = min(lo + 2 * width, n)
            i, j, k = lo, mid, lo
            while i < mid and j < hi:
                if keys[a[j]] < keys[a[i]]:  # strictly less: the left run's equal keys go first
                    b[k] = a[j]
                    j += 1
                else:
                    b[k] = a[i]
                    i += 1
                k += 1
            while i < mid:
                b[k] = a[i]
                i += 1
                k += 1
            while j < hi:
                b[k] = a[j]
                j += 1
                k += 1
        a, b = b, a
        width *= 2
    return a
