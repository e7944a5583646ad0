"""The verl door of multi-latent attention and DeepSeek-V3's router: what hdp reconciles with the HF config where
mbridge 0.15's DeepSeek-V3 bridge (under transformers 5 and megatron-core 0.16) loses it.

mbridge's bridge looks YaRN up in a ``rope_scaling`` that transformers 5's config does not expose by its test, so its
``MLATransformerConfig`` says plain RoPE with factor 1: Megatron's MLA would rotate without YaRN and scale the logits
by ``1/sqrt(D)`` instead of HF's ``mscale² / sqrt(D)``; it sets no group-limited routing; it passes a config keyword
megatron-core 0.16 renamed.  The end-to-end check (log-probs 2e-5 against HF through verl's worker) is
``tests/distributed/trainer/test_model_families.py tests/slow/trainer/test_model_families_slow.py``; here each piece
against transformers' own numbers.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest

pytest.importorskip("verl")
pytest.importorskip("transformers")

from hdp.integrations.verl.scaffolding.tiny import family_config  # noqa: E402


def _mbridge_tf(**kw):
    """The ``MLATransformerConfig`` mbridge's DeepSeek-V3 bridge builds from the tiny config under transformers 5."""
    from hdp import megatron_compat as mc

    base = dict(num_layers=3, hidden_size=32, num_attention_heads=4, attention_dropout=0.0, q_lora_rank=16,
                kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, rotary_base=10000.0,
                rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=1.0, num_moe_experts=8,
                moe_router_topk=4, moe_ffn_hidden_size=16, moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, moe_layer_freq=[0, 1, 1])
    base.update(kw)
    return mc.MLATransformerConfig(**base)


def test_mla_rope_and_softmax_scale_are_the_hf_configs(caplog):
    """HF's YaRN (factor 4, mscale 0.9 / mscale_all_dim 1: attention factor and softmax scale) with interleaved
    pairs, and HF DeepseekV3Attention's own ``scaling``, over the plain RoPE mbridge's config says (logged)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    from hdp.integrations.verl.attention import mla_softmax_scale
    from hdp.integrations.verl.rope import mla_rope_config
    from hdp.rope import RopeType

    hf, tf = family_config("deepseek-v3"), _mbridge_tf()
    with caplog.at_level(logging.WARNING):
        rope = mla_rope_config(tf, hf)
        scale = mla_softmax_scale(tf, hf, megatron_scale=12 ** -0.5)
    assert rope.interleaved and rope.base == 10000.0 and rope.scaling.type is RopeType.YARN
    assert rope.scaling.factor == 4.0 and rope.scaling.original_max_position_embeddings == 32
    assert rope.scaling.attention_scale == pytest.approx(DeepseekV3RotaryEmbedding(hf).attention_scaling, rel=1e-12)
    assert scale == pytest.approx(DeepseekV3Attention(hf, 0).scaling, rel=1e-12)
    assert scale == pytest.approx(12 ** -0.5 * (1 + 0.1 * math.log(4.0)) ** 2, rel=1e-12)
    assert "hdp computes the HF config's" in caplog.text
    # without an HF config: Megatron's own (its rope_type, interleaved pairs, its softmax scale)
    assert mla_rope_config(tf, None).scaling is None and mla_rope_config(tf, None).interleaved
    assert mla_softmax_scale(tf, None, megatron_scale=0.25) == 0.25


def test_mla_rope_refuses_what_mla_does_not_compute():
    from hdp.integrations.verl.rope import mla_rope_config

    hf = family_config("deepseek-v3")
    hf.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    with pytest.raises(ValueError, match=r"rope_type='llama3' with multi-latent attention"):
        mla_rope_config(_mbridge_tf(), hf)
    hf.rope_parameters = {"rope_type": "default", "rope_theta": 500.0}
    with pytest.raises(ValueError, match=r"rope_theta=500.0 but the Megatron model was built with rotary_base"):
        mla_rope_config(_mbridge_tf(), hf)


def test_router_takes_hf_group_limited_routing():
    """HF's ``n_group`` / ``topk_group`` set on a Megatron config without them; disagreement and what Megatron's
    router computes differently are refused naming the fields."""
    from hdp.integrations.verl.moe_router import reconcile_router

    hf, key = family_config("deepseek-v3"), "actor_rollout_ref.actor"
    tf = _mbridge_tf()
    reconcile_router(tf, hf, key)
    assert (tf.moe_router_num_groups, tf.moe_router_group_topk) == (4, 2)
    reconcile_router(tf, hf, key)  # idempotent
    with pytest.raises(ValueError, match=r"n_group=4, topk_group=2 but .*moe_router_num_groups=2"):
        reconcile_router(_mbridge_tf(moe_router_num_groups=2, moe_router_group_topk=1), hf, key)
    with pytest.raises(ValueError, match=r"routed_scaling_factor=2.5 but .*moe_router_topk_scaling_factor=1.0"):
        reconcile_router(_mbridge_tf(moe_router_topk_scaling_factor=1.0), hf, key)
    hf.topk_group = 1  # Megatron would score a group by its best 4, HF by its best 2
    with pytest.raises(ValueError, match=r"topk = 2 \* topk_group only"):
        reconcile_router(_mbridge_tf(), hf, key)
    hf.topk_group, hf.norm_topk_prob = 2, False
    with pytest.raises(ValueError, match=r"norm_topk_prob=False"):
        reconcile_router(_mbridge_tf(), hf, key)
    qwen = _mbridge_tf()
    reconcile_router(qwen, family_config("qwen3"), key)  # other model types: unchanged
    assert qwen.moe_router_num_groups is None


def test_mbridge_config_keyword_renamed_for_megatron_0_16():
    """mbridge's DeepSeek-V3 bridge passes ``max_position_embeddings``; megatron-core 0.16's MLA config calls it
    ``original_max_position_embeddings``."""
    from hdp import megatron_compat as mc
    from hdp.integrations.verl.compat import MLAConfigNames

    class Base:
        TransformerConfigClass = mc.MLATransformerConfig

        def _build_base_config(self, text_config_key=None, **kwargs):
            return kwargs

    class Bridge(MLAConfigNames, Base):
        pass

    assert Bridge()._build_base_config(max_position_embeddings=32) == {"original_max_position_embeddings": 32}
    @dataclasses.dataclass
    class Older:  # megatron-core <= 0.13's MLATransformerConfig had the field
        max_position_embeddings: int = 4096

    Base.TransformerConfigClass = Older  # a config class that has the field keeps it
    assert Bridge()._build_base_config(max_position_embeddings=32) == {"max_position_embeddings": 32}
