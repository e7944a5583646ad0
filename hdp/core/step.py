"""The step both doors run, written once: agree → rounds → reduce → the non-finite rules → the optimizer
step or an agreed skip → calibration (observe) → metrics, and the release of what a step holds.

:class:`Steps` runs an engine's steps on its round core (:mod:`hdp.core.rounds`: the phases, the only
caller of Megatron's schedules) and its planner (:mod:`hdp.core.planning`).  A door supplies only
what is its own, as a ``prepare`` callable that returns a :class:`Prepared`: its validation and planning
(run inside the call's agreement, so any error on any rank raises on every rank), its loss adapter
(:class:`~hdp.core.rounds.RoundLoss`, which also keeps the door's outputs) and the samples the rounds
run.  It reads back a :class:`Pass` and formats its outputs and metrics (`plan_metrics`).

A training step has two halves, because verl calls them separately (``forward_backward_batch`` then
``optimizer_step``) and may accumulate several forward-backward passes between two ``optimizer_zero_grad``:

1. :meth:`Steps.forward_backward_batch`: the agreement (the call, validation and planning outcome, plan checksum, batch
   digest), every round with backward (each round's peak memory measured when asked), the step's one
   reduce, the adapter's errors raised on every rank, and the non-finite rules: a NaN/inf loss
   (:class:`~hdp.core.rounds.NonFiniteLossError`) or, with a finite loss, a NaN/inf gradient on any rank
   (:class:`~hdp.core.rounds.NonFiniteGradientError`) — decided alike on every rank from the reduce;
2. :meth:`Steps.optimizer_step`: the update of the passes since :meth:`Steps.optimizer_zero_grad` — skipped on every rank
   when any pass was not finite (gradients zeroed, parameters and optimizer state unchanged), else
   Megatron's optimizer step; then each pass's round times, peak memory and phase times go to the planner
   (one all-gather: calibration records, auto-calibration, ``hdp/time/*``).

:meth:`Steps.train_batch` is both halves after zeroing the gradients; :meth:`Steps.infer_batch` a forward-only pass
(agree, rounds without grad, reduce, the adapter's errors).  What each door does with a skipped update is
its own: the library raises the error (:attr:`Outcome.skipped`), verl reports ``grad_norm`` NaN.  What is
not: a run of them.  After ``max_consecutive_skips`` updates skipped in a row (`hdp.core.options.HdpOptions`)
:meth:`Steps.optimizer_step` raises :class:`SkippedUpdatesError` on every rank — the skip decision is agreed, so the
count is the same everywhere — naming the count and the first skipped step's cause, with nothing applied.

:meth:`Steps.close` is the one teardown of what the steps hold (the plan-ahead thread, the core's watcher
and hooks, every reference to the engine's groups); each door then destroys the groups it owns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from hdp.memory_meter import MemoryMeter
from hdp.packing import Plan
from hdp.core.memory import measured_row, start_measure
from hdp.core.planning import DomainPlanner, plan_id
from hdp.core.rounds import NonFiniteGradientError, NonFiniteLossError, RoundCore, RoundHooks, RoundLoss, StepState

__all__ = ["Steps", "Prepared", "Pass", "Outcome", "SkippedUpdatesError", "plan_metrics"]


class SkippedUpdatesError(RuntimeError):
    """``limit`` updates in a row were skipped for a non-finite loss or gradient (`Steps.optimizer_step`, raised on every
    rank alike, nothing applied): the run no longer trains.  ``first`` is the first skip's error (also the
    ``__cause__``), ``last`` this one's."""

    def __init__(self, count: int, limit: int, option: str, first: NonFiniteLossError, last: NonFiniteLossError) -> None:
        self.count = count
        self.first = first
        self.last = last
        super().__init__(
            f"step {last.step}: {count} updates in a row were skipped (a NaN/inf loss or gradient each; {option}="
            f"{limit}), so the run no longer trains; nothing was applied. The first skip, at step {first.step}: "
            f"{first}. Fix that cause, or raise {option} (None: never raise)"
        )


@dataclass(frozen=True, eq=False)
class Prepared:
    """A door's batch, validated and planned inside the call's agreement (what its ``prepare`` returns)."""

    plan: Plan
    digest: int
    """The batch's digest (`hdp.digest.batch_digest`), compared over the job with the plan's checksum."""
    tokens: Sequence[torch.Tensor]
    """S x [L_i] integer tokens: the samples the rounds run."""
    adapter: RoundLoss
    """The door's loss adapter for this pass (it keeps the door's outputs)."""
    planner_ms: float = 0.0
    """Milliseconds the plan took (made ahead or in line)."""
    exposed_ms: float = 0.0
    """Milliseconds the step waited for it."""
    hooks: RoundHooks | None = None
    """The door's hooks around each chunk's forward (verl: MoE router replay), or None."""


