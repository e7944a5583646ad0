"""Self-calibration of the cost model from the rounds a job times (pure numpy; no torch.distributed).

The engine times every round on every rank; `hdp.core.planning` gathers those times so that every
rank of the job holds the same ``[N, R]`` table (a domain rank's slowest TP rank and stage) and feeds it here:

* `CostWindow` turns a step's plan and its ``[N, R]`` round times into calibration records
  (`hdp.packing.calibrate` schema: a group record per group, the slowest of its ranks, with the
  nodes it spans on a domain over several, so refits fit the inter-node link too; a round record
  per round, the slowest rank of the domain) and keeps the most recent ones (a sliding
  window of at most `AutoCalibrate.window_groups` group records);
* every `AutoCalibrate.every_steps` steps, `refit` fits the family to the window's training rounds
  (one of every `AutoCalibrate.holdout_every` rounds of the window is held out; a round's weight halves
  every `AutoCalibrate.half_life_steps` steps of age, so the fit follows a drifting machine; records
  far off a first fit, such as a descheduled process's, are dropped before the second; the first
  `AutoCalibrate.warmup_steps` steps are never recorded), with the current model
  as the base (what the window cannot determine stays as it is); two more candidates are that fit and
  the current model rescaled (`rescaled`: the machine got faster or slower) to the training rounds added
  since the last refit decision (the newest 8 when fewer came since); the best candidate is adopted
  only when it predicts the held-out rounds better than the current model
  (`round_error`: the bias of their total time plus their median |log(predicted / measured)|; the
  held-out rounds added since the last refit decide, or the newest 8 when fewer came since);
* a window without a single-rank group cannot show what context parallelism costs (a model that
  thinks CP is free puts every sample on a CP group, and its records then never contradict it): the
  step after such a refit is planned with a CP-averse variant (`explore_model`), once per refit.

Everything here is deterministic in its inputs, so ranks holding the same window reach the same
decision; the trainer still broadcasts world rank 0's decision (one fixed-size vector) so that
BLAS differences between nodes cannot split the domain.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

import numpy as np

from hdp.packing.calibrate import calibrate, group_seconds
from hdp.packing.cost import MAX_UNIT_TIME_S, MIN_UNIT_TIME_S, CostModel
from hdp.packing.plan import Plan
from hdp.packing.topology import Nodes

__all__ = [
    "AutoCalibrate", "CostWindow", "Refit", "refit", "round_error", "records_r2", "auto_calibrate_config",
    "needs_exploration", "explore_model", "rescaled", "held_out",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class AutoCalibrate:
    """How the engine refits its cost model from the rounds it times (``PlanningConfig.auto_calibrate``)."""

    _FIELD_PREFIX: ClassVar[str] = "AutoCalibrate"

    enabled: bool = True
    """Time every round, keep a window of records on every rank and refit the cost model; False: plan
    with the configured model forever (no extra collective)."""
    every_steps: int = 20
    """Refit every this many training steps (once the window holds `min_rounds` rounds)."""
    window_groups: int = 8192
    """Group records the sliding window keeps (the oldest rounds leave first)."""
    min_rounds: int = 16
    """Rounds the window must hold before the first refit."""
    holdout_every: int = 4
    """One round of every this many (`held_out`) is kept out of the fit and decides the adoption."""
    min_gain: float = 0.02
    """Adopt a refit only when its held-out error is below (1 - min_gain) x the current model's."""
    warmup_steps: int = 1
    """The first this many training steps are not recorded: they pay one-off costs (allocator growth,
    communicator setup, lazy initialisation) that later steps do not."""
    half_life_steps: int = 40
    """A round recorded this many steps before the newest counts half as much in the fit (weights
    halve every ``half_life_steps``), so the model follows a machine whose speed drifts (clocks, other
    jobs, warm-up); 0: every round in the window counts the same."""
    explore: bool = True
    """When the window holds no single-rank group (so nothing shows what context parallelism costs,
    e.g. after a model that thinks CP is free put every sample on a CP group), plan the step after a
    refit with a CP-averse variant of the model (`explore_model`): smallest groups, new records."""

    def __post_init__(self) -> None:
        self.check(self._FIELD_PREFIX)

    def check(self, prefix: str) -> None:
        """Raise ValueError naming ``prefix.field``, the bad value and the fix."""
        for flag in ("enabled", "explore"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{prefix}.{flag}={getattr(self, flag)!r}: pass True or False")
        for name, lo in (("every_steps", 1), ("window_groups", 8), ("min_rounds", 2), ("holdout_every", 2),
                         ("warmup_steps", 0), ("half_life_steps", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{prefix}.{name}={v!r}: pass an integer >= {lo}")
        g = self.min_gain
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 <= g < 1.0:
            raise ValueError(f"{prefix}.min_gain={g!r}: pass a fraction in [0, 1) (0.02: adopt on a 2% better fit)")


def auto_calibrate_config(value: object, field_name: str) -> AutoCalibrate:
    """An `AutoCalibrate` from an `AutoCalibrate`, a bool (on with defaults / off) or a mapping of its fields."""
    if isinstance(value, AutoCalibrate):
        return value
    if isinstance(value, bool):
        return AutoCalibrate(enabled=value)
    if isinstance(value, Mapping):
        known = {f.name for f in fields(AutoCalibrate)}
        unknown = sorted(set(map(str, value)) - known)
        if unknown:
            raise ValueError(f"{field_name}: unknown keys {unknown}; known: {', '.join(sorted(known))}")
        try:
            return AutoCalibrate(**dict(value))
        except ValueError as exc:
            raise ValueError(f"{field_name}: {exc}") from exc
    raise ValueError(
        f"{field_name}={value!r}: pass True, False, a hdp.packing.autocal.AutoCalibrate or a mapping of its fields"
    )


# -------------------------------------------------------------------------------------- the window


@dataclass(frozen=True)
class _Round:
    """One timed round: its group records and its wall time."""

    ident: int  # running number of the round in the window's life (decides the hold-out)
    step: int  # the training step it was timed in (decides its weight in the fit)
    groups: tuple[dict[str, Any], ...]
    seconds: float


class CostWindow:
    """The most recent timed rounds as calibration records (identical on every rank fed the same input)."""

    def __init__(self, capacity_groups: int) -> None:
        self.capacity = int(capacity_groups)
        self._rounds: deque[_Round] = deque()
        self._groups = 0
        self._next = 0
        self._mark = 0  # ident of the first round after the last refit decision
        self._step = -1  # training step of the newest step added

    def __len__(self) -> int:
        return len(self._rounds)

    @property
    def num_groups(self) -> int:
        """Group records held."""
        return self._groups

    def add_step(self, plan: Plan, times: np.ndarray, step: int | None = None) -> None:
        """Add a step: ``times`` [N, R] are every rank's seconds of every round of ``plan``; ``step``
        its training step (default: one after the last step added).

        A group's time is its slowest rank's, a round's the slowest rank of the domain.  Rounds
        whose times are not finite and positive are skipped.
        """
        step = self._step + 1 if step is None else int(step)
        self._step = step
        times = np.asarray(times, dtype=np.float64)
        assert times.shape == (plan.num_ranks, plan.num_rounds), (times.shape, plan.num_ranks, plan.num_rounds)
        nodes = Nodes.of(plan.node_of, plan.num_ranks)
        for rnd in plan.rounds:
            col = times[:, rnd.index]  # [N]
            if not np.all(np.isfinite(col)) or col.max() <= 0:
                continue
            groups = []
            for g in rnd.groups:
                secs = float(col[g.start : g.start + g.size].max())
                if secs > 0:
                    span = {} if nodes is None else {"nodes": int(nodes.spans(g.start, g.size))}
                    groups.append({"kind": "group", "lengths": [int(x) for x in g.lengths], "group_size": int(g.size),
                                   "seconds": secs, **span})
            if not groups:
                continue
            self._rounds.append(_Round(self._next, step, tuple(groups), float(col.max())))
            self._next += 1
            self._groups += len(groups)
        while self._groups > self.capacity and len(self._rounds) > 1:
            self._groups -= len(self._rounds.popleft().groups)

    def mark(self) -> None:
        """Note that a refit decision was taken here: `recent` holds the rounds added after it."""
        self._mark = self._next

    def recent(self, rounds: Sequence[_Round], at_least: int) -> list[_Round]:
        """The rounds of ``rounds`` (oldest first) added since the last `mark`, or the newest
        ``at_least`` of them when fewer were added since (all when there are fewer)."""
        newer = [r for r in rounds if r.ident >= self._mark]
        return newer if len(newer) >= at_least else list(rounds[-at_least:])

    def split(self, holdout_every: int) -> tuple[list[_Round], list[_Round]]:
        """(training rounds, held-out rounds): one round of every ``holdout_every`` consecutive ones
        (by number) is held out, at a position within the block that `held_out` scatters."""
        train = [r for r in self._rounds if not held_out(r.ident, holdout_every)]
        held = [r for r in self._rounds if held_out(r.ident, holdout_every)]
        return train, held

    @property
    def newest_step(self) -> int:
        """The training step of the newest step added (-1 when none)."""
        return self._step

    def rounds(self) -> list[_Round]:
        """Every round held, oldest first."""
        return list(self._rounds)

    def group_sizes(self) -> set[int]:
        """The group sizes of the records held."""
        return {g["group_size"] for r in self._rounds for g in r.groups}

    def longest(self) -> int:
        """The longest sample of the records held (0 when empty)."""
        return max((max(g["lengths"]) for r in self._rounds for g in r.groups), default=0)


def held_out(ident: int, every: int) -> bool:
    """Whether round number ``ident`` is held out: one of each block of ``every`` consecutive numbers, at
    a position a multiplicative hash of the block number picks.  Not every ``every``-th round: a job whose
    steps have ``every`` rounds would then hold out the same round of each step (the one with the
    longest samples, say) and judge the models on it alone."""
    block = (ident // every * 0x9E3779B1) & 0xFFFFFFFF  # Knuth's multiplicative hash (2^32 / golden ratio)
    return ident % every == (block >> 16) % every


def needs_exploration(window: CostWindow) -> bool:
    """True when the window holds group records but none of a single rank: without them the fit
    cannot tell the per-token cost of context parallelism from the linear work."""
    sizes = window.group_sizes()
    return bool(sizes) and 1 not in sizes


def explore_model(current: CostModel, window: CostWindow) -> CostModel:
    """``current`` with a per-token CP cost of 10 x (a + longest sample) units: every sample goes on
    the smallest group that fits it (single ranks for the short ones) for one step."""
    return replace(current, cp_per_token=current.cp_per_token + 10.0 * (current.linear_coef + window.longest()))


def _records(rounds: Sequence[_Round], newest: int = 0, half_life: int = 0) -> list[dict[str, Any]]:
    """Group and round records of ``rounds`` (`hdp.packing.calibrate` schema); with ``half_life`` > 0
    each carries the weight 0.5 ** ((newest - its step) / half_life)."""
    out: list[dict[str, Any]] = []
    for r in rounds:
        extra = {"weight": 0.5 ** (max(0, newest - r.step) / half_life)} if half_life > 0 else {}
        out.extend({**g, **extra} for g in r.groups)
        out.append({"kind": "round", "seconds": r.seconds, **extra,
                    "groups": [{"lengths": g["lengths"], "group_size": g["group_size"], "nodes": g.get("nodes", 1)}
                               for g in r.groups]})
    return out


def _round_predictions(cost: CostModel, rounds: Sequence[_Round]) -> np.ndarray:
    beta = cost.round_cost * cost.unit_time_s
    return np.array([max(group_seconds(cost, g["lengths"], g["group_size"], g.get("nodes", 1)) for g in r.groups) + beta
                     for r in rounds])


def round_error(cost: CostModel, rounds: Sequence[_Round]) -> float:
    """How far ``cost`` is off the round times (nan without rounds): |log(sum predicted / sum measured)|,
    what the step-time prediction is off by, plus the median |log(predicted / measured)| of the rounds,
    how well it tells rounds apart (the median, so that a few rounds of a descheduled process do not
    decide).  The first term counts a bias of x at its size; the median alone barely sees a bias below
    the rounds' own scatter (20% on a shared CPU), so a model 20% off the step time could stay in use."""
    if not rounds:
        return float("nan")
    measured = np.array([r.seconds for r in rounds])
    predicted = _round_predictions(cost, rounds)
    with np.errstate(divide="ignore"):  # a model predicting no time at all is infinitely off (never adopted)
        bias = abs(float(np.log(predicted.sum() / measured.sum())))
        return float(bias + np.median(np.abs(np.log(predicted / measured))))


def rescaled(cost: CostModel, rounds: Sequence[_Round], newest: int = 0, half_life: int = 0) -> CostModel | None:
    """``cost`` with its seconds per unit scaled to the rounds' times (the same plans, other predictions):
    the machine got faster or slower but its costs kept their shape (warm-up ending, clocks, other jobs).
    The scale is the weighted median of measured / predicted over ``rounds``, each weighted by its
    predicted seconds (the step time is a sum of rounds; the measured seconds would weigh the rounds
    that happened to run slow more) and, with ``half_life`` > 0, by 0.5 ** (age in steps / half_life).
    None without rounds, when a round is predicted to take no time, or when the scale leaves the unit's range."""
    if not rounds:
        return None
    measured = np.array([r.seconds for r in rounds])  # [R]
    predicted = _round_predictions(cost, rounds)  # [R]
    if not np.all(predicted > 0):
        return None  # a model that predicts no time for a round has nothing to scale
    ratio = np.log(measured / predicted)  # [R]
    age = np.array([max(0, newest - r.step) for r in rounds], dtype=np.float64)
    weight = predicted * (0.5 ** (age / half_life) if half_life > 0 else 1.0)
    order = np.argsort(ratio, kind="stable")
    cum = np.cumsum(weight[order])
    scale = math.exp(float(ratio[order][np.searchsorted(cum, 0.5 * cum[-1])]))
    unit = cost.unit_time_s * scale
    if not (np.isfinite(unit) and MIN_UNIT_TIME_S <= unit <= MAX_UNIT_TIME_S):
        return None
    return replace(cost, unit_time_s=unit)


def records_r2(cost: CostModel, rounds: Sequence[_Round]) -> float:
    """R² of ``cost`` on the group and round times of ``rounds`` (nan when undefined)."""
    pred, meas = [], []
    for r in rounds:
        for g in r.groups:
            pred.append(group_seconds(cost, g["lengths"], g["group_size"], g.get("nodes", 1)))
            meas.append(g["seconds"])
    if rounds:
        pred.extend(_round_predictions(cost, rounds))
        meas.extend(r.seconds for r in rounds)
    y, p = np.array(meas), np.array(pred)
    if y.size < 2:
        return float("nan")
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - float(np.sum((y - p) ** 2)) / ss_tot if ss_tot > 0 else float("nan")


# ---------------------------------------------------------------------------------------- refits


@dataclass(frozen=True, kw_only=True)
class Refit:
    """The outcome of one refit: the candidate, whether to adopt it, and why."""

    candidate: CostModel | None
    """The model fitted to the window's training rounds (None when the fit failed)."""
    adopt: bool
    """True when the candidate predicts the held-out rounds better than the current model."""
    error_new: float
    """Held-out median |log(predicted / measured)| of the candidate (nan when none)."""
    error_old: float
    """The same for the current model."""
    r2: float
    """R² over the whole window of the model in use after this refit."""
    reason: str = ""
    """Why nothing was adopted (empty when adopted)."""
    explore: bool = False
    """Plan the next step with `explore_model` (the window lacks single-rank groups)."""

    VECTOR_SIZE: ClassVar[int] = 5
    """Fixed values before the model's parameters in `to_vector` (adopt, explore, error_new, error_old, r2)."""

    def to_vector(self, current: CostModel) -> np.ndarray:
        """[adopt, explore, error_new, error_old, r2, parameters of the model to plan with] (float64, fixed size)."""
        model = self.candidate if self.adopt and self.candidate is not None else current
        head = [1.0 if self.adopt else 0.0, 1.0 if self.explore else 0.0, self.error_new, self.error_old, self.r2]
        return np.concatenate([np.array(head, dtype=np.float64), model.to_vector()])

    @classmethod
    def from_vector(cls, vector: np.ndarray) -> Refit:
        """Inverse of `to_vector` (the candidate is the model in the vector)."""
        v = np.asarray(vector, dtype=np.float64)
        adopt = bool(v[0] > 0.5)
        return cls(candidate=CostModel.from_vector(v[cls.VECTOR_SIZE:]), adopt=adopt, explore=bool(v[1] > 0.5),
                   error_new=float(v[2]), error_old=float(v[3]), r2=float(v[4]),
                   reason="" if adopt else "not better on the held-out rounds")


_MIN_JUDGE = 8
"""Fewest held-out rounds that decide an adoption (the newest ones when fewer came since the last refit)."""
_MIN_SCALE = 8
"""Fewest training rounds a rescaled candidate is scaled to (the newest ones when fewer came since)."""


def refit(window: CostWindow, current: CostModel, settings: AutoCalibrate) -> Refit:
    """Fit the window's training rounds (base: ``current``; older rounds weigh less,
    `AutoCalibrate.half_life_steps`); adopt when the held-out rounds added
    since the last refit decision (`CostWindow.mark`; the newest 8 when fewer came since) say so:
    the machine drifts (warm-up, clocks, other jobs), and the current model was already judged on
    the older rounds."""
    explore = settings.explore and needs_exploration(window)
    train, held = window.split(settings.holdout_every)
    if not held or len(train) < 2:
        return Refit(candidate=None, adopt=False, error_new=math.nan, error_old=math.nan,
                     r2=records_r2(current, window.rounds()), reason="too few rounds in the window", explore=explore)
    judge = window.recent(held, _MIN_JUDGE)  # the newest held-out rounds: what the model faces next
    err_old = round_error(current, judge)
    # candidates: the family fitted to the training rounds, and it and the current model rescaled to the
    # training rounds since the last decision (the newest 8 when fewer; one parameter, so a few noisy rounds
    # place it well: the usual drift is a machine that got faster or slower, which the fit, weighing older
    # rounds too, follows late)
    candidates: list[CostModel] = []
    failed = ""
    try:
        records = _records(train, window.newest_step, settings.half_life_steps)
        candidates.append(calibrate(records, base=current, warn=False, robust=True).cost)  # outliers trimmed there
    except ValueError as exc:
        failed = f"fit failed: {exc}"
        logger.info("auto-calibration: refit failed (%s)", exc)
    newest = window.recent(train, _MIN_SCALE)
    for model in [*candidates, current]:
        scaled = rescaled(model, newest)
        if scaled is not None and scaled != current:
            candidates.append(scaled)
    if not candidates:
        return Refit(candidate=None, adopt=False, error_new=math.nan, error_old=err_old,
                     r2=records_r2(current, window.rounds()), reason=failed or "no candidate", explore=explore)
    errors = [round_error(c, judge) for c in candidates]
    best = min(range(len(candidates)), key=lambda i: (not np.isfinite(errors[i]), errors[i]))  # the fit on ties
    candidate, err_new = candidates[best], errors[best]
    adopt = bool(np.isfinite(err_new) and err_new < err_old * (1.0 - settings.min_gain))
    in_use = candidate if adopt else current
    return Refit(candidate=candidate, adopt=adopt, error_new=err_new, error_old=err_old,
                 r2=records_r2(in_use, window.rounds()), explore=explore,
                 reason="" if adopt else f"held-out error {err_new:.3g} not below {err_old:.3g} x (1 - {settings.min_gain:g})")
