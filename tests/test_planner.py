"""Planner invariants (DESIGN 1-3) for every policy, determinism, bad input, and the hdp policy
against the exact optimum on small instances."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hdp.packing import PlannerConfig, Policy, check_plan, cost_model, plan, zigzag_bounds
from hdp.packing.exact import exact_search
from hdp.packing.plan import Plan

POLICIES = [p.value for p in Policy]
COSTS = {
    "h100": cost_model("deepseek-v3", "h100-nvlink"),
    "ascend": cost_model("deepseek-v3", "ascend-910b-hccs"),
    "cpu": cost_model("cpu-tiny", "cpu-gloo"),
}


@st.composite
def batches(draw):
    n_ranks = draw(st.integers(1, 12))
    budget = draw(st.integers(8, 4096))
    n = draw(st.integers(1, 40))
    # lengths from 1 up to the whole domain's capacity, skewed to short ones
    lengths = draw(
        st.lists(st.integers(1, n_ranks * (budget - 1)), min_size=n, max_size=n).map(
            lambda xs: [max(1, x // 7) if i % 3 else x for i, x in enumerate(xs)]
        )
    )
    return lengths, n_ranks, budget


def _check_cover(p: Plan) -> None:
    # invariant 1: every sample in exactly one group of one round, chunks cover it exactly
    seen = np.zeros(p.num_samples, dtype=np.int64)
    for rnd in p.rounds:
        for g in rnd.groups:
            for pos, s in enumerate(g.samples):
                seen[s] += 1
                b = g.chunk_bounds(pos)
                assert b[0] == 0 and b[-1] == p.lengths[s] and np.all(np.diff(b) >= 0)
                assert len(b) == 2 * g.size + 1
            held = sum(
                (fe - fs) + (be - bs) for r in g.ranks for _, (fs, fe), (bs, be) in g.rank_chunks(r)
            )
            assert held == g.tokens
    assert np.all(seen == 1)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), shape=st.sampled_from(["any", "pow2"]), cost=st.sampled_from(sorted(COSTS)))
def test_invariants_every_policy(policy, batch, shape, cost):
    lengths, n_ranks, budget = batch
    if shape == "pow2" and policy == "hdp":
        n_ranks = 1 << int(np.log2(n_ranks))  # pow2 blocks need a power-of-two domain to hold N*B
        lengths = [min(x, n_ranks * (budget - 1)) for x in lengths]
    cfg = PlannerConfig(
        num_ranks=n_ranks, max_tokens_per_rank=budget, policy=policy, group_shape=shape,
        cost=COSTS[cost],
    )
    p = plan(lengths, cfg)
    check_plan(p, pow2=(policy == "hdp" and shape == "pow2"))
    _check_cover(p)
    # invariant 3: a pure function of (lengths, config)
    assert plan(list(lengths), cfg) == p
    assert plan(np.asarray(lengths), cfg).checksum() == p.checksum()
    assert p.stats is not None and 0 < p.stats.efficiency <= 1.0 + 1e-6


def test_plan_roundtrip_and_views():
    cfg = PlannerConfig(num_ranks=4, max_tokens_per_rank=100)
    p = plan([30, 250, 7, 1, 99, 40], cfg)
    q = Plan.from_dict(p.to_dict())
    assert q == p and q.checksum() == p.checksum()
    sched = p.rank_schedule(2)
    assert len(sched) == p.num_rounds
    assert zigzag_bounds(10, 2).tolist() == [0, 2, 5, 7, 10]


@pytest.mark.parametrize(
    "lengths, ranks, budget, match",
    [
        ([], 4, 100, "lengths: the batch is empty"),
        ([10, 0, 5], 4, 100, r"lengths\[1\]=0"),
        ([10, -3], 4, 100, r"lengths\[1\]=-3"),
        ([10, 2.5], 4, 100, r"lengths\[1\]=2.5 is not an integer"),
        ([10, 401, 5], 4, 100, r"lengths\[1\]=401 does not fit .* at least 101"),
    ],
)
def test_bad_lengths(lengths, ranks, budget, match):
    with pytest.raises(ValueError, match=match):
        plan(lengths, PlannerConfig(num_ranks=ranks, max_tokens_per_rank=budget))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_ranks=0, max_tokens_per_rank=10), "config.num_ranks=0"),
        (dict(num_ranks=4, max_tokens_per_rank=0), "config.max_tokens_per_rank=0"),
        (dict(num_ranks=4, max_tokens_per_rank=10, policy="magic"), "config.policy='magic' is unknown"),
        (dict(num_ranks=4, max_tokens_per_rank=10, group_shape="hex"), "config.group_shape='hex'"),
        (dict(num_ranks=4, max_tokens_per_rank=10, static_cp_size=8), "config.static_cp_size=8"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlannerConfig(**kwargs)


def test_unknown_profile_and_model():
    with pytest.raises(ValueError, match="profile='tpu' is unknown"):
        cost_model("dense-8b", "tpu")
    with pytest.raises(ValueError, match="model='gpt5' is unknown"):
        cost_model("gpt5", "h100-nvlink")


def test_hdp_beats_static_cp_on_short_tail():
    # mostly short samples and a thin tail: static CP pays ring overhead on every short sample
    rng = np.random.default_rng(1)
    lengths = np.concatenate([rng.integers(200, 3000, 120), [16000, 9000]])
    cfg = dict(num_ranks=8, max_tokens_per_rank=4096, cost=COSTS["ascend"])
    hdp = plan(lengths, PlannerConfig(**cfg)).stats
    static = plan(lengths, PlannerConfig(policy="static-cp", **cfg)).stats
    assert hdp.step_time < static.step_time / 1.2, (hdp.step_time, static.step_time)
    assert hdp.efficiency > 0.95


def test_hdp_close_to_exact_optimum_on_small_instances():
    """hdp within a stated gap of the exact optimum (B&B over all plans) on small instances."""
    rng = np.random.default_rng(7)
    gaps = []
    for _ in range(6):
        n_ranks = int(rng.integers(2, 5))
        budget = 1024
        lengths = rng.integers(16, 2 * budget, int(rng.integers(3, 7))).tolist()
        cfg = PlannerConfig(num_ranks=n_ranks, max_tokens_per_rank=budget, cost=COSTS["ascend"])
        res = exact_search(lengths, cfg, time_limit_s=5.0)
        hdp = plan(lengths, cfg).stats.step_time
        assert hdp >= res.step_time * (1 - 1e-9)  # the optimum is a true lower bound
        gaps.append(hdp / res.step_time - 1)
    assert max(gaps) < 0.35, gaps


def test_max_rank_tokens_matches_zigzag_chunks():
    """The closed form of the busiest rank's tokens equals the count over the actual chunks."""
    from hdp.packing.chunks import rank_token_count
    from hdp.packing.cost import max_rank_tokens

    lengths, ks, want = [], [], []
    for length in range(1, 260):
        for k in range(1, 34):
            lengths.append(length)
            ks.append(k)
            want.append(max(rank_token_count(length, k, j) for j in range(k)))
    got = max_rank_tokens(np.array(lengths), np.array(ks))
    assert np.array_equal(got, np.array(want))


