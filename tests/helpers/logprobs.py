"""Definitions more than one test module needs (a test module never imports another), moved out of test_logprobs.py;
used by tests/distributed/hdp/test_logprobs_dist.py, tests/unit/hdp/test_logprobs.py,
tests/unit/hdp/test_fused_logprobs.py (`BigOutputs`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

T, V = 37, 1000


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    """A one-rank gloo world for this module's in-process tests (the TP group without tensor parallelism)."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("logprobs") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class BigOutputs(TorchDispatchMode):
    """Op outputs of at least ``limit`` elements in new storage (views and detaches share theirs): ``big`` lists
    each as ``op(shape)``."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.big: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = [a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        seen = {a.untyped_storage().data_ptr() for a in flat}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.limit and t.untyped_storage().data_ptr() not in seen:
                self.big.append(f"{func}{tuple(t.shape)}")
        return out
