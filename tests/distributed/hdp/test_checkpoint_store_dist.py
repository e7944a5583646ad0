"""The distributed tier (other processes) of the tests tests/unit/hdp/test_checkpoint_store.py describes: its docstring says what they check and how."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers.dist_helper import run_distributed
from hdp.guard import DomainStepError, StepGuard
from hdp.core.checkpoint import CheckpointError, read_manifest, save_slots, verify_checkpoint

WORLD = 3
META = {"model_digest": "abc", "domain_size": WORLD}


def _guard(rank: int) -> StepGuard:
    return StepGuard(group=dist.group.WORLD, rank=rank, size=WORLD, device=torch.device("cpu"))


def _save(root: Path, rank: int, step: int, value: float, die_rank: int | None = None) -> None:
    def write(slot: Path) -> None:
        torch.save({"w": torch.full((1000,), value), "step": step}, slot / f"rank_{rank}.pt")
        if rank == die_rank:
            os._exit(9)  # killed in the middle of the save, after writing its file

    save_slots(root, guard=_guard(rank), group=dist.group.WORLD, rank=rank, size=WORLD, step=step,
               format="per-rank", meta=META, write=write)


def _load(root: Path, rank: int, step: int, expect=META) -> float:
    m = verify_checkpoint(root, guard=_guard(rank), rank=rank, size=WORLD, step=step, expect=expect)
    state = torch.load(root / m.slot / f"rank_{rank}.pt")
    return float(state["w"][0])


def _worker_commit(rank: int, world: int, root: str) -> None:
    root = Path(root)
    _save(root, rank, 1, 1.0)
    first = read_manifest(root)
    _save(root, rank, 2, 2.0)
    second = read_manifest(root)
    assert {first.slot, second.slot} == {"slot-0", "slot-1"} and second.step == 2
    assert sorted(second.files) == [f"rank_{r}.pt" for r in range(WORLD)]
    assert _load(root, rank, 2) == 2.0
    # another model: every rank raises before reading anything
    with pytest.raises(DomainStepError, match="another model or layout.*model_digest"):
        _load(root, rank, 2, expect={"model_digest": "xyz"})
    dist.barrier(group=dist.group.WORLD)
    # one corrupted file (64 flipped bytes) seen by whichever rank hashes it: every rank raises
    f = root / second.slot / "rank_2.pt"
    good = f.read_bytes()
    if rank == 0:
        data = bytearray(good)
        for i in range(200, 264):
            data[i] ^= 0xFF
        f.write_bytes(bytes(data))
    dist.barrier(group=dist.group.WORLD)
    with pytest.raises(DomainStepError, match=r"rank_2\.pt is corrupted"):
        _load(root, rank, 2)
    dist.barrier(group=dist.group.WORLD)
    if rank == 0:  # truncated
        f.write_bytes(good)
        f = root / second.slot / "rank_1.pt"
        f.write_bytes(f.read_bytes()[:100])
    dist.barrier(group=dist.group.WORLD)
    with pytest.raises(DomainStepError, match=r"rank_1\.pt has 100 bytes"):
        _load(root, rank, 2)
    # a new save over a damaged checkpoint: the free slot is rewritten, the commit repairs it
    _save(root, rank, 3, 3.0)
    assert _load(root, rank, 3) == 3.0


def test_commit_alternates_slots_and_load_verifies_every_file(tmp_path):
    run_distributed(_worker_commit, WORLD, str(tmp_path / "ckpt"), timeout=120)


def _worker_killed(rank: int, world: int, root: str, phase: str) -> None:
    root = Path(root)
    if phase == "first":
        _save(root, rank, 1, 1.0)
    else:
        _save(root, rank, 2, 2.0, die_rank=1)


def _worker_load_previous(rank: int, world: int, root: str) -> float:
    return _load(Path(root), rank, 1)


def test_killed_during_save_keeps_the_previous_checkpoint(tmp_path):
    from hdp.trainer.launch import WorkerError

    root = tmp_path / "ckpt"
    run_distributed(_worker_killed, WORLD, str(root), "first", timeout=120)
    before = read_manifest(root)
    with pytest.raises(WorkerError, match=r"rank 1 \(exit code 9\) died without a report; ranks \[0, 2\] failed after it"):
        run_distributed(_worker_killed, WORLD, str(root), "second", timeout=60)
    after = read_manifest(root)
    assert after == before  # the manifest still names the first save
    other = {"slot-0": "slot-1", "slot-1": "slot-0"}[before.slot]
    assert (root / other).exists()  # the partial slot of the killed save is there, uncommitted
    assert run_distributed(_worker_load_previous, WORLD, str(root), timeout=120) == [1.0] * WORLD


def test_forked_writers_die_with_a_killed_parent(tmp_path):
    pidfile = tmp_path / "child.pid"
    script = textwrap.dedent(f"""
        import os, time
        from hdp.core.checkpoint import writers_die_with_parent
        with writers_die_with_parent():
            pid = os.fork()
            if pid == 0:
                time.sleep(120)
                os._exit(0)
        open({str(pidfile)!r}, "w").write(str(pid))
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.1)
    child = int(pidfile.read_text())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return  # the orphan is gone
        # a zombie re-parented to init is reaped soon; check its state
        try:
            state = Path(f"/proc/{child}/stat").read_text().split()[2]
            if state == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the forked writer outlived its killed parent")


