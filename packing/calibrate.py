"""Fit a `CostModel` to measured times (numpy only).

Record schema (one JSON object per line of a ``.jsonl`` file):

* **group** record (``"kind": "group"``, the default when ``kind`` is absent)::

      {"kind": "group", "lengths": [L1, L2, ...], "group_size": k, "seconds": t}

  ``lengths`` are the samples one group of ``k`` ranks ran packed in one round (forward +
  backward), ``t`` the measured time of one rank of that group for that work, without the fixed
  per-round cost.  k = 1 records fix a (linear coefficient) and the unit time; k >= 2 records
  fix the ring-attention overheads.

* **round** record::

      {"kind": "round", "seconds": t, "groups": [{"lengths": [...], "group_size": k}, ...]}

  the wall time of one whole round in which the listed groups ran side by side; ``t - max over
  groups of the group time`` is the per-round cost beta.

Any record may carry extra keys (``"note"``, ``"rank"``, ...); they are ignored.

Model (see `hdp.packing.cost`), with ``Lp`` the lengths padded to 2k chunks and
``X1 = sum Lp / k``, ``X2 = sum Lp**2 / k``, ``X3 = sum Lp**2 / k**2``::

    t = u * a * X1 + u * X2 + (k - 1) * u * step_overhead
        + (k - 1) * u * max(0, step_latency + comm_per_token * X1 - X3)

For fixed (step_latency, comm_per_token) this is linear in (u*a, u, u*step_overhead), so the fit
solves a non-negative least-squares problem for those three on a grid over the two hideable
communication parameters, refines the grid around the best point, and finally sets beta from the
round records.  Residuals are reported as R² and the median relative error over all records.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hdp.packing.cost import CostModel, padded_length

__all__ = ["calibrate", "CalibrationResult", "load_records", "validate_record", "group_seconds"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CalibrationResult:
    """A fitted cost model and how well it explains the records."""

    cost: CostModel
    """The fitted model (units: token² units; seconds via cost.unit_time_s)."""
    r2: float
    """Coefficient of determination over all records (1 = perfect)."""
    median_rel_err: float
    """Median of |predicted - measured| / measured over all records."""
    n_records: int
    """Records used (group + round)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: fitted parameters and fit quality."""
        c = self.cost
        return {
            "unit_time_s": c.unit_time_s,
            "linear_coef": c.linear_coef,
            "round_cost": c.round_cost,
            "round_cost_s": c.round_cost * c.unit_time_s,
            "step_overhead": c.step_overhead,
            "step_latency": c.step_latency,
            "comm_per_token": c.comm_per_token,
            "r2": self.r2,
            "median_rel_err": self.median_rel_err,
            "n_records": self.n_records,
        }


def _group_fields(rec: Mapping[str, Any], where: str) -> tuple[np.ndarray, int]:
    lengths = rec.get("lengths")
    if not isinstance(lengths, (list, tuple)) or not lengths:
        raise ValueError(f"{where}.lengths: expected a non-empty list of sample lengths, got {lengths!r}")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in lengths):
        raise ValueError(f"{where}.lengths: every length must be an integer >= 1, got {lengths!r}")
    k = rec.get("group_size")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{where}.group_size: expected an integer >= 1, got {k!r}")
    return np.asarray(lengths, dtype=np.int64), k


def _seconds(rec: Mapping[str, Any], where: str) -> float:
    t = rec.get("seconds")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not np.isfinite(t) or t <= 0:
        raise ValueError(f"{where}.seconds: expected a measured time > 0, got {t!r}")
    return float(t)


def validate_record(rec: Any, where: str = "record") -> dict[str, Any]:
    """Check one record against the schema; return it normalised (``kind`` filled in)."""
    if not isinstance(rec, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    kind = rec.get("kind", "group")
    if kind == "group":
        _group_fields(rec, where)
    elif kind == "round":
        groups = rec.get("groups")
        if not isinstance(groups, list) or not groups:
            raise ValueError(f"{where}.groups: a round record needs a non-empty list of groups")
        for i, g in enumerate(groups):
            if not isinstance(g, Mapping):
                raise ValueError(f"{where}.groups[{i}]: expected an object with lengths and group_size")
            _group_fields(g, f"{where}.groups[{i}]")
    else:
        raise ValueError(f"{where}.kind={kind!r} is unknown; use 'group' or 'round'")
    _seconds(rec, where)
    return {**rec, "kind": kind}


def load_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read and validate JSON-lines records; errors name the file and line."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"records file {str(p)!r}: cannot read it ({exc.strerror or exc})") from exc
    out: list[dict[str, Any]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{p}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg}): {line.strip()[:80]!r}") from exc
        out.append(validate_record(rec, where))
    if not out:
        raise ValueError(f"records file {str(p)!r}: holds no records")
    return out


def _features(lengths: np.ndarray, k: int) -> tuple[float, float, float]:
    lp = padded_length(lengths, k).astype(np.float64)
    s1, s2 = float(lp.sum()), float((lp * lp).sum())
    return s1 / k, s2 / k, s2 / (k * k)


def group_seconds(cost: CostModel, lengths: Sequence[int], k: int) -> float:
    """Predicted per-rank seconds of one group of k ranks running ``lengths`` packed."""
    lp = padded_length(np.asarray(lengths, dtype=np.int64), k).astype(np.float64)
    units = cost.group_cost(cost.work(lp).sum(), lp.sum(), (lp * lp).sum(), k)
    return float(units) * cost.unit_time_s


def _nnls_small(a: np.ndarray, b: np.ndarray, required: int) -> tuple[np.ndarray, float]:
    """Least squares with non-negative coefficients by enumerating active sets (few columns).

    Column ``required`` must stay in the model with a positive coefficient (the unit time).
    """
    n = a.shape[1]
    best, best_sse = None, np.inf
    others = [j for j in range(n) if j != required]
    for r in range(len(others) + 1):
        for subset in itertools.combinations(others, r):
            cols = [required, *subset]
            coef, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(coef < 0) or coef[0] <= 0:
                continue
            full = np.zeros(n)
            full[cols] = coef
            sse = float(np.sum((a @ full - b) ** 2))
            if sse < best_sse:
                best, best_sse = full, sse
    if best is None:
        return np.zeros(n), np.inf
    return best, best_sse


def _check_fit(sse: float) -> None:
    if not np.isfinite(sse):
        raise ValueError(
            "calibrate: no fit with a positive unit time; the records do not grow with length "
            "(check the seconds fields)"
        )


def calibrate(records: Iterable[Mapping[str, Any]], base: CostModel | None = None) -> CalibrationResult:
    """Fit unit time, a, beta and the CP overheads of a `CostModel` to measured records.

    Parameters the records cannot identify keep their values from ``base`` (default: a
    `CostModel()` with zero overheads): the CP parameters without any k >= 2 record, beta without
    any round record.  Raises ValueError when there is no group record or a record is malformed.
    """
    base = base if base is not None else CostModel()
    recs = [validate_record(r, f"records[{i}]") for i, r in enumerate(records)]
    groups = [r for r in recs if r["kind"] == "group"]
    rounds = [r for r in recs if r["kind"] == "round"]
    if not groups:
        raise ValueError("calibrate: records hold no group records ({'lengths', 'group_size', 'seconds'})")

    feats = np.array([_features(*_group_fields(r, "record")) for r in groups])  # [G, 3]
    ks = np.array([int(r["group_size"]) for r in groups], dtype=np.float64)  # [G]
    t = np.array([float(r["seconds"]) for r in groups])  # [G]
    x1, x2, x3 = feats.T
    ring = ks - 1.0
    multi = ring > 0
    # weight rows by 1/t so the fit minimises relative error (times span orders of magnitude)
    w = 1.0 / t

    def solve(lat: float, cpt: float) -> tuple[np.ndarray, float]:
        hidden = np.maximum(0.0, lat + cpt * x1 - x3)
        cols = [x2 + ring * hidden, x1]
        if multi.any():
            cols.append(ring)
        a = np.stack(cols, axis=1) * w[:, None]
        return _nnls_small(a, t * w, required=0)

    if multi.any():
        scale = float(np.median(x3[multi]))
        lat_grid = np.concatenate([[0.0], scale * np.geomspace(1e-3, 30.0, 25)])
        tok = float(np.median(x1[multi]))
        cpt_grid = np.concatenate([[0.0], scale / tok * np.geomspace(1e-3, 30.0, 25)])
        best = (np.inf, 0.0, 0.0)
        for lat in lat_grid:
            for cpt in cpt_grid:
                _, sse = solve(lat, cpt)
                if sse < best[0] * (1 - 1e-12):
                    best = (sse, lat, cpt)
        # pattern search: shrink multiplicative steps around the best grid point
        _, lat, cpt = best
        step = 30.0 ** (1 / 12)
        for _ in range(40):
            improved = False
            for dl, dc in ((step, 1), (1 / step, 1), (1, step), (1, 1 / step),
                           (step, step), (1 / step, 1 / step), (step, 1 / step), (1 / step, step)):
                cand_lat = lat * dl if lat > 0 else (scale * 1e-3 if dl > 1 else 0.0)
                cand_cpt = cpt * dc if cpt > 0 else (scale / tok * 1e-3 if dc > 1 else 0.0)
                _, sse = solve(cand_lat, cand_cpt)
                if sse < best[0] * (1 - 1e-12):
                    best, lat, cpt, improved = (sse, cand_lat, cand_cpt), cand_lat, cand_cpt, True
            if not improved:
                step = step ** 0.5
                if step < 1.0005:
                    break
        coef, sse = solve(lat, cpt)
        _check_fit(sse)
        u, ua = coef[0], coef[1]
        cost = replace(
            base, unit_time_s=float(u), linear_coef=float(ua / u), step_overhead=float(coef[2] / u),
            step_latency=float(lat), comm_per_token=float(cpt),
        )
    else:
        logger.info("calibrate: no k >= 2 records; CP overheads kept from base")
        coef, sse = solve(0.0, 0.0)
        _check_fit(sse)
        cost = replace(base, unit_time_s=float(coef[0]), linear_coef=float(coef[1] / coef[0]))

    if rounds:
        excess = np.array([
            float(r["seconds"]) - max(group_seconds(cost, *_group_fields(g, "group")) for g in r["groups"])
            for r in rounds
        ])
        # relative-error weighting, as for the group records: weights 1 / t**2
        wr = 1.0 / np.array([float(r["seconds"]) for r in rounds]) ** 2
        beta_s = max(0.0, float(np.sum(wr * excess) / np.sum(wr)))
        cost = replace(cost, round_cost=beta_s / cost.unit_time_s)
    else:
        logger.info("calibrate: no round records; round_cost kept from base")
        cost = replace(cost, round_cost=base.round_cost * base.unit_time_s / cost.unit_time_s)

    measured = np.concatenate([t, [float(r["seconds"]) for r in rounds]])
    predicted = np.array(
        [group_seconds(cost, *_group_fields(r, "group")) for r in groups]
        + [
            max(group_seconds(cost, *_group_fields(g, "group")) for g in r["groups"])
            + cost.round_cost * cost.unit_time_s
            for r in rounds
        ]
    )
    ss_res = float(np.sum((measured - predicted) ** 2))
    ss_tot = float(np.sum((measured - measured.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    rel = float(np.median(np.abs(predicted - measured) / measured))
    logger.info("calibrate: %d records, R2=%.4f, median rel err=%.3g", len(recs), r2, rel)
    return CalibrationResult(cost=cost, r2=r2, median_rel_err=rel, n_records=len(recs))
