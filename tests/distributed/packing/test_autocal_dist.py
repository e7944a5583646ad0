"""The distributed tier (other processes) of the tests tests/unit/packing/test_autocal.py describes: its docstring says what they check and how."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from helpers.dist_helper import run_distributed
from hdp.packing import PlannerConfig
from hdp.packing.autocal import AutoCalibrate
from hdp.packing.workloads import short_tail

from helpers.autocal import B, CP_FREE, TRUE, _timed


# ------------------------------------------------------------------------------- over the domain


def _layout(rank: int, world: int):
    """LayoutGroups of a TP = PP = 1 job whose domain is the world (no Megatron)."""
    from hdp.groups import DomainGroups, LayoutGroups

    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in order
    mine = singles[rank]
    return LayoutGroups(world=dist.group.WORLD, domain=DomainGroups.build(dist.group.WORLD), tp=mine, pp=mine, ep=mine)


def _domain_worker(rank: int, world: int, break_rank0: bool) -> None:
    import hdp.core.planning as planning
    from hdp.core.planning import DomainPlanner

    if break_rank0 and rank == 0:
        def boom(*a, **k):
            raise RuntimeError("injected")
        planning.refit = boom  # rank 0's fit fails: the others must not hang
    layout = _layout(rank, world)
    cfg = PlannerConfig(num_ranks=world, max_tokens_per_rank=B, cost=CP_FREE)
    cal = DomainPlanner(cfg, AutoCalibrate(every_steps=3, min_rounds=2), layout, collective_device=torch.device("cpu"))
    rng = np.random.default_rng(rank)  # every rank measures different times; the gather makes them common
    versions, costs = [], []
    for s in range(6):
        lengths = short_tail(24, mean=600.0, max_len=world * B - 2 * world, seed=s)
        p = cal.plan(lengths)
        mine = _timed(p, TRUE, rng)[rank]
        m = cal.observe(p, mine.tolist(), step=s + 1)
        assert {"hdp/cost_fit_r2", "hdp/predicted_over_measured", "hdp/cost_model_version",
                "hdp/idle_fraction_measured"} <= set(m)
        versions.append(m["hdp/cost_model_version"])
        costs.append(cal.cost.to_vector())
    assert min(r.step for r in cal.window.rounds()) == 1  # warmup_steps=1: step 0 is not recorded
    table = [None] * world
    dist.all_gather_object(table, (versions, [c.tolist() for c in costs]), group=dist.group.WORLD)
    assert all(t == table[0] for t in table), "ranks disagree on the cost model"  # bit-identical
    if break_rank0:
        assert versions[-1] == 0
    else:
        assert versions[-1] >= 1 and versions[0] == 0
    # off: plans with the configured model forever; only the timing metrics remain
    off = DomainPlanner(cfg, AutoCalibrate(enabled=False), layout, collective_device=torch.device("cpu"))
    for s in range(4):
        p = off.plan([100, 200, 300])
        m = off.observe(p, [0.1] * p.num_rounds, step=s + 1)
        assert "hdp/cost_model_version" not in m and np.isfinite(m["hdp/predicted_over_measured"])
    assert off.cost == CP_FREE and len(off.window) == 0


@pytest.mark.parametrize("break_rank0", [False, True])
def test_domain_calibrator_agrees_on_every_rank(break_rank0):
    run_distributed(_domain_worker, 2, break_rank0, timeout=120.0)
