"""`hdp bench train` machinery on a tiny model: same losses under every policy, JSON contract,
baseline regression detection (timings are not asserted: they live in the benchmark)."""

from __future__ import annotations

import pytest

from hdp.trainer.bench_train import TrainBenchSpec, bench_train, compare_with_baseline, train_batch_lengths


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


@pytest.mark.dist
def test_bench_train_small_run_contract_and_regression_check(tmp_path):
    spec = TrainBenchSpec(
        ranks=2, steps=2, samples=8, max_tokens_per_rank=128, num_layers=1, hidden_size=32,
        vocab_size=64, records_dir=str(tmp_path),
    )
    res = bench_train(spec)
    assert set(res["results"]) == {"static-cp", "hdp"}
    for r in res["results"].values():
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and len(r["losses"]) == 2
    assert res["loss_match"] is True, res["loss_max_rel_diff"]
    assert "hdp_vs_static-cp" in res["speedup"]
    assert res["environment"]["ranks"] == 2 and res["environment"]["torch"]
    assert "predicted_over_measured" in res["calibration"], res["calibration"]
    # a baseline twice as fast is a regression; the result itself is not
    faster = {"results": {p: {"tokens_per_s": 2 * r["tokens_per_s"]} for p, r in res["results"].items()},
              "speedup": res["speedup"]}
    assert compare_with_baseline(res, res, 0.05) == []
    problems = compare_with_baseline(res, faster, 0.05)
    assert len(problems) == 2 and "tokens/s < baseline" in problems[0]
