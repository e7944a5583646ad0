"""`round_capacity_bound`: the lower bound that prices the ranks a sample uses in the round
of the longest sample, in time and in tokens at once.  It must stay below the exact optimum, every
plan the package builds and random valid plans on batches with tall samples, and it must be active
(above T*) on such batches; its pieces (`FirstFit`, the fractional knapsack) are checked against
plain scans."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hdp.packing import CostModel, PlannerConfig, Policy, plan, simulate
from hdp.packing.exact import exact_search
from hdp.packing.round_bound import FirstFit, _knapsack, round_capacity_bound
from hdp.packing.simulate import lower_bound, lower_bound_tight
from hdp.packing.workloads import wikipedia

from helpers.examples_loader import load_example
from helpers.planner_bound import _random_plan

REL = 1e-9
SAMPLE = Path(__file__).resolve().parents[3] / "packing" / "data" / "wikipedia_sample.txt"


def test_first_fit_is_the_first_size_that_fits():
    rng = np.random.default_rng(0)
    cost = CostModel(linear_coef=500.0, step_overhead=200.0, step_latency=1e3, comm_per_token=3.0,
                     merge_per_token=40.0, cp_per_token=25.0)
    N = 12
    length = rng.integers(1, 4000, 40)
    k_lo = rng.integers(1, N + 1, 40)
    heights = np.r_[np.geomspace(10.0, 1e8, 30), np.inf, 1e30]
    k, found = FirstFit(length, k_lo, N, cost)(heights)
    for i in range(length.size):
        h = [float(cost.sample_cost(np.array([length[i]]), np.array([kk]))[0]) for kk in range(1, N + 1)]
        for g, t in enumerate(heights):
            fits = [kk for kk in range(int(k_lo[i]), N + 1) if h[kk - 1] <= t]
            assert found[i, g] == bool(fits), (i, g)
            if fits:
                assert k[i, g] == fits[0], (i, g, k[i, g], fits[0])


def test_knapsack_is_the_greedy_optimum():
    rng = np.random.default_rng(1)
    C, n = 30, 25
    values = rng.uniform(0.0, 10.0, (C, n))
    weights = rng.uniform(0.0, 3.0, (C, n))
    weights[rng.random((C, n)) < 0.2] = np.inf  # not allowed
    weights[rng.random((C, n)) < 0.05] = 0.0  # free
    cap = rng.uniform(0.0, 20.0, C)
    got = _knapsack(values, weights, cap)
    for c in range(C):
        items = [(v, w) for v, w in zip(values[c], weights[c]) if np.isfinite(w)]
        total = sum(v for v, w in items if w == 0)
        room = cap[c]
        for v, w in sorted([it for it in items if it[1] > 0], key=lambda it: -it[0] / it[1]):
            take = min(1.0, room / w)
            total += take * v
            room -= take * w
            if room <= 0:
                break
        assert got[c] == pytest.approx(total, rel=1e-12, abs=1e-12)


def _tall_batch(rng):
    N = int(rng.integers(2, 7))
    B = int(rng.integers(16, 400))
    lengths = np.concatenate([rng.integers(B, N * B, size=int(rng.integers(1, 3))),
                              rng.integers(1, B, size=int(rng.integers(2, 7)))]).astype(np.int64)

    def mag(lo, hi):
        return float(10 ** rng.uniform(lo, hi)) if rng.random() < 0.8 else 0.0

    cost = CostModel(linear_coef=mag(0, 3.5), round_cost=mag(0, 4), step_overhead=mag(0, 4), step_latency=mag(0, 4),
                     comm_per_token=mag(-1, 2), merge_per_token=mag(0, 3.5), cp_per_token=mag(0, 3.5))
    return lengths, N, B, cost


def test_round_bound_is_below_the_optimum_and_every_plan_on_tall_batches():
    """Random batches of 1-2 samples longer than B among short ones, random cost terms, with and
    without a pipeline: the bound is below the exact optimum (where the search proves one), every
    policy's plan and 12 random valid plans -- and above T* on a good share of them (it is not idle)."""
    rng = np.random.default_rng(2026)
    active = checked_exact = 0
    cases = 30
    for case in range(cases):
        lengths, N, B, cost = _tall_batch(rng)
        stages = int(rng.choice([1, 1, 3]))
        cfg = PlannerConfig(num_ranks=N, max_tokens_per_rank=B, cost=cost, pipeline_stages=stages)
        bound = round_capacity_bound(lengths, N, B, cost, stages)
        assert bound == -np.inf or np.isfinite(bound)
        times = []
        if stages == 1:
            res = exact_search(lengths, cfg, time_limit_s=2.0)
            if res.optimal:
                times.append(res.step_time)
                checked_exact += 1
        for name in [p.value for p in Policy]:
            try:
                times.append(plan(lengths, replace(cfg, policy=name)).stats.step_time)
            except ValueError:
                pass
        for s in range(12):
            times.append(simulate(_random_plan(lengths, N, B, 1000 * case + s), cost, pipeline_stages=stages).step_time)
        assert bound <= min(times) * (1 + REL), (case, bound, min(times), lengths.tolist(), N, B, cost)
        assert lower_bound_tight(lengths, N, B, cost, stages) <= min(times) * (1 + REL)
        active += bound > lower_bound(lengths, N, B, cost, stages) * (1 + 1e-6)
    assert checked_exact >= cases // 3, checked_exact
    assert active >= cases // 5, active  # the bound says more than T* on tall batches


def test_closed_loop_seed_sweep_reports_best_possible_efficiency():
    """``examples/cost_closed_loop.py --seeds K``: every batch's efficiency is at most its best
    possible T*/T*_tight, which is at most 1, and hdp keeps the budget."""
    loop = load_example("cost_closed_loop")
    sweep = loop.seed_sweep(loop.HARDWARE, ranks=8, samples=64, budget=8192, seeds=2, wikipedia_path=str(SAMPLE))
    assert set(sweep) == {"rl", "rl-32k", "wikipedia"}
    for name, row in sweep.items():
        assert len(row["efficiency"]) == 2 and all(row["budget_ok"]), (name, row)
        for e, t, b in zip(row["efficiency"], row["efficiency_tight"], row["best_possible"]):
            assert 0 < e <= b * (1 + REL) and b <= 1 + REL and e <= t <= 1 + REL, (name, e, t, b)


def test_no_plan_of_the_closed_loop_wikipedia_batch_reaches_095():
    """The closed loop's Wikipedia batch (examples/cost_closed_loop.py: the bundled sample, N = 64,
    1,024 documents, B = 8192, a machine with a large per-token CP cost).  A round holding a 32K
    document on g ranks lasts its height while B tokens of short documents fill a rank in far less,
    so T*_tight / T* shows that no plan reaches T*/T = 0.95 -- the issue's target on this batch is
    out of every planner's reach -- and hdp's plan is within 5% of T*_tight."""
    hardware = load_example("cost_closed_loop").HARDWARE
    lengths = wikipedia(n=1024, seed=5, path=SAMPLE)
    tight = lower_bound_tight(lengths, 64, 8192, hardware)
    plain = lower_bound(lengths, 64, 8192, hardware)
    assert plain / tight < 0.95, (plain, tight)  # the best any plan can reach
    p = plan(lengths, PlannerConfig(num_ranks=64, max_tokens_per_rank=8192, cost=hardware))
    s = simulate(p, hardware, tight=True)
    assert s.lower_bound_tight == tight and s.efficiency_tight >= 0.95, s.efficiency_tight
    assert s.efficiency <= plain / tight * (1 + REL)