def test_window_max_matches_brute_force():
    """The log-doubling sliding-window maximum of the round-swap pass equals the direct one."""
    from hdp.packing.policies.hdp import _window_max

    rng = np.random.default_rng(3)
    hg = rng.random((4, 37))
    for w in range(1, 38):
        want = np.array([[row[i : i + w].max() for i in range(37 - w + 1)] for row in hg])
        assert np.array_equal(_window_max(hg, w), want), w


def test_merge_groups_lowers_a_round_maximum():
    """Two 2-rank groups of uneven height in one round run better as one 4-rank group."""
    from hdp.packing.policies.common import Assignment
    from hdp.packing.policies.hdp import _merge_groups, _round_heights

    lengths = np.array([6000, 600])
    cfg = PlannerConfig(num_ranks=4, max_tokens_per_rank=4096)
    a = Assignment(round_of=np.array([0, 0]), group_start=np.array([0, 2]), group_size=np.array([2, 2]))
    merged = _merge_groups(lengths, a, cfg)
    assert merged.group_size.tolist() == [4, 4] and merged.group_start.tolist() == [0, 0]
    before, _ = _round_heights(lengths, a, cfg)
    after, _ = _round_heights(lengths, merged, cfg)
    assert after[0] < before[0]
    p = plan(lengths, cfg)  # the planner, which runs this pass, still gives a valid plan
    check_plan(p)


