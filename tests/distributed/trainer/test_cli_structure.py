"""The shape of the ``hdp`` command: one sub-parser per bench with only its own flags, one meaning per flag.
Run as users run it: ``python -m hdp.trainer ...`` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _hdp(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hdp.trainer", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("argv,flag,owner", [
    (["bench", "planner", "--baseline", "b.json"], "--baseline", "hdp bench train, hdp bench regress"),
    (["bench", "memory", "--large-repeats", "1"], "--large-repeats", "hdp bench planner"),
    (["bench", "device", "--lengths", "x.txt"], "--lengths", "hdp plan, hdp simulate, hdp bench train, hdp bench regress"),
    (["bench", "train", "--dry-run"], "--dry-run", "hdp bench device"),
])
def test_a_flag_of_another_bench_is_an_error_naming_it(argv, flag, owner):
    out = _hdp(*argv)
    assert out.returncode == 2, out
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: hdp bench {argv[1]}: unrecognized arguments: {flag}"), out.stderr
    assert f"{flag} is a flag of {owner}" in err[0], err
    assert out.stdout == ""


def test_each_bench_lists_only_its_own_flags():
    for bench, own, foreign in (("train", "--lengths", "--dry-run"), ("device", "--dry-run", "--lengths"),
                                ("planner", "--repeats", "--timeout"), ("regress", "--preset", "--families")):
        out = _hdp("bench", bench, "--help")
        assert out.returncode == 0, out.stderr
        assert own in out.stdout and foreign not in out.stdout, (bench, out.stdout)


def test_model_is_the_cost_preset_and_shape_the_memory_model():
    """--model picks the cost preset only; --shape the memory model's shape (and the preset's default)."""
    base = ["plan", "--workload", "rl", "--samples", "64", "-N", "16", "-B", "4096", "--layout", "tp1,pp8,ep16", "--json"]
    runs = {}
    for name, extra in (("shape", ["--shape", "qwen3-235b-a22b"]),
                        ("shape+preset", ["--shape", "qwen3-235b-a22b", "--model", "qwen3-235b-a22b"]),
                        ("shape+other", ["--shape", "qwen3-235b-a22b", "--model", "deepseek-v3"])):
        out = _hdp(*base, *extra)
        assert out.returncode == 0, out.stderr
        runs[name] = json.loads(out.stdout)
    assert runs["shape"]["whatif"]["model"] == runs["shape+other"]["whatif"]["model"] == "qwen3-235b-a22b"
    assert runs["shape"]["stats"]["step_time"] == runs["shape+preset"]["stats"]["step_time"]
    assert runs["shape"]["stats"]["step_time"] != runs["shape+other"]["stats"]["step_time"]  # another cost preset
    # the memory options need --shape; --model alone is no memory model
    out = _hdp(*base, "--model", "qwen3-235b-a22b")
    assert out.returncode == 2 and "need --shape NAME" in out.stderr, out.stderr
    # --model with --cost-model is always a conflict (it never means the shape)
    out = _hdp(*base, "--shape", "qwen3-235b-a22b", "--model", "qwen3-235b-a22b", "--cost-model", "deepseek-v3@h100-nvlink")
    assert out.returncode == 2 and "--cost-model and --model are mutually exclusive" in out.stderr, out.stderr


def test_simulate_has_one_zero_memory_flag():
    base = ["simulate", "--workload", "rl-32k", "--samples", "64", "-N", "16", "-B", "4096", "--policies", "static-cp",
            "--no-peers", "--json"]
    out = _hdp(*base, "--moe-zero-memory", "level0")
    assert out.returncode == 2 and "unrecognized arguments: --moe-zero-memory" in out.stderr, out.stderr
    out = _hdp(*base, "--zero-memory", "level0")
    assert out.returncode == 0, out.stderr
    cases = {c["policy"]: c for c in json.loads(out.stdout)["cases"]}
    assert cases["static-cp+level0"]["max_tokens_per_rank"] > cases["static-cp"]["max_tokens_per_rank"]
