"""The distributed tier (other processes) of the tests tests/unit/hdp/test_dispatch.py describes: its docstring says what they check and how."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from helpers.dist_helper import expect_value_error, run_distributed
from helpers.dispatch_reference import owners_by_modulo, redistribute, select_local
from hdp.dispatch import gather_outputs, pack

from helpers.dispatch import _batch, _plans


def _cases(domain, seed):
    """All redistribute / gather_outputs cases on one domain group (rank = domain rank)."""
    rank, world_size = dist.get_rank(domain), dist.get_world_size(domain)
    for idx, plan in enumerate(_plans(world_size, seed)):
        xs = _batch(plan, idx)
        ids = [torch.arange(int(n), dtype=torch.int64) * 10 + i for i, n in enumerate(plan.lengths)]
        expect = [select_local(plan, rank, r, xs) for r in range(plan.num_rounds)]
        owner_lists = [None, np.random.default_rng(idx).integers(0, world_size, size=plan.num_samples)]
        for owners in owner_lists:
            own = owners_by_modulo(plan.num_samples, world_size) if owners is None else owners
            mine = {i: xs[i] for i in range(plan.num_samples) if own[i] == rank}
            got = redistribute(plan, mine, domain, owners=owners, like=xs[0])
            assert len(got) == plan.num_rounds
            for g, e in zip(got, expect):
                assert torch.equal(g.values, e.values) and g.meta.position_ids.tolist() == e.meta.position_ids.tolist()
            # an integer field with no trailing dims; ranks owning nothing learn dtype/shape from the header
            got_ids = redistribute(plan, {i: ids[i] for i in mine}, domain, owners=owners)
            for r, g in enumerate(got_ids):
                assert torch.equal(g.values, select_local(plan, rank, r, ids).values)

        # outputs (a per-token function of the inputs) come back in caller order on every rank
        local_out = [(e.values * 2 + 1).sum(-1) for e in expect]  # [T, 2]
        full = gather_outputs(plan, rank, local_out, domain, dst="all")
        assert len(full) == plan.num_samples
        for x, y in zip(xs, full):
            assert torch.equal((x * 2 + 1).sum(-1), y)
        only = gather_outputs(plan, rank, local_out, domain, dst=1)
        assert (only is None) == (rank != 1)
        if only is not None:
            assert all(torch.equal(a, b) for a, b in zip(only, full))

    # a bad shard on one rank raises on every rank (no hang)
    plan = _plans(world_size, seed)[0]
    xs = _batch(plan)
    own = owners_by_modulo(plan.num_samples, world_size)
    mine = {i: xs[i] for i in range(plan.num_samples) if own[i] == rank}
    if rank == world_size - 1 and mine:
        key = next(iter(mine))
        mine[key] = mine[key][:, :1]
    expect_value_error(lambda: redistribute(plan, mine, domain), "redistribute")
    # a wrong number of rounds on one rank raises on every rank
    outs = [select_local(plan, rank, r, xs).values for r in range(plan.num_rounds)]
    if rank == 0:
        outs = outs + outs[:1]
    expect_value_error(lambda: gather_outputs(plan, rank, outs, domain), "gather_outputs")
    expect_value_error(lambda: gather_outputs(plan, (rank + 1) % world_size, outs, domain), "rank=")
    # owner lists that differ between ranks raise everywhere instead of mismatching split sizes
    owners = own.copy()
    if rank == 0:
        owners[0] = (owners[0] + 1) % world_size
    mine = {i: xs[i] for i in range(plan.num_samples) if owners[i] == rank}
    expect_value_error(lambda: redistribute(plan, mine, domain, owners=owners), "different arguments")
    expect_value_error(lambda: redistribute(plan, {}, None), "domain_group=None")
    dist.barrier(group=domain)


def _worker(rank, world_size, seed):
    # a 4-rank domain, then two 2-rank domains {0, 1} and {2, 3} running side by side: every
    # collective must name its domain group (a group=None would mix the two domains and hang)
    _cases(dist.new_group(list(range(world_size))), seed)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    _cases(pairs[rank // 2], seed + rank // 2)


def test_redistribute_and_gather():
    run_distributed(_worker, 4, 11, timeout=120)
