"""Checkpoint slots + manifest: atomic commit, every file verified on every rank, nothing half-written."""

from __future__ import annotations

import os

import pytest

from hdp.core.checkpoint import CheckpointError, read_manifest


def test_partial_directory_without_manifest_is_named(tmp_path):
    root = tmp_path / "ckpt"
    (root / "slot-0").mkdir(parents=True)
    (root / "slot-0" / "rank_0.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"partial slot\(s\) \['slot-0'\].*interrupted"):
        read_manifest(root)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_manifest(tmp_path / "nothing")


def test_a_waiter_that_locks_the_released_lock_file_retries(tmp_path, monkeypatch) -> None:
    """The flock + unlink race, step by step: B opens the lock file while A holds it; A releases (unlinks,
    closes); C creates and locks a new file under the name; only then does B's flock run, and succeeds on the
    unlinked inode.  B must notice (fstat of its descriptor vs stat of the path), re-open, and be refused
    because C holds the lock; without C, B retries and holds the file at the path."""
    import fcntl

    from hdp.core.checkpoint import _SaveLock

    real_flock = fcntl.flock
    root = tmp_path / "ckpt"
    a, b, c = _SaveLock(root), _SaveLock(root), _SaveLock(root)
    a.acquire()
    steps: list[str] = []

    def flock_after_release(fd: int, op: int) -> None:
        if not steps:  # B's first flock: A releases and C locks in between B's open and its flock
            steps.append("A released, C locked")
            a.release()
            c.acquire()
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_release)
    with pytest.raises(CheckpointError, match=rf"is being saved by another writer \(pid {os.getpid()} on "):
        b.acquire()
    assert steps == ["A released, C locked"] and b.fd is None and c.fd is not None
    c.release()
    # without a third writer: B's first flock lands on the unlinked file, its retry holds the file at the path
    a.acquire()
    steps.clear()

    def flock_after_unlink(fd: int, op: int) -> None:
        if not steps:
            steps.append("A released")
            a.release()
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_unlink)
    b.acquire()
    assert steps == ["A released"] and b.fd is not None
    assert os.fstat(b.fd).st_ino == os.stat(root / ".hdp-save.lock").st_ino
    b.release()
    assert not (root / ".hdp-save.lock").exists()
