"""Fit a `CostModel` to measured times (numpy; deterministic).

Records: `hdp.packing.calibration_records` (their schema, checks and loading).

Model (`hdp.packing.cost`), with ``Lp`` the lengths padded to 2k chunks, ``X1 = sum Lp / k``,
``X2 = sum Lp**2 / k``, ``X3 = sum Lp**2 / k**2`` and u the unit time::

    t = u * (a * X1 + X2) + u * (k-1) * max(0, step_latency + comm_per_token * X1 - X3)
        + u * step_overhead * (k-1) + u * merge_per_token * (k-1) * X1
        + u * cp_per_token * X1 * [k >= 2]

For fixed (step_latency, comm_per_token) this is linear in (u, u*a, u*step_overhead,
u*merge_per_token, u*cp_per_token); the fit solves that non-negative least-squares problem exactly
(active sets enumerated, u > 0) with rows weighted by sqrt(weight)/t (relative error), on a grid over the two
hideable communication parameters refined by a pattern search; beta comes last from the round
records.  Records of groups whose ranks spanned two or more nodes (``"nodes"`` >= 2) are left out of
that fit and fit the inter-node link afterwards (`hdp.packing.calibrate_nodes`); records inside one
node alone fit as before.

**What the records cannot say.**  A parameter is *fitted* only when the records determine it:
moving it by 2x either way (from 0: to the value where it would add 5% to the typical record)
must worsen the fit by more than the noise (4 sigma², sigma² the residual variance).  Otherwise it
keeps the base model's value (when that value is consistent with the records) and the result says
which and why (`CalibrationResult.from_base`, `CalibrationResult.reasons`).  Parameters are tried
for this in the order cp_per_token, merge_per_token, step_latency, comm_per_token, step_overhead,
linear_coef, so of two that the records cannot tell apart the later keeps being fitted.  The unit
time is always fitted; a fit uses at most (group records - 1) parameters.  Parameters kept from
the base keep their value in seconds (a keeps its ratio), unless the base's overheads in seconds
exceed the measured times: then they keep their value in units (they scale with the fitted unit
time) and a warning says so.  Residuals are reported as R² and relative errors over all records.
Times that fall as the work grows (rank correlation <= -0.8 within a group size) are an error;
times that barely grow with it, or a fit with R² < 0.9, give a warning.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hdp.packing.calibrate_nodes import NODE_PARAMS, fit_node_link
from hdp.packing.calibration_records import (
    MAX_GROUP_SIZE, MAX_LENGTH, MAX_SECONDS, MAX_WEIGHT, MEMORY_FEATURES, MIN_SECONDS, group_fields, group_nodes,
    load_records, record_weight, validate_record,
)
from hdp.packing.cost import PARAMETERS, CostModel, padded_float

__all__ = [
    "calibrate", "CalibrationResult", "load_records", "validate_record", "group_seconds", "MEMORY_FEATURES",
    "MAX_LENGTH", "MAX_GROUP_SIZE", "MIN_SECONDS", "MAX_SECONDS", "MAX_WEIGHT", "FIT_ORDER",
]

logger = logging.getLogger(__name__)


_LINEAR = ("unit_time_s", "linear_coef", "step_overhead", "merge_per_token", "cp_per_token")
_COMM = ("step_latency", "comm_per_token")
FIT_ORDER = ("cp_per_token", "merge_per_token", "step_latency", "comm_per_token", "step_overhead", "linear_coef")
"""Order in which parameters are tested (and dropped to the base value) when the records cannot
determine them; the unit time is always fitted."""
_CP_PARAMS = ("step_overhead", "merge_per_token", "cp_per_token", "step_latency", "comm_per_token")


@dataclass(frozen=True, kw_only=True)
class CalibrationResult:
    """A fitted cost model, which parameters the records determined, and how well it explains them."""

    cost: CostModel
    """The fitted model (units: token² units; seconds via cost.unit_time_s)."""
    r2: float
    """Coefficient of determination over all records (1 = perfect)."""
    median_rel_err: float
    """Median of |predicted - measured| / measured over all records."""
    n_records: int
    """Records used (group + round)."""
    fitted: tuple[str, ...] = ()
    """Parameters fitted from the records (`PARAMETERS` order)."""
    from_base: tuple[str, ...] = ()
    """Parameters kept from the base model (`PARAMETERS` order)."""
    reasons: Mapping[str, str] = field(default_factory=dict)
    """Why each parameter in `from_base` was not fitted."""
    rel_err_p90: float = float("nan")
    """90th percentile of the relative errors."""
    max_rel_err: float = float("nan")
    """Largest relative error."""
    n_group_records: int = 0
    """Group records used."""
    n_round_records: int = 0
    """Round records used."""
    warnings: tuple[str, ...] = ()
    """Problems worth a look (too few records, a poor fit); also logged."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: every parameter (and beta in seconds) and the fit quality."""
        c = self.cost
        out: dict[str, Any] = {n: float(getattr(c, n)) for n in PARAMETERS}
        out["round_cost_s"] = c.round_cost * c.unit_time_s
        out.update(self.fit_report())
        out["fitted"] = list(self.fitted)
        out["from_base"] = list(self.from_base)
        return out

    def fit_report(self) -> dict[str, Any]:
        """The ``fit`` section of a cost-model file (`hdp.packing.cost_file`)."""
        return {
            "r2": self.r2,
            "median_rel_err": self.median_rel_err,
            "rel_err_p90": self.rel_err_p90,
            "max_rel_err": self.max_rel_err,
            "n_records": self.n_records,
            "n_group_records": self.n_group_records,
            "n_round_records": self.n_round_records,
            "reasons": dict(self.reasons),
            "warnings": list(self.warnings),
        }

    def metadata(self, base: str | None) -> dict[str, Any]:
        """Metadata of the cost-model file for this fit (``base``: the base preset's name or None)."""
        return {"fitted": list(self.fitted), "from_base": list(self.from_base), "base": base, "fit": self.fit_report()}


