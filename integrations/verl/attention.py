"""The attention swap: verl's built Megatron model runs hdp's core attention (CP rings over the domain,
RoPE at the positions of the unsplit sample), with every attention setting computed or refused.

The settings come from the Megatron ``TransformerConfig`` (:func:`hdp.core.attention_config.check_attention_config`:
what mbridge built plus ``override_transformer_config``) and are reconciled with the HF config, the model's
definition under verl (see :mod:`hdp.integrations.verl.rope` for RoPE):

* sliding windows: HF's ``sliding_window`` with ``layer_types`` (``sliding_attention`` / ``full_attention``;
  Qwen2 sets them from ``use_sliding_window`` / ``max_window_layers``), or on every layer when the config has
  ``sliding_window`` and no ``layer_types`` (Mistral).  mbridge does not carry them into ``window_size``: when
  Megatron has no window, hdp applies HF's (and logs it); when both have one they must give every layer the
  same window, or ``ValueError`` names both;
* ``softmax_type`` and ``softmax_scale`` are Megatron's (set them with ``override_transformer_config``); an HF
  model with sinks (``gpt_oss``) needs ``softmax_type='learnable'``;
* HF attention settings hdp does not compute are refused, naming the field (:data:`HF_REFUSED`);
* multi-latent attention (DeepSeek-V3, ``multi_latent_attention=True``): each layer's ``MLASelfAttention`` becomes
  :class:`hdp.core.mla.HdpMLASelfAttention` (same parameters; its RoPE moves into hdp's core attention), the
  decoupled part rotated as the HF config says (:func:`hdp.integrations.verl.rope.mla_rope_config`), with the
  HF model's softmax scale (:func:`mla_softmax_scale`; logged where Megatron's MLA would have differed).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch

from hdp.core.attention_config import AttentionSettings, SoftmaxType, check_attention_config

__all__ = ["install_hdp_attention", "hf_layer_windows", "attention_settings", "mla_softmax_scale", "HF_REFUSED"]

logger = logging.getLogger(__name__)

HF_REFUSED: dict[str, str] = {
    "attn_logit_softcapping": "tanh soft-capping of the attention logits (Gemma 2) is not computed by hdp",
    "attention_chunk_size": "chunked local attention (Llama 4) is not computed by hdp",
    "use_bidirectional_attention": "bidirectional attention: hdp's attention is causal",
}
"""HF config fields that change attention's math and that hdp does not compute: refused when set."""

_WINDOW_TYPES = {"sliding_attention": True, "full_attention": False}


def hf_layer_windows(hf_config: Any, num_layers: int) -> list[int | None]:
    """Per layer, the sliding window HF's attention applies (``left``: keys at most that many positions
    before the query; ``None``: full causal attention), from ``sliding_window`` and ``layer_types``."""
    sliding = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        left = None if sliding is None else int(sliding) - 1
        return [left] * num_layers
    types = list(types)
    if len(types) != num_layers:
        raise ValueError(f"hf_config.layer_types has {len(types)} entries for a model of {num_layers} layers")
    out: list[int | None] = []
    for i, kind in enumerate(types):
        if kind not in _WINDOW_TYPES:
            raise ValueError(
                f"hf_config.layer_types[{i}]={kind!r}: hdp computes {list(_WINDOW_TYPES)} layers only"
            )
        if _WINDOW_TYPES[kind] and sliding is None:
            raise ValueError(f"hf_config.layer_types[{i}]='sliding_attention' but hf_config.sliding_window is None")
        out.append(int(sliding) - 1 if _WINDOW_TYPES[kind] else None)
    return out


def _check_hf_fields(hf_config: Any, settings: AttentionSettings, head_dim: int) -> None:
    for name, why in HF_REFUSED.items():
        value = getattr(hf_config, name, None)
        if value not in (None, False, 0):
            raise ValueError(f"hf_config.{name}={value!r}: {why}")
    if getattr(hf_config, "model_type", None) == "gpt_oss" and settings.softmax_type is not SoftmaxType.LEARNABLE:
        raise ValueError(
            f"hf_config.model_type='gpt_oss' has attention sinks but TransformerConfig.softmax_type="
            f"{settings.softmax_type.value!r}; set override_transformer_config.softmax_type=learnable"
        )
    scalar = getattr(hf_config, "query_pre_attn_scalar", None)  # Gemma: logits scaled by its -1/2 power
    if scalar is not None:
        want = float(scalar) ** -0.5
        have = settings.softmax_scale if settings.softmax_scale is not None else head_dim ** -0.5
        if not math.isclose(want, have, rel_tol=1e-6):
            raise ValueError(
                f"hf_config.query_pre_attn_scalar={scalar!r} scales the logits by {want:.6g} but "
                f"TransformerConfig.softmax_scale gives {have:.6g}; set override_transformer_config.softmax_scale={want!r}"
            )


