"""Every model family hdp computes exactly, against HF ``transformers``' own model on the same weights, through both
doors: ``HdpEngine.build`` (the library) and verl's ``ActorRolloutRefWorker`` (mbridge-built, for the families
mbridge knows).  Llama 3.1 (``rope_type: llama3``), Qwen3 with YaRN, Qwen2 with a per-layer sliding window, Mistral
with a sliding window, gpt-oss-style learned sinks, off-by-one sinks, a custom ``softmax_scale``, DeepSeek-V3
(multi-latent attention: q/k heads of 8 + a decoupled interleaved YaRN RoPE part of 4, value heads of 6; DeepSeek's
MoE: sigmoid router with expert bias, group-limited top-k, shared experts, a dense first layer) under EP 2 and
hdp's MoE zero-memory level1.

Each run plans a sample longer than the token budget onto a CP group of 2 (the windows cross its chunk
boundaries).  What is compared and the tolerances: :mod:`hdp.integrations.verl.scaffolding.families`
(log-probs 2e-5 absolute, loss 1e-5 and grad norm 1e-4 relative, float32).
"""

from __future__ import annotations

import pytest

from helpers.model_families import VERL, _check

pytest.importorskip("transformers")

from helpers.dist_helper import run_distributed  # noqa: E402

LIBRARY = ["llama3.1", "qwen3-yarn", "qwen2-window", "mistral-window", "mistral-sinks", "qwen3-off-by-one",
           "qwen3-scale", "deepseek-v3"]


def _library(rank: int, world: int, name: str, root: str) -> dict:
    from hdp.integrations.verl.scaffolding.families import library_door

    return library_door(rank, world, name, root)


def _library_tp2(rank: int, world: int, name: str, root: str) -> dict:
    from hdp.integrations.verl.scaffolding.families import library_door

    return library_door(rank, world, name, root, tp=2)


@pytest.mark.parametrize("name", LIBRARY)
def test_library_door_matches_hf(name: str, tmp_path) -> None:
    _check(run_distributed(_library, 2, name, str(tmp_path), timeout=300), name)


@pytest.mark.parametrize("name", ["mistral-sinks", "qwen2-window"])
def test_library_door_under_tp2_matches_hf(name: str, tmp_path) -> None:
    """TP 2 x domain 2 (sequence parallel): the learned sinks are TP-sharded by head like Megatron's
    ``softmax_offset``; Qwen2's QKV bias and per-layer windows on each TP rank's heads."""
    _check(run_distributed(_library_tp2, 4, name, str(tmp_path), timeout=400), name)


def test_verl_door_lists_every_family_mbridge_knows() -> None:
    """The verl cases are exactly the families mbridge has a bridge for; the others are named in the matrix."""
    from hdp.integrations.verl.scaffolding.families import CASES

    assert VERL == [n for n, c in CASES.items() if c.mbridge]
    assert set(LIBRARY) == set(CASES)


def test_every_family_has_a_regress_row() -> None:
    """``hdp bench regress`` guards each family of ``hdp bench models`` with one flag."""
    from hdp.integrations.verl.scaffolding.families import CASES
    from benchmarks.ci import MODEL_FAMILIES, ROWS

    assert [name for name, _ in MODEL_FAMILIES] == list(CASES)
    assert {f"models-{name}-exact" for name in CASES} <= {r.name for r in ROWS}


def _sinks_checkpoint(rank: int, world: int, root: str) -> dict:
    import os

    import torch
    import torch.distributed as dist

    from hdp.integrations.verl.scaffolding.families import CASES, hf_init_fn, model_config, reference_model
    from hdp.integrations.verl.scaffolding.tiny import build_tiny
    from hdp.packing import cost_model
    from hdp.trainer.config import EngineConfig, PlanningConfig
    from hdp.trainer.engine import HdpEngine

    case = CASES["mistral-sinks"]
    path = os.path.join(root, "model")
    if rank == 0:
        build_tiny(path, family=case.hf)
    dist.barrier(group=dist.group.WORLD)
    ref = reference_model(path, case)
    cfg = EngineConfig(model=model_config(ref.config, case), device="cpu", planning=PlanningConfig(
        max_tokens_per_rank=48, cost_model=cost_model("cpu-tiny", "cpu-gloo")))
    engine = HdpEngine.build(cfg, dist.group.WORLD, init_fn=hf_init_fn(ref.state_dict(), ref.config))
    out = {}
    try:
        for fmt in ("dist", "per-rank"):
            ckpt = os.path.join(root, f"ckpt-{fmt}")
            engine.save_checkpoint(ckpt, format=fmt)
            saved = {n: p.detach().clone() for n, p in engine.model.named_parameters() if "softmax_offset" in n}
            with torch.no_grad():
                for n, p in engine.model.named_parameters():
                    if n in saved:
                        p.add_(1.0)
            engine.load_checkpoint(ckpt)
            now = {n: p.detach() for n, p in engine.model.named_parameters() if n in saved}
            out[fmt] = len(saved) == 2 and all(torch.equal(saved[n], now[n]) for n in saved)
    finally:
        engine.close()
    return out


def test_library_door_checkpoints_keep_the_learned_sinks(tmp_path) -> None:
    """``softmax_offset`` (one per layer) is saved and restored by Megatron's distributed format and the per-rank one."""
    for r in run_distributed(_sinks_checkpoint, 2, str(tmp_path), timeout=300):
        assert r == {"dist": True, "per-rank": True}, r
