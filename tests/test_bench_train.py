"""`hdp bench train` machinery on a tiny model: same losses under every policy, JSON contract,
baseline regression detection (timings are not asserted: they live in the benchmark)."""

from __future__ import annotations

import pytest

from hdp.trainer.bench.train import (
    TrainBenchSpec,
    bench_train,
    compare_with_baseline,
    domain_size,
    train_batch_lengths,
)


def test_workloads_fit_the_domain():
    for workload in ("short-tail", "long-response"):
        spec = TrainBenchSpec(ranks=4, workload=workload, max_tokens_per_rank=256)
        lengths = train_batch_lengths(spec, 0)
        assert len(lengths) == spec.samples and max(lengths) <= 4 * 256
        if workload == "short-tail":
            assert sum(n <= 256 for n in lengths) > len(lengths) // 2 and max(lengths) > 3 * 256
        else:
            assert min(lengths) > 256


def test_bad_spec_names_the_field():
    with pytest.raises(ValueError, match="workload='poisson'"):
        TrainBenchSpec(workload="poisson")
    with pytest.raises(ValueError, match="steps=1"):
        TrainBenchSpec(steps=1)
    with pytest.raises(ValueError, match=r"ranks=6: must be a multiple of tp x pp = 2 x 2"):
        TrainBenchSpec(ranks=6, tp=2, pp=2)
    with pytest.raises(ValueError, match="pp=0"):
        TrainBenchSpec(pp=0)


def test_lengths_are_sized_for_the_domain():
    spec = TrainBenchSpec(ranks=8, tp=2, pp=2, max_tokens_per_rank=256)
    assert domain_size(spec) == 2
    assert max(train_batch_lengths(spec, 0)) <= 2 * 256


@pytest.mark.dist
def test_bench_train_small_run_contract_and_regression_check(tmp_path):
    # two pipeline stages over a domain of one rank: the bench's PP path at the cost of 2 processes
    spec = TrainBenchSpec(
        ranks=2, pp=2, steps=2, samples=8, max_tokens_per_rank=128, num_layers=2, hidden_size=32,
        vocab_size=64, records_dir=str(tmp_path),
    )
    res = bench_train(spec)
    assert set(res["results"]) == {"static-cp", "hdp"}
    for r in res["results"].values():
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and len(r["losses"]) == 2
    assert res["loss_match"] is True, res["loss_max_rel_diff"]
    assert "hdp_vs_static-cp" in res["speedup"]
    assert res["environment"]["ranks"] == 2 and res["environment"]["pp"] == 2 and res["environment"]["torch"]
    assert "predicted_over_measured" in res["calibration"], res["calibration"]
    assert res["calibration"]["model"], res["calibration"]  # which model produced the ratios
    ahead = res["plan_ahead"]  # the timed batches again as one step of several mini-batches
    assert ahead["mini_batches"] == 1 and len(ahead["planner_ms"]) == len(ahead["planner_ms_exposed"]) == 1
    # a baseline twice as fast is a regression; the result itself is not
    faster = {"results": {p: {"tokens_per_s": 2 * r["tokens_per_s"]} for p, r in res["results"].items()},
              "speedup": res["speedup"]}
    assert compare_with_baseline(res, res, 0.05) == []
    problems = compare_with_baseline(res, faster, 0.05)
    assert len(problems) == 2 and "tokens/s < baseline" in problems[0]
