"""The distributed tier (other processes) of the tests tests/unit/hdp/test_phases.py describes: its docstring says what they check and how."""

from __future__ import annotations

import math
import time

from helpers.dist_helper import run_distributed
from hdp.core.phases import LATE_PHASES, PHASES, metric_name

SLEEP_S = 0.3
"""What one rank's loss function sleeps in one step (the others do not)."""


def _worker(rank: int, world: int) -> list[dict[str, float]]:
    import torch
    import torch.distributed as dist

    from hdp.trainer.config import EngineConfig, PlanningConfig
    from hdp.trainer.engine import Batch, HdpEngine, nll_loss
    from hdp.trainer.model import ModelConfig

    cfg = EngineConfig(model=ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64),
                       planning=PlanningConfig(max_tokens_per_rank=64, cost_model="cpu-tiny@cpu-gloo",
                                               auto_calibrate=False, measure_memory=False))
    engine = HdpEngine.build(cfg, dist.group.WORLD)
    gen = torch.Generator().manual_seed(0)
    batch = Batch(tokens=[torch.randint(0, 64, (n,), generator=gen) for n in (100, 20, 30, 12)])

    def slow_on_rank_1(local, logprobs, weights):  # one rank's loss is slow in the second step only
        if rank == 1 and engine.step == 2:
            time.sleep(SLEEP_S)
        return nll_loss(local, logprobs, weights)

    out = []
    for _ in range(3):
        m = engine.train_step(batch, slow_on_rank_1)
        out.append({p: m[metric_name(p)] for p in PHASES})
    engine.close()
    return out


def test_library_door_reports_the_slowest_ranks_phases() -> None:
    """Every rank reports the same per-phase seconds, the slowest rank's: the one rank that slept in its loss
    function shows in every rank's ``hdp/time/loss`` and ``rounds`` (carried on the calibration gather)."""
    per_rank = run_distributed(_worker, 2, timeout=120)
    assert repr(per_rank[0]) == repr(per_rank[1])  # one gathered table: the same maxima on every rank (NaN aside)
    first, slow, after = per_rank[0]
    assert all(math.isnan(first[p]) for p in LATE_PHASES)  # nothing before the first step
    assert all(first[p] >= 0.0 for p in PHASES if p not in LATE_PHASES)
    assert slow["loss"] >= SLEEP_S and slow["rounds"] >= slow["loss"]
    assert first["loss"] < SLEEP_S and after["loss"] < SLEEP_S  # only the step where rank 1 slept
    assert after["calibrate"] > 0.0 and after["exchange"] == 0.0 and after["collect"] == 0.0  # library door