def _as_plan(lengths, a, cfg) -> Plan:
    return Plan.from_columns(
        num_ranks=cfg.num_ranks, max_tokens_per_rank=cfg.max_tokens_per_rank, policy="hdp",
        lengths=np.asarray(lengths), round_of=a.round_of, group_start=a.group_start,
        group_size=a.group_size,
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), shape=st.sampled_from(["any", "pow2"]), cost=st.sampled_from(sorted(COSTS)))
def test_polish_never_raises_the_step_and_keeps_plans_valid(batch, shape, cost):
    """The local search only takes steps that lower the step time (or level it), and its plans
    keep every invariant: budget, group sizes, aligned blocks, every sample once."""
    from hdp.packing.policies.hdp import _construct, _sizes, _step
    from hdp.packing.policies.polish import polish

    lengths, n_ranks, budget = batch
    if shape == "pow2":
        n_ranks = 1 << int(np.log2(n_ranks))
        lengths = [min(x, n_ranks * (budget - 1)) for x in lengths]
    lengths = np.asarray(lengths, dtype=np.int64)
    cfg = PlannerConfig(num_ranks=n_ranks, max_tokens_per_rank=budget, group_shape=shape, cost=COSTS[cost])
    k_min, sizes = _sizes(lengths, cfg)
    a = _construct(lengths, cfg, k_min, sizes)
    b = polish(lengths, a, cfg, k_min, max_steps=4 * lengths.size)
    assert _step(lengths, b, cfg) <= _step(lengths, a, cfg) * (1 + 1e-12)
    assert np.all(b.group_size >= k_min)
    p = _as_plan(lengths, b, cfg)
    check_plan(p, pow2=(shape == "pow2"))
    _check_cover(p)
    again = polish(lengths, a, cfg, k_min, max_steps=4 * lengths.size)  # deterministic
    assert all(np.array_equal(getattr(again, f), getattr(b, f)) for f in ("round_of", "group_start", "group_size"))


def test_polish_moves_a_sample_off_a_roof():
    """A round whose roof is one rank holding two samples: one of them moves to the idle rank."""
    from hdp.packing.cost import CostModel
    from hdp.packing.policies.common import Assignment
    from hdp.packing.policies.polish import polish

    cfg = PlannerConfig(num_ranks=2, max_tokens_per_rank=4096, cost=CostModel(linear_coef=0.0))
    lengths = np.array([1000, 1000, 200])
    a = Assignment(round_of=np.zeros(3, np.int64), group_start=np.array([0, 0, 1]),
                   group_size=np.ones(3, np.int64))
    b = polish(lengths, a, cfg, np.ones(3, np.int64), max_steps=10)
    loads = np.bincount(b.group_start, weights=lengths.astype(float) ** 2, minlength=2)
    assert sorted(loads.tolist()) == [1000.0**2, 1000.0**2 + 200.0**2]


def test_polish_trades_when_no_sample_can_move():
    """Token budgets full to within one sample: only a trade (100 tokens for 60) lowers the roof."""
    from hdp.packing.cost import CostModel
    from hdp.packing.policies.common import Assignment
    from hdp.packing.policies.polish import polish

    cfg = PlannerConfig(num_ranks=2, max_tokens_per_rank=1100, cost=CostModel(linear_coef=0.0))
    lengths = np.array([1000, 100, 900, 100, 60])
    a = Assignment(round_of=np.zeros(5, np.int64), group_start=np.array([0, 0, 1, 1, 1]),
                   group_size=np.ones(5, np.int64))
    b = polish(lengths, a, cfg, np.ones(5, np.int64), max_steps=10)
    assert b.group_start.tolist() == [0, 1, 1, 1, 0]  # sample 1 (100) and sample 4 (60) traded
    p = _as_plan(lengths, b, cfg)
    check_plan(p)


def test_tall_round_puts_the_tallest_samples_together():
    """Two 32K samples among 1.5K ones (the Ascend short-tail case): a candidate first round holds
    both, each widened past its budget minimum, the others on the next-longest samples."""
    from hdp.packing.policies.hdp import _sizes
    from hdp.packing.policies.tall_round import needs_tall_round, tall_round

    rng = np.random.default_rng(0)
    lengths = np.concatenate([[32768, 31935, 16000, 12000, 9000], rng.integers(200, 3000, 600)])
    cfg = PlannerConfig(num_ranks=64, max_tokens_per_rank=4096, cost=COSTS["ascend"])
    k_min, sizes = _sizes(lengths, cfg)
    assert needs_tall_round(lengths, k_min, cfg)
    cands = tall_round(lengths, k_min, cfg, sizes)
    assert cands
    for samples, group, width in cands:
        assert {0, 1} <= set(samples.tolist())
        assert width.sum() <= 64 and np.all(width[group] >= k_min[samples])
        assert width[group[list(samples).index(0)]] > k_min[0]  # widened: 8 ranks would idle the rest
    p = plan(lengths, cfg)
    assert p.round_of[0] == p.round_of[1]
    check_plan(p)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(), shape=st.sampled_from(["any", "pow2"]), extra=st.integers(0, 2))
