"""numpy's reductions, compiled to the bit: the pairwise sum of a float64 vector, and ``np.maximum.at``."""

import numpy as np

from hdp.packing.kernels.jit import F8_1D, I64_1D, helper, int_array, kernel

__all__ = ["pairwise_sum", "group_max", "max_at"]


@helper
def _block_sum(a, lo, n):
    """numpy's pairwise summation of a block of at most 128 values: eight running sums, then the rest."""
    if n < 8:
        res = 0.0
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r = np.empty(8)
    for j in range(8):
        r[j] = a[lo + j]
    i = 8
    while i < n - (n % 8):
        for j in range(8):
            r[j] += a[lo + i + j]
        i += 8
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    while i < n:
        res += a[lo + i]
        i += 1
    return res


@helper
def pairwise_sum(a, lo, n):
    """numpy's pairwise summation of ``a[lo:lo + n]`` (what ``a.sum()`` returns for a float64 vector):
    blocks of up to 128 values, halves (rounded to multiples of 8) added.  Iterative: numba's cache
    cannot hold a recursive function (numba/numba#6061: a segmentation fault on loading it)."""
    los = np.empty(64, dtype=np.int64)  # a stack of halves: 2**64 values never come
    ns = np.empty(64, dtype=np.int64)
    stage = np.zeros(64, dtype=np.int64)  # 0: left half next, 1: right half next, 2: add them
    left = np.empty(64)
    los[0], ns[0], stage[0] = lo, n, 0
    top = 0
    ret = 0.0
    while top >= 0:
        m = ns[top]
        if m <= 128:
            ret = _block_sum(a, los[top], m)
            top -= 1
            continue
        n2 = m // 2
        n2 -= n2 % 8
        if stage[top] == 0:
            stage[top] = 1
            los[top + 1], ns[top + 1], stage[top + 1] = los[top], n2, 0
            top += 1
        elif stage[top] == 1:
            left[top] = ret
            stage[top] = 2
            los[top + 1], ns[top + 1], stage[top + 1] = los[top] + n2, m - n2, 0
            top += 1
        else:
            ret = left[top] + ret
            top -= 1
    return ret


@kernel(F8_1D, I64_1D, F8_1D)
def group_max(out, idx, vals):
    """``np.maximum.at(out, idx, vals)`` (no NaN among the values)."""
    for i in range(idx.size):
        if vals[i] > out[idx[i]]:
            out[idx[i]] = vals[i]


def max_at(out: np.ndarray, idx: np.ndarray, vals: np.ndarray) -> None:
    """``np.maximum.at(out, idx, vals)`` for a float64 ``out`` (in place), compiled: numpy's unbuffered
    ``at`` is a slow call per element; the maximum does not depend on the order."""
    assert out.dtype == np.float64 and out.flags.c_contiguous and out.flags.writeable
    group_max(out, int_array(idx), np.array(vals, dtype=np.float64))
