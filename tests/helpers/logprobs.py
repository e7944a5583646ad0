"""Definitions more than one test module needs (a test module never imports another), moved out of test_logprobs.py;
used by tests/distributed/hdp/test_logprobs_dist.py, tests/unit/hdp/test_logprobs.py."""

from __future__ import annotations

import pytest

import torch.distributed as dist

T, V = 37, 1000


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    """A one-rank gloo world for this module's in-process tests (the TP group without tensor parallelism)."""
    store = dist.FileStore(str(tmp_path_factory.mktemp("logprobs") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()
