"""Cost model of one training step in "token² units" (docs/design.md, "Cost model").

work(L) = a*L + L**2 is the forward+backward cost of one causal sample of L tokens: ``a*L`` the
linear part (projections, MLP, experts), ``L**2`` causal attention.  One unit is the attention
cost of one token pair row (``6 * n_layers * d_attn`` FLOPs, the convention under which
``a ~ N_active_params / (n_layers * d_attn)``); `CostModel.unit_time_s` converts units to seconds.

A group of k >= 2 ranks running a packed set of samples with zigzag ring attention costs every
rank of the group (``Lp = ceil(L / 2k) * 2k``, the length rounded to 2k chunks, i.e. the busiest
rank's share; sums over the group's samples)

    sum work(Lp) / k                                          compute of the rank's share
      + (k - 1) * step_overhead                               fixed cost of every ring step
      + (k - 1) * max(0, step_latency + comm_per_token * sum Lp / k
                          - sum (Lp / k)**2)                  K/V transfer not hidden by compute
      + merge_per_token * (k - 1) * sum Lp / k                per-token work of every ring step
      + cp_per_token * sum Lp / k                             per-token work of being split at all

and a rank of a group of k = 1 costs ``sum work(L)``.  **Two link classes.**  A ring step's
transfer runs over the slowest link the ring crosses: inside one node the intra-node link
(``step_latency``, ``comm_per_token``: NVLink, HCCS); a group whose ranks span two or more nodes
(`hdp.packing.topology`) pays ``max(step_latency + comm_per_token * sum Lp / k, node_step_latency
+ node_comm_per_token * sum Lp / k)`` in that term instead (InfiniBand, RoCE), hidden behind
compute the same way.  With both node terms 0 there is one level (every older model).  A round costs its busiest rank plus
``round_cost`` (beta); a step is the sum of its rounds (the rounds model of docs/design.md).

The two per-token terms are the memory-bound work that the K/V transfer does not hide and that
grows with L on every rank whatever k is: in forward every ring step after the first merges a
partial output and log-sum-exp into the rank's L/k query tokens; in backward dK/dV of the block
travelling with the ring are accumulated once per step (and dQ of the local block).  That is
``merge_per_token * (k - 1) * L / k`` per rank, about ``merge_per_token * L`` for large k.
``cp_per_token * L / k`` is the per-local-token work of being split (zigzag split and re-assembly,
fp32 output/LSE buffers, the first step's bookkeeping).  Together they span ``c * L`` per rank
(``c * L = c * (k-1) * L/k + c * L/k``) and every mix of per-step and per-split work, with
non-negative coefficients, linear in the parameters (the fit in `hdp.packing.calibrate` is a
non-negative least-squares problem in them).

Attention-kernel efficiency that falls with block size needs no parameter of its own: a kernel
running s-token blocks at efficiency ``s / (s + s0)`` takes ``pairs * (1 + s0 / s)``; with blocks
of s = L/k tokens in each of the k ring steps that is ``L**2 / k + s0 * L`` per rank, the k = 1
part ``s0 * L / k`` is in ``a`` (fitted on single-rank records) and the rest,
``s0 * (k - 1) * L / k``, is exactly a ``merge_per_token`` term (`tests/unit/packing/test_cost_model.py`
fits records made under such a law).

Units: ``linear_coef`` is dimensionless (units per token per unit of L**2 / L); ``round_cost``,
``step_overhead``, ``step_latency`` and ``node_step_latency`` are units; ``comm_per_token``,
``node_comm_per_token``, ``merge_per_token`` and ``cp_per_token`` are units per token; ``unit_time_s`` is seconds per unit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

MAX_PARAMETER = 1e30
"""Largest value of a unit-valued `CostModel` parameter (beyond it step times of long samples overflow)."""
MIN_UNIT_TIME_S = 1e-30
MAX_UNIT_TIME_S = 1.0
"""Range of `CostModel.unit_time_s` (seconds per token pair of attention)."""

__all__ = ["CostModel", "SizePricedCost", "PARAMETERS", "work", "padded_length", "padded_float", "max_rank_tokens", "min_group_size", "pow2_ceil"]


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


def padded_float(lengths: np.ndarray | int, k: np.ndarray | int) -> np.ndarray:
    """`padded_length` as float64 (what the cost formulas take), computed in floating point.

    Exact for lengths below 2**53: ``L / 2k`` is correctly rounded, so it is an integer exactly when
    2k divides L, and otherwise lies at least ``1 / 2k`` above an integer -- far beyond its rounding
    error -- so its ceiling, times 2k, is the integer result (and cheaper than the integer path).
    """
    length = np.asarray(lengths, dtype=np.float64)
    kf = np.asarray(k, dtype=np.float64)
    two_k = 2.0 * kf
    return np.where(kf > 1, np.ceil(length / two_k) * two_k, length)


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


PARAMETERS = (
    "linear_coef", "round_cost", "step_overhead", "step_latency", "comm_per_token",
    "merge_per_token", "cp_per_token", "node_step_latency", "node_comm_per_token", "unit_time_s",
)
"""Names of the `CostModel` fields, in the order of `CostModel.to_vector`."""


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Per-rank cost of samples on groups, in token² units (see module docstring)."""

    linear_coef: float = 24_700.0
    """a: linear work per token over attention work (DeepSeek-V3 ~ 24.7K, Qwen3-235B ~ 28.6K); dimensionless."""
    round_cost: float = 0.0
    """beta: fixed cost of one round (launches, gradient accumulation, pipeline bubble), units."""
    step_overhead: float = 0.0
    """Un-hidable fixed cost of one ring step (kernel launches, P2P set-up, synchronisation), units per step."""
    step_latency: float = 0.0
    """Latency of one ring step's K/V transfer (hidden behind attention compute), units per step."""
    comm_per_token: float = 0.0
    """K/V transfer time per token of a ring step (bytes / link bandwidth), units per token per step."""
    merge_per_token: float = 0.0
    """Memory-bound work per local token per ring step after the first (output/LSE merge in forward,
    dK/dV and dQ accumulation in backward, small-block kernel efficiency); enters as
    ``(k - 1) * sum Lp / k`` per rank, units per token per step."""
    cp_per_token: float = 0.0
    """Work per local token of a sample that is split at all (k >= 2: zigzag split and re-assembly,
    fp32 output/LSE buffers); enters as ``sum Lp / k`` per rank, units per token."""
    node_step_latency: float = 0.0
    """Latency of one ring step's K/V transfer over the inter-node link (InfiniBand, RoCE), units per
    step: a group whose ring crosses a node boundary pays ``max`` of the two links' transfer time per
    step (its slowest link); 0 with `node_comm_per_token` 0: no slower link (one level)."""
    node_comm_per_token: float = 0.0
    """K/V transfer time per token of a ring step over the inter-node link, units per token per step
    (the intra-node link's is `comm_per_token`)."""
    unit_time_s: float = 1.0e-9
    """Seconds per unit on the target hardware (converts step times to seconds)."""

    def __post_init__(self) -> None:
        for name in PARAMETERS[:-1]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
                raise ValueError(f"cost.{name}={value!r}: must be a finite number >= 0")
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"cost.{name}={value!r}: must be a finite number >= 0")
            if value > MAX_PARAMETER:
                raise ValueError(f"cost.{name}={value!r}: above {MAX_PARAMETER:g} units, where step times of long "
                                 "samples overflow; no machine costs that (a unit is one token pair of attention)")
        u = self.unit_time_s
        if isinstance(u, bool) or not isinstance(u, (int, float, np.floating, np.integer)) or not np.isfinite(u) or u <= 0:
            raise ValueError(f"cost.unit_time_s={u!r}: must be a finite number > 0 (seconds per unit)")
        if not MIN_UNIT_TIME_S <= u <= MAX_UNIT_TIME_S:
            raise ValueError(f"cost.unit_time_s={u!r}: must be in [{MIN_UNIT_TIME_S:g}, {MAX_UNIT_TIME_S:g}] seconds per "
                             "unit (one token pair of attention: ~1e-9 s on one accelerator)")

    def save(self, path: str | os.PathLike[str], *, metadata: dict | None = None) -> None:
        """Write this model to a cost-model file (`hdp.packing.cost_file`; ``hdp plan --cost-model`` reads it)."""
        from hdp.packing.cost_file import save_cost_model

        save_cost_model(self, path, metadata=metadata)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CostModel:
        """Read a cost-model file written by `save` or ``hdp calibrate --out`` (ValueError naming the problem)."""
        from hdp.packing.cost_file import load_cost_model

        return load_cost_model(path)

    def to_vector(self) -> np.ndarray:
        """The parameters as a float64 vector in `PARAMETERS` order (for collectives)."""
        return np.array([float(getattr(self, n)) for n in PARAMETERS], dtype=np.float64)

    @classmethod
    def from_vector(cls, vector: np.ndarray) -> CostModel:
        """Inverse of `to_vector`."""
        v = np.asarray(vector, dtype=np.float64).reshape(-1)
        if v.size != len(PARAMETERS):
            raise ValueError(f"cost vector has {v.size} values; a CostModel has {len(PARAMETERS)} ({', '.join(PARAMETERS)})")
        return cls(**{n: float(x) for n, x in zip(PARAMETERS, v)})

    def work(self, lengths: np.ndarray | float) -> np.ndarray:
        """work(L) = a*L + L**2 (units), the cost of a sample on one rank."""
        return work(lengths, self.linear_coef)

    def group_cost(
        self, sum_work: np.ndarray, sum_len: np.ndarray, sum_sq: np.ndarray, k: np.ndarray,
        cross: np.ndarray | bool = False,
    ) -> np.ndarray:
        """Per-rank cost of groups from their sums over samples of padded work, length, length².

        ``sum_work = sum_i work(Lp_i)``, ``sum_len = sum_i Lp_i``, ``sum_sq = sum_i Lp_i**2``,
        all taken with Lp padded for the group size ``k`` (arrays broadcast together); ``cross``:
        the group's ring crosses a node boundary, so a ring step's transfer takes the slower of the
        two links (`node_step_latency`, `node_comm_per_token`).
        """
        k = np.asarray(k, dtype=np.float64)
        local = np.asarray(sum_len, dtype=np.float64) / k  # tokens per rank
        comm = self.step_latency + self.comm_per_token * local
        if np.any(cross):
            comm = np.where(cross, np.maximum(comm, self.node_step_latency + self.node_comm_per_token * local), comm)
        hidden = np.asarray(sum_sq, dtype=np.float64) / (k * k)
        per_step = self.step_overhead + np.maximum(0.0, comm - hidden)
        if self.merge_per_token:
            per_step = per_step + self.merge_per_token * local
        ring = (k - 1.0) * per_step
        if self.cp_per_token:
            ring = ring + self.cp_per_token * local
        return np.asarray(sum_work, dtype=np.float64) / k + np.where(k > 1, ring, 0.0)

    def group_cost_one(self, sum_work: float, sum_len: float, sum_sq: float, k: int, cross: bool = False) -> float:
        """`group_cost` of one group, in plain Python floats (for scalar search loops)."""
        if k <= 1:
            return float(sum_work)
        local = sum_len / k
        link = self.step_latency + self.comm_per_token * local
        if cross:
            link = max(link, self.node_step_latency + self.node_comm_per_token * local)
        comm = link - sum_sq / (k * k)
        per_step = self.step_overhead + (comm if comm > 0.0 else 0.0) + self.merge_per_token * local
        return sum_work / k + (k - 1) * per_step + self.cp_per_token * local

    def split_per_token(self, k: np.ndarray | float) -> np.ndarray:
        """Rank-time per token of a sample split over k ranks, summed over the group:
        ``(k - 1) * merge_per_token + cp_per_token`` for k >= 2 (k ranks x the per-rank terms
        ``merge (k - 1) Lp / k + cp Lp / k`` of `group_cost`), 0 for k = 1; additive over samples."""
        k = np.asarray(k, dtype=np.float64)
        return np.where(k > 1, (k - 1.0) * self.merge_per_token + self.cp_per_token, 0.0)

    def packed_cost(self, lengths: np.ndarray | list[int], k: int, cross: bool = False) -> float:
        """Per-rank cost (units) of one group of ``k`` ranks running ``lengths`` packed in one round
        (``cross``: its ring crosses a node boundary)."""
        lp = padded_float(np.asarray(lengths, dtype=np.int64), k)
        return float(self.group_cost(self.work(lp).sum(), lp.sum(), (lp * lp).sum(), k, cross))

    def sample_cost(self, lengths: np.ndarray | float, k: np.ndarray | int,
                    cross: np.ndarray | bool = False) -> np.ndarray:
        """Per-rank cost of each sample alone on a group of k ranks (units; ``cross``: the ring
        crosses a node boundary)."""
        k = np.asarray(k, dtype=np.int64)
        padded = padded_float(lengths, k)
        return self.group_cost(self.work(padded), padded, padded * padded, k, cross)

    def wide_cost(self, lengths: np.ndarray | float, k: np.ndarray | int, node_ranks: int | None) -> np.ndarray:
        """`sample_cost` on groups that cross a node boundary exactly when they are wider than
        ``node_ranks`` (the largest node: such a group spans two wherever it sits; ``None``: one
        node) -- the least height a sample has on k ranks of that domain."""
        if node_ranks is None:
            return self.sample_cost(lengths, k)
        return self.sample_cost(lengths, k, np.asarray(k) > node_ranks)

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


@dataclass(frozen=True, kw_only=True)
class SizePricedCost(CostModel):
    """A `CostModel` that knows the largest node of the domain (``node_ranks`` ranks) and prices a
    group by its size alone: one wider than a node crosses a boundary wherever it sits (the
    inter-node link), a narrower one is priced inside a node.  How the hdp policy's passes see
    groups before they are placed (`hdp.packing.policies.hdp.placement` then lays them out, and
    prices every group where it sits)."""

    node_ranks: int = 1 << 62
    """Ranks of the largest node."""

    def group_cost(self, sum_work: np.ndarray, sum_len: np.ndarray, sum_sq: np.ndarray, k: np.ndarray,
                   cross: np.ndarray | bool = False) -> np.ndarray:
        """`CostModel.group_cost`, a group wider than the largest node crossing nodes."""
        return super().group_cost(sum_work, sum_len, sum_sq, k, np.logical_or(cross, np.asarray(k) > self.node_ranks))

    def group_cost_one(self, sum_work: float, sum_len: float, sum_sq: float, k: int, cross: bool = False) -> float:
        """`CostModel.group_cost_one`, a group wider than the largest node crossing nodes."""
        return super().group_cost_one(sum_work, sum_len, sum_sq, k, cross or k > self.node_ranks)