def group_seconds(cost: CostModel, lengths: Sequence[int], k: int, nodes: int = 1) -> float:
    """Predicted per-rank seconds of one group of k ranks running ``lengths`` packed (``nodes``: the
    nodes its ranks span; 2 or more: its ring steps take the slower link)."""
    return cost.packed_cost(np.asarray(lengths, dtype=np.int64), k, nodes > 1) * cost.unit_time_s


def _record_seconds(cost: CostModel, rec: Mapping[str, Any]) -> float:
    """`group_seconds` of a group record or a round record's group."""
    return group_seconds(cost, *group_fields(rec, "group"), group_nodes(rec, "group"))


# ------------------------------------------------------------------------------------- the design


@dataclass(frozen=True)
class _Design:
    """Features of the group records (one row each)."""

    t: np.ndarray  # [G] measured seconds
    w: np.ndarray  # [G] record weights, mean 1
    k: np.ndarray  # [G] group sizes (float)
    x1: np.ndarray  # [G] sum Lp / k
    x2: np.ndarray  # [G] sum Lp**2 / k
    x3: np.ndarray  # [G] sum Lp**2 / k**2

    @property
    def ring(self) -> np.ndarray:
        return self.k - 1.0

    @property
    def multi(self) -> np.ndarray:
        return self.k > 1

    def columns(self) -> dict[str, np.ndarray]:
        """The linear columns (in units; the coefficient of each is u times the parameter)."""
        return {
            "linear_coef": self.x1,
            "step_overhead": self.ring,
            "merge_per_token": self.ring * self.x1,
            "cp_per_token": np.where(self.multi, self.x1, 0.0),
        }

    def exposed(self, lat: float | np.ndarray, cpt: float | np.ndarray) -> np.ndarray:
        """(k-1) * max(0, lat + cpt * X1 - X3): un-hidden K/V transfer in units ([G], or [P, G] for
        [P, 1] columns of points)."""
        return self.ring * np.maximum(0.0, lat + cpt * self.x1 - self.x3)


def _design(groups: Sequence[Mapping[str, Any]]) -> _Design:
    rows = []
    for r in groups:
        lengths, k = group_fields(r, "record")
        lp = padded_float(lengths, k)
        s1, s2 = float(lp.sum()), float((lp * lp).sum())
        rows.append((float(r["seconds"]), record_weight(r, "record"), float(k), s1 / k, s2 / k, s2 / (k * k)))
    t, w, k, x1, x2, x3 = (np.array(c) for c in zip(*rows))
    return _Design(t=t, w=w / w.mean(), k=k, x1=x1, x2=x2, x3=x3)


# -------------------------------------------------------------------------------------- the fit


@dataclass
class _State:
    """What is free and what is fixed (and to what) during one fit."""

    free: list[str]  # linear parameters fitted besides the unit time (`_Design.columns` names)
    comm_free: list[str]  # of step_latency / comm_per_token
    fixed: dict[str, float]  # parameter -> value: a as a ratio, the others in seconds (or units, below)
    units: bool = False  # fixed values other than a are in units (scale with the fitted u), not seconds

    def without(self, name: str, value: float | None = None) -> "_State":
        """A copy with ``name`` no longer free (fixed to ``value`` when given)."""
        fixed = dict(self.fixed)
        if value is not None:
            fixed[name] = value
        return _State([n for n in self.free if n != name], [n for n in self.comm_free if n != name], fixed, self.units)


_SUBSETS: dict[int, np.ndarray] = {}


def _subsets(n: int) -> np.ndarray:
    """[S, n] boolean masks of every column subset that holds column 0 (cached)."""
    if n not in _SUBSETS:
        rows = [[True, *bits] for bits in itertools.product((False, True), repeat=n - 1)]
        _SUBSETS[n] = np.array(rows, dtype=bool)
    return _SUBSETS[n]


