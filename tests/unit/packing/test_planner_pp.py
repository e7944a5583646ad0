"""Pipeline parallelism in the planner and the simulator (the planner's side).

With PP stages a step costs the sum of round times plus (PP - 1) times the longest round (the
pipeline's fill and drain); the lower bound accounts for it, and the hdp policy plans for it:
with PP it may use more, smaller rounds, and its plan is never slower under PP than the plan it
makes without knowing the pipeline.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hdp.packing import CostModel, Plan, PlannerConfig, Policy, check_plan, cost_model, lower_bound, plan, simulate
from hdp.packing.simulate import round_times, step_time

ASCEND = cost_model("deepseek-v3", "ascend-910b-hccs")


def test_step_time_counts_the_longest_round_pp_minus_one_more_times():
    cost = CostModel(linear_coef=0.0, round_cost=10.0)
    # round 0: one sample of 300 on rank 0 (9e4) and 100 on rank 1; round 1: 200 and 100
    p = Plan.from_columns(num_ranks=2, max_tokens_per_rank=1000, policy="hand", lengths=np.array([300, 100, 200, 100]),
                          round_of=np.array([0, 0, 1, 1]), group_start=np.array([0, 1, 0, 1]),
                          group_size=np.ones(4, np.int64))
    tops = round_times(p, cost)
    assert tops.tolist() == [9e4, 4e4]
    for pp in (1, 2, 8):
        s = simulate(p, cost, pipeline_stages=pp)
        assert s.step_time == pytest.approx(9e4 + 4e4 + 2 * 10.0 + (pp - 1) * 9e4)
        assert s.pipeline_fill == pytest.approx((pp - 1) * 9e4)
        assert s.pipeline_stages == pp and s.to_dict()["pipeline_stages"] == pp
        assert step_time(tops, cost, pp) == s.step_time
    with pytest.raises(ValueError, match="pipeline_stages"):
        simulate(p, cost, pipeline_stages=0)


@st.composite
def batches(draw):
    n_ranks = draw(st.integers(1, 12))
    budget = draw(st.integers(8, 4096))
    n = draw(st.integers(1, 30))
    lengths = draw(st.lists(st.integers(1, n_ranks * (budget - 1)), min_size=n, max_size=n).map(
        lambda xs: [max(1, x // 7) if i % 3 else x for i, x in enumerate(xs)]))
    return lengths, n_ranks, budget


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), stages=st.integers(1, 12), cost=st.sampled_from([ASCEND, cost_model("cpu-tiny", "cpu-gloo")]))
def test_lower_bound_holds_under_pp_for_every_policy(batch, stages, cost):
    lengths, n_ranks, budget = batch
    cfg = PlannerConfig(num_ranks=n_ranks, max_tokens_per_rank=budget, cost=cost, pipeline_stages=stages)
    flat = lower_bound(np.asarray(lengths), n_ranks, budget, cost)
    bound = lower_bound(np.asarray(lengths), n_ranks, budget, cost, stages)
    assert bound >= flat * (1 - 1e-12)  # the pipeline only adds
    for policy in Policy:
        p = plan(lengths, replace(cfg, policy=policy))
        check_plan(p)
        assert p.stats.pipeline_stages == stages
        assert p.stats.step_time >= bound * (1 - 1e-9), policy
        assert p.stats.lower_bound == pytest.approx(bound)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), stages=st.sampled_from([2, 4, 8]))
def test_pp_aware_plan_is_never_slower_under_pp(batch, stages):
    """hdp planned for PP vs the plan it makes without PP, both scored with PP: the former never
    loses (it takes the PP-unaware plan's shapes among its own candidates, and its search is
    scored by the PP objective)."""
    lengths, n_ranks, budget = batch
    cfg = PlannerConfig(num_ranks=n_ranks, max_tokens_per_rank=budget, cost=ASCEND, pipeline_stages=stages)
    aware = plan(lengths, cfg)
    blind = plan(lengths, replace(cfg, pipeline_stages=1))
    blind_pp = simulate(blind, ASCEND, pipeline_stages=stages).step_time
    assert aware.stats.step_time <= blind_pp * (1 + 1e-9)


def test_with_pp_more_smaller_rounds_win():
    """A 32K sample among short ones: without PP one round holds it on few ranks; with 8 stages the
    longest round costs 7 more times, so the plan widens it or spreads the work over more rounds,
    and is faster under PP than the plan made without PP."""
    rng = np.random.default_rng(3)
    lengths = np.concatenate([[32768, 30000], rng.integers(300, 3000, 400)])
    cfg = PlannerConfig(num_ranks=32, max_tokens_per_rank=4096, cost=ASCEND, pipeline_stages=8)
    aware = plan(lengths, cfg)
    blind = plan(lengths, replace(cfg, pipeline_stages=1))
    blind_pp = simulate(blind, ASCEND, pipeline_stages=8)
    check_plan(aware)
    assert aware.stats.step_time < blind_pp.step_time * 0.99
    # the longest round is what PP pays for: the aware plan's is shorter
    assert round_times(aware, ASCEND).max() < round_times(blind, ASCEND).max()
    assert aware.stats.efficiency > blind_pp.efficiency


def test_pipeline_stages_is_validated():
    with pytest.raises(ValueError, match=r"config\.pipeline_stages=0"):
        PlannerConfig(num_ranks=4, max_tokens_per_rank=16, pipeline_stages=0)
    with pytest.raises(ValueError, match=r"config\.pipeline_stages=True"):
        PlannerConfig(num_ranks=4, max_tokens_per_rank=16, pipeline_stages=True)


def test_engine_planning_config_passes_the_stages():
    from hdp.trainer.config import PlanningConfig

    cfg = PlanningConfig(max_tokens_per_rank=512, cost_model="cpu-tiny@cpu-gloo").planner_config(8, pipeline_stages=4)
    assert cfg.pipeline_stages == 4 and cfg.num_ranks == 8
    assert PlanningConfig(cost_model="cpu-tiny@cpu-gloo").planner_config(8).pipeline_stages == 1
