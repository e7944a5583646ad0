"""The attention swap: verl's built Megatron model runs hdp's core attention (CP rings over the domain,
RoPE at the positions of the unsplit sample)."""

from __future__ import annotations

from typing import Any

__all__ = ["install_hdp_attention"]


def install_hdp_attention(chunk: Any, hf_config: Any) -> None:
    """Swap every layer's core attention for hdp's and move RoPE into it (positions of the unsplit sample).

    Megatron's own RoPE takes positions from ``cu_seqlens``, which for zigzag chunks are not the
    sample positions; hdp's core attention applies RoPE at ``HdpPackedSeqParams.positions``.
    """
    from hdp.integrations.verl import compat
    from hdp.integrations.verl.rope import rope_config
    from hdp.trainer.attention_spec import HdpCoreAttention

    model = compat.unwrap_model(chunk)
    rope = rope_config(model, hf_config)  # raises on any RoPE variant hdp does not implement
    for layer in model.decoder.layers:
        attn = layer.self_attention
        old = attn.core_attention
        attn.core_attention = HdpCoreAttention(  # parameter-free: nothing to move to the device
            config=old.config,
            layer_number=old.layer_number,
            attn_mask_type=compat.causal_mask_type(),
            attention_type="self",
            rope=rope,
        )
    model.position_embedding_type = "none"  # RoPE now happens inside hdp's core attention
