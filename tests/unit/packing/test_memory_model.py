"""The per-rank memory model (`hdp.packing.memory`) and planning to a memory limit: the fit recovers
known coefficients, the derived token budget is the largest that fits, plans stay within the limit,
zero-memory and recompute shrink CP groups, and bad input names the setting, the figure and the fix."""

from __future__ import annotations

import numpy as np
import pytest

from hdp.packing import PlannerConfig, plan
from hdp.packing.memory import (
    GB,
    MemoryCoefficients,
    MemoryLayout,
    MemoryModel,
    fit_memory,
    memory_features,
    model_for,
    plan_memory,
    rank_group_sizes,
    window_tokens,
)
from hdp.packing.model_shape import ModelShape
from hdp.packing.workloads import get_workload

QWEN = "qwen3-235b-a22b"


def _model(spec: str = "tp1,pp8,ep16", **kw) -> MemoryModel:
    return model_for(QWEN, MemoryLayout.parse(spec, domain=kw.pop("domain", 16), **kw))


def test_layout_parse_and_errors():
    lay = MemoryLayout.parse("tp2,pp4,ep8,vpp2", domain=8, recompute="full")
    assert (lay.tp, lay.pp, lay.ep, lay.vpp, lay.domain, lay.recompute) == (2, 4, 8, 2, 8, "full")
    with pytest.raises(ValueError, match=r"'cp4' is not one of tpN"):
        MemoryLayout.parse("tp1,cp4")
    with pytest.raises(ValueError, match=r"MemoryLayout.recompute='some'"):
        MemoryLayout(recompute="some")
    with pytest.raises(ValueError, match=r"MemoryLayout.pp=0"):
        MemoryLayout(pp=0)
    with pytest.raises(ValueError, match="do not split over ep=3"):
        model_for(QWEN, MemoryLayout(ep=3, domain=3))


