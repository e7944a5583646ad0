"""Cost model of one training step in "token² units" (see ../shared/DESIGN.md).

work(L) = a*L + L**2 is the forward+backward cost of one causal sample of L tokens: ``a*L`` the
linear part (projections, MLP, experts), ``L**2`` causal attention.  One unit is the attention
cost of one token pair row (``6 * n_layers * d_attn`` FLOPs, the convention under which
``a ~ N_active_params / (n_layers * d_attn)``).

A group of k >= 2 ranks running a packed set of samples with zigzag ring attention costs every
rank of the group

    sum_i work(Lp_i) / k
      + (k - 1) * ( step_overhead
                    + max(0, step_latency + comm_per_token * sum_i Lp_i / k - sum_i (Lp_i / k)**2) )

where ``Lp = ceil(L / 2k) * 2k`` is the length rounded to 2k chunks (the busiest rank's share),
``step_overhead`` is the un-hidable fixed cost of one ring step (kernel launches, small-kernel
inefficiency, synchronisation), and the ``max(0, ...)`` term is the K/V transfer of one ring step
(latency + bytes / bandwidth) minus the attention compute of that step that hides it.  For k = 1
the cost is ``sum_i work(L_i)``.  All parameters are in units; `unit_time_s` converts to seconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

__all__ = ["CostModel", "work", "padded_length", "max_rank_tokens", "min_group_size", "pow2_ceil"]


def work(lengths: np.ndarray | float, linear_coef: float) -> np.ndarray:
    """a*L + L**2 for every length (float64 array)."""
    length = np.asarray(lengths, dtype=np.float64)
    return linear_coef * length + length * length


def padded_length(lengths: np.ndarray | int, k: np.ndarray | int) -> np.ndarray:
    """Length rounded up to a multiple of 2k for k >= 2 (unchanged for k == 1)."""
    length = np.asarray(lengths, dtype=np.int64)
    k = np.asarray(k, dtype=np.int64)
    two_k = 2 * k
    padded = -(-length // two_k) * two_k
    return np.where(k > 1, padded, length)


def max_rank_tokens(lengths: np.ndarray | int, k: np.ndarray | int) -> np.ndarray:
    """Most tokens any rank of a k-group holds of a sample under zigzag chunking (exact, O(1) each).

    Rank j holds chunks j and 2k-1-j with boundaries floor(c*L/2k) (`hdp.packing.chunks`), i.e.
    ``floor((j+1)L/2k) - floor(jL/2k) + ceil((j+1)L/2k) - ceil(jL/2k)`` tokens.  With
    L = 2k*q + r (0 <= r < 2k) that is 2q + e_j, where e_j counts the floor and the ceil step
    inside (jr, (j+1)r]; both steps fall in one rank's range exactly when a multiple of 2k lies
    strictly inside (jr, (j+1)r) for some j < k, which happens iff r > 2 and r does not divide 2k
    (the first multiple, 2k itself, then sits at j = floor(2k/r) < k).  So the maximum is 2q for
    r = 0, 2q + 2 in that case and 2q + 1 otherwise.  k = 1 holds the whole sample.
    """
    length = np.atleast_1d(np.asarray(lengths, dtype=np.int64))
    k = np.broadcast_to(np.asarray(k, dtype=np.int64), length.shape)
    two_k = 2 * k
    q, r = np.divmod(length, two_k)
    split = (r > 2) & (two_k % np.maximum(r, 1) != 0)  # one rank takes a floor and a ceil step
    out = np.where(k > 1, 2 * q + np.where(r == 0, 0, np.where(split, 2, 1)), length)
    return out if np.ndim(lengths) else out[:1]


def pow2_ceil(x: np.ndarray | int) -> np.ndarray:
    """Smallest power of two >= x (x >= 1), elementwise."""
    x = np.maximum(1, np.asarray(x, dtype=np.int64))
    return (1 << np.ceil(np.log2(x)).astype(np.int64)).astype(np.int64)


def min_group_size(lengths: np.ndarray, budget: int, max_k: int, pow2: bool = False) -> np.ndarray:
    """Smallest k such that no rank of a k-group holds more than ``budget`` tokens of the sample.

    Returns ``max_k + 1`` for samples that do not fit on ``max_k`` ranks.  With ``pow2`` the
    smallest such power of two: the power of two above the plain minimum, doubled while the
    zigzag split still puts more than ``budget`` tokens on a rank (an odd budget small next to
    the group can: 21 tokens on 8 ranks, budget 3); a power of two above ``max_k`` when none fits.
    """
    length = np.asarray(lengths, dtype=np.int64)
    k = np.maximum(1, -(-length // budget))
    for _ in range(4):  # the zigzag rounding adds at most one token per rank: k or k + 1 suffice
        fits = (k > max_k) | (max_rank_tokens(length, np.minimum(k, max_k)) <= budget)
        if fits.all():
            break
        k = np.where(fits, k, k + 1)
    k = np.minimum(k, max_k + 1)
    if not pow2:
        return k
    k = pow2_ceil(k)
    while True:
        over = (k <= max_k) & (max_rank_tokens(length, np.minimum(k, max_k)) > budget)
        if not over.any():
            return k
        k = np.where(over, 2 * k, k)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Per-rank cost of samples on groups, in token² units (see module docstring)."""

    linear_coef: float = 24_700.0
    """a: linear work per token over attention work (DeepSeek-V3 ~ 24.7K, Qwen3-235B ~ 28.6K)."""
    round_cost: float = 0.0
    """beta: fixed cost of one round (launches, gradient accumulation, pipeline bubble), units."""
    step_overhead: float = 0.0
    """Un-hidable fixed cost of one ring step (launch, sync, small kernels), units."""
    step_latency: float = 0.0
    """Latency of one ring step's K/V transfer (hidden behind attention compute), units."""
    comm_per_token: float = 0.0
    """K/V transfer time per token of a ring step (bytes / bandwidth), units per token."""
    unit_time_s: float = 1.0e-9
    """Seconds per unit on the target hardware (converts step times to seconds)."""

    def __post_init__(self) -> None:
        for name in ("linear_coef", "round_cost", "step_overhead", "step_latency", "comm_per_token"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"cost.{name}={value!r}: must be a finite number >= 0")
        if not np.isfinite(self.unit_time_s) or self.unit_time_s <= 0:
            raise ValueError(f"cost.unit_time_s={self.unit_time_s!r}: must be a number > 0")

    def save(self, path: str | os.PathLike[str], *, metadata: dict | None = None) -> None:
        """Write this model to a cost-model file (`hdp.packing.cost_file`; ``hdp plan --cost-model`` reads it)."""
        from hdp.packing.cost_file import save_cost_model

        save_cost_model(self, path, metadata=metadata)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostModel:
        """Read a cost-model file written by `save` or ``hdp calibrate --out`` (ValueError naming the problem)."""
        from hdp.packing.cost_file import load_cost_model

        return load_cost_model(path)

    def work(self, lengths: np.ndarray | float) -> np.ndarray:
        """work(L) = a*L + L**2 (units), the cost of a sample on one rank."""
        return work(lengths, self.linear_coef)

    def group_cost(
        self, sum_work: np.ndarray, sum_len: np.ndarray, sum_sq: np.ndarray, k: np.ndarray
    ) -> np.ndarray:
        """Per-rank cost of groups from their sums over samples of padded work, length, length².

        ``sum_work = sum_i work(Lp_i)``, ``sum_len = sum_i Lp_i``, ``sum_sq = sum_i Lp_i**2``,
        all taken with Lp padded for the group size ``k`` (arrays broadcast together).
        """
        k = np.asarray(k, dtype=np.float64)
        comm = self.step_latency + self.comm_per_token * np.asarray(sum_len) / k
        hidden = np.asarray(sum_sq, dtype=np.float64) / (k * k)
        ring = (k - 1.0) * (self.step_overhead + np.maximum(0.0, comm - hidden))
        return np.asarray(sum_work, dtype=np.float64) / k + np.where(k > 1, ring, 0.0)

    def sample_cost(self, lengths: np.ndarray | float, k: np.ndarray | int) -> np.ndarray:
        """Per-rank cost of each sample alone on a group of k ranks (units)."""
        k = np.asarray(k, dtype=np.int64)
        padded = padded_length(lengths, k).astype(np.float64)
        return self.group_cost(self.work(padded), padded, padded * padded, k)

    def cheapest_rank_time(self, lengths: np.ndarray, k_min: np.ndarray, k_max: int) -> np.ndarray:
        """min over k in [k_min, k_max] of k * sample_cost(L, k): each sample's least rank-time."""
        length = np.asarray(lengths, dtype=np.float64)
        k_min = np.asarray(k_min, dtype=np.int64)
        best = k_min * self.sample_cost(length, k_min)
        # Rank-time grows with k except through padding artefacts; scanning a few sizes is exact
        # enough for the bound and keeps it cheap for 100K samples.
        for extra in (1, 2, 3):
            k = np.minimum(k_min + extra, k_max)
            best = np.minimum(best, k * self.sample_cost(length, k))
        return best
