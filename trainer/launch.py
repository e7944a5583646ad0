"""Start the ranks of a domain: local spawning (gloo on CPU) or ``torchrun``'s environment.

``spawn(fn, world_size, *args)`` starts ``world_size`` processes, joins them into one
process group through a TCPStore the parent owns (free port, no race), calls
``fn(rank, world_size, *args)`` in each and returns the ranks' return values; a failure in any
rank raises :class:`WorkerError` with every failing rank's traceback, and the other ranks are
stopped.  Workers are *not* daemonic, so they may start helper processes of their own (Megatron's
checkpoint writer does).  Return values travel as plain pickles (by value, not through shared
memory), so they may hold torch tensors.

Workers are forked from a ``multiprocessing`` fork server (POSIX; ``spawn`` elsewhere) that
imported torch and Megatron-core once (`PRELOAD`): a worker then starts in ~0.1 s instead of
paying that ~9 s import on every rank of every launch (a 4-rank launch on 2 cores: 15 s -> 0.1 s
after the first).  The server holds no torch state beyond its imports (no thread pool, no device,
no process group).  Each worker takes the caller's environment variables and standard output
and error *at launch* (not the server's, which are those of the first launch), so it behaves
like a freshly spawned process; only the import-time warnings of the preloaded modules are not
repeated per worker (the server imports them with :func:`quiet_third_party_warnings` applied).

:func:`quiet_third_party_warnings` silences the known, harmless warnings of Megatron-core and
torch (TransformerEngine / Apex fallbacks, deprecations) in the process that calls it; ``spawn``
applies it in its workers (``quiet=True``) and the ``hdp`` command in itself.  The library never
calls it: a trainer that imports hdp sees every warning unless it opts in.

``init_from_env()`` joins the process group that ``torchrun`` describes with ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` (returns False when those are absent).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from hdp import device as _device
from hdp.trainer.quiet import THIRD_PARTY_WARNINGS, quiet_third_party_warnings

__all__ = ["spawn", "init_from_env", "WorkerError", "RankOutcome", "THIRD_PARTY_WARNINGS", "quiet_third_party_warnings"]


class WorkerError(RuntimeError):
    """One or more spawned ranks failed; the message holds their tracebacks."""


PRELOAD: tuple[str, ...] = ("hdp.trainer._preload",)
"""What the fork server imports before it forks workers (`hdp.trainer._preload`: torch,
torch.distributed and Megatron-core where installed)."""


class _ParentFd:
    """A file descriptor of the caller that the worker receives as its own (pickled at launch, when
    ``multiprocessing`` hands the descriptor to the new process)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_received_fd, (reduction.DupFd(self.fd),))


def _received_fd(dup: Any) -> int:
    return dup.detach()


def _context() -> Any:
    """The fork-server context with `PRELOAD` (the ``spawn`` context where there is no fork server)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _adopt_caller(env: dict[str, str] | None, stdio: tuple[int, int] | None) -> None:
    """Take the caller's environment and standard output / error (a fork-server worker starts
    with the server's)."""
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if stdio is not None:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        for fd, target in zip(stdio, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    threads: int,
    payload: bytes,
    results: Any,
    timeout: float,
    quiet: bool,
    env: dict[str, str] | None = None,
    stdio: tuple[int, int] | None = None,
) -> None:
    try:
        _adopt_caller(env, stdio)
        if quiet:
            quiet_third_party_warnings()
        fn, args = pickle.loads(payload)  # after the filters: unpickling imports fn's modules
        torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        # every rank's connections are up before any rank's function runs: a rank whose function returns at
        # once would otherwise exit and close its side of the mesh while a peer is still connecting to it
        # (gloo's connectFullMesh then fails on that peer)
        store.set(f"hdp/launch/ready/{rank}", "1")
        store.wait([f"hdp/launch/ready/{r}" for r in range(world_size)])
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        try:
            # by value: torch's queue pickler would pass tensors through shared memory that this
            # process releases when it exits, before the parent reads them
            blob = pickle.dumps(out)
        except Exception as exc:
            raise TypeError(
                f"spawn: the return value of rank {rank} ({type(out).__name__}) cannot be pickled: {exc}; "
                "return picklable values (tensors, numbers, dicts, lists)"
            ) from exc
        results.put((rank, True, blob))
    except BaseException:  # report everything (assertions included) to the parent
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1)


def _descendants(pids: list[int | None]) -> list[int]:
    """Process ids started (recursively) by ``pids``."""
    import psutil

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