def test_static_memory_shards_as_the_layout_says():
    # the optimizer shard falls with the domain, parameters and gradients with PP and EP, not with N
    m16, m32 = _model(domain=16), _model(domain=32)
    dense, expert = m16.params(0)
    assert m32.params(0) == (dense, expert)
    assert m32.static_bytes(0) < m16.static_bytes(0)
    p16 = (dense + expert) * (2 + 4)  # bf16 parameters + fp32 gradients
    assert m16.static_bytes(0) - p16 == pytest.approx(dense * 12 / 16 + expert * 12 / (16 // 16))
    m_ep32 = model_for(QWEN, MemoryLayout.parse("tp1,pp8,ep32", domain=32))
    assert m_ep32.params(0)[1] == pytest.approx(expert / 2)
    # 94 layers on 8 stages: 11, 12 x 6, 11 (Megatron's uneven first/last stages)
    assert [m16.layers(s) for s in range(8)] == [11, 12, 12, 12, 12, 12, 12, 11]


def test_zero_memory_and_recompute_lower_bytes_per_token_and_raise_the_budget():
    budgets = {}
    for rc in ("none", "selective", "full"):
        for zm in ("none", "level0", "level1"):
            m = _model(recompute=rc, zero_memory=zm)
            budgets[rc, zm] = m.token_budget(80 * GB)
    for rc in ("none", "selective"):
        assert budgets[rc, "none"] < budgets[rc, "level0"] < budgets[rc, "level1"]
    for zm in ("none", "level0", "level1"):
        assert budgets["none", zm] < budgets["selective", zm] < budgets["full", zm]


def test_token_budget_is_the_largest_that_fits():
    for rc, zm, limit in (("none", "none", 64 * GB), ("full", "level1", 48 * GB), ("selective", "level0", 80 * GB)):
        m = _model(recompute=rc, zero_memory=zm)
        b = m.token_budget(limit)
        assert b > 0
        # every stage, every in-flight round at B tokens: within the limit; one token more: over it on some stage
        assert m.peak_bytes(b, 2) <= limit
        assert m.peak_bytes(b + 1, 2) > limit
        tokens = np.full((12, 16), float(b))
        assert plan_memory(tokens, np.full((12, 16), 2), m).max() <= limit


def test_window_tokens_follow_1f1b_in_flight_rounds():
    m = model_for("dense-8b", MemoryLayout(pp=4, domain=4))
    t = np.array([10.0, 20.0, 30.0, 40.0, 50.0])
    # stage 0 holds up to PP = 4 rounds, the last stage one
    assert window_tokens(t, m, 0).tolist() == [10, 30, 60, 100, 140]
    assert window_tokens(t, m, 3).tolist() == t.tolist()


def _records(truth: MemoryCoefficients, layouts: list[MemoryLayout], n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        base = model_for(QWEN, layouts[i % len(layouts)])
        true_model = MemoryModel(shape=base.shape, layout=base.layout, coef=truth)
        stage, k = int(rng.integers(0, base.layout.pp)), int(rng.integers(1, 5))
        t = float(rng.integers(100, 8000))
        w = t * float(rng.uniform(1.0, 2.0))
        static = base.static_bytes(stage)
        peak = static + true_model.dynamic_bytes(t, k, stage=stage, window_tokens=w)
        records.append({"kind": "memory", "features": memory_features(base, t, k, stage, w),
                        "static_bytes": static, "peak_bytes": peak})
    return records


TRUTH = MemoryCoefficients(activation=1.3, expert=0.7, cp=2.0, logits=1.1, headroom_bytes=3e8)


def test_fit_recovers_known_coefficients_from_records_of_several_levels():
    # activation and expert bytes both grow with the tokens in flight: only records of several
    # zero-memory levels tell them apart
    layouts = [MemoryLayout.parse("tp1,pp2,ep16", domain=16, zero_memory=z) for z in ("none", "level0", "level1")]
    coef, quality = fit_memory(_records(TRUTH, layouts, 60, 0))
    for name in ("activation", "expert", "cp", "logits"):
        assert getattr(coef, name) == pytest.approx(getattr(TRUTH, name), rel=1e-3), name
    assert coef.headroom_bytes == pytest.approx(TRUTH.headroom_bytes, rel=2e-2)
    assert quality["max_rel_err"] < 1e-4 and quality["n_records"] == 60


def test_fit_of_one_layout_predicts_exactly_and_keeps_the_undetermined_split():
    lay = MemoryLayout.parse("tp1,pp2,ep16", domain=16)
    records = _records(TRUTH, [lay], 40, 1)
    coef, quality = fit_memory(records)
    assert quality["max_rel_err"] < 1e-4
    # the split of (activation, expert) is not determined by one layout: the fit stays closest to the base (1, 1)
    assert coef.activation / coef.expert == pytest.approx(1.0, rel=0.2)
    fitted = MemoryModel(shape=model_for(QWEN, lay).shape, layout=lay, coef=coef)
    truth = MemoryModel(shape=fitted.shape, layout=lay, coef=TRUTH)
    for t, k in ((500.0, 1), (6000.0, 3)):
        assert fitted.peak_bytes(t, k) == pytest.approx(truth.peak_bytes(t, k), rel=1e-4)


def test_fit_with_cover_never_under_predicts_and_rejects_bad_records():
    base = model_for("dense-8b", MemoryLayout(domain=4))
    rng = np.random.default_rng(1)
    records = []
    for _ in range(30):
        t, k = float(rng.integers(500, 4000)), int(rng.integers(1, 4))
        f = memory_features(base, t, k, 0, t)
        noise = float(rng.uniform(0.9, 1.1))
        records.append({"features": f, "static_bytes": 1e9, "peak_bytes": 1e9 + noise * sum(f)})
    coef, _ = fit_memory(records, cover=True)
    for r in records:
        pred = r["static_bytes"] + sum(c * x for c, x in zip(
            (coef.activation, coef.expert, coef.cp, coef.logits), r["features"])) + coef.headroom_bytes
        assert pred >= r["peak_bytes"] * (1 - 1e-9)
    with pytest.raises(ValueError, match=r"memory record 0: needs 'features'"):
        fit_memory([{"static_bytes": 1.0, "peak_bytes": 2.0}])
    with pytest.raises(ValueError, match=r"memory record 0: .*peak > static"):
        fit_memory([{"features": [1, 0, 0, 0], "static_bytes": 5.0, "peak_bytes": 2.0}])
    with pytest.raises(ValueError, match="no memory records"):
        fit_memory([])


@pytest.mark.parametrize("workload", ["rl", "rl-32k", "bimodal", "wikipedia"])
def test_plans_to_a_memory_limit_stay_within_it(workload):
    lengths = get_workload(workload)(n=256, seed=3)
    m = _model(domain=16, zero_memory="level1", recompute="selective")
    limit = 80 * GB
    cfg = PlannerConfig(num_ranks=16, max_tokens_per_rank=None, memory_limit=limit, memory_model=m, pipeline_stages=8)
    p = plan(lengths, cfg)
    mem = p.stats.memory
    assert mem["within_limit"] and mem["peak_bytes"] <= limit
    assert p.max_tokens_per_rank == m.token_budget(limit) == mem["token_budget"]
    peaks = plan_memory(p.stats.tokens_per_rank, rank_group_sizes(p), m)
    assert peaks.max() == pytest.approx(mem["peak_bytes"])
    assert len(mem["round_peak_bytes"]) == p.num_rounds
    # each sample's group is no wider than the memory needs: ceil(L / B) ranks (the planner may widen
    # for balance, never below it)
    assert np.all(p.group_size >= np.ceil(np.asarray(lengths) / p.max_tokens_per_rank))


def test_zero_memory_shrinks_the_smallest_group_of_a_long_sample_and_the_step():
    lengths = [32768] + [1024] * 300
    smallest, rounds, step = {}, {}, {}
    for zm in ("none", "level1"):
        m = _model(domain=16, zero_memory=zm, recompute="selective")
        p = plan(lengths, PlannerConfig(num_ranks=16, max_tokens_per_rank=None, memory_limit=96 * GB, memory_model=m,
                                        pipeline_stages=8))
        smallest[zm] = -(-32768 // p.max_tokens_per_rank)  # the fewest ranks the sample fits on
        assert p.group_size[0] >= smallest[zm] and p.stats.memory["within_limit"]
        rounds[zm], step[zm] = p.num_rounds, p.stats.step_time
    assert smallest == {"none": 13, "level1": 4}
    assert rounds["level1"] < rounds["none"] and step["level1"] < step["none"]


def test_a_token_budget_caps_the_derived_one():
    m = _model(domain=16, recompute="full", zero_memory="level1")
    free = m.token_budget(80 * GB)
    p = plan([4000] * 32, PlannerConfig(num_ranks=16, max_tokens_per_rank=1024, memory_limit=80 * GB, memory_model=m,
                                         pipeline_stages=8))
    assert free > 1024 and p.max_tokens_per_rank == 1024


def test_bad_limits_name_the_setting_the_figure_and_the_fix():
    m = _model(domain=16)
    static = m.worst_static() / GB
    with pytest.raises(ValueError, match=rf"memory_limit=16 GB per device is below the static memory .*{static:.3g} GB"
                                         r".*raise the limit or shard more"):
        plan([100, 200], PlannerConfig(num_ranks=16, max_tokens_per_rank=None, memory_limit=16 * GB, memory_model=m,
                                       pipeline_stages=8))
    b = m.token_budget(40 * GB)
    longest = 16 * b + 16 * 50
    with pytest.raises(ValueError, match=rf"lengths\[1\]={longest} tokens fits no group of the domain.*recompute"):
        plan([100, longest], PlannerConfig(num_ranks=16, max_tokens_per_rank=None, memory_limit=40 * GB, memory_model=m,
                                       pipeline_stages=8))
    with pytest.raises(ValueError, match=r"config.memory_limit needs config.memory_model"):
        PlannerConfig(num_ranks=16, max_tokens_per_rank=None, memory_limit=40 * GB)
    with pytest.raises(ValueError, match=r"config.memory_limit=-1"):
        PlannerConfig(num_ranks=16, max_tokens_per_rank=None, memory_limit=-1, memory_model=m)
    with pytest.raises(ValueError, match=r"layout.domain=16 but num_ranks=8"):
        PlannerConfig(num_ranks=8, max_tokens_per_rank=None, memory_limit=80 * GB, memory_model=m, pipeline_stages=8)
    with pytest.raises(ValueError, match=r"layout.pp=8 but pipeline_stages=1"):
        PlannerConfig(num_ranks=16, max_tokens_per_rank=None, memory_limit=80 * GB, memory_model=m)
    with pytest.raises(ValueError, match=r"config.max_tokens_per_rank=None"):
        PlannerConfig(num_ranks=8, max_tokens_per_rank=None)


def test_shape_from_hf_config_missing_field_names_it():
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_hf_config({"num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10})


# ---- the fused log-prob path's logits term (MemoryLayout.fused_logprobs) ----

def test_fused_logprobs_term_is_the_hidden_states_not_the_logits():
    """On the last stage the fused path holds the hidden states and an fp32 gradient accumulator per token
    (h · (b + 4) + 20 bytes) plus one bounded chunk working set, instead of 2 · V/TP · b + 4 · 4096 per token;
    the other stages and terms are unchanged."""
    from hdp.packing.memory import logits_bytes

    logits, fused = _model(zero_memory="level1"), _model(zero_memory="level1", fused_logprobs=True)
    t = 3000.0
    h, v = 4096, 151936
    assert logits.features(t, 2, stage=7)["logits"] == pytest.approx(t * (2 * v * 2 + 4096 * 4))
    want = t * (h * 6 + 20) + 16 * 3000 * 4096 + 4096 * h * 4
    assert fused.features(t, 2, stage=7)["logits"] == pytest.approx(want)
    assert fused.features(t, 2, stage=7)["logits"] < logits.features(t, 2, stage=7)["logits"] / 5
    for st in range(7):
        assert fused.features(t, 2, stage=st) == logits.features(t, 2, stage=st)
    # the bounded part stops growing past one token chunk; no round, no bytes
    assert logits_bytes(8192.0, h, v, 2, fused=True) - logits_bytes(4096.0, h, v, 2, fused=True) == \
        pytest.approx(4096 * (h * 6 + 20))
    assert logits_bytes(0.0, h, v, 2, fused=True) == 0.0
    with pytest.raises(ValueError, match="MemoryLayout.fused_logprobs='yes'"):
        MemoryLayout(fused_logprobs="yes")


@pytest.mark.parametrize(("shape", "spec", "kw"), [
    ("qwen3-30b-a3b", "tp1,pp1,ep8", {"zero_memory": "level1", "recompute": "full"}),  # the last stage binds
    ("dense-8b", "tp1,pp1", {"recompute": "full"}),
    (QWEN, "tp1,pp8,ep16", {"zero_memory": "level1"}),  # stage 0's in-flight rounds bind: B is the same
])
def test_fused_budget_is_the_largest_that_fits_and_never_smaller(shape, spec, kw):
    """The fused term is not linear in T (its chunk working set is bounded): the derived budget is still the
    largest T that fits on every stage, plans priced with it stay within the limit, and it is never below the
    logits path's."""
    n = 16 if shape == QWEN else 8
    limit = 64 * GB if shape == QWEN else 80 * GB
    logits = model_for(shape, MemoryLayout.parse(spec, domain=n, **kw))
    fused = model_for(shape, MemoryLayout.parse(spec, domain=n, fused_logprobs=True, **kw))
    b0, b = logits.token_budget(limit), fused.token_budget(limit)
    assert b >= b0 > 0
    if shape != QWEN:
        assert b > 1.1 * b0, (b0, b)
    assert fused.peak_bytes(b, 2) <= limit < fused.peak_bytes(b + 1, 2)
    tokens = np.full((12, n), float(b))
    assert plan_memory(tokens, np.full(tokens.shape, 2), fused).max() <= limit
    if fused.layout.pp == 1:  # no window of in-flight rounds: each round's price is the model's own
        tokens = np.array([[float(b)] * n, [1.0] * n, [b / 3] * n])
        got = plan_memory(tokens, np.full(tokens.shape, 2), fused)
        for r in range(tokens.shape[0]):
            assert got[r, 0] == pytest.approx(fused.peak_bytes(tokens[r, 0], 2))