@dataclass(frozen=True)
class Outcome:
    """What :meth:`Steps.optimizer_step` did with the passes since the gradients were zeroed, alike on every rank."""

    applied: bool
    """The optimizer stepped."""
    grad_norm: float
    """Megatron's grad norm; NaN when the update was skipped."""
    skipped: NonFiniteLossError | None
    """Why the update was skipped (a non-finite loss, or :class:`NonFiniteGradientError`); None: applied."""
    calibration: dict[str, Any]
    """The planner's metrics of the last pass (`DomainPlanner.observe`: ``hdp/predicted_over_measured``,
    ``hdp/time/*``, memory, ...); empty when the update was skipped."""


@dataclass(eq=False)
class Pass:
    """One forward or forward-backward pass that ran (see the module docstring)."""

    prepared: Prepared
    train: bool
    step: int
    """The step counter when it ran (a training pass counts one)."""
    state: StepState
    reduced: torch.Tensor
    """[3 + S] float64 on the host: the step's one reduce (`RoundCore.reduce`)."""
    round_seconds: list[float]
    """This rank's seconds per plan round."""
    nonfinite: NonFiniteLossError | None = None
    """A training pass whose loss or gradient was not finite on some rank (the update will be skipped)."""
    meter: MemoryMeter | None = None
    """Measured each round's peak memory (read after the update, `hdp.core.memory.measured_row`)."""
    static_bytes: int = 0
    """The static bytes the meter's peaks add to."""
    outcome: Outcome | None = None
    """Set by :meth:`Steps.optimizer_step`."""

    @property
    def plan(self) -> Plan:
        return self.prepared.plan

    @property
    def adapter(self) -> RoundLoss:
        return self.prepared.adapter

    @property
    def loss(self) -> float:
        """The step's loss: Σ over the domain of the rounds' shares (NaN/inf when not finite)."""
        return float(self.reduced[0])

    def metrics(self) -> dict[str, Any]:
        """The pass's ``hdp/*`` plan metrics (`plan_metrics`)."""
        return plan_metrics(self.plan, self.prepared.planner_ms, self.prepared.exposed_ms)


def plan_metrics(plan: Plan, planner_ms: float, exposed_ms: float) -> dict[str, Any]:
    """The ``hdp/*`` metrics of the plan a pass ran, with the same names on both doors (verl lists each
    value and spells the histogram ``hdp/cp_degree_hist/<k>``)."""
    stats = plan.stats
    return {
        "hdp/rounds": plan.num_rounds,
        "hdp/plan_id": plan_id(plan),
        "hdp/efficiency_planned": float(stats.efficiency) if stats else math.nan,
        "hdp/cp_degree_hist": {int(k): int(v) for k, v in sorted(stats.cp_degree_hist.items())} if stats else {},
        "hdp/planner_ms": planner_ms,
        "hdp/planner_ms_exposed": exposed_ms,
    }


