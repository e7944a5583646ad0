"""Megatron's parallel state, shared by the library engines of one process.

megatron-core keeps one parallel state per process (``parallel_state``'s module globals), so two
:class:`~hdp.trainer.engine.HdpEngine` of one process (an actor and a critic) share it: the first build makes
it, later builds with the same layout hold it once more, the last close destroys it.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

from hdp import megatron_compat as mc
from hdp.groups import GroupLedger

__all__ = ["SharedMegatron"]


class SharedMegatron:
    """Megatron's parallel state, shared by the engines of this process.

    megatron-core keeps one parallel state per process (``parallel_state``'s module globals: one TP × PP ×
    EP layout, one RNG tracker), and parts of Megatron read it instead of the groups they are given.  So
    the engines of one process share it: the first build initialises it (its groups in a ledger of their
    own), later builds with the same layout reuse it, and the last engine to close destroys it.  A build
    with another layout while an engine holds it is refused (:meth:`check`).  ``current`` is that one
    process-wide state (it mirrors Megatron's own global)."""

    current: ClassVar["SharedMegatron | None"] = None

    def __init__(self, layout: dict[str, Any], runtime: mc.MegatronRuntime, ledger: GroupLedger) -> None:
        self.layout, self.runtime, self.ledger, self.holders = layout, runtime, ledger, 1

    @classmethod
    def _live(cls) -> "SharedMegatron | None":
        cur = cls.current
        return cur if cur is not None and cur.holders > 0 and cur.runtime.current else None

    @classmethod
    def check(cls, layout: dict[str, Any]) -> None:
        """Raise ``ValueError`` (pure: before any collective) when an open engine holds Megatron's state with
        another layout."""
        cur = cls._live()
        if cur is not None and cur.layout != layout:
            held = ", ".join(f"{k}={v}" for k, v in cur.layout.items())
            want = ", ".join(f"{k}={v}" for k, v in layout.items())
            raise ValueError(
                f"HdpEngine.build: {cur.holders} open engine(s) of this process hold Megatron's parallel state with "
                f"layout {held}; this engine asks for {want}. Megatron keeps one parallel state per process, so the "
                "engines of one process share one layout: build this one with the same EngineConfig.parallel, or "
                "close() the open engine(s) first"
            )

    @classmethod
    def acquire(cls, layout: dict[str, Any], seed: int, make: Callable[[], mc.MegatronRuntime]) -> "SharedMegatron":
        """The live state of this layout, held once more (Megatron's RNG tracker reseeded with ``seed``, as a
        fresh initialisation would), or a new one from ``make`` (collective over the world)."""
        cls.check(layout)
        cur = cls._live()
        if cur is not None:
            mc.manual_seed(seed)
            cur.holders += 1
            return cur
        ledger = GroupLedger()
        try:
            runtime = make()
        except BaseException:
            ledger.release()
            raise
        ledger.seal()
        cls.current = shared = cls(layout, runtime, ledger)
        return shared

    def release(self) -> None:
        """One holder less; the last one destroys the parallel state, its groups and the checkpoint writer."""
        self.holders -= 1
        if self.holders > 0:
            return
        self.runtime.close()
        self.ledger.release()
        mc.stop_checkpoint_writer()
        if SharedMegatron.current is self:
            SharedMegatron.current = None