def attention_settings(tf_config: Any, hf_config: Any | None) -> AttentionSettings:
    """The attention settings hdp computes for a Megatron config built from ``hf_config`` (module docstring)."""
    settings = check_attention_config(tf_config)  # refuses what hdp does not compute
    if hf_config is None:
        return settings
    layers = int(tf_config.num_layers)
    if settings.is_mla:
        head_dim = settings.rope_start + int(settings.rope_dim or 0)
    else:
        head_dim = int(tf_config.kv_channels or tf_config.hidden_size // tf_config.num_attention_heads)
    _check_hf_fields(hf_config, settings, head_dim)
    hf = hf_layer_windows(hf_config, layers)
    mega = [settings.window_for(layer) for layer in range(1, layers + 1)]
    if settings.window is not None:
        if mega != hf:
            raise ValueError(
                f"TransformerConfig.window_size={tuple(tf_config.window_size)!r} with window_attn_skip_freq="
                f"{tf_config.window_attn_skip_freq!r} gives the layers the windows {mega}, but the HF config "
                f"(sliding_window={getattr(hf_config, 'sliding_window', None)!r}, layer_types="
                f"{getattr(hf_config, 'layer_types', None)!r}) gives {hf}; make them agree"
            )
        return settings
    windows = {w for w in hf if w is not None}
    if not windows:
        return settings
    (left,) = windows  # one sliding_window value per HF config
    logger.info("attention: the HF config's sliding window (%d keys) on layers %s; the Megatron config had none",
                left + 1, [i + 1 for i, w in enumerate(hf) if w is not None])
    return dataclasses.replace(settings, window=left, window_layers=tuple(w is not None for w in hf))


def mla_softmax_scale(tf_config: Any, hf_config: Any | None, megatron_scale: float) -> float:
    """The logit scale of an MLA layer: HF DeepSeek-V3's (``(qk_nope_head_dim + qk_rope_head_dim)^-1/2``, times
    ``mscale(factor, mscale_all_dim)²`` under a RoPE variant with ``mscale_all_dim``) when the HF config is given,
    else Megatron's (``megatron_scale``, ``MLASelfAttention.softmax_scale``: the same formula on its own
    ``rotary_scaling_factor`` / ``mscale_all_dim``)."""
    if hf_config is None:
        return float(megatron_scale)
    from hdp.integrations.verl.rope import hf_rope_parameters

    scale = float(tf_config.qk_head_dim + tf_config.qk_pos_emb_head_dim) ** -0.5
    hf = hf_rope_parameters(hf_config)
    if hf.get("rope_type") not in (None, "default"):
        m_all, factor = hf.get("mscale_all_dim") or 0.0, hf.get("factor")
        if m_all and factor is not None and float(factor) > 1:
            scale *= (0.1 * float(m_all) * math.log(float(factor)) + 1.0) ** 2
    if not math.isclose(scale, float(megatron_scale), rel_tol=1e-9):
        logger.warning("MLA softmax scale: the HF config gives %.6g, Megatron's MLASelfAttention %.6g "
                       "(rotary_scaling_factor=%s, mscale_all_dim=%s); hdp computes the HF config's", scale,
                       megatron_scale, getattr(tf_config, "rotary_scaling_factor", None),
                       getattr(tf_config, "mscale_all_dim", None))
    return scale


def install_hdp_attention(chunk: Any, hf_config: Any, *, fused_rope: bool = False) -> None:
    """Swap every layer's core attention for hdp's and move RoPE into it (positions of the unsplit sample).

    Megatron's own RoPE takes positions from ``cu_seqlens``, which for zigzag chunks are not the
    sample positions; hdp's core attention applies RoPE at ``HdpPackedSeqParams.positions``.  Every
    attention setting is reconciled first (:func:`attention_settings`; the RoPE of
    :func:`hdp.integrations.verl.rope.rope_config`): a refused one raises before any layer changes.
    An MLA layer's self-attention becomes :class:`hdp.core.mla.HdpMLASelfAttention` (module docstring).
    ``fused_rope``: the rotation takes the device's fused kernel (:mod:`hdp.integrations.verl.fusions`).
    """
    from hdp.integrations.verl import compat
    from hdp.integrations.verl.rope import rope_config
    from hdp.core.attention_spec import HdpCoreAttention
    from hdp.core.mla import adopt_mla

    model = compat.unwrap_model(chunk)
    rope = rope_config(model, hf_config)  # raises on any RoPE variant hdp does not implement
    if fused_rope:
        rope = dataclasses.replace(rope, fused=True)
    settings = attention_settings(model.config, hf_config)  # raises on any attention setting hdp does not compute
    scale = None
    for layer in model.decoder.layers:
        attn = layer.self_attention
        if settings.is_mla:  # the same parameters; Megatron's MLA RoPE off (hdp's core attention rotates)
            attn = adopt_mla(attn)
            layer.self_attention = attn
            if scale is None:
                scale = mla_softmax_scale(model.config, hf_config, attn.softmax_scale)
        old = attn.core_attention
        new = HdpCoreAttention(
            config=old.config,
            layer_number=old.layer_number,
            attn_mask_type=compat.causal_mask_type(),
            attention_type="self",
            softmax_scale=scale,
            pg_collection=getattr(attn, "pg_collection", None),
            rope=rope,
            settings=settings,
        )
        old_offset = getattr(old, "softmax_offset", None)
        if new.softmax_offset is not None:  # learnable sinks: keep the built (or loaded) values and device
            if isinstance(old_offset, torch.nn.Parameter) and old_offset.shape == new.softmax_offset.shape:
                with torch.no_grad():
                    new.softmax_offset.copy_(old_offset)
            new.to(attn.linear_proj.weight.device)
        attn.core_attention = new
    model.position_embedding_type = "none"  # RoPE now happens inside hdp's core attention
