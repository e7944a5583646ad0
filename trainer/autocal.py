"""The engine's self-calibration over the domain: gather round times, refit, adopt on every rank alike.

`DomainAutoCalibrator.observe` is called once per training step on every rank of the domain with
the step's plan and this rank's seconds of every round.  It

1. all-gathers the ``[R]`` round times over the domain group (one fixed-size collective: R is the
   same on every rank, the plan is), so every rank holds the same ``[N, R]`` table and the same
   `hdp.packing.autocal.CostWindow`;
2. every ``every_steps`` steps, on domain rank 0 only, refits the cost model to the window
   (`hdp.packing.autocal.refit`), and broadcasts the decision as one fixed-size float64 vector
   (adopt and explore flags, held-out errors, R², the model's parameters) over the domain group, so
   every rank adopts bit-identical parameters whatever its BLAS does (plans stay identical; the plan
   checksum still guards); an explore decision plans the next step with
   `hdp.packing.autocal.explore_model` and the one after with the model in use again;
3. returns the model to plan with from now on (or None) and the metrics ``hdp/cost_fit_r2``,
   ``hdp/predicted_over_measured`` and ``hdp/cost_model_version``.

A failure of the fit on rank 0 never hangs the others: the broadcast always happens, with the
adopt flag off.  With ``enabled=False`` nothing is gathered and no collective runs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hdp.checksum import collective_device
from hdp.packing import simulate
from hdp.packing.autocal import AutoCalibrate, CostWindow, Refit, explore_model, refit
from hdp.packing.cost import PARAMETERS, CostModel
from hdp.packing.plan import Plan

__all__ = ["DomainAutoCalibrator", "AutoCalUpdate"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoCalUpdate:
    """What one observed step changes: the cost model to plan with from now on, and metrics."""

    cost: CostModel | None = None
    """The model to plan with from the next step on (None: keep the current one): an adopted refit,
    for one step an exploration variant, then the adopted model again."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """``hdp/cost_fit_r2``, ``hdp/predicted_over_measured``, ``hdp/cost_model_version`` (empty when off)."""


class DomainAutoCalibrator:
    """Sliding-window self-calibration of the cost model, identical on every rank of the domain."""

    def __init__(self, settings: AutoCalibrate, cost: CostModel, domain_group: dist.ProcessGroup, *,
                 rank: int, size: int) -> None:
        if not isinstance(settings, AutoCalibrate):
            raise TypeError(f"settings is {type(settings).__name__}; pass a hdp.packing.autocal.AutoCalibrate")
        self.settings = settings
        self.cost = cost
        self.group = domain_group
        self.rank = rank
        self.size = size
        self.window = CostWindow(settings.window_groups)
        self.version = 0
        self.steps = 0
        self.r2 = math.nan
        self.last: Refit | None = None
        self._exploring = False  # this step was planned with explore_model (the next one reverts)

    def observe(self, plan: Plan, round_seconds: Sequence[float]) -> AutoCalUpdate:
        """Feed one step (collective over the domain group when enabled); see the module docstring."""
        if not self.settings.enabled:
            return AutoCalUpdate()
        times = self._gather(round_seconds, plan.num_rounds)  # [N, R]
        if self.steps >= self.settings.warmup_steps:  # the first steps pay one-off costs
            self.window.add_step(plan, times, step=self.steps)
        self.steps += 1
        measured = float(times.max(axis=0).sum()) if times.size else math.nan  # sum over rounds of the slowest rank
        predicted = simulate(plan, self.cost).step_time_s  # the model this step was planned with
        plan_with = None
        if self._exploring:  # back to the model in use after one exploration step
            self._exploring, plan_with = False, self.cost
        if self.steps % self.settings.every_steps == 0 and len(self.window) >= self.settings.min_rounds:
            decision = self._decide()
            self.window.mark()  # every rank alike: the next refit is judged on the rounds after this one
            self.last = decision
            self.r2 = decision.r2
            if decision.adopt and decision.candidate is not None and decision.candidate != self.cost:
                plan_with = self.cost = decision.candidate
                self.version += 1
                logger.info("auto-calibration: cost model v%d adopted (held-out error %.3g -> %.3g, R2 %.3f)",
                            self.version, decision.error_old, decision.error_new, decision.r2)
            else:
                logger.info("auto-calibration: kept cost model v%d (%s)", self.version, decision.reason)
            if decision.explore:  # identical on every rank: the flag came with the broadcast
                self._exploring, plan_with = True, explore_model(self.cost, self.window)
                logger.info("auto-calibration: no single-rank group in the window; next step explores")
        return AutoCalUpdate(cost=plan_with, metrics={
            "hdp/cost_fit_r2": self.r2,
            "hdp/predicted_over_measured": predicted / measured if measured > 0 else math.nan,
            "hdp/cost_model_version": self.version,
        })

    def _gather(self, round_seconds: Sequence[float], num_rounds: int) -> np.ndarray:
        """[N, R] every rank's seconds of every round (one all-gather over the domain group)."""
        mine = np.asarray(list(round_seconds), dtype=np.float64)
        if mine.shape != (num_rounds,):
            mine = np.full(num_rounds, math.nan)  # a caller bug must not change the collective's size
        dev = collective_device(self.group)
        local = torch.from_numpy(mine).to(dev)  # [R]
        table = [torch.empty_like(local) for _ in range(self.size)]  # N x [R]
        dist.all_gather(table, local, group=self.group)
        return torch.stack(table).cpu().numpy()  # [N, R]

    def _decide(self) -> Refit:
        """Refit on domain rank 0; every rank receives the same decision vector (one broadcast)."""
        n = Refit.VECTOR_SIZE + len(PARAMETERS)
        vec = np.zeros(n, dtype=np.float64)
        if self.rank == 0:
            try:
                vec = refit(self.window, self.cost, self.settings).to_vector(self.cost)
            except Exception as exc:  # noqa: BLE001 - rank 0 must still broadcast, or the domain hangs
                logger.warning("auto-calibration: refit raised %s: %s; keeping the current cost model",
                               type(exc).__name__, exc)
                vec = Refit(candidate=None, adopt=False, error_new=math.nan, error_old=math.nan,
                            r2=math.nan).to_vector(self.cost)
        dev = collective_device(self.group)
        buf = torch.from_numpy(vec).to(dev)  # [4 + P] float64
        src = dist.get_global_rank(self.group, 0) if self.group is not dist.group.WORLD else 0
        dist.broadcast(buf, src=src, group=self.group)
        return Refit.from_vector(buf.cpu().numpy())