def test_spread_plans_are_valid(batch, shape, extra):
    """The spread starting plan (multi-rank samples over every round) keeps every invariant
    whenever the budget lets it hold the batch, at the fewest rounds and above."""
    from hdp.packing.policies.hdp import _sizes, _spread

    lengths, n_ranks, budget = batch
    if shape == "pow2":
        n_ranks = 1 << int(np.log2(n_ranks))
        lengths = [min(x, n_ranks * (budget - 1)) for x in lengths]
    lengths = np.asarray(lengths, dtype=np.int64)
    cfg = PlannerConfig(num_ranks=n_ranks, max_tokens_per_rank=budget, group_shape=shape, cost=COSTS["ascend"])
    k_min, _ = _sizes(lengths, cfg)
    rounds = max(1, -(-int(lengths.sum()) // (n_ranks * budget))) + extra
    a = _spread(lengths, k_min, cfg, rounds)
    if a is None:
        return
    assert np.array_equal(a.group_size, k_min)
    p = _as_plan(lengths, a, cfg)
    check_plan(p, pow2=(shape == "pow2"))
    _check_cover(p)


def test_hdp_plans_a_batch_whose_multi_rank_groups_fill_every_rank():
    """Regression: a spread plan whose multi-rank groups took every rank of its rounds left no
    rank for the single-rank samples (the balancer looped with no bins); it is now infeasible
    and the planner goes on with the other starting points."""
    lengths = [16084, 2565, 3510, 5638, 732, 1690, 1912]
    cfg = PlannerConfig(num_ranks=8, max_tokens_per_rank=2357, group_shape="pow2", cost=COSTS["cpu"])
    p = plan(lengths, cfg)
    check_plan(p, pow2=True)
    _check_cover(p)


def test_pow2_groups_double_until_the_zigzag_split_fits():
    """With an odd budget small next to the group, the power of two above ceil(L/B) can still put
    B + 1 tokens on a rank (21 tokens on 8 ranks, B = 3: 4 on one); the group doubles to 16."""
    cfg = PlannerConfig(num_ranks=16, max_tokens_per_rank=3, group_shape="pow2", cost=COSTS["cpu"])
    p = plan([21, 2, 3], cfg)
    check_plan(p, pow2=True)
    _check_cover(p)
    assert p.group_size[0] == 16


@pytest.mark.parametrize("lengths,n_ranks,budget", [
    ([21], 8, 3), ([35, 1, 1], 8, 5), ([105, 40, 40, 40], 16, 7), ([165, 20, 20], 16, 11),
])
def test_pow2_sample_that_fits_no_block_is_rejected(lengths, n_ranks, budget):
    """A sample whose zigzag split overflows B on every power-of-two block of the domain gets a
    ValueError naming it, not a plan over budget."""
    cfg = PlannerConfig(num_ranks=n_ranks, max_tokens_per_rank=budget, group_shape="pow2", cost=COSTS["cpu"])
    with pytest.raises(ValueError, match=r"lengths\[0\]=.*power-of-two block"):
        plan(lengths, cfg)


def test_tall_round_without_short_samples_scores_are_finite():
    """Every sample multi-rank and some groups token-full: the waste scores stay finite."""
    import warnings

    from hdp.packing.policies.hdp import _sizes
    from hdp.packing.policies.tall_round import tall_round

    cfg = PlannerConfig(num_ranks=16, max_tokens_per_rank=4096, cost=COSTS["ascend"])
    lengths = np.array([65536] + [8192] * 12)
    k_min, sizes = _sizes(lengths, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cands = tall_round(lengths, k_min, cfg, sizes)
        p = plan(lengths, cfg)
    assert cands and 0 in cands[0][0].tolist()
    check_plan(p)
