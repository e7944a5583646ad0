"""One rule for every error inside a step: every rank of the domain learns of it and raises too.

A step is a sequence of *phases* (``validate``, ``rounds``, ``optimizer``, ``save``, ``load``, ...).
Each phase runs inside :meth:`StepGuard.phase`; whatever it raises — ``ValueError``, a
``RuntimeError`` from backward, a ``BaseException`` such as Megatron's ``CheckpointException`` —
is caught, and at the end of the phase every rank takes part in **one fixed-size all-gather** over
the domain group: a flag byte and the first bytes of the error message per rank.  So

* a rank whose phase failed raises :class:`DomainStepError` naming itself and its original error
  (chained with ``from``), and
* every other rank raises :class:`DomainStepError` too, naming the failed ranks and their messages,

before the next collective of the step; the caller decides what the phase may have changed (the
engine runs phases so that nothing is applied before the agreement: no optimizer step, no partial
load).  The agreement itself is one collective of a size that does not depend on the error, so it
cannot hang on a mismatch.

When the agreement cannot complete — a rank died (the transport reports a closed connection) or
hangs (the group's timeout expires) — each surviving rank raises :class:`DomainUnreachableError`
naming the step, the phase and the timeout, on its own, within that timeout.  After that the
domain's process groups are unusable: tear them down and restart the job from its last checkpoint.

Phases whose body runs collectives (the rounds: CP rings, EP all-to-alls) must not raise out of the
middle of them on one rank only — the others would wait for a partner that left.  Such code catches
the error where it happens, records it with :meth:`StepGuard.defer`, keeps the collectives lined up
(e.g. backward of a zero loss), and lets the guard raise at the end of the phase.

Legend: N ranks in the domain, M message bytes per rank (:data:`MESSAGE_BYTES`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from hdp.alarm import is_transport_error

__all__ = ["MESSAGE_BYTES", "DomainStepError", "DomainInputError", "DomainUnreachableError", "RankFailedError",
           "StepGuard", "describe", "is_input_error"]

logger = logging.getLogger(__name__)

MESSAGE_BYTES = 480
"""Bytes of each rank's error message carried by the agreement (UTF-8, cut at this length)."""


class DomainStepError(RuntimeError):
    """A phase of a step failed on some rank(s) of the domain; raised on every rank of the domain."""

    def __init__(self, message: str, *, step: int, phase: str, ranks: tuple[int, ...], messages: dict[int, str]):
        super().__init__(message)
        self.step = step
        """The step counter the phase belongs to."""
        self.phase = phase
        """Name of the failed phase."""
        self.ranks = ranks
        """Ranks whose phase raised, numbered in the guard's group (the message's label says which:
        ``domain rank`` or, for the engine's guard over the whole job, ``world rank``)."""
        self.messages = messages
        """Rank (as in ``ranks``) -> the (cut) message of its original error."""


class DomainInputError(DomainStepError, ValueError):
    """Every rank that failed the phase failed on bad input (``ValueError``/``TypeError``): raised on
    every rank, and still a ``ValueError`` for callers that catch input errors."""


def is_input_error(exc: BaseException | None) -> bool:
    """True for the errors hdp raises on bad input (``ValueError``, ``TypeError``)."""
    return isinstance(exc, (ValueError, TypeError))


class DomainUnreachableError(RuntimeError):
    """The domain's agreement collective failed: a rank died, hangs, or the transport broke."""

    def __init__(self, message: str, *, step: int, phase: str):
        super().__init__(message)
        self.step = step
        self.phase = phase


class RankFailedError(DomainUnreachableError):
    """A rank failed for a reason of its own in the middle of a phase's collectives (a forward, a CP
    backward, an interrupt); it told every rank (:mod:`hdp.alarm`), and every rank raises this at once,
    naming the failed ranks and their errors.  The groups were aborted: the engine is unusable."""

    def __init__(self, message: str, *, step: int, phase: str, failures: dict[int, str]):
        super().__init__(message, step=step, phase=phase)
        self.failures = failures
        """World rank -> what it published (phase and error)."""


