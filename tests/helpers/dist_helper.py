"""The one spawn helper of the distributed tests: N gloo ranks on this machine.

A thin wrapper over the library's launcher (`hdp.trainer.launch.spawn`): a free port through a
parent-owned TCPStore, one intra-op thread per rank by default, a timeout that kills the ranks
(and processes they started), and every failing rank's traceback in the raised error.
"""

from __future__ import annotations

from typing import Any, Callable

from hdp.trainer.launch import spawn

__all__ = ["run_distributed"]


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results; raise on any failure.

    ``fn`` and ``args`` must be picklable (a module-level function).  Raises
    ``hdp.trainer.launch.WorkerError`` (a RuntimeError) with the failing ranks' tracebacks, or
    ``TimeoutError`` after ``timeout`` seconds.
    """
    return spawn(fn, world_size, *args, timeout=timeout, threads=threads)


def expect_value_error(fn, *needles: str) -> None:
    """``fn()`` raises a ValueError whose message names every one of ``needles``."""
    try:
        fn()
    except ValueError as exc:
        for needle in needles:
            assert needle in str(exc), f"{needle!r} not in {exc}"
    else:
        raise AssertionError(f"no ValueError (expected one naming {needles})")
