"""megatron-core's real BalancedCPScheduler converted to our Plan."""

from __future__ import annotations

import numpy as np
import pytest

from hdp.packing import PlannerConfig, cost_model

pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")

from hdp.trainer.bench.peers import budget_ok, megatron_core_plan, megatron_core_report  # noqa: E402


def test_megatron_core_plan_long_tail_8_ranks():
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(1500) - 0.72, 1.2, 64)), 1, 8 * 4096)
    lengths = lengths.astype(np.int64)
    cfg = PlannerConfig(
        num_ranks=8, max_tokens_per_rank=4096, cost=cost_model("deepseek-v3", "ascend-910b-hccs")
    )
    p = megatron_core_plan(lengths, cfg)
    assert p.num_samples == lengths.size
    assert np.all((p.round_of >= 0) & (p.round_of < p.num_rounds))
    assert np.all(p.group_start + p.group_size <= 8)
    k = p.group_size
    assert np.all((k & (k - 1)) == 0)
    # every sample placed exactly once: its tokens are counted once over ranks and rounds
    assert int(p.tokens_per_rank().sum()) == int(lengths.sum())
    assert p.stats is not None and p.stats.step_time > 0
    report = megatron_core_report(lengths, cfg)
    assert report["budget_ok"] == budget_ok(p)
    assert report["budget_ok"] == (report["max_tokens_per_rank"] <= 4096)


@pytest.mark.parametrize("seed", [1, 11])
def test_megatron_dcp_port_matches_megatron_core_when_memory_is_slack(seed):
    # On these batches no group ever runs into our per-round budget, so adaptation (a) of
    # hdp.packing.policies.megatron_dcp is inactive and the port must reproduce megatron-core.
    from hdp.packing import plan

    rng = np.random.default_rng(seed)
    n = int(rng.integers(8, 40))
    lengths = np.clip(np.round(rng.lognormal(np.log(3000) - 0.72, 1.2, n)), 1, 8 * 8192 - 64)
    lengths = lengths.astype(np.int64)
    cfg = PlannerConfig(
        num_ranks=8, max_tokens_per_rank=8192, policy="megatron-dcp",
        cost=cost_model("deepseek-v3", "ascend-910b-hccs"),
    )
    ours, real = plan(lengths, cfg), megatron_core_plan(lengths, cfg)
    assert budget_ok(real)
    assert np.array_equal(ours.round_of, real.round_of)
    assert np.array_equal(ours.group_start, real.group_start)
    assert np.array_equal(ours.group_size, real.group_size)
