"""The slow tier (over ~20 s) of the tests tests/unit/trainer/test_fused_logprobs_engine.py describes: its docstring says what they check and how."""

from __future__ import annotations

import zlib

import pytest
import torch

VOCAB, B = 256, 32
LENGTHS = [60, 30, 20, 12, 25, 9, 17]  # 60 > B: a CP group of 2


def init_param(name: str, p: torch.Tensor) -> None:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    val = torch.randn(p.shape, generator=g, dtype=torch.float32)
    p.copy_(1.0 + 0.1 * val if p.dim() == 1 else 0.05 * val)


def loss_fn(local, logprobs, weights):
    """PG-like loss with an entropy bonus and a term on the logits themselves (a z-loss on this TP rank's shard)."""
    from hdp.fused_logprobs import LastHidden

    fused = isinstance(local.output, LastHidden)
    assert fused == bool(local.extras["fused"][0]), "the loss function must see the path its engine runs"
    z = torch.logsumexp(local.logits.float(), dim=-1)  # [T] on this TP rank's vocabulary shard
    return -(weights * logprobs * local.extras["adv"]).sum() - 0.01 * (weights * local.entropy()).sum() \
        + 1e-3 * (weights * z * z).sum()


def _config(sp: bool, fused: str):
    from hdp.packing import cost_model
    from hdp.trainer.config import EngineConfig, ParallelConfig, PlanningConfig
    from hdp.trainer.model import ModelConfig, OptimConfig

    return EngineConfig(
        model=ModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                          max_sequence_length=256),
        parallel=ParallelConfig(tp=2, sequence_parallel=sp),
        optim=OptimConfig(lr=1e-3, adam_eps=1e-3, clip_grad=1.0),
        planning=PlanningConfig(max_tokens_per_rank=B, cost_model=cost_model("deepseek-v3", "h100-nvlink"),
                                auto_calibrate=False),
        fused_logprobs=fused,
    )


def _batch(fused: bool):
    from hdp.trainer.engine import Batch

    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    adv = [torch.randn(n, generator=g) for n in LENGTHS]
    flag = [torch.full((n,), float(fused)) for n in LENGTHS]
    return Batch(tokens=tokens, extras={"adv": adv, "fused": flag})


def _worker(rank: int, world: int, sp: bool) -> None:
    import torch.distributed as dist

    from hdp.trainer.engine import HdpEngine

    runs = {}
    for path in ("off", "auto"):
        engine = HdpEngine.build(_config(sp, path), dist.group.WORLD, init_fn=init_param)
        fused = path == "auto"
        assert engine.core.fused_logprobs is fused
        batch = _batch(fused)
        plan = engine.plan(batch)
        assert max(plan.group_size) > 1, "the plan must hold a CP group"
        before = engine.forward(batch)
        metrics = engine.train_step(batch, loss_fn)
        after = engine.forward(batch)
        params = {n: p.detach().clone() for n, p in engine.model.module.named_parameters()}
        # the head returns hidden states during the engine's rounds only: outside them the model is Megatron's
        assert "forward" not in engine.model.module.output_layer.__dict__
        runs[path] = (before, metrics, after, params)
        engine.close()
    (b0, m0, a0, p0), (b1, m1, a1, p1) = runs["off"], runs["auto"]
    for x, y in ((b0, b1), (a0, a1)):
        for i in range(len(LENGTHS)):
            torch.testing.assert_close(y.logprobs[i], x.logprobs[i], atol=1e-5, rtol=0)
            torch.testing.assert_close(y.entropies[i], x.entropies[i], atol=1e-5, rtol=0)
    assert abs(m1["loss"] - m0["loss"]) <= 1e-5 * max(1.0, abs(m0["loss"])), (m0["loss"], m1["loss"])
    assert abs(m1["grad_norm"] - m0["grad_norm"]) <= 1e-4 * m0["grad_norm"], (m0["grad_norm"], m1["grad_norm"])
    assert p0.keys() == p1.keys()
    for n in p0:
        torch.testing.assert_close(p1[n], p0[n], atol=2e-6, rtol=0, msg=lambda m, n=n: f"{n}: {m}")
    moved = max(float((a0.logprobs[i] - b0.logprobs[i]).abs().max()) for i in range(len(LENGTHS)))
    assert moved > 1e-4, "the update must change the log-probs (else the comparison after it says nothing)"


@pytest.mark.parametrize("sp", [True, False], ids=["tp2-sp", "tp2"])
def test_fused_engine_equals_the_logits_engine(sp: bool) -> None:
    from helpers.dist_helper import run_distributed

    run_distributed(_worker, 4, sp, timeout=600)
