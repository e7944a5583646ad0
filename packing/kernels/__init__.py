"""Compiled kernels (numba) the planner's policies share, and the door to numba.

* `jit` -- how a kernel is declared (its argument types, once), cached on disk and warmed up;
* `sort` -- numpy's stable argsort of a float64 vector, a counting regroup;
* `heap` -- a binary min-heap of indices by (key, index);
* `sums` -- numpy's pairwise float64 sum and ``np.maximum.at``, to the bit;
* `kk` -- Karmarkar-Karp's largest differencing method.

The hdp policy's own kernels are in ``hdp.packing.policies.hdp.kernels``; a baseline policy imports
only these, so it never compiles the hdp policy's.
"""

__all__: list[str] = []