def _nnls(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """min ||a[p] x - b||² with x >= 0 and x[0] > 0 for every p, by enumerating active sets.

    ``a`` is [P, G, n] (n <= 6 columns), ``b`` [G]; returns (x [P, n], sse [P]).  Columns are
    scaled to unit norm first (their magnitudes differ by 10 orders); every subset's least-squares
    solution comes from one batched solve of its normal equations (a 1e-10 ridge keeps collinear
    subsets solvable; their sse is then that of the ridge solution, never below the subset's true
    minimum); the best feasible one is exact NNLS, and its sse is recomputed from the residual
    (the normal-equation sse cancels when the fit is nearly exact).  Deterministic.  sse is inf
    where no subset gives x[0] > 0 or ``a[p]`` is not finite.
    """
    p_count, _, n = a.shape
    finite = np.all(np.isfinite(a), axis=(1, 2)) & bool(np.all(np.isfinite(b)))  # [P]
    a = np.where(finite[:, None, None], a, 0.0)  # never hand LAPACK a NaN/inf (it prints to stdout)
    b = np.where(np.isfinite(b), b, 0.0)
    norms = np.sqrt(np.einsum("pgi,pgi->pi", a, a))  # [P, n]
    norms[norms == 0] = 1.0
    an = a / norms[:, None, :]  # [P, G, n]
    gram = np.einsum("pgi,pgj->pij", an, an)  # [P, n, n]
    rhs = np.einsum("pgi,g->pi", an, b)  # [P, n]
    bb = float(b @ b)
    masks = _subsets(n)  # [S, n]
    both = masks[:, :, None] & masks[:, None, :]  # [S, n, n]
    eye = np.eye(n)
    mat = np.where(both[None], gram[:, None] + 1e-10 * eye, eye)  # [P, S, n, n]
    x = np.linalg.solve(mat, np.where(masks[None], rhs[:, None, :], 0.0)[..., None])[..., 0]  # [P, S, n]
    x = np.where(masks[None], x, 0.0)
    sse = bb - 2.0 * np.einsum("psi,pi->ps", x, rhs) + np.einsum("psi,pij,psj->ps", x, gram, x)  # [P, S]
    ok = np.all(x >= 0, axis=2) & (x[:, :, 0] > 0) & np.isfinite(sse)  # [P, S]
    best = np.argmin(np.where(ok, sse, np.inf), axis=1)  # [P]: the first subset of least sse
    xb = x[np.arange(p_count), best]  # [P, n]
    resid = np.einsum("pgi,pi->pg", an, xb) - b  # [P, G]
    found = ok.any(axis=1) & finite
    return np.where(found[:, None], xb / norms, 0.0), np.where(found, np.einsum("pg,pg->p", resid, resid), np.inf)


_CHUNK = 1 << 18
"""Design entries (points x group records) per batched NNLS: bounds the [P, G, n] arrays (~12 MB)."""


def _solve_many(des: _Design, st: _State, lat: np.ndarray, cpt: np.ndarray, u_hint: float) -> tuple[np.ndarray, np.ndarray]:
    """Best linear parameters for each communication point (lat[p], cpt[p]); (x [P, 1 + F], sse [P]).

    ``x[p, 0]`` is the unit time u, ``x[p, i]`` u times the i-th free parameter (`_State.free`).
    Free ``lat``/``cpt`` are in units.  A fixed one is in seconds, so whether it is hidden depends
    on u: it is converted with ``u_hint`` and then with the fitted u until u settles (3 passes).
    Weighted rows (sqrt(weight)/t): the sse is a weighted sum of squared relative errors.
    """
    lat = np.asarray(lat, dtype=np.float64)
    cpt = np.asarray(cpt, dtype=np.float64)
    step = max(1, _CHUNK // max(1, des.t.size))
    if lat.size > step:  # bound the memory of one batch
        parts = [_solve_many(des, st, lat[i : i + step], cpt[i : i + step], u_hint) for i in range(0, lat.size, step)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    cols = des.columns()
    w = np.sqrt(des.w) / des.t
    target = des.t.copy()
    a_fixed = "linear_coef" not in st.free
    fixed_col = np.zeros_like(des.t)  # fixed parameters that scale with u (units)
    for name, value in st.fixed.items():
        if name in cols and name != "linear_coef":
            if st.units:
                fixed_col = fixed_col + value * cols[name]
            else:
                target = target - value * cols[name]  # seconds
    rest = np.stack([cols[n] for n in st.free], axis=1) if st.free else np.zeros((des.t.size, 0))  # [G, F]
    one_pass = len(st.comm_free) == 2 or st.units
    u = np.full(lat.size, float(u_hint))
    x = np.zeros((lat.size, 1 + len(st.free)))
    sse = np.full(lat.size, np.inf)
    todo = np.ones(lat.size, dtype=bool)  # points whose u has not settled
    for _ in range(1 if one_pass else 3):
        idx = np.flatnonzero(todo)
        scale = np.ones(idx.size) if st.units else u[idx]
        lat_u = lat[idx] if "step_latency" in st.comm_free else st.fixed["step_latency"] / scale  # [p]
        cpt_u = cpt[idx] if "comm_per_token" in st.comm_free else st.fixed["comm_per_token"] / scale
        base_col = des.x2 + des.exposed(lat_u[:, None], cpt_u[:, None]) + fixed_col  # [p, G]
        if a_fixed:
            base_col = base_col + st.fixed["linear_coef"] * des.x1
        mat = np.concatenate([base_col[:, :, None], np.broadcast_to(rest, (idx.size, *rest.shape))], axis=2)
        xs, ss = _nnls(mat * w[None, :, None], target * w)  # [p, 1 + F], [p]
        x[idx], sse[idx] = xs, ss
        new_u = xs[:, 0]
        settled = ~np.isfinite(ss) | (np.abs(new_u / u[idx] - 1.0) < 1e-12)
        u[idx] = np.where(np.isfinite(ss), new_u, u[idx])
        todo[idx[settled]] = False
        if not todo.any():
            break
    return x, sse


def _solve(des: _Design, st: _State, lat: float, cpt: float, u_hint: float) -> tuple[dict[str, float], float]:
    """`_solve_many` at one point: ({name: units, "unit_time_s": u}, sse); ({}, inf) when no fit."""
    x, sse = _solve_many(des, st, np.array([lat]), np.array([cpt]), u_hint)
    if not np.isfinite(sse[0]):
        return {}, np.inf
    u = float(x[0, 0])
    return {"unit_time_s": u, **{n: float(x[0, i]) / u for i, n in enumerate(st.free, start=1)}}, float(sse[0])


_STARTS = 4
"""Grid points refined by the pattern search (the best few: the sse over (lat, cpt) has several basins)."""


def _pattern(des: _Design, st: _State, starts: Sequence[tuple[float, float]], u_hint: float, lat_free: bool,
             cpt_free: bool, scale: float, tok: float) -> list[tuple[float, float, float]]:
    """Multiplicative pattern search from each of ``starts`` (lat, cpt); returns (sse, lat, cpt) of each.

    Every iteration scores the (up to 8) neighbours of every unfinished search at its current
    step in one batch; each search moves to its best neighbour that improves (the first of equal
    ones) or, with none, square-roots its step.  The searches are independent (run side by side
    only to share the batches).
    """
    n = len(starts)
    lat = np.array([s[0] for s in starts], dtype=np.float64)  # [n]
    cpt = np.array([s[1] for s in starts], dtype=np.float64)
    best = _solve_many(des, st, lat, cpt, u_hint)[1]  # [n]
    step = np.full(n, 30.0 ** (1 / 12))
    signs = np.array([(x, y) for x in (1, 0, -1) for y in (1, 0, -1)
                      if (x, y) != (0, 0) and (x == 0 or lat_free) and (y == 0 or cpt_free)], dtype=np.float64)
    live = np.ones(n, dtype=bool)
    for _ in range(200):
        idx = np.flatnonzero(live)
        if idx.size == 0:
            break
        dl = step[idx, None] ** signs[None, :, 0]  # [m, D]
        dc = step[idx, None] ** signs[None, :, 1]
        la, ca = lat[idx, None], cpt[idx, None]
        cand_l = np.where(la > 0, la * dl, np.where(dl > 1, scale * 1e-3, 0.0))  # [m, D]
        cand_c = np.where(ca > 0, ca * dc, np.where(dc > 1, scale / tok * 1e-3, 0.0))
        sse = _solve_many(des, st, cand_l.ravel(), cand_c.ravel(), u_hint)[1].reshape(cand_l.shape)  # [m, D]
        pick = np.argmin(sse, axis=1)  # [m]
        rows = np.arange(idx.size)
        gain = sse[rows, pick] < best[idx] * (1 - 1e-12)
        mv = idx[gain]
        best[mv], lat[mv], cpt[mv] = sse[rows, pick][gain], cand_l[rows, pick][gain], cand_c[rows, pick][gain]
        stay = idx[~gain]
        step[stay] = step[stay] ** 0.5
        live[stay[step[stay] < 1.0005]] = False
    return [(float(best[i]), float(lat[i]), float(cpt[i])) for i in range(n)]


def _search(des: _Design, st: _State, start: tuple[float, float] | None, u_hint: float) -> tuple[dict[str, float], float, float, float]:
    """Minimise over the free communication parameters; returns (params, sse, lat, cpt), lat/cpt in units."""
    if not st.comm_free:
        params, sse = _solve(des, st, 0.0, 0.0, u_hint)
        scale = 1.0 if st.units else params.get("unit_time_s", u_hint)
        return params, sse, st.fixed["step_latency"] / scale, st.fixed["comm_per_token"] / scale
    multi = des.multi
    scale = float(np.median(des.x3[multi]))
    tok = float(np.median(des.x1[multi]))
    lat_free = "step_latency" in st.comm_free
    cpt_free = "comm_per_token" in st.comm_free
    lat_grid = np.concatenate([[0.0], scale * np.geomspace(1e-3, 30.0, 25)]) if lat_free else np.zeros(1)
    cpt_grid = np.concatenate([[0.0], scale / tok * np.geomspace(1e-3, 30.0, 25)]) if cpt_free else np.zeros(1)
    lats = np.repeat(lat_grid, cpt_grid.size)  # [P]: lat outer, cpt inner
    cpts = np.tile(cpt_grid, lat_grid.size)
    sses = _solve_many(des, st, lats, cpts, u_hint)[1]  # [P]: one batch for the whole grid
    scored = [(float(s), float(la), float(c)) for s, la, c in zip(sses, lats, cpts)]  # (sse, lat, cpt)
    scored.sort(key=lambda x: x[0])  # stable: ties keep grid order (deterministic)
    starts = [s[1:] for s in scored[:_STARTS]]
    if start is not None:
        starts.insert(0, start)
    best = (np.inf, 0.0, 0.0)
    # the landscape is not convex: refine the best few grid points
    for found in _pattern(des, st, starts, u_hint, lat_free, cpt_free, scale, tok):
        if found[0] < best[0] * (1 - 1e-12):
            best = found
    _, lat, cpt = best
    params, sse = _solve(des, st, lat, cpt, u_hint)
    scale = 1.0 if st.units else params.get("unit_time_s", u_hint)
    if not lat_free:
        lat = st.fixed["step_latency"] / scale
    if not cpt_free:
        cpt = st.fixed["comm_per_token"] / scale
    return params, sse, lat, cpt


def _natural_scale(des: _Design, name: str, u: float) -> float:
    """The value (units) at which parameter ``name`` would add 5% to the median record it touches."""
    cols = des.columns()
    if name in cols:
        col = cols[name]
    else:  # comm parameters, as if fully exposed
        col = des.ring if name == "step_latency" else des.ring * des.x1
    rows = col > 0
    if not rows.any():
        return 0.0
    return float(0.05 * np.median(des.t[rows] / u) / np.median(col[rows]))


def _spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx = np.argsort(np.argsort(x, kind="stable"), kind="stable").astype(np.float64)
    ry = np.argsort(np.argsort(y, kind="stable"), kind="stable").astype(np.float64)
    rx -= rx.mean()
    ry -= ry.mean()
    den = float(np.sqrt((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum() / den) if den > 0 else 0.0


def _check_order(des: _Design, base: CostModel) -> list[str]:
    """Raise when the measured times fall as the work grows (records that cannot be right); return
    warnings where they barely grow.  Per group size with >= 3 distinct works spanning >= 2x: rank
    correlation of work and time <= -0.8 is an error (3 records: all in reverse order), <= 0.2 a
    warning (overheads or timing noise dominate: one pair out of order in 3 noisy records is -0.5)."""
    notes = []
    for k in np.unique(des.k):
        rows = des.k == k
        size = base.linear_coef * des.x1[rows] + des.x2[rows]
        if np.unique(size).size < 3 or size.max() < 2.0 * size.min():
            continue  # too little spread for noise not to invert the order
        rho = _spearman(size, des.t[rows])
        if rho <= -0.8:
            raise ValueError(
                f"records: the measured seconds fall as the work grows in the {int(rows.sum())} group "
                f"records with group_size={int(k)} (rank correlation {rho:+.2f}); check that each "
                "record's 'seconds' is the time of its own 'lengths' (one group, one round, forward + backward)"
            )
        if rho <= 0.2:
            notes.append(
                f"calibrate: the times of the {int(rows.sum())} group records with group_size={int(k)} barely grow "
                f"with the work (rank correlation {rho:+.2f}): fixed overheads or timing noise dominate them; "
                "longer samples or a quieter machine give a better fit"
            )
    return notes


def calibrate(records: Iterable[Mapping[str, Any]], base: CostModel | None = None, *, warn: bool = True,
              robust: bool = True) -> CalibrationResult:
    """Fit the parameters of a `CostModel` that the records determine; keep the others from ``base``.

    ``base`` (default: a `CostModel()` with zero overheads) supplies every parameter the records
    cannot determine (see the module docstring: no k >= 2 records, one group size only, comm
    always hidden, no round records, too few records); the result names them and why.  Raises
    ValueError when there is no group record, a record is malformed, or the times fall as the
    work grows, and when the fit explains nothing (R² <= 0).  Memory records (``"kind": "memory"``) are
    validated and left out (`hdp.packing.memory.fit_memory` fits them; record numbers in later messages
    count the group and round records only).  ``warn=False`` logs the result's warnings
    at INFO instead of WARNING (for fits that run again and again, like the engine's self-calibration).

    Robust to bad records: records whose time per unit of work is ``SCREEN_FACTOR`` off the median
    are rejected by name before fitting; with ``robust`` the records far off a first fit are left out
    of a second (trimmed residuals).  Scales to a long job's records: beyond ``MAX_FIT_RECORDS`` per
    kind they are subsampled (evenly spaced, weights scaled).  The result's warnings say what was done.
    """
    base = base if base is not None else CostModel()
    recs = [validate_record(r, f"records[{i}]") for i, r in enumerate(records)]
    recs = [r for r in recs if r["kind"] != "memory"]  # the memory model's (hdp.packing.memory.fit_memory)
    if not any(r["kind"] == "group" for r in recs):
        raise ValueError(
            "calibrate: records hold no group records ({'lengths', 'group_size', 'seconds'}); the unit "
            "time and a come from them"
        )
    notes: list[str] = []
    recs = _screen(recs, base, notes)
    recs = _subsample(recs, notes)
    first = _fit(recs, base, warn=False, notes=notes)
    if not robust:
        return _report(first, warn)
    kept = _trim(recs, first.cost, notes)
    if len(kept) == len(recs):
        return _report(first, warn)
    return _report(_fit(kept, base, warn=False, notes=notes), warn)


MAX_FIT_RECORDS = 8192
"""Most group records (and, separately, round records) one fit uses: more are subsampled (evenly spaced
in input order, each kept record's weight scaled by the ratio), so a fit of a long job's records costs
what one of 8,192 does (~3 s)."""
SCREEN_FACTOR = 100.0
"""A record whose time per unit of work is this many times off the records' median is rejected by name."""


def _work_units(rec: Mapping[str, Any], a: float) -> float:
    """a · sum Lp / k + sum Lp² / k of a group record (``k`` = its group size)."""
    lengths, k = group_fields(rec, "record")
    lp = np.asarray([padded_float(float(x), k) for x in lengths])
    return float((a * lp.sum() + (lp * lp).sum()) / k)


def _screen(recs: list[dict[str, Any]], base: CostModel, notes: list[str]) -> list[dict[str, Any]]:
    """Drop records whose seconds per unit of work are ``SCREEN_FACTOR`` off the median (a length typed
    wrong, a stalled process, another machine): one such record can otherwise dominate a least-squares fit."""
    a = float(base.linear_coef)
    per = []
    for r in recs:
        if r["kind"] == "group":
            per.append(float(r["seconds"]) / max(_work_units(r, a), 1e-300))
        else:
            w = max(_work_units(g, a) for g in r["groups"])
            per.append(float(r["seconds"]) / max(w, 1e-300))
    per_arr = np.log10(np.asarray(per))
    med = float(np.median(per_arr[[r["kind"] == "group" for r in recs]]))
    bad = np.flatnonzero(np.abs(per_arr - med) > np.log10(SCREEN_FACTOR))
    if bad.size == 0:
        return recs
    shown = ", ".join(
        f"records[{i}] ({recs[i]['kind']}, {recs[i]['seconds']:.3g} s for "
        f"{'lengths ' + str(recs[i]['lengths'][:4]) if recs[i]['kind'] == 'group' else str(len(recs[i]['groups'])) + ' groups'})"
        for i in bad[:5])
    notes.append(f"calibrate: rejected {bad.size} record(s) whose time per unit of work is more than "
                 f"{SCREEN_FACTOR:g}x off the others' median: {shown}{' ...' if bad.size > 5 else ''}")
    kept = [r for i, r in enumerate(recs) if i not in set(bad.tolist())]
    if not any(r["kind"] == "group" for r in kept):
        raise ValueError("calibrate: every group record was rejected as inconsistent; check the records")
    return kept


def _subsample(recs: list[dict[str, Any]], notes: list[str]) -> list[dict[str, Any]]:
    """At most ``MAX_FIT_RECORDS`` group and round records each: evenly spaced, weights scaled."""
    out: list[dict[str, Any]] = []
    for kind in ("group", "round"):
        these = [r for r in recs if r["kind"] == kind]
        if len(these) <= MAX_FIT_RECORDS:
            out += these
            continue
        idx = np.unique(np.linspace(0, len(these) - 1, MAX_FIT_RECORDS).round().astype(int))
        scale = len(these) / idx.size
        out += [{**these[i], "weight": record_weight(these[i], kind) * scale} for i in idx]
        notes.append(f"calibrate: {len(these)} {kind} records subsampled to {idx.size} (evenly spaced, weights x{scale:.3g})")
    return out


def _trim(recs: list[dict[str, Any]], cost: CostModel, notes: list[str]) -> list[dict[str, Any]]:
    """``recs`` without the outliers of a first fit (a descheduled process, a GC pause): records whose
    |log(predicted / measured)| exceeds max(0.05, 3 x 1.48 x its median, its 80th percentile) (at most a
    fifth); the second fit then runs on the rest."""
    pred = []
    for r in recs:
        if r["kind"] == "group":
            pred.append(_record_seconds(cost, r))
        else:
            beta = cost.round_cost * cost.unit_time_s
            pred.append(max(_record_seconds(cost, g) for g in r["groups"]) + beta)
    dev = np.abs(np.log(np.array(pred) / np.array([float(r["seconds"]) for r in recs])))
    limit = max(0.05, 3.0 * 1.4826 * float(np.median(dev)), float(np.quantile(dev, 0.8)))
    kept = [r for r, d in zip(recs, dev) if d <= limit]
    if len(kept) < len(recs) and any(r["kind"] == "group" for r in kept):
        notes.append(f"calibrate: {len(recs) - len(kept)} record(s) more than {np.exp(limit):.3g}x off the first fit "
                     "left out of the second (trimmed residuals)")
        return kept
    return recs


def _report(result: "CalibrationResult", warn: bool) -> "CalibrationResult":
    for msg in result.warnings:
        logger.log(logging.WARNING if warn else logging.INFO, "%s", msg)
    return result


def _fit(recs: list[dict[str, Any]], base: CostModel, *, warn: bool, notes: Sequence[str]) -> "CalibrationResult":
    """One fit of ``recs`` (validated): see :func:`calibrate`."""
    every_group = [r for r in recs if r["kind"] == "group"]
    inside = [r for r in every_group if group_nodes(r, "record") == 1]
    across = [r for r in every_group if group_nodes(r, "record") > 1]  # the inter-node link's (`calibrate_nodes`)
    groups = inside or every_group  # every term but the inter-node link's, from the records inside one node
    rounds = [r for r in recs if r["kind"] == "round"]
    des = _design(groups)
    warnings: list[str] = [*notes, *_check_order(des, base)]
    reasons: dict[str, str] = {}

    # structural limits of the design
    free = ["linear_coef", "step_overhead", "merge_per_token", "cp_per_token"]
    comm_free = ["step_latency", "comm_per_token"]
    multi_ks = np.unique(des.k[des.multi])
    if multi_ks.size == 0:
        for n in _CP_PARAMS:
            reasons[n] = "no group record with group_size >= 2"
    elif multi_ks.size == 1:
        reasons["cp_per_token"] = (
            f"every k >= 2 record has group_size={int(multi_ks[0])}: records of two group sizes >= 2 "
            "separate cp_per_token from merge_per_token"
        )
    budget = len(groups) - 1  # parameters besides the unit time
    for n in FIT_ORDER:
        if n in reasons:
            continue
        n_free = sum(1 for m in FIT_ORDER if m not in reasons)
        if n_free > budget:
            reasons[n] = (f"too few records: {len(groups)} group record{'s' if len(groups) > 1 else ''} fit at "
                          f"most {budget} parameter{'s' if budget != 1 else ''} besides the unit time")
    if "linear_coef" not in reasons and np.unique(np.round(des.x2 / des.x1, 9)).size < 2:
        reasons["linear_coef"] = "every group record has the same ratio sum L**2 / sum L: lengths must vary to separate a from L**2"
    if len(groups) < 2:
        warnings.append(f"calibrate: only {len(groups)} group record: the unit time alone is fitted, every other parameter comes from the base model")

    u_base = base.unit_time_s

    in_units = False  # parameters kept from the base keep their seconds, unless the records contradict that

    def make_state() -> _State:
        per = 1.0 if in_units else u_base
        fixed = {n: (base.linear_coef if n == "linear_coef" else getattr(base, n) * per)
                 for n in free + comm_free if n in reasons}
        return _State([n for n in free if n not in reasons], [n for n in comm_free if n not in reasons], fixed, in_units)

    st = make_state()
    params, sse, lat, cpt = _search(des, st, None, u_base)
    if not np.isfinite(sse) and any(n in reasons for n in free[1:] + comm_free):
        # the base's overheads in seconds already exceed some measured time: keep them relative to
        # the fitted unit time instead (they then scale with this machine's speed)
        in_units = True
        warnings.append(
            "calibrate: the base model's overheads (in seconds) exceed some measured times; the parameters "
            "kept from the base are scaled with the fitted unit time instead"
        )
        st = make_state()
        params, sse, lat, cpt = _search(des, st, None, u_base)
    if not np.isfinite(sse):
        raise ValueError(
            "calibrate: no fit with a positive unit time; the records do not grow with length "
            "(check the seconds fields)"
        )

    # which of the fitted parameters do the records actually determine?
    n_rows = len(groups)
    n_eff = float(des.w.sum() ** 2 / (des.w * des.w).sum())  # Kish: weighted records count for fewer
    for name in FIT_ORDER:
        if name in reasons:
            continue
        u = params["unit_time_s"]
        value = lat if name == "step_latency" else cpt if name == "comm_per_token" else params[name]
        dof = max(1.0, n_eff - 1 - len(st.free) - len(st.comm_free))
        thr = max(4.0 * sse / dof, 1e-10 * n_rows)
        trials = [2.0 * value, 0.5 * value] if value > 0 else [_natural_scale(des, name, u)]
        if trials == [0.0]:
            continue

        def sse_with(v: float, name: str = name, u: float = u) -> float:
            """Fit with parameter ``name`` held at ``v`` (units)."""
            if name == "step_latency":
                return _solve(des, st, v, cpt, u)[1]  # comm parameters are inputs of _solve
            if name == "comm_per_token":
                return _solve(des, st, lat, v, u)[1]
            return _solve(des, st.without(name, v if name == "linear_coef" or st.units else v * u), lat, cpt, u)[1]

        if all(sse_with(v) - sse > thr for v in trials):
            continue  # determined
        base_units = base.linear_coef if name == "linear_coef" or in_units else getattr(base, name) * u_base / u
        if sse_with(base_units) - sse <= thr:
            reasons[name] = "the records do not determine it (moving it 2x changes the fit by less than the noise)"
            st = make_state()
            params, sse, lat, cpt = _search(des, st, (lat, cpt), u)
        else:
            logger.info("calibrate: %s only loosely determined, but the base value %.4g contradicts the "
                        "records; kept the fitted %.4g", name, getattr(base, name), value)

    u = params["unit_time_s"]
    values: dict[str, float] = {"unit_time_s": u, "step_latency": lat, "comm_per_token": cpt}
    for n in free:
        if n in st.free:
            values[n] = params[n]
        else:
            values[n] = base.linear_coef if n == "linear_coef" else getattr(base, n) * (1.0 if in_units else u_base / u)
    values["round_cost"] = base.round_cost * (1.0 if in_units else u_base / u)
    try:
        cost = replace(base, **values)
    except ValueError as exc:
        raise ValueError(f"calibrate: the records fit no physical cost model ({exc}); check the records") from None
    if inside:
        cost = fit_node_link(across, cost, base, base_per_unit=1.0 if in_units else u_base / cost.unit_time_s,
                             reasons=reasons)
    else:  # no record inside one node: the fit above is of rings across nodes, the inter-node terms the base's
        cost = replace(cost, **{n: getattr(base, n) * (1.0 if in_units else u_base / cost.unit_time_s)
                                for n in NODE_PARAMS})
        for n in NODE_PARAMS:
            reasons[n] = ("every group record spans two nodes: no record inside one node tells the links apart (the "
                          "fitted step_latency and comm_per_token are those rings')")

    if rounds:
        excess = np.array([
            float(r["seconds"]) - max(_record_seconds(cost, g) for g in r["groups"])
            for r in rounds
        ])
        wr = np.array([record_weight(r, "round") / float(r["seconds"]) ** 2 for r in rounds])  # relative-error weights
        beta_s = max(0.0, float(np.sum(wr * excess) / np.sum(wr)))
        cost = replace(cost, round_cost=beta_s / cost.unit_time_s)
    else:
        reasons["round_cost"] = "no round records"

    measured = np.array([float(r["seconds"]) for r in every_group] + [float(r["seconds"]) for r in rounds])
    predicted = np.array(
        [_record_seconds(cost, r) for r in every_group]
        + [
            max(_record_seconds(cost, g) for g in r["groups"])
            + cost.round_cost * cost.unit_time_s
            for r in rounds
        ]
    )
    ss_res = float(np.sum((measured - predicted) ** 2))
    ss_tot = float(np.sum((measured - measured.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan")  # one distinct time: R² undefined
    rel = np.abs(predicted - measured) / measured
    if len(recs) >= 3 and np.isfinite(r2) and r2 <= 0.0:
        raise ValueError(
            f"calibrate: the fit explains nothing (R²={r2:.3g}: no better than the records' mean time; median "
            f"relative error {float(np.median(rel)):.1%}); check that the records come from one machine and model"
        )
    if len(recs) >= 3 and np.isfinite(r2) and r2 < 0.9:
        warnings.append(
            f"calibrate: the model explains the records poorly (R²={r2:.3f}, median relative error "
            f"{float(np.median(rel)):.1%}); check that the records come from one machine and model"
        )
    from_base = tuple(n for n in PARAMETERS if n in reasons)
    fitted = tuple(n for n in PARAMETERS if n not in reasons)
    for n in from_base:
        logger.info("calibrate: %s kept from the base model (%s)", n, reasons[n])
    logger.info("calibrate: %d records, R2=%.4f, median rel err=%.3g", len(recs), r2, float(np.median(rel)))
    return CalibrationResult(
        cost=cost, r2=r2, median_rel_err=float(np.median(rel)), n_records=len(recs),
        fitted=fitted, from_base=from_base, reasons={n: reasons[n] for n in from_base},
        rel_err_p90=float(np.quantile(rel, 0.9)), max_rel_err=float(rel.max()),
        n_group_records=len(every_group), n_round_records=len(rounds), warnings=tuple(warnings),
    )
