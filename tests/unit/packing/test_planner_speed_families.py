"""The batch families of ``hdp bench planner``: the new workloads plan into valid, deterministic
plans, and the bench reports hdp beside megatron-core's scheduler (its own, when installed) and hdp's
port of it.  Speed itself is the bench's business (``hdp bench planner``), not a test's."""

from __future__ import annotations

import numpy as np
import pytest

from hdp.packing import PlannerConfig, check_plan, plan
from hdp.packing import workloads as wl
from hdp.trainer.bench.planner import FAMILIES, Family, bench_planner, megatron_core_status


def test_families_cover_the_suite_and_the_new_shapes():
    names = [f.name for f in FAMILIES]
    assert {"lognormal", "rl-16k", "rl-32k", "bimodal", "wikipedia", "ascend-short-tail"} <= set(names)
    assert {"short-reasoning", "pareto", "rl-grouped-16"} <= set(names)
    for f in FAMILIES:
        assert set(dict(f.budgets)) == {64, 512}, f.name


def test_short_reasoning_has_a_short_bulk_and_a_long_tail():
    x = wl.short_reasoning(1024, seed=0)
    assert 900 < np.median(x) < 1300 and x.max() > 16_384 and x.min() < 300
    assert np.mean(x > 4 * 1105) < 0.08


def test_pareto_shortest_is_the_scale_and_the_tail_is_heavy():
    x = wl.pareto(20_000, scale=512.0, alpha=1.3, seed=0)
    assert x.min() == 512 and x.max() == 32_768
    top = np.sort(x)[-200:]  # the longest 1%
    assert (top.astype(float) ** 2).sum() > 0.3 * (x.astype(float) ** 2).sum()


def test_rl_grouped_responses_of_a_prompt_share_its_prompt_and_difficulty():
    x = wl.rl_grouped(1600, group=16, seed=1).astype(float)
    groups = np.log(x).reshape(100, 16)
    within = groups.var(axis=1).mean()
    between = groups.mean(axis=1).var()
    assert between > 0.3 * within  # a prompt's responses are alike (its difficulty), prompts differ
    with pytest.raises(ValueError, match="group"):
        wl.rl_grouped(10, group=0)


@pytest.mark.parametrize("name", ["short-reasoning", "pareto", "rl-grouped"])
def test_new_families_plan_valid_and_deterministic(name):
    lengths = wl.WORKLOADS[name](n=256, seed=5)
    cfg = PlannerConfig(num_ranks=16, max_tokens_per_rank=4096)
    p = plan(lengths, cfg)
    check_plan(p)
    assert p.checksum() == plan(lengths, cfg).checksum()
    static = plan(lengths, PlannerConfig(num_ranks=16, max_tokens_per_rank=4096, policy="static-cp"))
    assert p.stats.step_time <= static.stats.step_time * (1 + 1e-9)


def test_bench_reports_hdp_and_both_peers_on_one_batch():
    fam = Family(name="tiny", workload="short-reasoning", budgets=((8, 4096),))
    out = bench_planner([fam], ((8, 100.0),), repeats=1, peer_repeats=1)
    (row,) = out["planner"]
    assert row["samples"] == 128 and row["median_cpu_ms"] > 0 and 0.5 < row["efficiency"] <= 1.0
    status = megatron_core_status()
    assert out["megatron_core"] == status
    if status["available"]:
        mc = row["megatron_core"]
        assert mc["median_ms"] > 0 and 0 < mc["efficiency"] <= 1.0 and isinstance(mc["budget_ok"], bool)
    else:
        assert "error" in row["megatron_core"]
    assert 0 < row["megatron_dcp_port"]["efficiency"] <= 1.0
    assert any("re-implementation" in n for n in out["notes"])
