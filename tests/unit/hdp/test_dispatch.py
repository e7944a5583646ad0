"""select_local / redistribute / gather_outputs: every token exactly once, caller order restored.

Distributed parts run on 2 and 4 gloo ranks (one spawn each, all cases inside); values are compared
exactly (pure data movement).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hdp.cp.metadata import rank_layout
from helpers.dispatch_reference import local_metas, select_local, unpack_into
from hdp.dispatch import local_meta, pack
from helpers.plan_factory import plan_with_k

from helpers.dispatch import _batch, _plans


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
