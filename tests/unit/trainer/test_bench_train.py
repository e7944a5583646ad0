"""`hdp bench train` machinery on a tiny model: same losses under every policy, JSON contract,
baseline regression detection (timings are not asserted: they live in the benchmark), and the replay of
the lengths a library-door run recorded: the same plans, checksum for checksum."""

from __future__ import annotations

import pytest

from hdp.trainer.bench.train import TrainBenchSpec, domain_size, train_batch_lengths


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