def _exit_text(code: int | None) -> str:
    """``exit code 3`` or ``killed by SIGKILL`` for a process exit code."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass(frozen=True)
class RankOutcome:
    """How one spawned rank ended (:func:`spawn` with ``collect=True``)."""

    rank: int
    """The rank."""
    ok: bool
    """True when ``fn`` returned."""
    value: Any = None
    """What ``fn`` returned (``ok``)."""
    error: str | None = None
    """The traceback, or how the process ended without a report (killed, exit code, stopped)."""
    exitcode: int | None = None
    """The process exit code (negative: killed by that signal)."""


RANKS_PER_CPU = 16
"""Local ranks per CPU core this launcher starts at most (gloo ranks mostly wait on each other)."""
BYTES_PER_RANK = 256 << 20
"""Memory one local rank needs at least (torch and Megatron imported: ~250 MB resident)."""


def check_local_capacity(world_size: int) -> None:
    """Raise ValueError, before any process starts, when this machine cannot run ``world_size`` local ranks
    (more than ``RANKS_PER_CPU`` per core, or than the available memory holds at ``BYTES_PER_RANK``)."""
    import psutil

    cpus = os.cpu_count() or 1
    free = int(psutil.virtual_memory().available)
    limit = max(1, min(cpus * RANKS_PER_CPU, free // BYTES_PER_RANK))
    if world_size > limit:
        raise ValueError(
            f"world_size={world_size}: this machine can run at most {limit} local ranks ({cpus} CPUs x "
            f"{RANKS_PER_CPU}, {free / 2**30:.1f} GiB available / {BYTES_PER_RANK >> 20} MiB per rank); ask for fewer "
            "ranks, or launch them over several machines (torchrun)"
        )


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 600.0,
    threads: int = 1,
    backend: str = "gloo",
    collect: bool = False,
    quiet: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return their results by rank.

    ``fn``, ``args`` and the results must be picklable (``fn`` a module-level function); results
    are sent back by value, so torch tensors (and dicts / lists of them) are fine.  Each worker runs
    with ``torch.set_num_threads(threads)`` and, with ``quiet``, :func:`quiet_third_party_warnings`
    applied before ``fn``'s module is imported.  Raises :class:`WorkerError` when a rank fails
    (including a return value that cannot be pickled) — naming first the ranks that died without a
    report (killed, ``os._exit``) and then the ranks that failed after them — and ``TimeoutError``
    after ``timeout`` seconds.

    ``collect=True`` (fault-injection harnesses): wait for every rank to return, fail or die (until
    ``timeout``), raise nothing for failed ranks, and return one :class:`RankOutcome` per rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be >= 1")
    check_local_capacity(world_size)
    try:
        payload = pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(
            f"spawn: {getattr(fn, '__name__', fn)!r} or its arguments cannot be pickled ({exc}); pass a "
            "module-level function and picklable arguments"
        ) from exc
    ctx = _context()
    forked = ctx.get_start_method() == "forkserver"
    env = dict(os.environ) if forked else None
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, store.port, backend, threads, payload, results, timeout, quiet,
                                          env, (_ParentFd(1), _ParentFd(2)) if forked else None))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    done: dict[int, Any] = {}
    failed: dict[int, str] = {}
    timed_out = False
    try:
        while len(done) + len(failed) < world_size:
            try:
                rank, ok, body = results.get(timeout=0.2)
                (done if ok else failed)[rank] = body
                continue
            except queue.Empty:
                pass
            if failed and not collect:
                time.sleep(1.0)  # let the other ranks report too
                break
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in done and r not in failed]
            if dead and results.empty():
                time.sleep(0.5)
                if results.empty():
                    failed.update({r: f"exited with code {procs[r].exitcode} without a report" for r in dead})
                    if not collect:
                        break
            if time.monotonic() > deadline:
                if collect:
                    timed_out = True
                    break
                raise TimeoutError(
                    f"{getattr(fn, '__name__', fn)} exceeded {timeout:.0f} s on {world_size} ranks; "
                    f"ranks still running: {[r for r in range(world_size) if r not in done]}"
                )
    finally:
        stuck = [p for p in procs if p.is_alive() and (failed or len(done) < world_size)]
        stopped = {procs.index(p) for p in stuck}
        for pid in _descendants([p.pid for p in stuck]):  # e.g. checkpoint writer processes
            _kill(pid)
        for p in stuck:
            p.kill()
        for p in procs:
            p.join(timeout=30)
        while True:
            try:
                rank, ok, body = results.get_nowait()
            except queue.Empty:
                break
            (done if ok else failed)[rank] = body
        del store
    # a rank that exited without a report died (killed, os._exit, a crash in C): name it first,
    # the ranks that then failed because their peer vanished second
    for r, p in enumerate(procs):
        if r in done or r in failed:
            continue
        if r in stopped:
            why = f"past the {timeout:.0f} s timeout" if timed_out else "after another rank failed"
            failed[r] = f"stopped by the launcher: still running {why}"
        elif p.exitcode not in (None, 0):
            failed[r] = f"exited with code {p.exitcode} without a report"
    if collect:
        return [
            RankOutcome(rank=r, ok=r in done, value=pickle.loads(done[r]) if r in done else None, error=failed.get(r), exitcode=procs[r].exitcode)
            for r in range(world_size)
        ]
    dead = sorted(r for r, msg in failed.items() if msg.endswith("without a report") and r not in stopped)
    if failed:
        name = getattr(fn, "__name__", fn)
        msgs = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items(), key=lambda kv: (kv[0] not in dead, kv[0])))
        if dead:
            how = ", ".join(f"rank {r} ({_exit_text(procs[r].exitcode)})" for r in dead)
            others = sorted(set(failed) - set(dead))
            then = f"; ranks {others} failed after it" if others else ""
            raise WorkerError(f"{name}: {how} died without a report{then}; failed on ranks {sorted(failed)}:\n{msgs}")
        raise WorkerError(f"{name} failed on ranks {sorted(failed)}:\n{msgs}")
    return [pickle.loads(done[r]) for r in range(world_size)]


def init_from_env(device: str | torch.device = "cpu") -> bool:
    """Join the process group ``torchrun`` describes; False when not launched by torchrun.

    The backend follows the device (gloo for CPU, nccl for CUDA, hccl for NPU).
    """
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    if not dist.is_initialized():
        dist.init_process_group(_device.backend_for(torch.device(device)), init_method="env://")
    return True
