"""Per-phase step timing, the same phases and names on both doors (`hdp.trainer.engine`, the verl engine).

A training step is timed in host wall seconds per phase (``time.perf_counter``; no device
synchronisation — on an accelerator, queued device work shows in the phase where the host waits for
it, the reduce's read-back):

=============  ==============================================================================
``plan``       validation, planning (or taking the plan made ahead) and the batch digest
``agree``      the agreement over the job (plan checksum, digest, failures)
``rounds``     every round through Megatron's schedule (forward, backward, the loss adapter)
``loss``       of ``rounds``: the engine's loss adapter (log-probs, the loss function)
``exchange``   of ``loss``: the group's whole-sample exchange (verl door; 0 on the library door)
``reduce``     the step's one all-reduce (loss, failures, non-finite flags)
``optimizer``  gradient finalisation and the optimizer step
``calibrate``  the round-time all-gather, records, auto-calibration (`DomainPlanner.observe`)
``collect``    outputs and metrics gathered for the caller (verl's collect rank; 0 on the library door)
=============  ==============================================================================

**Slowest rank, no extra synchronisation.**  The phases of a step ride on the all-gather that the
calibration already does after every training step (`hdp.core.planning.DomainPlanner.observe`):
each rank adds its row of phase seconds to the round times it sends, and every rank reads the
maximum over the job.  The phases up to ``optimizer`` are this step's; ``calibrate`` and
``collect`` come after that gather, so a step reports the **previous** training step's (NaN on the
first).  Metrics: ``hdp/time/<phase>`` (verl's logger shows ``actor/hdp/time/<phase>``).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["PHASES", "LATE_PHASES", "PhaseTimer", "metric_name", "median_phases"]

PHASES: tuple[str, ...] = ("plan", "agree", "rounds", "loss", "exchange", "reduce", "optimizer", "calibrate", "collect")
"""Every phase, in step order (``loss`` and ``exchange`` are parts of ``rounds``)."""

LATE_PHASES: tuple[str, ...] = ("calibrate", "collect")
"""Phases after the calibration gather: reported one training step late."""

_EARLY = tuple(p for p in PHASES if p not in LATE_PHASES)


def metric_name(phase: str) -> str:
    """``hdp/time/<phase>``."""
    return f"hdp/time/{phase}"


class PhaseTimer:
    """Host seconds per phase of one engine's steps (see the module docstring); one per round core."""

    def __init__(self) -> None:
        self._early = dict.fromkeys(_EARLY, 0.0)
        self._late = dict.fromkeys(LATE_PHASES, 0.0)
        self._rows = 0

    def begin(self) -> None:
        """A step starts (the core's agreement): this step's phases restart from zero."""
        self._early = dict.fromkeys(_EARLY, 0.0)

    def add(self, phase: str, seconds: float) -> None:
        """Add ``seconds`` to ``phase`` of the current step."""
        (self._late if phase in self._late else self._early)[phase] += seconds

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """Time the body as (part of) ``phase``; an unknown name is a bug (KeyError at once)."""
        if phase not in self._early and phase not in self._late:
            raise KeyError(f"phase {phase!r}: not one of {PHASES}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - t0)

    def row(self) -> list[float]:
        """This rank's row for the calibration gather, in `PHASES` order: this step's phases up to the
        optimizer, and the late phases measured since the previous row (NaN before the first)."""
        late = self._late if self._rows else dict.fromkeys(LATE_PHASES, math.nan)
        out = [self._early[p] if p in self._early else late[p] for p in PHASES]
        self._late = dict.fromkeys(LATE_PHASES, 0.0)
        self._rows += 1
        return out

    @staticmethod
    def metrics(slowest: Sequence[float]) -> dict[str, float]:
        """``hdp/time/<phase>`` from a row of per-phase seconds (the job's maximum of `row`)."""
        if len(slowest) != len(PHASES):
            raise ValueError(f"slowest has {len(slowest)} entries; one per phase of {PHASES}")
        return {metric_name(p): float(s) for p, s in zip(PHASES, slowest)}


def median_phases(steps: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Median over steps of each phase's ``hdp/time/<phase>`` metric (a bench's per-phase summary;
    a value may be a verl-style one-element list; NaN and absent entries skipped, NaN when none)."""
    out = {}
    for p in PHASES:
        vals = []
        for m in steps:
            v = m.get(metric_name(p), math.nan)
            v = float(v[0] if isinstance(v, (list, tuple)) else v)
            if math.isfinite(v):
                vals.append(v)
        out[p] = statistics.median(vals) if vals else math.nan
    return out
