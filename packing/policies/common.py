"""What every policy returns, and small helpers shared by policies."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Assignment", "pow2_ceil"]


@dataclass(frozen=True)
class Assignment:
    """Per-sample columns (caller order): round, first rank of the group, group size."""

    round_of: np.ndarray
    group_start: np.ndarray
    group_size: np.ndarray


def pow2_ceil(x: np.ndarray | int) -> np.ndarray:
    """Smallest power of two >= x (x >= 1), elementwise."""
    x = np.maximum(1, np.asarray(x, dtype=np.int64))
    return (1 << np.ceil(np.log2(x)).astype(np.int64)).astype(np.int64)