def describe(exc: BaseException) -> str:
    """``"TypeName: message"`` of an exception (the part of it the agreement carries)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _encode(error: BaseException | None) -> bytes:
    """Flag byte (0 fine, 1 failed, 2 failed on bad input) and the cut UTF-8 message."""
    if error is None:
        return b"\x00" + bytes(MESSAGE_BYTES)
    raw = describe(error).encode("utf-8", errors="replace")[:MESSAGE_BYTES]
    return (b"\x02" if is_input_error(error) else b"\x01") + raw + bytes(MESSAGE_BYTES - len(raw))


def _decode(row: bytes) -> tuple[int, str] | None:
    if row[0] == 0:
        return None
    return row[0], row[1:].rstrip(b"\x00").decode("utf-8", errors="replace")


@dataclass(eq=False)
class StepGuard:
    """Runs the phases of a step so that an error on any rank raises on every rank of the domain.

    ``group`` is the domain's process group (named explicitly), ``rank`` this rank's index in it,
    ``device`` where the small agreement tensor lives (CPU for gloo), ``timeout_s`` the group's
    collective timeout (only quoted in messages: the process group enforces it), ``label`` how
    messages name a rank of ``group`` (``"domain rank"``; the engine, whose group is the whole
    TP × PP × domain job, says ``"rank"``).
    """

    group: dist.ProcessGroup
    rank: int
    size: int
    device: torch.device
    timeout_s: float | None = None
    label: str = "domain rank"

    def __post_init__(self) -> None:
        if self.group is None:
            raise ValueError("StepGuard.group=None: pass the domain's process group (None means the whole world)")
        self._deferred: BaseException | None = None

    def defer(self, error: BaseException) -> None:
        """Record an error of the running phase without raising yet (the first one is kept)."""
        if self._deferred is None:
            self._deferred = error

    @property
    def deferred(self) -> BaseException | None:
        """The error recorded by :meth:`defer` in the running phase, if any."""
        return self._deferred

    @contextlib.contextmanager
    def phase(self, name: str, step: int) -> Iterator["StepGuard"]:
        """Run the ``with`` body as phase ``name`` of ``step``; agree on errors at its end (collective).

        Every rank of the domain must enter the same phases in the same order.
        """
        self._deferred = None
        error: BaseException | None = None
        try:
            yield self
        except (KeyboardInterrupt, SystemExit):
            # an interrupt may land in the middle of the body's collectives (a Megatron dist save): this
            # rank stops now, and the engine's alarm (hdp.alarm) tells the others and releases them
            self._deferred = None
            raise
        except BaseException as exc:  # every type: one rank's failure must reach all ranks
            if is_transport_error(exc):
                # a collective of the body broke (a peer failed in it and freed its groups, or died): the
                # failed rank does not come to the agreement; the engine's alarm names it
                self._deferred = None
                raise
            error = exc
        if error is None:
            error = self._deferred
        self._deferred = None
        self.agree(name, step, error)

    def agree(self, name: str, step: int, error: BaseException | None) -> None:
        """One fixed-size all-gather of (flag, message) over the domain; raise on every rank if any failed."""
        mine = torch.frombuffer(bytearray(_encode(error)), dtype=torch.uint8).to(self.device)  # [1 + M]
        table = [torch.empty_like(mine) for _ in range(self.size)]  # N x [1 + M]
        t0 = time.monotonic()
        try:
            dist.all_gather(table, mine, group=self.group)
        except Exception as exc:  # the transport broke: a rank died or hangs
            waited = time.monotonic() - t0
            limit = f"collective timeout {self.timeout_s:g} s" if self.timeout_s is not None else "the group's collective timeout"
            local = f"; this rank's own error: {describe(error)}" if error is not None else ""
            raise DomainUnreachableError(
                f"step {step}, phase {name!r}: {self.label} {self.rank} could not agree with the other "
                f"{self.size - 1} ranks after {waited:.1f} s ({limit}): a rank died, "
                f"hangs, or the transport failed ({describe(exc)}){local}. The domain's process groups are "
                "no longer usable: restart the job from the last checkpoint",
                step=step, phase=name,
            ) from (error if error is not None else exc)
        rows = {r: d for r, d in ((r, _decode(bytes(t.cpu().numpy()))) for r, t in enumerate(table)) if d is not None}
        if not rows:
            return
        messages = {r: m for r, (_, m) in rows.items()}
        inputs = all(flag == 2 for flag, _ in rows.values())  # every failure was bad input
        failed = tuple(sorted(messages))
        detail = "; ".join(f"{self.label} {r}: {messages[r]}" for r in failed)
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise error  # the other ranks were told; this one stops as it was asked to
        if error is not None:
            head = f"step {step}, phase {name!r} failed on {self.label} {self.rank}: {describe(error)}"
            others = [r for r in failed if r != self.rank]
            tail = f" (also failed on: {'; '.join(f'{self.label} {r}: {messages[r]}' for r in others)})" if others else ""
            msg = f"{head}{tail}; every rank of the domain raises this step"
        elif inputs:
            msg = (f"step {step}, phase {name!r}: invalid input on {self.label}s {list(failed)} [{detail}]; "
                   "this rank stops too (nothing was run): every rank must pass the same valid input")
        else:
            msg = (f"step {step}, phase {name!r} failed on {self.label}s {list(failed)} [{detail}]; "
                   "this rank stops too, so the domain stays in step")
        logger.debug("guard: %s", msg)
        cls = DomainInputError if inputs else DomainStepError
        raise cls(msg, step=step, phase=name, ranks=failed, messages=messages) from error
