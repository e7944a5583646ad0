"""The slow tier (over ~20 s) of the tests tests/unit/hdp/test_moe_zero_memory.py describes: its docstring says what they check and how."""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers.dist_helper import run_distributed


# ---- (c) bench smoke: saved bytes really drop -------------------------------------------------------


def test_bench_moe_saved_bytes_order() -> None:
    from benchmarks.moe import bench_moe

    res = bench_moe(2, tokens=128, hidden_size=64, ffn_hidden_size=128, iters=1, timeout=110)
    sb = res["saved_bytes"]
    assert sb["none"] > sb["level0"] > sb["level1"] >= sb["full_recompute"] > 0
    assert res["freed_fraction_of_full"]["level0"] >= 0.6 and res["freed_fraction_of_full"]["level1"] >= 0.9


# ---- (e) grouped experts through the engine: EP 2 x PP 2, with and without zero-memory --------------------

ENGINE_LENGTHS = [40, 13, 22, 9, 30, 5]  # the 40-token sample needs a CP group of 2 at budget 32


def _engine_grouped(rank: int, world: int) -> None:
    """HdpEngine.build of a MoE GPT with Megatron's GroupedMLP (bf16), EP 2 x PP 2 on 4 ranks: a train step
    with zero-memory (level1 on the first MoE layer of each stage, level0 on the second) equals the same step
    without it bit for bit (loss, grad norm, every parameter after the update)."""
    import dataclasses
    import zlib

    from hdp.packing import cost_model
    from hdp.trainer.config import EngineConfig, ParallelConfig, PlanningConfig
    from hdp.trainer.engine import Batch, HdpEngine, nll_loss
    from hdp.trainer.model import ModelConfig, OptimConfig

    def init(name: str, p: torch.Tensor) -> None:
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        val = torch.randn(p.shape, generator=g, dtype=torch.float32)
        p.copy_(1.0 + 0.1 * val if p.dim() == 1 else 0.05 * val)

    model = ModelConfig(vocab_size=128, hidden_size=32, num_layers=4, num_attention_heads=4, num_query_groups=2,
                        max_sequence_length=128, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                        activation="swiglu", params_dtype="bfloat16", moe_grouped_gemm=True)
    base = EngineConfig(model=model, parallel=ParallelConfig(pp=2, ep=2), optim=OptimConfig(lr=1e-3, adam_eps=1e-3),
                        planning=PlanningConfig(max_tokens_per_rank=32, cost_model=cost_model("deepseek-v3", "h100-nvlink")))
    g = torch.Generator().manual_seed(5)
    batch = Batch(tokens=[torch.randint(0, 128, (n,), generator=g) for n in ENGINE_LENGTHS],
                  loss_mask=[torch.ones(n) for n in ENGINE_LENGTHS])
    results = {}
    for mode, level, first_n in (("none", "none", None), ("level1-first1", "level1", 1)):
        cfg = dataclasses.replace(base, planning=dataclasses.replace(base.planning, zero_memory=level,
                                                                     zero_memory_num_layers=first_n))
        engine = HdpEngine.build(cfg, dist.group.WORLD, init_fn=init)
        experts = [m for m in engine.model.module.modules() if type(m).__name__ == "GroupedMLP"]
        assert len(experts) == 2, experts  # this stage's two MoE layers
        zm = [lay.zero_memory_level.value for lay in engine.model.module.decoder.layers.modules()
              if hasattr(lay, "zero_memory_level")] if level != "none" else []
        if mode == "level1-first1":
            assert zm == ["level1", "level0"], zm
        metrics = engine.train_step(batch, nll_loss)
        assert metrics["hdp/microbatches"] >= 2, metrics  # several rounds through the two stages
        params = {n: p.detach().clone() for n, p in engine.model.module.named_parameters()}
        results[mode] = ((metrics["loss"], metrics["grad_norm"]), params)
        engine.close()
    ref_metrics, ref_params = results["none"]
    for mode in ("level1-first1",):
        got_metrics, params = results[mode]
        assert got_metrics == ref_metrics, (mode, got_metrics, ref_metrics)
        assert set(params) == set(ref_params)
        for n, p in ref_params.items():
            assert torch.equal(params[n], p), f"{mode}: {n} differs by {float((params[n].float() - p.float()).abs().max())}"


def test_engine_grouped_experts_zero_memory_ep2_pp2_equals_no_zero_memory() -> None:
    run_distributed(_engine_grouped, 4, timeout=300)
