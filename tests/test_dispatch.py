"""select_local / redistribute / gather_outputs: every token exactly once, caller order restored.

Distributed parts run on 2 and 4 gloo ranks (one spawn each, all cases inside); values are compared
exactly (pure data movement).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dist_helper import run_distributed
from hdp.cp.metadata import rank_layout
from dispatch_reference import local_metas, owners_by_modulo, redistribute, select_local, unpack_into
from hdp.dispatch import gather_outputs, local_meta, pack
from hdp.packing import PlannerConfig, plan as make_plan
from plan_factory import plan_with_k, random_plan


def _plans(num_ranks: int, seed: int):
    rng = np.random.default_rng(seed)
    plans = [random_plan(rng, num_ranks, s, max_k=min(4, num_ranks)) for s in (7, 1, 12)]
    plans.append(random_plan(rng, num_ranks, 5, max_k=min(4, num_ranks), min_len=0, max_len=3))  # tiny/empty samples
    lengths = rng.integers(1, 40, size=10)
    plans.append(make_plan(lengths, PlannerConfig(num_ranks=num_ranks, max_tokens_per_rank=24)))
    return plans


def _batch(plan, seed=0, feat=(2, 3), dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(int(n), *feat, generator=gen, dtype=torch.float64).to(dtype) for n in plan.lengths]


def test_select_local_round_trip():
    for plan in _plans(4, 0) + _plans(3, 1):
        xs = _batch(plan)
        seen = [torch.zeros(int(n), dtype=torch.int64) for n in plan.lengths]
        rebuilt = [torch.full_like(x, float("nan")) for x in xs]
        for rank in range(plan.num_ranks):
            schedule = plan.rank_schedule(rank)
            for r in range(plan.num_rounds):
                batch = select_local(plan, rank, r, xs)
                meta = batch.meta
                assert meta.idle == (schedule[r] is None)
                assert batch.values.shape == (meta.num_tokens, 2, 3)
                assert meta.cu_seqlens.tolist() == rank_layout(meta.group_lengths, meta.k, meta.j).cu_seqlens.tolist()
                assert meta.num_tokens == int(plan.tokens_per_rank()[r, rank])
                # the index map points every local token at its source
                for t in range(meta.num_tokens):
                    s, off = int(meta.sample_index[t]), int(meta.token_offset[t])
                    assert torch.equal(batch.values[t], xs[s][off])
                    seen[s][off] += 1
                unpack_into(meta, batch.values * 3, rebuilt)
        assert all(bool((c == 1).all()) for c in seen), "a token was processed zero or several times"
        for x, y in zip(xs, rebuilt):
            assert torch.equal(x * 3, y)


def test_select_local_bad_input():
    plan = plan_with_k(np.random.default_rng(0), 4, 2, 3)
    xs = _batch(plan)
    with pytest.raises(ValueError, match="len\\(tensors\\)=2"):
        select_local(plan, 0, 0, xs[:2])
    bad = list(xs)
    bad[1] = bad[1][:-1]
    with pytest.raises(ValueError, match="tensors\\[1\\].shape"):
        for rank in range(4):
            select_local(plan, rank, 0, bad)
    with pytest.raises(ValueError, match="round_index=5"):
        local_meta(plan, 0, 5)
    with pytest.raises(ValueError, match="rank=4"):
        local_meta(plan, 4, 0)


def _expect_value_error(fn, *needles):
    try:
        fn()
    except ValueError as exc:
        for needle in needles:
            assert needle in str(exc), f"{needle!r} not in {exc}"
    else:
        raise AssertionError(f"no ValueError (expected one naming {needles})")


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
    _expect_value_error(lambda: redistribute(plan, mine, domain), "redistribute")
    # a wrong number of rounds on one rank raises on every rank
    outs = [select_local(plan, rank, r, xs).values for r in range(plan.num_rounds)]
    if rank == 0:
        outs = outs + outs[:1]
    _expect_value_error(lambda: gather_outputs(plan, rank, outs, domain), "gather_outputs")
    _expect_value_error(lambda: gather_outputs(plan, (rank + 1) % world_size, outs, domain), "rank=")
    # owner lists that differ between ranks raise everywhere instead of mismatching split sizes
    owners = own.copy()
    if rank == 0:
        owners[0] = (owners[0] + 1) % world_size
    mine = {i: xs[i] for i in range(plan.num_samples) if owners[i] == rank}
    _expect_value_error(lambda: redistribute(plan, mine, domain, owners=owners), "different arguments")
    _expect_value_error(lambda: redistribute(plan, {}, None), "domain_group=None")
    dist.barrier(group=domain)


def _worker(rank, world_size, seed):
    # a 4-rank domain, then two 2-rank domains {0, 1} and {2, 3} running side by side: every
    # collective must name its domain group (a group=None would mix the two domains and hang)
    _cases(dist.new_group(list(range(world_size))), seed)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    _cases(pairs[rank // 2], seed + rank // 2)


@pytest.mark.dist
def test_redistribute_and_gather():
    run_distributed(_worker, 4, 11, timeout=120)


def test_group_rows_are_the_metas_rows():
    """The whole-sample exchange's row layout (`_flat_rows`, from the group's lengths alone) is where each
    member's local tokens sit in its group's samples laid one after another, as its `local_meta` says
    (sample and position of every token), for every member of every group, empty samples included."""
    from hdp.dispatch import _flat_rows

    for num_ranks in (2, 4):
        for plan in _plans(num_ranks, seed=3):
            for r in range(plan.num_ranks):
                for meta in local_metas(plan, r):
                    if not meta.samples:
                        continue
                    lengths = torch.tensor(meta.group_lengths, dtype=torch.int64)
                    first = dict(zip(meta.samples, (torch.cumsum(lengths, 0) - lengths).tolist()))
                    want = torch.tensor([first[int(i)] for i in meta.sample_index], dtype=torch.int64) + meta.position_ids
                    got = _flat_rows(meta.group_lengths, meta.k, meta.j)
                    assert torch.equal(got, want), (num_ranks, r, meta.round_index)
