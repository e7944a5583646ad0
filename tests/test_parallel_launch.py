"""The local launcher: tensors come back from spawned ranks, and its workers are quiet."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hdp.trainer.launch import WorkerError, spawn

pytestmark = pytest.mark.dist


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
