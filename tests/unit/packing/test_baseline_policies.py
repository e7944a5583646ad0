"""Baseline policies (static-cp, megatron-dcp, ascend-hdp, verl-kk): invariants and shapes."""

from __future__ import annotations

import numpy as np
import pytest

from hdp.packing import PlannerConfig, check_plan, cost_model, plan
from hdp.packing.policies.kk import (
    first_fit_decreasing,
    karmarkar_karp,
    lpt_with_capacity,
    rounds_from_bins,
)

BASELINES = ["static-cp", "megatron-dcp", "ascend-hdp", "verl-kk"]
COST = cost_model("deepseek-v3", "ascend-910b-hccs")


def _lognormal(n: int, seed: int, mean: float = 1500.0, sigma: float = 1.2, cap: int = 32768):
    rng = np.random.default_rng(seed)
    mu = np.log(mean) - sigma * sigma / 2
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), 1, cap).astype(np.int64)


def _workloads():
    yield "lognormal-64x8", _lognormal(64, 0), 8, 4096
    yield "lognormal-256x64", _lognormal(256, 1), 64, 4096
    yield "longtail-8", _lognormal(40, 2, sigma=1.6, cap=8 * 2048), 8, 2048
    yield "uniform-6ranks", np.random.default_rng(3).integers(1, 9000, 30), 6, 4096
    yield "few", np.array([5000, 17, 300]), 4, 4096
    yield "one", np.array([1234]), 4, 4096
    yield "all-ranks", np.array([8 * 1024 - 3, 8 * 1024, 100, 7000]), 8, 1024
    yield "tiny-lengths", np.array([1, 1, 2, 3, 1]), 3, 2


WORKLOADS = list(_workloads())


@pytest.mark.parametrize("policy", BASELINES)
@pytest.mark.parametrize("name,lengths,N,B", WORKLOADS, ids=[w[0] for w in WORKLOADS])
def test_invariants_and_determinism(policy, name, lengths, N, B):
    cfg = PlannerConfig(num_ranks=N, max_tokens_per_rank=B, policy=policy, cost=COST)
    p = plan(lengths, cfg)
    aligned = policy in ("static-cp", "verl-kk")
    check_plan(p, pow2=aligned and (N & (N - 1)) == 0)
    assert p.stats is not None and 0.0 < p.stats.efficiency <= 1.0 + 1e-9
    assert p.stats.rounds >= p.stats.min_rounds
    assert plan(lengths, cfg) == p  # pure function of (lengths, config)
    assert plan(lengths.copy(), cfg).checksum() == p.checksum()


@pytest.mark.parametrize("policy", ["static-cp", "verl-kk"])
def test_static_policies_use_one_group_size(policy):
    lengths = _lognormal(200, 5)
    cfg = PlannerConfig(num_ranks=32, max_tokens_per_rank=4096, policy=policy, cost=COST)
    p = plan(lengths, cfg)
    assert np.unique(p.group_size).size == 1
    k = int(p.group_size[0])
    assert k & (k - 1) == 0 and np.all(p.group_start % k == 0)
    cfg6 = PlannerConfig(
        num_ranks=32, max_tokens_per_rank=4096, policy=policy, cost=COST, static_cp_size=16
    )
    p6 = plan(lengths, cfg6)
    check_plan(p6, pow2=True)
    assert set(p6.group_size.tolist()) == {16}


def test_static_cp_size_too_small_is_rejected():
    cfg = PlannerConfig(
        num_ranks=8, max_tokens_per_rank=1024, policy="static-cp", cost=COST, static_cp_size=2
    )
    with pytest.raises(ValueError, match="static_cp_size"):
        plan(np.array([5000, 10]), cfg)


def test_static_cp_uses_min_rounds_when_possible():
    lengths = np.full(64, 1000)
    cfg = PlannerConfig(num_ranks=8, max_tokens_per_rank=4096, policy="static-cp", cost=COST)
    p = plan(lengths, cfg)
    assert p.stats.rounds == 2  # 64k tokens over 8 x 4096 per round
    assert p.stats.efficiency > 0.95


@pytest.mark.parametrize("seed", range(4))
def test_megatron_dcp_powers_of_two(seed):
    lengths = _lognormal(120, seed, sigma=1.5, cap=12 * 2048 - 100)
    for N in (16, 12):
        cfg = PlannerConfig(num_ranks=N, max_tokens_per_rank=2048, policy="megatron-dcp", cost=COST)
        p = plan(lengths, cfg)
        check_plan(p, pow2=False)
        k = p.group_size
        # powers of two, or the whole domain (Megatron's groups: every power of two and DPxCP)
        assert np.all(((k & (k - 1)) == 0) | (k == N))
        if N == 16:
            assert np.all((k & (k - 1)) == 0)


@pytest.mark.parametrize("seed", range(4))
def test_ascend_hdp_groups_stay_in_boxes(seed):
    lengths = _lognormal(150, seed, sigma=1.4, cap=4 * 4096)
    for k_box in (None, 8):
        cfg = PlannerConfig(
            num_ranks=16, max_tokens_per_rank=4096, policy="ascend-hdp", cost=COST,
            static_cp_size=k_box,
        )
        p = plan(lengths, cfg)
        check_plan(p)
        k = k_box or 4  # longest sample fits 4 ranks
        assert np.all(p.group_size <= k)
        assert np.all(p.group_start // k == (p.group_start + p.group_size - 1) // k)
        assert np.all(p.group_start + p.group_size <= (16 // k) * k)


def test_kk_helpers():
    w = np.array([8.0, 7, 6, 5, 4])
    parts = karmarkar_karp(w, 2)
    sums = np.bincount(parts, weights=w, minlength=2)
    assert abs(sums[0] - sums[1]) <= 2  # KK gives {8,6}{7,5,4}-> 14 vs 16 or better
    assert np.array_equal(karmarkar_karp(w, 2), parts)
    assert np.array_equal(karmarkar_karp(w, 1), np.zeros(5, np.int64))
    bins = first_fit_decreasing(np.array([5, 4, 3, 2, 1]), 6)
    assert np.bincount(bins, weights=[5, 4, 3, 2, 1]).max() <= 6 and bins.max() == 2
    assert lpt_with_capacity(np.ones(3), np.array([5, 5, 5]), 2, 6) is None
    rnd, slot = rounds_from_bins(np.array([1.0, 9, 5, 7]), 2)
    assert rnd.tolist() == [1, 0, 1, 0] and sorted(slot[rnd == 0].tolist()) == [0, 1]
