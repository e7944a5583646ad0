"""The size a tall sample is widened to, compiled (`sizes._best_sizes`)."""

import numpy as np

from hdp.packing.kernels.jit import F8, F8_1D, I64, I64_1D, kernel
from hdp.packing.policies.hdp.kernels.costs import CP, MERGE, STEP_OVERHEAD, A, sample_cost

__all__ = ["best_sizes"]


@kernel(F8_1D, I64, I64_1D, I64_1D, I64_1D, F8, I64_1D, F8_1D)
def best_sizes(p, num_ranks, lengths, k0, cand, reach, out_k, out_h):
    """`sizes._best_sizes`: per sample the size of ``cand`` (ascending) >= ``k0`` of least
    ``k h(k) + (N - k) max(0, h(k) - reach)`` (the first among equals) and its height, into ``out_k``
    and ``out_h``.  A size whose lower bound ``work(L) + [k >= 2] ((k - 1) k step_overhead +
    ((k - 1) merge + cp) L)`` (`CostModel.group_cost`'s terms, padding aside) exceeds the best
    score so far ends the scan: the bound grows with k."""
    a = p[A]
    for s in range(lengths.size):
        length = lengths[s]
        lf = float(length)
        work = a * lf + lf * lf
        best, best_k, best_h = np.inf, -1, 0.0
        for j in range(cand.size):
            k = cand[j]
            if k < k0[s]:
                continue
            if best_k >= 0 and k >= 2:
                kf = float(k)
                floor = work + (kf - 1.0) * kf * p[STEP_OVERHEAD] + ((kf - 1.0) * p[MERGE] + p[CP]) * lf
                if floor > best * (1 + 1e-12):
                    break
            h = sample_cost(p, length, k)
            sc = float(k) * h + float(num_ranks - k) * max(0.0, h - reach)
            if sc < best or best_k < 0:
                best, best_k, best_h = sc, k, h
        if best_k < 0:  # no size fits (never for `grow_sizes`'s candidates): the first, as numpy's argmin
            best_k, best_h = cand[0], sample_cost(p, length, cand[0])
        out_k[s] = best_k
        out_h[s] = best_h
