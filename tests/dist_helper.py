"""The one helper that spawns gloo process groups for hdp's distributed tests.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh processes (spawn), joins them
into a gloo group through a TCPStore the parent owns on a free port (no port race), calls
``fn(rank, world_size, *args)`` in each, and raises with every failing child's full traceback.
Children that outlive ``timeout`` seconds are killed (with the processes they started, when
``psutil`` is installed) and a ``TimeoutError`` is raised.

Children are not daemonic: Megatron's distributed-checkpoint writer (megatron-core 0.16.1,
``filesystem_async``) starts a ``multiprocessing`` Manager and forked writer processes, which a
daemonic process may not do.  The ``finally`` block below kills and joins every child instead.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["run_distributed"]


def _child(
    rank: int,
    world_size: int,
    port: int,
    threads: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    errors: Any,
    timeout: float,
) -> None:
    try:
        torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # report everything, including assertion errors, to the parent
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1)


def _descendants(pids: list[int | None]) -> list[int]:
    """Process ids started (recursively) by ``pids``; empty without ``psutil``."""
    try:
        import psutil
    except ImportError:
        return []
    out: list[int] = []
    for pid in pids:
        try:
            out += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except (psutil.Error, TypeError):  # already gone (or never started: pid None)
            continue
    return out


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads: int = 1,
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise on any failure.

    ``fn`` and ``args`` must be picklable (a module-level function).  Each child runs with
    ``torch.set_num_threads(threads)``.
    """
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    errors = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, store.port, threads, fn, args, errors, timeout), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failed: list[tuple[int, str]] = []
    try:
        while any(p.is_alive() for p in procs):
            try:
                failed.append(errors.get(timeout=0.2))
            except queue.Empty:
                pass
            if failed:
                time.sleep(1.0)  # let the other ranks report too (they usually fail right after)
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"distributed test {getattr(fn, '__name__', fn)} exceeded {timeout:.0f} s on "
                    f"{world_size} ranks; alive ranks: {[r for r, p in enumerate(procs) if p.is_alive()]}"
                )
    finally:
        alive = [p for p in procs if p.is_alive()]
        for pid in _descendants([p.pid for p in alive]):
            _kill(pid)
        for p in alive:
            p.kill()
        for p in procs:
            p.join(timeout=10)
        while True:
            try:
                failed.append(errors.get_nowait())
            except queue.Empty:
                break
        del store
    if failed:
        # first reporter first: later ones usually fail because a peer died
        msgs = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in dict.fromkeys(failed))
        raise RuntimeError(f"distributed test {getattr(fn, '__name__', fn)} failed:\n{msgs}")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise RuntimeError(f"ranks exited abnormally (rank, exit code): {bad} (pid {os.getpid()} parent)")
