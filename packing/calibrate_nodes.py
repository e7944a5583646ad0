"""The inter-node link of a fitted cost model: ``node_step_latency`` and ``node_comm_per_token`` from
the group records whose ranks spanned two or more nodes (`hdp.packing.calibrate` fits the rest).

A group record may say how many nodes its ranks spanned (``"nodes"``, `hdp.packing.calibration_records`);
a ring across nodes pays, per step, the slower of the two links' transfer (`hdp.packing.cost`).  With
every other parameter fitted on the records inside one node (those alone decide them, as on a
domain inside one node), the records across nodes are

    t = u * (a X1 + X2 + (k - 1) (step_overhead + merge_per_token X1) + cp_per_token X1)
        + u * (k - 1) * max(0, max(step_latency + comm_per_token X1, node_step_latency
                                   + node_comm_per_token X1) - X3)

(``X1 = sum Lp / k``, ``X2 = sum Lp**2 / k``, ``X3 = sum Lp**2 / k**2``), a two-parameter problem: a
grid over both (0 and 25 geometric values around the records' scales, as `calibrate` does for the
intra-node link), the best few refined by a multiplicative pattern search, minimising the weighted
squared relative error.  As in `calibrate`, a parameter is fitted only when the records determine it
(moving it 2x, or from 0 to where it adds 5% to the median record, worsens the fit by more than
4 sigma²); otherwise it keeps the base model's value in seconds and the reason is given.  Records
whose transfer hides behind attention on both links determine neither (a ring across nodes then
costs what one inside a node does, and the fit says so).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from hdp.packing.calibration_records import group_fields, record_weight
from hdp.packing.cost import CostModel, padded_float

__all__ = ["fit_node_link", "NODE_PARAMS"]

NODE_PARAMS = ("node_step_latency", "node_comm_per_token")
"""The inter-node link's parameters, in the order they are tested."""


def _rows(records: Sequence[Mapping[str, Any]], cost: CostModel) -> dict[str, np.ndarray]:
    t, w, ring, x1, x3, fixed = [], [], [], [], [], []
    for r in records:
        lengths, k = group_fields(r, "record")
        lp = padded_float(lengths, k)
        s1, s2 = float(lp.sum()), float((lp * lp).sum())
        t.append(float(r["seconds"]))
        w.append(record_weight(r, "record"))
        ring.append(k - 1.0)
        x1.append(s1 / k)
        x3.append(s2 / (k * k))
        # everything but the transfer, in units
        fixed.append(float(cost.work(lp).sum() / k + (k - 1) * (cost.step_overhead + cost.merge_per_token * s1 / k)
                           + cost.cp_per_token * s1 / k))
    out = {n: np.asarray(v, dtype=np.float64) for n, v in
           (("t", t), ("w", w), ("ring", ring), ("x1", x1), ("x3", x3), ("fixed", fixed))}
    out["w"] = out["w"] / out["w"].mean()
    out["intra"] = cost.step_latency + cost.comm_per_token * out["x1"]
    return out


def _sse(d: dict[str, np.ndarray], u: float, lat: np.ndarray, cpt: np.ndarray) -> np.ndarray:
    """[P] weighted squared relative errors at the points (lat[p], cpt[p]) (units)."""
    slow = np.maximum(d["intra"][None, :], lat[:, None] + cpt[:, None] * d["x1"][None, :])  # [P, G]
    pred = u * (d["fixed"][None, :] + d["ring"][None, :] * np.maximum(0.0, slow - d["x3"][None, :]))
    rel = (pred - d["t"][None, :]) / d["t"][None, :]
    return (d["w"][None, :] * rel * rel).sum(axis=1)


