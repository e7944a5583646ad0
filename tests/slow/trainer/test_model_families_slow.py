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


def _verl(rank: int, world: int, name: str, root: str) -> dict:
    from hdp.integrations.verl.scaffolding.families import verl_door

    return verl_door(rank, world, name, root)


@pytest.mark.parametrize("name", VERL)
def test_verl_worker_path_matches_hf(name: str, tmp_path) -> None:
    pytest.importorskip("verl")
    pytest.importorskip("mbridge")
    _check(run_distributed(_verl, 2, name, str(tmp_path), timeout=300), name)