class Steps:
    """An engine's steps on its round core and planner (see the module docstring).

    ``measure_memory``: measure each training round's peak memory (when the planner has a memory model);
    ``loss_name``: the adapter as the errors name it (``loss_fn``, ``verl loss function``);
    ``max_consecutive_skips``: the door's option (None: never raise), ``skips_option`` its name in errors.
    """

    def __init__(self, core: RoundCore, planner: DomainPlanner, *, measure_memory: bool, loss_name: str,
                 max_consecutive_skips: int | None = None, skips_option: str = "max_consecutive_skips") -> None:
        self.core = core
        self.planner = planner
        self.measure_memory = bool(measure_memory) and planner.memory is not None
        self.loss_name = loss_name
        self.max_consecutive_skips = max_consecutive_skips
        self.skips_option = skips_option
        self.consecutive_skips = 0
        """Updates skipped since the last one applied (alike on every rank)."""
        self._first_skip: NonFiniteLossError | None = None
        self.step = 0
        """Training passes that passed their agreement (skipped ones included)."""
        self.round_seconds: list[float] = []
        """This rank's seconds per round of the last training pass."""
        self._pending: list[Pass] = []

    # -- the halves of a training step --

    def train_batch(self, what: str, call: str, prepare: Callable[[], Prepared]) -> Pass:
        """One whole training step: zero the gradients, :meth:`forward_backward_batch`, :meth:`optimizer_step`."""
        self.optimizer_zero_grad()
        done = self.forward_backward_batch(what, call, prepare)
        self.optimizer_step()
        return done

    def optimizer_zero_grad(self) -> None:
        """Zero the DDP grad buffers and the optimizer's grads; forget the passes not yet applied."""
        self.core.skip_update()
        self._pending = []

    def forward_backward_batch(self, what: str, call: str, prepare: Callable[[], Prepared]) -> Pass:
        """Agree, run every round with backward, reduce, raise an adapter's error on every rank, and apply
        the non-finite rules (:attr:`Pass.nonfinite`); the update waits for :meth:`optimizer_step`."""
        prep = self.core.agree(what, self.step + 1, prepare, call=call)
        self.step += 1  # counts the passes that passed validation (non-finite ones included)
        core, step = self.core, self.step
        with core.collectives("rounds", step):
            meter, static = start_measure(core.device, core.chunks, core.optimizer, self.measure_memory)
            state = core.run(prep.plan, prep.tokens, prep.adapter, train=True, meter=meter, hooks=prep.hooks)
            red = core.reduce(state)  # loss, failures, and every rank's gradient checked for NaN/inf
        self.round_seconds = core.round_seconds(state)
        core.raise_adapter_error(state, red, step, self.loss_name)
        done = Pass(prep, True, step, state, red, self.round_seconds, self._nonfinite(prep.plan, state, red),
                    meter, static)
        self._pending.append(done)
        return done

    def optimizer_step(self) -> Outcome:
        """The update of the passes since :meth:`optimizer_zero_grad` (none: Megatron's optimizer on the gradients as
        they are): skipped on every rank when any was not finite, else the optimizer step; then every
        pass's round times go to the planner.  Sets :attr:`Pass.outcome` on each.  Raises
        :class:`SkippedUpdatesError` on every rank when this skip makes ``max_consecutive_skips`` in a row."""
        passes, self._pending = self._pending, []
        core, step = self.core, self.step
        skipped = next((p.nonfinite for p in passes if p.nonfinite is not None), None)
        if skipped is not None:
            core.skip_update()
            outcome = Outcome(applied=False, grad_norm=math.nan, skipped=skipped, calibration={})
            for p in passes:
                p.outcome = outcome
            self.consecutive_skips += 1
            if self._first_skip is None:
                self._first_skip = skipped
            limit = self.max_consecutive_skips
            if limit is not None and self.consecutive_skips >= limit:  # the same count on every rank: agreed skips
                raise SkippedUpdatesError(self.consecutive_skips, limit, self.skips_option, self._first_skip,
                                          skipped) from self._first_skip
            return outcome
        with core.collectives("optimizer", step):
            ok, grad_norm = core.optimizer_step()
        if not ok:
            raise RuntimeError(f"step {step}: Megatron's optimizer skipped the update (inf/NaN gradients)")
        calibration: dict[str, Any] = {}
        with core.collectives("calibrate", step):
            for p in passes:
                calibration = self.planner.observe(p.plan, p.round_seconds, step=p.step, phases=core.phases,
                                                   memory_row=measured_row(p.plan, p.meter, p.static_bytes))
        norm = float(grad_norm) if grad_norm is not None else math.nan
        outcome = Outcome(applied=True, grad_norm=norm, skipped=None, calibration=calibration)
        self.consecutive_skips, self._first_skip = 0, None
        for p in passes:
            p.outcome = outcome
        return outcome

    def infer_batch(self, what: str, call: str, prepare: Callable[[], Prepared], *, label: str | None = None) -> Pass:
        """A forward-only pass: agree, every round without grad, reduce, an adapter's error raised on every
        rank (``label`` names the adapter; default `loss_name`)."""
        prep = self.core.agree(what, self.step + 1, prepare, call=call)
        core, step = self.core, self.step
        with core.collectives("forward", step):
            state = core.run(prep.plan, prep.tokens, prep.adapter, train=False, hooks=prep.hooks)
            red = core.reduce(state)
            core.raise_adapter_error(state, red, step, label or self.loss_name)
        return Pass(prep, False, step, state, red, [])

    # -- the pieces --

    def _nonfinite(self, plan: Plan, state: StepState, red: torch.Tensor) -> NonFiniteLossError | None:
        """The non-finite rules, alike on every rank: a NaN/inf loss (its samples and their ranks), else a
        NaN/inf gradient on any rank (one diagnostic all-gather names the ranks)."""
        core = self.core
        bad = core.nonfinite(state, red)
        if bad or not torch.isfinite(red[0]):
            return NonFiniteLossError(self.step, bad, core.ranks_of(plan, bad))
        ranks = core.nonfinite_grad_ranks(state, red, self.step)
        return NonFiniteGradientError(self.step, ranks, float(red[0])) if ranks else None

    # -- teardown, once for both doors --

    def close(self) -> None:
        """Release what the steps hold (idempotent): the passes not applied, the plan-ahead thread, the
        core's watcher and hooks, and every reference to the engine's groups (the planner's, the core's, the
        rings' of the domain), so that destroying the groups afterwards frees them — on gloo a group closes
        its connections, which is what releases a peer blocked on it, only with its last reference."""
        self._pending = []
        self.planner.close()
        self.planner.groups = None  # its all-gather and broadcast run on the agreement group
        groups = self.core.groups
        self.core.close()
        if groups is not None:
            groups.domain.detach()  # rings a failed step's autograd graph still holds keep no group alive