def _search(d: dict[str, np.ndarray], u: float, free: tuple[bool, bool], start: tuple[float, float]) -> tuple[float, float, float]:
    """(sse, lat, cpt) minimising `_sse` over the free parameters (the others at ``start``)."""
    multi = d["ring"] > 0
    scale = float(np.median(d["x3"][multi])) if multi.any() else 1.0
    tok = max(float(np.median(d["x1"][multi])) if multi.any() else 1.0, 1e-300)
    lat_grid = np.concatenate([[0.0], scale * np.geomspace(1e-3, 30.0, 25)]) if free[0] else np.array([start[0]])
    cpt_grid = np.concatenate([[0.0], scale / tok * np.geomspace(1e-3, 30.0, 25)]) if free[1] else np.array([start[1]])
    lats, cpts = np.repeat(lat_grid, cpt_grid.size), np.tile(cpt_grid, lat_grid.size)
    sses = _sse(d, u, lats, cpts)
    best = (np.inf, 0.0, 0.0)
    for p in np.argsort(sses, kind="stable")[:4]:  # the best few grid points, refined
        cur = (float(sses[p]), float(lats[p]), float(cpts[p]))
        step = 30.0 ** (1 / 12)
        while step > 1.0005:
            moves = [(a, b) for a in (1, 0, -1) for b in (1, 0, -1) if (a, b) != (0, 0)
                     and (a == 0 or free[0]) and (b == 0 or free[1])]
            cand_l = np.array([cur[1] * step ** a if cur[1] > 0 else (scale * 1e-3 if a > 0 else 0.0) for a, _ in moves])
            cand_c = np.array([cur[2] * step ** b if cur[2] > 0 else (scale / tok * 1e-3 if b > 0 else 0.0) for _, b in moves])
            s = _sse(d, u, cand_l, cand_c)
            i = int(np.argmin(s))
            if s[i] < cur[0] * (1 - 1e-12):
                cur = (float(s[i]), float(cand_l[i]), float(cand_c[i]))
            else:
                step = step ** 0.5
        if cur[0] < best[0] * (1 - 1e-12):
            best = cur
    return best


def fit_node_link(records: Sequence[Mapping[str, Any]], cost: CostModel, base: CostModel, *, base_per_unit: float,
                  reasons: dict[str, str]) -> CostModel:
    """``cost`` (every other parameter fitted) with the inter-node link fitted from ``records`` (group
    records spanning two or more nodes; module docstring), or kept from ``base`` where they cannot
    say (``reasons`` gains why).  ``base_per_unit``: what one of the base model's units is in the
    fitted model's units (``base.unit_time_s / cost.unit_time_s``, or 1 when the base's overheads
    are kept in units)."""
    kept = {n: getattr(base, n) * base_per_unit for n in NODE_PARAMS}
    if not records:
        for n in NODE_PARAMS:
            reasons[n] = "no group record spans two nodes (a domain inside one node shows one link)"
        return replace(cost, **kept)
    d = _rows(records, cost)
    u = cost.unit_time_s
    if not np.any(d["ring"] > 0):
        for n in NODE_PARAMS:
            reasons[n] = "no group record of k >= 2 spans two nodes"
        return replace(cost, **kept)
    free = [True, True]
    sse, lat, cpt = _search(d, u, (True, True), (0.0, 0.0))
    n_eff = float(d["w"].sum() ** 2 / (d["w"] * d["w"]).sum())
    for i, name in enumerate(NODE_PARAMS):
        dof = max(1.0, n_eff - 1 - sum(free))
        thr = max(4.0 * sse / dof, 1e-10 * d["t"].size)
        value = (lat, cpt)[i]
        col = d["ring"] if i == 0 else d["ring"] * d["x1"]
        natural = float(0.05 * np.median(d["t"] / u) / max(float(np.median(col[col > 0])), 1e-300)) if (col > 0).any() else 0.0
        trials = [2.0 * value, 0.5 * value] if value > 0 else [natural]

        def at(v: float, i: int = i) -> float:
            pt = [lat, cpt]
            pt[i] = v
            return float(_sse(d, u, np.array([pt[0]]), np.array([pt[1]]))[0])

        if all(at(v) - sse > thr for v in trials):
            continue  # determined
        if at(kept[name]) - sse <= thr:
            reasons[name] = ("the records across nodes do not determine it (moving it 2x changes the fit by less than the "
                             "noise: their transfer hides behind attention, or one link term explains them)")
            free[i] = False
            fixed = (kept["node_step_latency"] if not free[0] else lat, kept["node_comm_per_token"] if not free[1] else cpt)
            if any(free):
                sse, lat, cpt = _search(d, u, (free[0], free[1]), fixed)
            else:
                lat, cpt = fixed
    return replace(cost, node_step_latency=lat, node_comm_per_token=cpt)
