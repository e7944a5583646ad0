"""The distributed tier (other processes) of the tests tests/unit/trainer/test_cli_bounds.py describes: its docstring says what they check and how."""

from __future__ import annotations

import gzip
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hdp.packing.workloads import MAX_LENGTHS_BYTES, MAX_SAMPLES

from helpers.cli_bounds import LAYOUTS


_ROOT = Path(__file__).resolve().parents[2].parent
_CI_BENCHES = ("exact", "moe", "attention")
"""Benches of this project's CI, outside the wheel: ``python -m benchmarks NAME`` from the checkout's root."""


def _hdp(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    if args[:1] == ("bench",) and args[1:2] and args[1] in _CI_BENCHES:
        cmd = [sys.executable, "-m", "benchmarks", *args[1:]]
    else:
        cmd = [sys.executable, "-m", "hdp.trainer", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=_ROOT)


def _refused(out: subprocess.CompletedProcess, *needles: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr  # one line, no traceback
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------------------------ --lengths caps

_PLAN = ["plan", "-N", "8", "-B", "8192", "--json"]


def test_lengths_file_past_the_sample_cap_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "many.txt"
    path.write_bytes(b"7\n" * (MAX_SAMPLES + 1))
    t0 = time.perf_counter()
    _refused(_hdp(*_PLAN, "--lengths", str(path)), "--lengths", f"more than {MAX_SAMPLES:,} lengths",
             f"line {MAX_SAMPLES + 1}")
    assert time.perf_counter() - t0 < 120  # read up to the cap, never planned
    path.write_bytes(b"7\n" * 1000)  # under the cap: planned
    out = _hdp(*_PLAN, "--lengths", str(path))
    assert out.returncode == 0, out.stderr[-2000:]


def test_lengths_file_past_the_byte_cap_is_refused_before_reading_or_while_unpacking(tmp_path: Path) -> None:
    sparse = tmp_path / "huge.txt"  # a hole, no disk: refused from its size alone
    with sparse.open("wb") as fh:
        fh.truncate(MAX_LENGTHS_BYTES + 1)
    _refused(_hdp(*_PLAN, "--lengths", str(sparse)), "--lengths", f"{MAX_LENGTHS_BYTES:,} bytes")
    bomb = tmp_path / "bomb.txt.gz"  # 40 KB that unpack to 320 MiB of a few long lines
    line = b"1" + b" " * ((1 << 20) - 2) + b"\n"
    with gzip.open(bomb, "wb", compresslevel=9) as fh:
        for _ in range(320):
            fh.write(line)
    assert bomb.stat().st_size < 1 << 20
    t0 = time.perf_counter()
    _refused(_hdp(*_PLAN, "--lengths", str(bomb)), "--lengths", "unpacks to more than", f"{MAX_LENGTHS_BYTES:,} bytes")
    assert time.perf_counter() - t0 < 120


@pytest.mark.parametrize("shape,layout,needles", LAYOUTS, ids=[f"{s}:{lay}" for s, lay, _ in LAYOUTS])
def test_an_impossible_layout_is_refused_by_plan_and_simulate(shape: str, layout: str, needles: tuple) -> None:
    common = ["--workload", "rl", "--samples", "32", "-N", "16", "-B", "4096", "--shape", shape, "--layout", layout]
    _refused(_hdp("plan", *common), f"--layout={layout!r}", *needles)
    _refused(_hdp("simulate", *common, "--no-peers", "--policies", "hdp"), f"--layout={layout!r}", *needles)


# ------------------------------------------------------------------------------------------ counts

@pytest.mark.parametrize("argv,needles", [
    (["bench", "exact", "--instances", "0"], ("argument --instances: 0 is out of range", ">= 1")),
    (["bench", "planner", "--repeats", "0"], ("argument --repeats: 0 is out of range",)),
    (["bench", "planner", "--large-repeats", "-1"], ("argument --large-repeats: -1 is out of range",)),
    (["plan", "--workload", "rl", "-N", "8", "-B", "8192", "--seed", "-1"], ("argument --seed: -1", "[0, 4294967295]")),
    (["plan", "--workload", "rl", "-N", "8", "-B", "8192", "--static-cp", "0"], ("argument --static-cp: 0",)),
    (["simulate", "--workload", "rl", "-N", "8", "-B", "8192", "--pp", "0"], ("argument --pp: 0",)),
    (["demo", "--verl", "--ranks", "0"], ("argument --ranks: 0 is out of range",)),
    (["demo", "--verl", "--steps", "-1"], ("argument --steps: -1 is out of range",)),
    (["demo", "--steps", "1"], ("steps=1", "--steps")),
    (["demo", "--ranks", "100000"], ("--ranks=100000", "local ranks")),
    (["bench", "moe", "--ep", "0"], ("argument --ep: 0",)),
    (["bench", "moe", "--experts", "sequential,grouped"], ("--experts='sequential,grouped'", "sequential, te_grouped")),
    (["bench", "attention", "--tokens", "0"], ("argument --tokens: 0",)),
    (["bench", "train", "--tp", "0"], ("argument --tp: 0",)),
])
def test_a_count_of_zero_or_below_names_its_flag_before_anything_starts(argv: list, needles: tuple) -> None:
    t0 = time.perf_counter()
    _refused(_hdp(*argv), *needles)
    assert time.perf_counter() - t0 < 60  # refused, not run
