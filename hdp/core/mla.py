"""Multi-latent attention (DeepSeek-V2 / V3, Kimi-K2) under hdp: Megatron's ``MLASelfAttention`` with its RoPE
moved into hdp's core attention.

Megatron's ``MLASelfAttention`` projects the hidden states through low-rank latents (``q_lora_rank``,
``kv_lora_rank``) into query/key heads of ``qk_head_dim + qk_pos_emb_head_dim`` dims and value heads of
``v_head_dim``, and rotates the decoupled tail (``q_pe``; ``k_pe``, one per token, shared by the heads) itself,
inside ``get_query_key_value_tensors``: for a packed (THD) batch it takes positions from ``cu_seqlens``, which
under hdp's zigzag chunks are not the sample positions (see :mod:`hdp.core.attention_spec`), and it splits
the batch by ``cu_seqlens`` that cover the real tokens only (hdp's micro-batch may end in padding).

:class:`HdpMLASelfAttention` keeps every projection, norm and split of Megatron's (its TP and sequence-parallel
gathers included) and hands hdp's core attention the *unrotated* q/k: it runs Megatron's code on the unpacked
view (``packed_seq_params=None``) with a rotary module of angle 0 (:class:`ZeroAngleRotary`).  At angle 0,
cos = 1 and sin = 0 exactly, so the only thing Megatron's unfused MLA RoPE (``_apply_rotary_pos_emb_bshd`` with
``multi_latent_attention=True``) still does is de-interleave the tail (evens, then odds); :func:`interleave`
undoes that permutation (exact).  :class:`~hdp.core.attention_spec.HdpCoreAttention` then rotates the tail at
each token's position in its sample, pairs interleaved (:func:`hdp.rope.apply_rope`), with the RoPE of the MLA
fields (:func:`mla_rope_config`), and attends with value heads narrower than query/key heads.  MLA's
``softmax_scale`` (``mscale(f, mscale_all_dim)² / sqrt(qk_head_dim + qk_pos_emb_head_dim)``) reaches core
attention as its constructor argument, as with Megatron's own core attention.

Megatron's fused MLA RoPE kernel (``apply_rope_fusion=True``, CUDA) is not used: hdp rotates itself, and the
flag must be off (``ValueError`` otherwise).  Latent caching (``cache_mla_latents``, inference) is refused by
:func:`hdp.core.attention_config.check_attention_config`.

Legend: T tokens of the micro-batch (THD), B = 1 the unpacked batch dim Megatron keeps, H query heads of this TP
rank, Dn ``qk_head_dim``, Dr ``qk_pos_emb_head_dim``, Dv ``v_head_dim``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hdp import megatron_compat as mc
from hdp.rope import RopeScaling, RopeType
from hdp.core.attention_spec import RopeConfig

__all__ = ["ZeroAngleRotary", "HdpMLASelfAttention", "interleave", "mla_rope_config", "adopt_mla"]


def interleave(x: torch.Tensor) -> torch.Tensor:
    """Undo the de-interleaving of the last dim: ``cat(x[..., 0::2], x[..., 1::2])`` -> ``x`` (exact)."""
    half = x.shape[-1] // 2
    return torch.stack((x[..., :half], x[..., half:]), dim=-1).flatten(-2)  # [..., Dr]


class ZeroAngleRotary(torch.nn.Module):
    """Stand-in for MLA's ``RotaryEmbedding`` / ``YarnRotaryEmbedding``: every angle 0 (cos = 1, sin = 0) and,
    for ``yarn``, an attention factor of 1 — so Megatron's unfused MLA RoPE leaves the values unchanged (up to
    its de-interleaving permutation, see the module docstring).  No state: nothing enters the state dict."""

    def __init__(self, dim: int, rope_type: str, device: torch.device | None = None) -> None:
        super().__init__()
        self.dim = int(dim)
        self.rope_type = rope_type
        self.register_buffer("_anchor", torch.zeros(0, device=device), persistent=False)  # follows .to(device)

    def get_rotary_seq_len(self, inference_context: Any, transformer: Any, transformer_input: torch.Tensor,
                           transformer_config: Any, packed_seq_params: Any = None, **kwargs: Any) -> int:
        """Tokens of the (unpacked) micro-batch: Megatron's rule without packing, inference or CP."""
        del inference_context, transformer, packed_seq_params, kwargs
        length = int(transformer_input.size(0))
        if transformer_config.sequence_parallel:
            length *= int(transformer_config.tensor_model_parallel_size)
        return length

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group: Any = None) -> Any:
        """[S, 1, 1, Dr] zero angles (``yarn``: with the attention factor 1.0)."""
        del offset, packed_seq, cp_group
        emb = torch.zeros(max_seq_len, 1, 1, self.dim, dtype=torch.float32, device=self._anchor.device)
        return emb if self.rope_type == "rope" else (emb, 1.0)


