"""The engine calibrates itself: from a deliberately wrong cost model (context parallelism free) to one
that predicts the measured step time, with plans that change accordingly (4 gloo ranks, a small GPT).

Through the door users use: ``HdpEngine.build`` with ``PlanningConfig(auto_calibrate=...)`` and
``train_step``; the metrics ``hdp/predicted_over_measured`` and ``hdp/cost_model_version`` are what
a trainer logs.  Measured step time here is the sum over rounds of the slowest rank's round time
(what the rounds model predicts); the tolerance is 15% (CPU timings on a shared machine).
"""

from __future__ import annotations

import dataclasses
import os
import statistics

import numpy as np
import pytest
import torch
import torch.distributed as dist

from helpers.dist_helper import run_distributed

RANKS, B, STEPS, EVERY, LAST = 4, 256, 20, 4, 12
NOISE_LIMIT = 0.25  # robust spread (1.48 MAD / median) of predicted/measured above which timings cannot judge 15%
LINK_S = 0.002
"""Seconds every ring step waits on top of gloo (both directions at once): the "hardware" of this test
has a slow CP link, so the CP-free model is clearly wrong on every machine, not only a loaded one
(on an idle 2-core machine gloo's own ring steps cost ~10% of a step, within the timing noise)."""


def _lengths(step: int) -> list[int]:
    """Short samples and a tail up to all four ranks' budget (the CP-free model spreads them widely)."""
    rng = np.random.default_rng(step)
    lengths = rng.lognormal(np.log(70.0), 0.6, 22)
    lengths[:2] = rng.uniform(0.5 * RANKS * B, RANKS * B - 2 * RANKS, 2)
    return rng.permutation(np.clip(lengths.astype(int), 16, RANKS * B - 2 * RANKS)).tolist()


def _batch(step: int, vocab: int):
    from hdp.trainer.engine import Batch

    g = torch.Generator().manual_seed(step)
    return Batch(tokens=[torch.randint(0, vocab, (n,), generator=g) for n in _lengths(step)])


def _worker(rank: int, world: int, out: dict) -> None:
    from hdp.packing import cost_model
    from hdp.packing.autocal import AutoCalibrate
    from hdp.trainer.config import EngineConfig, PlanningConfig
    from hdp.trainer.engine import HdpEngine, nll_loss
    from hdp.trainer.model import ModelConfig, OptimConfig

    import time

    import hdp.cp.ring as ring

    real_exchange = ring._exchange

    def slow_link(*args, **kwargs):  # the emulated interconnect: a fixed latency per ring step
        time.sleep(LINK_S)
        return real_exchange(*args, **kwargs)

    ring._exchange = slow_link
    cp_free = dataclasses.replace(cost_model("cpu-tiny", "cpu-gloo"), step_overhead=0.0, step_latency=0.0,
                                  comm_per_token=0.0, merge_per_token=0.0, cp_per_token=0.0)
    vocab = 256
    cfg = EngineConfig(
        model=ModelConfig(vocab_size=vocab, hidden_size=128, num_layers=2, num_attention_heads=4,
                          max_sequence_length=RANKS * B),
        optim=OptimConfig(lr=1e-4),
        planning=PlanningConfig(max_tokens_per_rank=B, cost_model=cp_free,
                                auto_calibrate=AutoCalibrate(every_steps=EVERY, min_rounds=8,
                                                              half_life_steps=EVERY)),
    )
    engine = HdpEngine.build(cfg, dist.group.WORLD)
    probe = _batch(1000, vocab)
    first_plan = engine.plan(probe)
    history = []
    for s in range(STEPS):
        m = engine.train_step(_batch(s, vocab), nll_loss)
        history.append({k: m[k] for k in ("hdp/predicted_over_measured", "hdp/cost_model_version", "hdp/cost_fit_r2",
                                           "hdp/cp_degree_hist", "perf/step_time")})
    last_plan = engine.plan(probe)
    if rank == 0:
        out.update(history=history, first=first_plan.stats.cp_degree_hist, last=last_plan.stats.cp_degree_hist,
                   cost=dataclasses.asdict(engine.planner.cost))


def test_engine_learns_the_cost_of_context_parallelism(tmp_path):
    import json
    import pickle

    path = tmp_path / "out.pkl"
    run_distributed(_run_and_save, RANKS, str(path), timeout=600.0)
    out = pickle.loads(path.read_bytes())
    hist = out["history"]
    ratios = [h["hdp/predicted_over_measured"] for h in hist]
    versions = [h["hdp/cost_model_version"] for h in hist]
    report = json.dumps({"ratios": ratios, "versions": versions, "first": out["first"], "last": out["last"],
                         "step_times": [h["perf/step_time"] for h in hist], "cost": out["cost"]}, default=str)
    # the CP-free model predicts far less than is measured before the first refit
    assert statistics.median(ratios[:EVERY]) < 0.85, report
    assert versions[0] == 0 and versions[-1] >= 1, report
    # the plans change: fewer ranks in CP groups on the same probe batch
    def cp_ranks(h: dict) -> int:
        return sum(int(k) * n for k, n in h.items() if int(k) > 1)
    assert out["first"] != out["last"] and cp_ranks(out["last"]) < cp_ranks(out["first"]), report
    # what changed them: the learned model charges context parallelism (rank-time on CP4 vs one rank)
    from hdp.packing import CostModel

    learned = CostModel(**out["cost"])
    assert 4 * float(learned.sample_cost(500, 4)) > 1.2 * float(learned.sample_cost(500, 1)), report
    # after the refits, the prediction is within 15% of the measured step time (median over the last
    # steps).  That needs timings that are themselves good to ~15%: when other jobs share the cores,
    # the same plan takes 0.7 s in one step and 2.4 s in the next, and no model can predict that.
    # The spread is that of predicted / measured itself (what no model can follow; perf/step_time
    # also varies with the plan and holds the refits' CPU time, which is not a timing error).
    last = ratios[-LAST:]
    med = statistics.median(last)
    spread = 1.4826 * statistics.median(abs(r - med) for r in last) / med  # robust: one spike does not count
    if spread > NOISE_LIMIT:
        pytest.skip(f"predicted/measured spreads by {spread:.0%} (> {NOISE_LIMIT:.0%}) over the last {LAST} steps: this "
                    f"machine is too loaded to judge a 15% prediction (load average {os.getloadavg()[0]:.1f}); {report}")
    assert abs(med - 1.0) <= 0.15, report


def _run_and_save(rank: int, world: int, path: str) -> None:
    import pickle

    out: dict = {}
    _worker(rank, world, out)
    if rank == 0:
        with open(path, "wb") as fh:
            pickle.dump(out, fh)
