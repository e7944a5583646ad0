"""The distributed tier (other processes) of the tests tests/unit/hdp/test_plan_ahead.py describes: its docstring says what they check and how."""

from __future__ import annotations

from hdp.packing.workloads import get_workload


def _steps_worker(rank: int, world: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from hdp.trainer.config import EngineConfig, PlanningConfig
    from hdp.trainer.engine import Batch, HdpEngine
    from hdp.trainer.model import ModelConfig, OptimConfig

    cfg = EngineConfig(model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128),
                       optim=OptimConfig(lr=1e-3),
                       planning=PlanningConfig(max_tokens_per_rank=256, auto_calibrate=False, cost_model="cpu-tiny@cpu-gloo"))
    engine = HdpEngine.build(cfg, dist.group.WORLD)
    g = torch.Generator().manual_seed(1)
    batches = [Batch(tokens=[torch.randint(0, 128, (int(n),), generator=g) for n in get_workload("rl")(
        n=48, seed=s, prompt_mean=8.0, prompt_cap=12, response_mean=120.0, response_cap=500)]) for s in range(4)]
    inline = [engine.plan(b).checksum() for b in batches]
    taken, take = [], engine.planner.take

    def record(*args, **kwargs):
        t = take(*args, **kwargs)
        taken.append((t.plan.checksum(), t.ahead))
        return t

    engine.planner.take = record
    metrics = engine.train_steps(batches)
    engine.close()
    return [{"ms": m["hdp/planner_ms"], "exposed": m["hdp/planner_ms_exposed"], "inline": c, "taken": t[0],
             "ahead": t[1]} for m, c, t in zip(metrics, inline, taken)]


def test_train_steps_plan_each_next_mini_batch_while_the_current_one_trains():
    from helpers.dist_helper import run_distributed

    a, b = run_distributed(_steps_worker, 2, timeout=300)
    for rank in (a, b):
        assert all(x["ahead"] and x["taken"] == x["inline"] for x in rank), rank  # the same plans as in line
    after_first = a[1:]
    assert all(x["exposed"] <= 0.1 * x["ms"] + 1.0 for x in after_first), a  # hidden behind the previous step
    assert all(x["exposed"] >= 0 for x in a)
