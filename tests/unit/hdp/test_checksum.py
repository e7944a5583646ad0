"""verify_plan raises the same clear ValueError on every rank when one rank's plan differs (no hang)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hdp.checksum import check_cu_seqlens, check_plan_domain, plan_digest
from hdp.packing.plan import Plan

from helpers.checksum import LENGTHS, _plan, _raises_naming


def test_digest_is_signed_int64():
    d = plan_digest(_plan(LENGTHS))
    assert -(1 << 63) <= d < (1 << 63)
    assert d == plan_digest(_plan(LENGTHS)) and d != plan_digest(_plan(LENGTHS[:-1]))


def test_check_cu_seqlens():
    check_cu_seqlens(torch.tensor([0, 3, 3, 7], dtype=torch.int32), 7, lengths=[3, 0, 4])
    _raises_naming(lambda: check_cu_seqlens([1, 3], 3), "cu_seqlens=[1, 3]", "start with 0")
    _raises_naming(lambda: check_cu_seqlens([0, 3, 2], 2), "non-decreasing")
    _raises_naming(lambda: check_cu_seqlens([0, 3, 7], 8, field="meta.cu_seqlens"), "meta.cu_seqlens", "8 tokens")
    _raises_naming(lambda: check_cu_seqlens([0, 3, 7], 7, lengths=[4, 3]), "[3, 4]", "[4, 3]")


def test_check_plan_domain():
    plan = _plan(LENGTHS)
    check_plan_domain(plan, 4)
    _raises_naming(lambda: check_plan_domain(plan, 8), "plan.num_ranks=4", "8 ranks")
    bad = Plan.from_columns(
        num_ranks=4, max_tokens_per_rank=16, policy="x", lengths=np.array([4, 5]),
        round_of=np.array([0, 0]), group_start=np.array([0, 3]), group_size=np.array([1, 2]),
    )
    _raises_naming(lambda: check_plan_domain(bad, 4), "plan.group_start[1]=3", "plan.group_size[1]=2", "[0, 4)")


def test_check_plan_budget_names_round_rank_and_samples():
    p = _plan(LENGTHS)
    from hdp.checksum import check_plan_budget

    check_plan_budget(p)  # a planner-made plan respects its budget
    # the same assignment declared with a smaller budget: a sample longer than its group's budget
    tight = Plan.from_columns(
        num_ranks=p.num_ranks, max_tokens_per_rank=8, policy=p.policy, lengths=p.lengths,
        round_of=p.round_of, group_start=p.group_start, group_size=p.group_size,
        num_rounds=p.num_rounds,
    )
    with pytest.raises(ValueError, match=r"plan round \d+: rank \d+ holds \d+ tokens > max_tokens_per_rank=8"):
        check_plan_budget(tight)
