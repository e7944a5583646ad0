"""What every policy returns, and small helpers shared by policies."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hdp.packing.config import GroupShape
from hdp.packing.cost import pow2_ceil

__all__ = ["Assignment", "allowed_sizes", "pow2_ceil", "left_starts", "TooLarge", "refuse_above"]


class TooLarge(ValueError):
    """A policy refuses, before planning, a batch it cannot plan in reasonable time or memory."""


def refuse_above(work: float, limit: float, policy: str, what: str) -> None:
    """Raise `TooLarge` with a one-line reason when the estimated ``work`` exceeds ``limit``."""
    if work > limit:
        raise TooLarge(
            f"{policy} does not scale to this batch: {what} is about {work:.2g} steps, over the "
            f"{limit:.2g} it takes on (minutes of Python); plan fewer samples or ranks"
        )


@dataclass(frozen=True)
class Assignment:
    """Per-sample columns (caller order): round, first rank of the group, group size."""

    round_of: np.ndarray
    group_start: np.ndarray
    group_size: np.ndarray


def allowed_sizes(num_ranks: int, shape: GroupShape) -> np.ndarray:
    """Group sizes a plan may use: every size up to N, or the powers of two up to N."""
    if shape is GroupShape.POW2:
        return 1 << np.arange(int(np.log2(num_ranks)) + 1, dtype=np.int64)
    return np.arange(1, num_ranks + 1, dtype=np.int64)


def left_starts(rounds: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """[G] first rank of every group when each round lays its groups out from rank 0, wider ones
    first (ties: lower index), so aligned power-of-two blocks stay aligned."""
    rounds, widths = np.asarray(rounds, dtype=np.int64), np.asarray(widths, dtype=np.int64)
    order = np.lexsort((np.arange(widths.size), -widths, rounds))
    w, r = widths[order], rounds[order]
    ends = np.cumsum(w)
    first = np.r_[True, r[1:] != r[:-1]] if r.size else np.zeros(0, dtype=bool)
    base = np.maximum.accumulate(np.where(first, ends - w, 0)) if r.size else ends
    start = np.zeros(widths.size, dtype=np.int64)
    start[order] = ends - w - base
    return start
