"""gather_objects: every rank's object on one rank, equal to what all_gather_object gives there.

One spawn of 4 gloo ranks; the whole world and a sub-group of two (a destination other than group rank
0), objects of different kinds and sizes (a metric dict, None, 200 KB of bytes); compared exactly.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from helpers.dist_helper import run_distributed
from hdp.objects import gather_objects


def _object(rank: int, case: int):
    return [{"actor/pg_loss": 0.5 * rank, "n": [rank] * rank}, None, bytes([rank]) * (200_000 * (rank % 2)),
            ("metrics", [{"a": float(rank)}] * case)][case % 4]


def _worker(rank: int, world: int) -> list[str]:
    checked = []
    pair = dist.new_group([1, 3])
    for case in range(5):
        for dst in range(world):
            got = gather_objects(_object(rank, case), dist.group.WORLD, dst=dst)
            ref: list = [None] * world
            dist.all_gather_object(ref, _object(rank, case), group=dist.group.WORLD)
            if rank == dst:
                assert got == ref, (case, dst, got, ref)
                checked.append(f"world case {case} dst {dst}")
            else:
                assert got is None
        if rank in (1, 3):
            got = gather_objects(_object(rank, case), pair, dst=1)  # group rank 1 = world rank 3
            if rank == 3:
                assert got == [_object(1, case), _object(3, case)], (case, got)
                checked.append(f"pair case {case}")
            else:
                assert got is None
    with pytest.raises(ValueError, match="dst=4"):
        gather_objects(1, dist.group.WORLD, dst=4)
    return checked


def test_gather_objects_equals_all_gather_object():
    out = run_distributed(_worker, 4)
    assert len(out[0]) == 5 and len(out[3]) == 5 + 5  # rank 3 is a destination of the world and of the pair
    assert all(len(o) == 5 for o in out[1:3])
