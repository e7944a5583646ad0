"""The local launcher: tensors come back from spawned ranks, and its workers are quiet."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hdp.trainer.launch import WorkerError, spawn


def _tensors(rank: int, world: int) -> dict:
    import warnings

    import hdp.trainer.engine  # noqa: F401  (imports megatron-core: its fallback warnings are silenced)

    if rank == 0:
        warnings.warn("a warning of the user", UserWarning)  # other warnings still show
    x = torch.full((3,), float(rank))
    dist.all_reduce(x, group=dist.group.WORLD)
    return {"rank": rank, "sum": x, "big": torch.arange(100_000, dtype=torch.float32) + rank}


def _unpicklable(rank: int, world: int):
    return lambda: rank


def test_spawn_returns_torch_tensors_by_value_and_its_workers_are_quiet(capfd) -> None:
    out = spawn(_tensors, 2, timeout=120)
    assert [o["rank"] for o in out] == [0, 1]
    for o in out:
        assert torch.equal(o["sum"], torch.full((3,), 1.0))
        assert o["big"][0] == o["rank"] and o["big"].shape == (100_000,)
    err = capfd.readouterr().err  # the workers write to this process's stderr
    assert "Apex" not in err and "Transformer Engine" not in err, err
    assert "a warning of the user" in err, err


def test_spawn_names_an_unpicklable_result() -> None:
    with pytest.raises(WorkerError, match="cannot be pickled"):
        spawn(_unpicklable, 1, timeout=60)


def _environment(rank: int, world: int, tag: str) -> dict:
    import os
    import sys

    print(f"rank {rank} says {tag}", flush=True)  # to the caller's stdout, not the fork server's
    print(f"rank {rank} warns {tag}", file=sys.stderr, flush=True)
    return {"env": os.environ.get("HDP_LAUNCH_TEST"), "pid": os.getpid(),
            "engine_loaded": "hdp.trainer.engine" in sys.modules}


def test_workers_take_the_callers_environment_and_output_at_each_launch(capfd, monkeypatch) -> None:
    # the fork server is started by the first launch of this process: later launches must still see
    # the environment and the standard output / error of their own caller, as fresh processes would
    monkeypatch.setenv("HDP_LAUNCH_TEST", "first")
    first = spawn(_environment, 2, "first", timeout=120)
    capfd.readouterr()
    monkeypatch.setenv("HDP_LAUNCH_TEST", "second")
    second = spawn(_environment, 2, "second", timeout=120)
    out = capfd.readouterr()
    assert [r["env"] for r in first] == ["first", "first"] and [r["env"] for r in second] == ["second", "second"]
    assert "rank 0 says second" in out.out and "rank 1 says second" in out.out, out
    assert "rank 1 warns second" in out.err and "first" not in out.out + out.err, out
    assert len({r["pid"] for r in first + second}) == 4  # a process per rank and launch
    import multiprocessing as mp

    if "forkserver" in mp.get_all_start_methods():  # the workers came with Megatron already imported
        assert all(r["engine_loaded"] for r in first + second)
