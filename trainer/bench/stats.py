"""Paired figures of policies run side by side, with their 95% intervals (numpy only).

On a machine that other work loads, one policy's tokens/s over a run drifts with that load; the ratio of
two policies' steps *on the same batch, one right after the other* (paired alternation: step s of policy A,
then step s of policy B, the order swapped every step) moves far less, because both steps met nearly the
same load.  `paired` takes each timed step's ratio and reports their median with a 95% bootstrap
interval of that median (`median_ci95`, seeded: the same steps give the same interval) -- how far one
run's figure can be from the machine's true one.  ``regress --update`` records ``half_width`` (half the
interval over the median) as the row's spread and derives its tolerance from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["median_ci95", "paired", "RESAMPLES"]

RESAMPLES = 2000
"""Bootstrap resamples of `median_ci95`."""


def median_ci95(values: Sequence[float], resamples: int = RESAMPLES, seed: int = 0) -> list[float]:
    """[low, high]: a 95% bootstrap interval of the median of ``values`` (``resamples`` resamples with
    replacement, seeded); ``[nan, nan]`` for no values."""
    x = np.asarray(values, dtype=np.float64)  # [n]
    if x.size == 0:
        return [math.nan, math.nan]
    g = np.random.default_rng(seed)
    med = np.median(x[g.integers(0, x.size, size=(resamples, x.size))], axis=1)  # [resamples]
    return [float(np.quantile(med, 0.025)), float(np.quantile(med, 0.975))]


def paired(numerator: Sequence[float], denominator: Sequence[float]) -> dict[str, Any]:
    """``{"median", "ci95": [low, high], "half_width", "n", "ratios"}`` of the per-step ratios
    ``numerator[s] / denominator[s]`` (a slower baseline step over the faster policy's step is a speedup > 1);
    ``half_width``: (high - low) / 2 / median, the interval's relative half width."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired: {len(numerator)} numerator steps, {len(denominator)} denominator steps; pass one "
                         "figure per step to both")
    ratios = [float(a) / float(b) for a, b in zip(numerator, denominator) if b > 0 and a > 0]
    if not ratios:
        return {"median": math.nan, "ci95": [math.nan, math.nan], "half_width": math.nan, "n": 0, "ratios": []}
    med = float(np.median(ratios))
    low, high = median_ci95(ratios)
    return {"median": med, "ci95": [low, high], "half_width": (high - low) / 2 / med, "n": len(ratios),
            "ratios": ratios}
