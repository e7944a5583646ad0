"""Planning the next mini-batch while the current one trains.

A step of several mini-batches (verl's ``ppo_epochs`` × mini-batches, `HdpEngine.train_steps`) knows
its batches' lengths before the first one runs.  `PlanAhead` takes them (`announce`) and plans them
one at a time on **one background thread**: the plan of mini-batch i+1 is computed while mini-batch
i runs its rounds, so the step only waits for what is left of it (`take`: the *exposed* time).

Same plans as planning in line, on every rank: planning is pure (`hdp.packing.plan` of the lengths
and the planner config), and a plan made ahead is used only when the config it was made with equals
the config in force when its mini-batch runs — after a refit or a memory tightening between the two,
the stale plan is dropped and the mini-batch is planned in line (``discarded``).  A plan that raised
(bad input) raises again, in line, inside the step's agreement, exactly as planning in line would.

Contention: the thread needs the GIL for the planner's Python and a core for its numpy work.  On an
accelerator the training thread spends a round mostly waiting for kernels and collectives (torch
releases the GIL there), so the two overlap almost fully; on CPU the rounds themselves run torch ops
on the same cores (which also release the GIL) and the planner competes with them for CPU time, so
the exposed time falls but the step's CPU time does not.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PlanAhead", "Taken"]


@dataclass(frozen=True)
class Taken:
    """A plan for the step about to run and what it cost."""

    plan: Any
    planner_ms: float
    """Wall milliseconds the planning took (on the thread, or in line)."""
    exposed_ms: float
    """Milliseconds the step waited for it (in line: all of ``planner_ms``)."""
    ahead: bool
    """Whether it was planned ahead."""


@dataclass
class _Job:
    lengths: tuple[int, ...]
    config: Any
    future: concurrent.futures.Future | None = None


def _timed(fn: Callable[[Sequence[int], Any], Any], lengths: Sequence[int], config: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    return fn(lengths, config), (time.perf_counter() - t0) * 1e3


class PlanAhead:
    """Plans announced mini-batches one ahead on a background thread (see the module docstring).

    ``plan_fn(lengths, config)``: the pure planner (`hdp.packing.plan`).  The thread starts with the
    first `announce` and stops with `close`.
    """

    def __init__(self, plan_fn: Callable[[Sequence[int], Any], Any]) -> None:
        self._plan = plan_fn
        self._queue: collections.deque[_Job] = collections.deque()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.discarded = 0
        """Plans made ahead and dropped because the config changed (or the batch was not the announced one)."""

    def announce(self, batches: Sequence[Sequence[int]], config_of: Callable[[int], Any]) -> None:
        """The lengths of the next mini-batches, in the order they will run; ``config_of(i)``: the
        planner config mini-batch i would be planned with now.  Replaces what was announced before."""
        self._drop_all()
        for i, lengths in enumerate(batches):
            self._queue.append(_Job(tuple(int(x) for x in lengths), config_of(i)))
        self._start_head()

    def extend(self, batches: Sequence[Sequence[int]], config_of: Callable[[int], Any]) -> None:
        """Announce more mini-batches after those already announced (``config_of(i)``: i counts from 0
        over ``batches``)."""
        for i, lengths in enumerate(batches):
            self._queue.append(_Job(tuple(int(x) for x in lengths), config_of(i)))
        self._start_head()

    def take(self, lengths: Sequence[int], config: Any) -> Taken:
        """The plan of ``lengths`` under ``config``: the one made ahead when it is the announced next
        mini-batch and was made with an equal config, else planned in line.  Starts the next one."""
        key = tuple(int(x) for x in lengths)
        t0 = time.perf_counter()
        job = self._queue.popleft() if self._queue else None
        if job is not None and (job.lengths != key or job.config != config):
            self.discarded += 1
            if job.lengths != key:  # not the announced sequence: forget the rest of it
                self._drop_all()
            job = None
        if job is not None and job.future is not None:
            try:
                plan, ms = job.future.result()
            except Exception:  # noqa: BLE001 - plan in line below: the error is raised where the caller agrees on it
                plan, ms = None, 0.0
            if plan is not None:
                exposed = (time.perf_counter() - t0) * 1e3
                self._start_head()
                return Taken(plan, ms, exposed, True)
        self._start_head()  # the next announced one goes on whatever this one does
        plan, ms = _timed(self._plan, lengths, config)  # raises as in-line planning does
        return Taken(plan, ms, (time.perf_counter() - t0) * 1e3, False)

    def pending(self) -> int:
        """Announced mini-batches not taken yet."""
        return len(self._queue)

    def _start_head(self) -> None:
        if not self._queue or self._queue[0].future is not None:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hdp-plan-ahead")
        job = self._queue[0]
        job.future = self._pool.submit(_timed, self._plan, job.lengths, job.config)

    def _drop_all(self) -> None:
        for job in self._queue:
            if job.future is not None:
                job.future.cancel()
        self._queue.clear()

    def close(self) -> None:
        """Forget what was announced and stop the thread (waits for a plan in progress)."""
        self._drop_all()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
