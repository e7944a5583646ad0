"""The exact branch-and-bound optimum on tiny instances."""

from __future__ import annotations

import numpy as np
import pytest

from hdp.packing import CostModel, Plan, PlannerConfig, check_plan, cost_model, plan, simulate
from hdp.packing.exact import exact_optimum, exact_search

COST = cost_model("deepseek-v3", "ascend-910b-hccs")


def _plan(lengths, cfg, a):
    return Plan.from_columns(
        num_ranks=cfg.num_ranks, max_tokens_per_rank=cfg.max_tokens_per_rank, policy="exact",
        lengths=np.asarray(lengths), round_of=a.round_of, group_start=a.group_start,
        group_size=a.group_size,
    )


def test_two_equal_samples_two_ranks_one_round():
    cfg = PlannerConfig(num_ranks=2, max_tokens_per_rank=4096, cost=COST)
    T, a = exact_optimum(np.array([3000, 3000]), cfg)
    assert a.round_of.tolist() == [0, 0]
    assert a.group_size.tolist() == [1, 1]
    assert sorted(a.group_start.tolist()) == [0, 1]
    assert T == pytest.approx(COST.work(3000.0) + COST.round_cost)


def test_budget_forces_cp_or_rounds():
    # one sample needs 2 ranks; with a round cost, the other two share the second round
    cfg = PlannerConfig(num_ranks=2, max_tokens_per_rank=1000, cost=CostModel(round_cost=1e9))
    T, a = exact_optimum(np.array([1500, 900, 800]), cfg)
    p = _plan([1500, 900, 800], cfg, a)
    check_plan(p)
    assert p.num_rounds == 2
    assert a.group_size[0] == 2
    assert T == pytest.approx(simulate(p, cfg.cost).step_time)


def test_round_cost_prefers_fewer_rounds():
    # beta huge: 4 short samples on 2 ranks must run in one round (2 per rank)
    cfg = PlannerConfig(num_ranks=2, max_tokens_per_rank=1000, cost=CostModel(round_cost=1e12))
    T, a = exact_optimum(np.array([400, 400, 300, 300]), cfg)
    assert set(a.round_of.tolist()) == {0}
    assert T == pytest.approx(1e12 + CostModel().work(400.0) + CostModel().work(300.0))


def test_max_rounds_infeasible():
    cfg = PlannerConfig(num_ranks=1, max_tokens_per_rank=100, cost=CostModel())
    with pytest.raises(ValueError, match="max_rounds"):
        exact_optimum(np.array([80, 80]), cfg, max_rounds=1)


@pytest.mark.parametrize("shape", ["any", "pow2"])
def test_exact_beats_every_baseline(shape):
    rng = np.random.default_rng(7)
    costs = [COST, CostModel(step_overhead=2e5, comm_per_token=50.0, round_cost=5e6)]
    for trial in range(20):
        n = int(rng.integers(1, 8))
        N = int(rng.choice([2, 3, 4, 6, 8]))
        B = int(rng.choice([1024, 2048, 4096]))
        cap = N * B - N if shape == "any" else (1 << (N.bit_length() - 1)) * B - N
        lengths = rng.integers(1, cap, n)
        cfg = PlannerConfig(
            num_ranks=N, max_tokens_per_rank=B, cost=costs[trial % 2], group_shape=shape
        )
        res = exact_search(lengths, cfg, time_limit_s=5.0)
        assert res.optimal
        p = _plan(lengths, cfg, res.assignment)
        check_plan(p, pow2=shape == "pow2")
        assert res.step_time == pytest.approx(simulate(p, cfg.cost).step_time, rel=1e-9)
        for policy in ("static-cp", "megatron-dcp", "ascend-hdp", "verl-kk"):
            base = plan(lengths, PlannerConfig(
                num_ranks=N, max_tokens_per_rank=B, cost=cfg.cost, policy=policy,
                group_shape=shape,
            ))
            valid_shape = shape == "any" or (
                np.all((base.group_size & (base.group_size - 1)) == 0)
                and np.all(base.group_start % base.group_size == 0)
            )
            if valid_shape:
                assert res.step_time <= base.stats.step_time * (1 + 1e-9), policy


def test_ten_samples_eight_ranks_is_fast():
    lengths = np.array([9000, 5200, 4100, 3000, 2500, 1800, 900, 700, 300, 120])
    cfg = PlannerConfig(num_ranks=8, max_tokens_per_rank=4096, cost=COST)
    res = exact_search(lengths, cfg, time_limit_s=10.0)
    assert res.optimal
    check_plan(_plan(lengths, cfg, res.assignment))
    assert res.step_time >= simulate(_plan(lengths, cfg, res.assignment), COST).lower_bound * (1 - 1e-9)


def test_rejects_large_instances():
    cfg = PlannerConfig(num_ranks=16, max_tokens_per_rank=4096)
    with pytest.raises(ValueError, match="num_ranks"):
        exact_optimum(np.array([1, 2]), cfg)


def test_optimum_gaps_report_is_consistent():
    """`hdp bench exact`'s figures: no hdp plan beats a proven optimum; worst >= mean >= 0."""
    from hdp.packing.exact import optimum_gaps

    res = optimum_gaps(instances=4, seed=5, max_samples=6, time_limit_s=5.0)
    assert res["instances"] == 4 and len(res["gaps"]) == 4
    assert res["proven_optimal"] == 4
    assert min(res["gaps"]) >= -1e-9  # the optimum is a lower bound of every valid plan
    assert res["worst_gap"] >= res["mean_gap"] >= 0.0
