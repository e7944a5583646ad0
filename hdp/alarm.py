"""A rank's own failure, told to every rank of the job at once: the rendezvous store plus a group abort.

Inside a phase whose collectives cannot be abandoned (the rounds: CP rings, EP all-to-alls, pipeline
sends), a rank that fails for a reason of its own — a ``RuntimeError`` in a forward or a CP backward,
the shape an out-of-memory takes, or a ``KeyboardInterrupt`` — used to leave its peers blocked in
their next collective until the group's timeout (300 s by default), after which they raised an
error that named neither the rank nor its error.  The failing process is alive and knows what
happened, so it

1. **publishes** its rank, the phase and its error in the job's rendezvous store (the default
   process group's ``TCPStore``: one ``set`` and one ``add`` under a prefix unique to the engine), then
2. **aborts** every process group the engine communicates on.  On NCCL and HCCL an abort ends the
   rank's own outstanding collectives (not run on hardware).  On gloo it ends none, neither here nor
   on a peer (`ProcessGroup.abort` and `shutdown` alike, measured with torch 2.13: a peer blocked in
   an all-reduce waits until this process exits); there the caller also frees the groups it holds
   (`hdp.core.rounds.RoundCore`: a freed gloo group closes its connections, which does release
   the peers).

Every rank runs a **watcher** thread that polls the store's counter (``poll_s``); when another
rank has published, it aborts its own groups too, so on NCCL/HCCL a rank blocked in a collective
that does not involve the failed rank (a CP ring elsewhere, a TP group) is released as well.  A rank whose
collective then breaks reads the published failures (:meth:`Alarm.failures`, waiting up to
``wait_s`` for them to arrive) and raises naming the failed rank and its error instead of a bare
transport error.  When nothing was published (a peer was killed or hangs), it publishes what *it*
saw, so the others are released too, and the caller raises as before.

Legend: W world size.  Cost: one store ``add`` per rank per ``poll_s`` while the engine lives.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

import torch.distributed as dist

__all__ = ["Alarm", "is_transport_error"]

logger = logging.getLogger(__name__)

_TRANSPORT_WORDS = ("gloo", "nccl", "hccl", "connection closed", "connection reset", "timed out", "aborted",
                    "broken pipe", "socket", "peer")


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that broke (a peer's failure reaching this rank), not this rank's own."""
    if isinstance(exc, (dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError)):
        return True
    if type(exc) is not RuntimeError:
        return False
    text = str(exc).lower()
    return any(w in text for w in _TRANSPORT_WORDS)


class Alarm:
    """Publishes this rank's failure and watches for the others' (see the module docstring).

    ``store``: the job's rendezvous store; ``prefix``: keys of this engine (the same on every rank);
    ``rank``: this world rank; ``groups``: returns the process groups to abort; ``poll_s``: how often
    the watcher reads the store.  ``store=None`` (no default store): publishing and watching are off.
    """

    def __init__(self, store: dist.Store | None, prefix: str, rank: int,
                 groups: Callable[[], Iterable[dist.ProcessGroup]], *, poll_s: float = 0.5) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = int(rank)
        self._groups = groups
        self.poll_s = float(poll_s)
        self.tripped = threading.Event()  # set once the groups are aborted (by us or by the watcher)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_job(cls, job_group: dist.ProcessGroup, rank: int,
                groups: Callable[[], Iterable[dist.ProcessGroup]], **kwargs: float) -> "Alarm":
        """The alarm of an engine whose agreement group is ``job_group`` (its name makes the prefix)."""
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            store: dist.Store | None = _get_default_store()
        except Exception:  # noqa: BLE001 - no default store (a custom init): the timeout still bounds waits
            store = None
        return cls(store, f"hdp/alarm/{job_group.group_name}", rank, groups, **kwargs)

    # -- the store --

    def _count(self) -> int:
        assert self.store is not None
        return int(self.store.add(f"{self.prefix}/count", 0))

    def publish(self, what: str) -> None:
        """Tell every rank that this rank failed (``what``: phase and error); never raises."""
        if self.store is None:
            return
        try:
            self.store.set(f"{self.prefix}/r{self.rank}", what.encode("utf-8", errors="replace")[:2000])
            self.store.add(f"{self.prefix}/count", 1)
        except Exception as exc:  # noqa: BLE001 - the store itself may be gone (its host died)
            logger.warning("alarm: could not publish to the store (%s)", exc)

    def failures(self, world: int, *, wait_s: float = 0.0) -> dict[int, str]:
        """World rank -> published failure (waits up to ``wait_s`` for the first one)."""
        if self.store is None:
            return {}
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if self._count() > 0:
                    break
            except Exception:  # noqa: BLE001
                return {}
            if time.monotonic() >= deadline:
                return {}
            time.sleep(0.05)
        out: dict[int, str] = {}
        for r in range(world):
            key = f"{self.prefix}/r{r}"
            try:
                if self.store.check([key]):
                    out[r] = self.store.get(key).decode("utf-8", errors="replace")
            except Exception:  # noqa: BLE001
                continue
        return out

    # -- the groups --

    def trip(self) -> None:
        """Abort every group this engine communicates on (idempotent): a blocked collective raises."""
        if self.tripped.is_set():
            return
        self.tripped.set()
        for pg in list(self._groups()):
            try:
                pg.abort()
            except Exception as exc:  # noqa: BLE001 - a backend without abort: its timeout still bounds it
                logger.debug("alarm: abort of group %s failed (%s)", getattr(pg, "group_name", pg), exc)

    def raise_alarm(self, what: str) -> None:
        """This rank failed inside a phase's collectives: publish, then abort the groups."""
        self.publish(what)
        self.trip()

    # -- the watcher --

    def start(self) -> None:
        """Start the watcher thread (daemon; one per engine)."""
        if self.store is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._watch, name="hdp-alarm", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                if self._count() > 0:
                    logger.info("alarm: another rank failed; aborting this rank's groups")
                    self.trip()
                    return
            except Exception:  # noqa: BLE001 - the store went away: nothing more to watch
                return

    def close(self) -> None:
        """Stop the watcher (the engine is closing)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
            self._thread = None
