"""Definitions more than one test module needs (a test module never imports another), moved out of
test_fused_logprobs.py; used by tests/distributed/hdp/test_fused_logprobs_dist.py,
tests/unit/hdp/test_fused_logprobs.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist

T, H, V = 37, 16, 1000
TOL64 = 1e-12


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    """A one-rank gloo world for the in-process tests (the TP group without tensor parallelism)."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("fused") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