class HdpMLASelfAttention(mc.MLASelfAttention):
    """Megatron's ``MLASelfAttention`` whose RoPE happens in hdp's core attention (module docstring).

    Same parameters, names and projections as ``MLASelfAttention``; build it from Megatron's MLA layer spec
    with ``module=HdpMLASelfAttention`` and hdp's core attention (:func:`hdp.trainer.model.layer_spec`), or
    convert a built one (:func:`adopt_mla`, the verl door)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._no_rotation()

    def _no_rotation(self) -> None:
        if self.config.apply_rope_fusion:
            raise ValueError(
                "TransformerConfig.apply_rope_fusion=True with multi_latent_attention: hdp applies MLA's RoPE in its "
                "core attention (at sample positions) and does not route Megatron's fused MLA RoPE kernel; set "
                "apply_rope_fusion=False"
            )
        device = next((p.device for p in self.parameters()), None)
        self.rotary_pos_emb = ZeroAngleRotary(self.config.qk_pos_emb_head_dim, self.config.rope_type, device)

    def get_query_key_value_tensors(self, hidden_states: torch.Tensor, key_value_states: Any = None,
                                    position_ids: Any = None, packed_seq_params: Any = None,
                                    inference_context: Any = None, *, inference_params: Any = None) -> Any:
        """``(query [T, H, Dn+Dr], key [T, H, Dn+Dr], value [T, H, Dv], q_compressed, kv_compressed)`` with the
        RoPE part unrotated (hdp's core attention rotates it)."""
        if inference_context is not None or inference_params is not None:
            raise ValueError("HdpMLASelfAttention: inference contexts are not supported (hdp trains)")
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        # Megatron's projections on the unpacked [T, B=1, ...] view, with zero angles
        query, key, value, q_compressed, kv_compressed = super().get_query_key_value_tensors(
            hidden_states, key_value_states, position_ids, None)  # [T, 1, H, D] each
        nope = self.config.qk_head_dim
        query = torch.cat([query[..., :nope], interleave(query[..., nope:])], dim=-1)  # undo the de-interleave
        key = torch.cat([key[..., :nope], interleave(key[..., nope:])], dim=-1)
        if packed:  # THD: [T, 1, H, D] -> [T, H, D], as Megatron's packed path returns them
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
            q_compressed = q_compressed.squeeze(1) if q_compressed is not None else None
            kv_compressed = kv_compressed.squeeze(1) if kv_compressed is not None else None
        return query.contiguous(), key.contiguous(), value.contiguous(), q_compressed, kv_compressed


def adopt_mla(attn: Any) -> HdpMLASelfAttention:
    """An :class:`HdpMLASelfAttention` sharing every submodule and parameter of a built ``MLASelfAttention``
    (same names, same tensors; the rotary module becomes :class:`ZeroAngleRotary`).  Put it in the layer in
    place of ``attn``."""
    if not isinstance(attn, mc.MLASelfAttention):
        raise TypeError(f"adopt_mla: expected Megatron's MLASelfAttention, got {type(attn).__name__}")
    if isinstance(attn, HdpMLASelfAttention):
        return attn
    new = HdpMLASelfAttention.__new__(HdpMLASelfAttention)
    new.__dict__.update(attn.__dict__)  # shares _modules/_parameters/_buffers
    new._modules = dict(attn._modules)  # own module table: the old one keeps its rotary module
    new._no_rotation()
    return new


def _concentration(f: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    """Megatron's YaRN attention factor on cos/sin (``_yarn_get_concentration_factor``)."""
    def m(scale: float, ms: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0

    if mscale is None or mscale_all_dim is None:
        return m(f)
    return m(f, mscale) / m(f, mscale_all_dim)


def mla_rope_config(config: Any) -> RopeConfig:
    """The RoPE an ``MLATransformerConfig`` gives its decoupled part, as hdp computes it: ``rope`` (base,
    ``rotary_percent``) or ``yarn`` (``rotary_scaling_factor``, ``original_max_position_embeddings``,
    ``beta_fast``/``beta_slow``, Megatron's attention factor ``mscale(f, mscale) / mscale(f, mscale_all_dim)``),
    pairs interleaved (Megatron's MLA RoPE de-interleaves the part before rotating)."""
    kind = getattr(config, "rope_type", "yarn")
    base = float(config.rotary_base)
    if kind == "rope":
        return RopeConfig(base=base, percent=float(config.rotary_percent), interleaved=True)
    if kind != "yarn":
        raise ValueError(f"TransformerConfig.rope_type={kind!r}: MLA's RoPE is 'rope' or 'yarn'")
    f = float(config.rotary_scaling_factor)
    scaling = RopeScaling(
        type=RopeType.YARN, factor=f, original_max_position_embeddings=int(config.original_max_position_embeddings),
        beta_fast=float(config.beta_fast), beta_slow=float(config.beta_slow), mscale=config.mscale,
        mscale_all_dim=config.mscale_all_dim,
        attention_factor=_concentration(f, config.mscale, config.mscale_all_dim), truncate=True,
    )
    return RopeConfig(base=base, scaling=scaling, interleaved=True)  # Megatron's YaRN rotates the whole part
