"""The distributed tier (other processes) of the tests tests/unit/trainer/test_bench_train.py describes: its docstring says what they check and how."""

from __future__ import annotations

import json

import pytest

from hdp.trainer.bench.train import TrainBenchSpec, bench_train, compare_with_baseline


def test_bench_train_small_run_contract_and_regression_check(tmp_path):
    # two pipeline stages over a domain of one rank: the bench's PP path at the cost of 2 processes
    spec = TrainBenchSpec(
        ranks=2, pp=2, steps=3, samples=8, max_tokens_per_rank=128, num_layers=2, hidden_size=32,
        vocab_size=64, records_dir=str(tmp_path),
    )
    res = bench_train(spec)
    assert set(res["results"]) == {"static-cp", "hdp"}
    for r in res["results"].values():
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and len(r["losses"]) == 3
        assert r["tokens_per_s_job"] == pytest.approx(2 * r["tokens_per_s"])
        assert r["model_tflops_per_device"] > 0 and r["mfu"] is None  # no peak is known for a CPU
        assert r["peak_memory_gb"] > 0 and r["phases"]
    pair = res["paired"]["hdp_vs_static-cp"]
    for clock in ("wall", "cpu"):  # one ratio per timed step, its median inside its interval
        assert pair[clock]["n"] == 2 and pair[clock]["ci95"][0] <= pair[clock]["median"] <= pair[clock]["ci95"][1]
    assert res["loss_match"] is True, res["loss_max_rel_diff"]
    assert "hdp_vs_static-cp" in res["speedup"]
    assert res["environment"]["ranks"] == 2 and res["environment"]["pp"] == 2 and res["environment"]["torch"]
    assert "predicted_over_measured" in res["calibration"], res["calibration"]
    assert res["calibration"]["model"], res["calibration"]  # which model produced the ratios
    ahead = res["plan_ahead"]  # the timed batches again as one step of several mini-batches
    assert ahead["mini_batches"] == 2 and len(ahead["planner_ms"]) == len(ahead["planner_ms_exposed"]) == 2
    # a baseline twice as fast is a regression; the result itself is not
    faster = {"results": {p: {"tokens_per_s": 2 * r["tokens_per_s"]} for p, r in res["results"].items()},
              "speedup": res["speedup"]}
    assert compare_with_baseline(res, res, 0.05) == []
    problems = compare_with_baseline(res, faster, 0.05)
    assert len(problems) == 2 and "tokens/s < baseline" in problems[0]


def _library_run(rank: int, world: int, records: str, batches: list[list[int]]) -> None:
    """A user's training through the library door, writing calibration records (and, beside them, lengths)."""
    import torch
    import torch.distributed as dist

    from hdp.trainer.config import EngineConfig, PlanningConfig
    from hdp.trainer.engine import Batch, HdpEngine, nll_loss
    from hdp.trainer.model import ModelConfig, OptimConfig

    cfg = EngineConfig(model=ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128),
                       optim=OptimConfig(lr=1e-3),
                       planning=PlanningConfig(max_tokens_per_rank=256, calibration_path=records, auto_calibrate=False))
    engine = HdpEngine.build(cfg, dist.group.WORLD)
    g = torch.Generator().manual_seed(0)
    for lengths in batches:
        engine.train_step(Batch(tokens=[torch.randint(0, 128, (n,), generator=g) for n in lengths]), nll_loss)
    engine.close()


def test_recorded_lengths_replay_the_runs_plans(tmp_path):
    """A library-door run records each step's lengths beside its calibration records; ``hdp bench train --lengths``
    on the same model (a Megatron config.json), domain, budget and cost model plans every step as the run did
    (the plans' checksums), while static CP runs the same batches beside it."""
    from helpers.cli_helper import hdp_json
    from helpers.dist_helper import run_distributed

    batches = [[300, 40, 25, 90, 60], [500, 12, 33], [100, 200, 48, 70, 8, 250]]
    run_distributed(_library_run, 2, str(tmp_path / "{role}.jsonl"), batches, timeout=300)
    recorded = [json.loads(line) for line in (tmp_path / "engine.lengths.jsonl").read_text().splitlines()]
    assert [r["lengths"] for r in recorded] == batches and {r["policy"] for r in recorded} == {"hdp"}
    model = tmp_path / "config.json"
    model.write_text(json.dumps({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 128}))
    res = hdp_json("bench", "train", "--ranks", "2", "--model", str(model), "--lengths", str(tmp_path / "engine.jsonl"),
                   "--cost-model", "auto", "--json")
    assert res["spec"]["max_tokens_per_rank"] == 256 and res["spec"]["steps"] == 4  # the recorded budget; 3 timed
    assert res["replay"] == {"hdp": {"compared": 3, "equal": 3}}, res["replay"]
    assert res["results"]["hdp"]["checksums"][1:] == [r["checksum"] for r in recorded]
    assert res["loss_match"] and res["plans_differ"]
