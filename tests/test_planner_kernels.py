"""The planner's compiled kernels (`hdp.packing.policies.hdp._kernels`, numba): the cost arithmetic is
the numpy formulas' own, bit for bit; plans are identical in every process (each rank plans on its
own and the engine compares plan checksums), with the on-disk cache or without one.  Speed is the
bench's business (``hdp bench planner``)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from hdp.packing import CostModel, PlannerConfig, plan
from hdp.packing.cost import PARAMETERS, max_rank_tokens, padded_float
from hdp.packing.policies.hdp import _kernels as K


def _cost_models(rng: np.random.Generator, count: int) -> list[CostModel]:
    """Random cost models, every field 0 or log-uniform over a wide range (as the rivals property test)."""
    out = []
    for _ in range(count):
        values = {f: 0.0 if rng.random() < 0.3 else float(10 ** rng.uniform(-3, 6)) for f in PARAMETERS[:-1]}
        out.append(CostModel(**values))
    return out


def test_group_cost_is_the_cost_models_own_to_the_bit():
    rng = np.random.default_rng(0)
    for cost in _cost_models(rng, 20):
        p = K.cost_params(cost)
        k = rng.integers(1, 600, 500)
        lengths = rng.integers(1, 2**20, 500)
        lp = padded_float(lengths, k)
        sw, sl, sq = cost.work(lp) * 3.7, lp * 3.7, lp * lp * 3.7  # sums of a few samples
        want = cost.group_cost(sw, sl, sq, k)
        got = np.array([K._group_cost(p, sw[i], sl[i], sq[i], k[i]) for i in range(k.size)])
        assert np.array_equal(got, want)
        got_one = np.array([K._sample_cost(p, lengths[i], k[i]) for i in range(k.size)])
        assert np.array_equal(got_one, cost.sample_cost(lengths, k))


def test_padding_and_busiest_rank_tokens_match_numpy():
    rng = np.random.default_rng(1)
    lengths = np.concatenate([rng.integers(1, 2**40, 2000), np.arange(1, 300)])
    k = np.concatenate([rng.integers(1, 2000, 2000), rng.integers(1, 40, 299)])
    assert np.array_equal([K._padded(a, b) for a, b in zip(lengths, k)], padded_float(lengths, k))
    assert np.array_equal(K.rank_tokens(lengths, k), max_rank_tokens(lengths, k))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 127, 128, 129, 300, 1000, 4097])
def test_pairwise_sum_is_numpys(n):
    a = np.random.default_rng(n).random(n) * 1e9
    assert K._pairwise_sum(a, 0, n) == a.sum()


def test_stable_argsort_matches_numpy_with_ties():
    rng = np.random.default_rng(2)
    for n in (0, 1, 5, 16, 17, 33, 1000):
        x = np.round(rng.random(n) * 10)  # many ties
        assert np.array_equal(K._argsort_stable(x), np.argsort(x, kind="stable"))


_SCRIPT = """
import numpy as np
from hdp.packing import PlannerConfig, plan, workloads
lengths = workloads.WORKLOADS["short-reasoning"](n=512, seed=11)
print(plan(lengths, PlannerConfig(num_ranks=32, max_tokens_per_rank=4096)).checksum())
"""


def _checksum_in_a_new_process(**env: str) -> str:
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_plans_are_identical_in_every_process():
    """Each rank plans on its own: a fresh process (kernels loaded from the cache) gets the plan this one
    gets, to the checksum."""
    from hdp.packing import workloads

    lengths = workloads.WORKLOADS["short-reasoning"](n=512, seed=11)
    here = plan(lengths, PlannerConfig(num_ranks=32, max_tokens_per_rank=4096)).checksum()
    assert _checksum_in_a_new_process() == here
    assert _checksum_in_a_new_process() == here


@pytest.mark.slow
def test_without_a_cache_directory_the_kernels_compile_per_process_to_the_same_plan():
    """No writable cache directory (numba's locators all refuse): the kernels are compiled in the
    process (seconds), and the plan is the same."""
    from hdp.packing import workloads

    lengths = workloads.WORKLOADS["short-reasoning"](n=512, seed=11)
    here = plan(lengths, PlannerConfig(num_ranks=32, max_tokens_per_rank=4096)).checksum()
    assert _checksum_in_a_new_process(NUMBA_CACHE_LOCATOR_CLASSES="ZipCacheLocator") == here
