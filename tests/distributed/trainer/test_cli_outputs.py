"""Every file the ``hdp`` command writes: refused with exit 2 and one line naming the flag, the path and the
fix unless it is a regular file or a new name in a folder this user can write — checked before the work,
written atomically, never replacing a device, FIFO or socket.  Run as users run it, in a subprocess."""

from __future__ import annotations

import json
import os
import random
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _hdp(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hdp.trainer", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def records(tmp_path: Path) -> Path:
    from hdp.packing import cost_model
    from hdp.packing.calibrate import group_seconds

    machine = cost_model("cpu-tiny", "cpu-gloo")
    rng = random.Random(0)
    rows = []
    for _ in range(60):
        k = rng.choice([1, 2, 4])
        lengths = [rng.randint(200, 8000) for _ in range(rng.randint(1, 3))]
        rows.append({"kind": "group", "lengths": lengths, "group_size": k, "seconds": group_seconds(machine, lengths, k)})
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _refused(out: subprocess.CompletedProcess, flag: str, path: str, *needles: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr  # one line, no traceback
    assert f"{flag}={path!r}" in lines[0], lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_calibrate_out_never_replaces_a_fifo_or_a_device(records: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    _refused(_hdp("calibrate", "--records", str(records), "--out", str(fifo)), "--out", str(fifo),
             "is a FIFO", "never replaced", "name a regular file")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    # a character device: one made here first (so that a regression replaces only this node), then /dev/null
    devices = []
    if hasattr(os, "mknod") and os.geteuid() == 0:
        node = tmp_path / "null-copy"
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        devices.append(str(node))
    devices.append("/dev/null")
    for dev in devices:
        before = os.stat(dev)
        _refused(_hdp("calibrate", "--records", str(records), "--out", dev), "--out", dev, "is a character device")
        after = os.stat(dev)
        assert stat.S_ISCHR(after.st_mode) and (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev), dev
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["fifo", "records.jsonl"] + (
        ["null-copy"] if len(devices) == 2 else [])), "no temporary file left behind"


def test_calibrate_out_refuses_a_socket_a_directory_and_pseudo_files(records: Path, tmp_path: Path) -> None:
    sock_path = tmp_path / "s.sock"
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(sock_path))
        _refused(_hdp("calibrate", "--records", str(records), "--out", str(sock_path)), "--out", str(sock_path),
                 "is a socket")
        assert stat.S_ISSOCK(os.stat(sock_path).st_mode)
    finally:
        sock.close()
    _refused(_hdp("calibrate", "--records", str(records), "--out", str(tmp_path)), "--out", str(tmp_path),
             "is a directory")
    for pseudo in ("/sys/x", "/proc/x"):
        if not os.path.isdir(os.path.dirname(pseudo)):
            continue
        _refused(_hdp("calibrate", "--records", str(records), "--out", pseudo), "--out", pseudo, "filesystem")
        assert not os.path.exists(pseudo)
    missing = tmp_path / "no" / "cost.json"
    _refused(_hdp("calibrate", "--records", str(records), "--out", str(missing)), "--out", str(missing),
             "does not exist")


def test_calibrate_out_replaces_a_regular_file_atomically_through_a_link(records: Path, tmp_path: Path) -> None:
    target = tmp_path / "cost.json"
    target.write_text("old")
    os.chmod(target, 0o640)
    link = tmp_path / "latest.json"
    link.symlink_to(target.name)
    out = _hdp("calibrate", "--records", str(records), "--out", str(link))
    assert out.returncode == 0, out.stderr[-3000:]
    assert link.is_symlink() and json.loads(target.read_text())["format"] == "hdp-cost-model"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640  # the file's mode is kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cost.json", "latest.json", "records.jsonl"]


def test_every_output_flag_is_checked_before_the_work(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    plan = ["plan", "--workload", "rl", "--samples", "64", "-N", "8", "-B", "8192"]
    _refused(_hdp(*plan, "--plot", str(fifo)), "--plot", str(fifo), "is a FIFO")
    _refused(_hdp(*plan, "--plot", "/dev/null"), "--plot", "/dev/null", "is a character device")
    _refused(_hdp("simulate", *plan[1:], "--no-peers", "--plot-dir", "/proc/x"), "--plot-dir", "/proc/x", "filesystem")
    _refused(_hdp("simulate", *plan[1:], "--no-peers", "--plot-dir", str(fifo)), "--plot-dir", str(fifo), "is a FIFO")
    _refused(_hdp("bench", "train", "--output", str(fifo)), "--output", str(fifo), "is a FIFO")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    t0 = time.perf_counter()
    _refused(_hdp("demo", "--out", "/proc/x"), "--out", "/proc/x", "filesystem")  # at once, not after the demo
    _refused(_hdp("demo", "--verl", "--out", "/proc/x"), "--out", "/proc/x", "filesystem")
    assert time.perf_counter() - t0 < 60


def test_plot_reports_the_file_it_wrote(tmp_path: Path) -> None:
    out = _hdp("plan", "--workload", "rl", "--samples", "64", "-N", "8", "-B", "8192", "--plot", str(tmp_path / "noext"))
    assert out.returncode == 0, out.stderr[-3000:]
    written = tmp_path / "noext.png"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["noext.png"]
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"Gantt chart: {written}" in out.stdout.replace("\n", ""), out.stdout[-500:]
    _refused(_hdp("plan", "--workload", "rl", "--samples", "64", "-N", "8", "-B", "8192", "--plot",
                  str(tmp_path / "a.txt")), "--plot", str(tmp_path / "a.txt"), ".txt is not one of .png")