# ---- one writer at a time -------------------------------------------------------------------------------


def _save_while_locked(rank: int, world: int, root: str) -> dict:
    try:
        _save(Path(root), rank, 1, 1.0)
        return {"error": None}
    except (CheckpointError, DomainStepError) as exc:
        return {"error": str(exc)}


def test_a_second_writer_is_refused_and_the_lock_file_removed(tmp_path) -> None:
    """Another job holds the save lock of the path (it is mid-save): every rank of this job raises naming the
    path and the other writer, nothing is written; once the other writer is done, saving works and no lock
    file is left behind."""
    import fcntl

    root = tmp_path / "ckpt"
    root.mkdir()
    lock = root / ".hdp-save.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, b"pid 4242 on other-host", 0)
    try:
        out = run_distributed(_save_while_locked, WORLD, str(root), timeout=240)
    finally:
        os.close(fd)
        lock.unlink()
    for o in out:
        assert o["error"] and "being saved by another writer (pid 4242 on other-host)" in o["error"], o
    assert sorted(p.name for p in root.iterdir()) == [], list(root.iterdir())  # nothing written
    out = run_distributed(_save_while_locked, WORLD, str(root), timeout=240)
    assert all(o["error"] is None for o in out), out
    assert (root / "manifest.json").is_file() and not lock.exists()


def _racing_saver(rank: int, world: int, root: str, job: str, value: float) -> dict:
    """One of two jobs saving per-rank checkpoints to one path at once.  Job A holds its save open (rank 0
    waits inside its write) until job B has tried; job B starts once A is writing."""
    root = Path(root)
    marks = root.parent

    def wait_for(name: str) -> None:
        deadline = time.monotonic() + 120
        while not (marks / name).exists():
            assert time.monotonic() < deadline, f"job {job} rank {rank}: {name} never appeared"
            time.sleep(0.05)

    def write(slot: Path) -> None:
        torch.save({"w": torch.full((1000,), value), "step": 1}, slot / f"rank_{rank}.pt")
        if job == "A" and rank == 0:
            (marks / "A-writing").write_text(f"pid {os.getpid()} on {os.uname().nodename}")
            wait_for("B-done")

    if job == "B":
        wait_for("A-writing")
    try:
        save_slots(root, guard=_guard(rank), group=dist.group.WORLD, rank=rank, size=WORLD, step=1,
                   format="per-rank", meta={**META, "job": job}, write=write)
        out = {"error": None}
    except (CheckpointError, DomainStepError) as exc:
        out = {"error": str(exc)}
    if job == "B":
        dist.barrier(group=dist.group.WORLD)
        if rank == 0:
            (marks / "B-done").write_text("")
    return out


def test_two_jobs_saving_to_one_path_at_once_one_wins_the_other_is_told(tmp_path) -> None:
    """Two real jobs (3 ranks each) save per-rank checkpoints to one path at the same time: exactly one
    succeeds, every rank of the other raises naming the path and the winner's process, and the manifest and
    the files are the winner's; no lock file is left."""
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path / "ckpt"
    with ThreadPoolExecutor(2) as pool:
        jobs = {job: pool.submit(run_distributed, _racing_saver, WORLD, str(root), job, value, timeout=240)
                for job, value in (("A", 1.0), ("B", 2.0))}
        out = {job: f.result() for job, f in jobs.items()}
    winner = (tmp_path / "A-writing").read_text()
    assert [o["error"] for o in out["A"]] == [None] * WORLD, out
    for o in out["B"]:
        assert o["error"] and f"is being saved by another writer ({winner})" in o["error"], out
    manifest = read_manifest(root)
    assert manifest.meta["job"] == "A" and manifest.step == 1
    assert run_distributed(_worker_load_previous, WORLD, str(root), timeout=120) == [1.0] * WORLD
    assert not (root / ".hdp-save.lock").exists()
