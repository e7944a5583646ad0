"""The distributed tier (other processes) of the tests tests/unit/hdp/test_checksum.py describes: its docstring says what they check and how."""

from __future__ import annotations

import torch.distributed as dist

from helpers.dist_helper import run_distributed
from helpers.dispatch_reference import verify_plan

from helpers.checksum import LENGTHS, _plan, _raises_naming


def _worker(rank, world_size):
    domain = dist.new_group(list(range(world_size)))
    verify_plan(_plan(LENGTHS), domain)  # identical plans pass
    # rank 2 sees a different batch: every rank raises, naming rank 2
    lengths = list(LENGTHS)
    if rank == 2:
        lengths[0] += 1
    _raises_naming(lambda: verify_plan(_plan(lengths), domain), "group ranks [2]", "plan mismatch", "same")
    # two ranks differ in different ways
    lengths = list(LENGTHS) + ([5] if rank == 0 else [6] if rank == 3 else [])
    _raises_naming(lambda: verify_plan(_plan(lengths), domain), "group ranks [0, 3]")
    # a plan for the wrong domain size fails on every rank too
    _raises_naming(lambda: verify_plan(_plan(LENGTHS, num_ranks=2), domain), "plan.num_ranks=2", "4 ranks")
    verify_plan(_plan(LENGTHS), domain)  # the group is still usable afterwards
    dist.barrier(group=domain)


def test_verify_plan_mismatch_raises_everywhere():
    run_distributed(_worker, 4, timeout=60)
