"""The distributed tier (other processes) of the tests tests/unit/hdp/test_groups.py describes: its docstring says what they check and how."""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.dist_helper import expect_value_error, run_distributed
from hdp.cp import CPAlgorithm, cp_attention
from hdp.groups import DomainGroups


def _groups_worker(rank, world_size):
    groups = DomainGroups.build(dist.group.WORLD)
    assert groups.size == world_size == 4 and groups.domain_rank == rank
    assert groups.global_ranks == (0, 1, 2, 3)
    pair = (rank // 2) * 2
    assert set(groups.blocks) == {(0, 4), (pair, 2)}
    assert groups.block_group(0, 4) is dist.group.WORLD  # the full domain is the domain group

    # a collective over the cached pair block: sum of the pair's ranks
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=groups.block_group(pair, 2))
    assert t.item() == pair + pair + 1, t

    # errors name the block / range
    expect_value_error(lambda: groups.block_group(0, 3), "(start=0, size=3)", "not built", "power-of-two")
    expect_value_error(lambda: groups.block_group(1, 2), "(start=1, size=2)", "aligned")
    expect_value_error(lambda: groups.block_group(2 - pair, 2), f"(start={2 - pair}, size=2)", "not a member")
    expect_value_error(lambda: groups.block_group(0, 8), "(start=0, size=8)", "outside the domain")
    expect_value_error(lambda: groups.block_group(rank, 1), f"(start={rank}, size=1)")
    expect_value_error(lambda: groups.ring(2, 3), "(start=2, size=3)", "outside the domain")
    expect_value_error(lambda: groups.ring(-1, 2), "(start=-1, size=2)")

    # rings over any contiguous range: 0..2 is a ring of three, 3 alone
    if rank < 3:
        ring = groups.ring(0, 3)
        assert ring.ranks == (0, 1, 2) and ring.position == rank and ring.group is dist.group.WORLD
        assert ring.next_rank == (rank + 1) % 3 and ring.prev_rank == (rank - 1) % 3
        send = torch.tensor([float(rank)])
        recv = torch.empty(1)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send, ring.next_rank, ring.group),
                dist.P2POp(dist.irecv, recv, ring.prev_rank, ring.group),
            ]
        )
        for w in works:
            w.wait()
        assert recv.item() == ring.prev_rank
        # all-gather CP needs a cached block: a range of three raises, naming it, before communicating
        q = torch.randn(4, 2, 8)
        kv = torch.randn(4, 1, 8)
        expect_value_error(
            lambda: cp_attention(q, kv, kv, [12], 3, ring=ring, groups=groups, algo=CPAlgorithm.ALLGATHER),
            "(start=0, size=3)",
        )
    else:
        ring = groups.ring(3, 1)
        assert ring.size == 1 and ring.prev_rank == ring.next_rank == 3
        expect_value_error(lambda: groups.ring(0, 3), "(start=0, size=3)", "does not contain domain rank 3")
    dist.barrier(group=dist.group.WORLD)


def test_domain_groups_on_four_ranks():
    run_distributed(_groups_worker, 4, timeout=90)


def _copy_worker(rank, world_size):
    import datetime

    from hdp.groups import copy_of_group

    # two domains of another library's groups, {0, 2} and {1, 3} (as Megatron's data-parallel groups under TP 2)
    theirs = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    job = dist.new_group([0, 1, 2, 3], timeout=datetime.timedelta(seconds=30))
    ours = copy_of_group(theirs, job, timeout_s=30.0)
    assert ours is not theirs
    assert dist.get_process_group_ranks(ours) == dist.get_process_group_ranks(theirs) == [rank % 2, rank % 2 + 2]
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=ours)
    assert t.item() == 2 * (rank % 2) + 2, t  # the pair's ranks
    # freeing the copy leaves the original working
    dist.destroy_process_group(ours)
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=theirs)
    assert t.item() == 2.0, t
    dist.barrier(group=job)


def test_copy_of_group_has_the_ranks_and_frees_alone():
    run_distributed(_copy_worker, 4, timeout=90)
