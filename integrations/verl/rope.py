"""The RoPE hdp's core attention applies, read from the built Megatron model and the HF config.

hdp moves RoPE into its core attention (positions of the unsplit sample, see
``hdp.trainer.attention_spec``), so it must rotate exactly as the model does.  Supported: plain
(non-interleaved) RoPE with any base and ``rotary_percent`` (HF ``partial_rotary_factor``).
Everything else raises a ``ValueError`` naming the field instead of silently rotating differently:
HF ``rope_parameters.rope_type`` other than ``default`` (YaRN, Llama-3, linear, dynamic, ...),
Megatron's ``rotary_interleaved``, ``seq_len_interpolation_factor``, ``rope_scaling``, and
position-embedding types other than ``rope`` (``mrope``, ``yarn``, ``learned_absolute``).
"""

from __future__ import annotations

import math
from typing import Any

from hdp.trainer.attention_spec import RopeConfig

__all__ = ["rope_config", "hf_rope_parameters"]

_DEFAULT_TYPES = (None, "default")


def hf_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The HF config's RoPE parameters as one dict (transformers 5 ``rope_parameters``, or 4.x ``rope_theta``/``rope_scaling``).

    ``{}`` when the config carries none.  Per-attention-type dicts (``{"full_attention": {...}}``)
    must all be equal (hdp applies one RoPE to every layer).
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        kinds = list(params.values())
        if any(k != kinds[0] for k in kinds[1:]):
            raise ValueError(
                f"hf_config.rope_parameters={params!r}: different RoPE per attention type is not supported by hdp"
            )
        params = kinds[0]
    out: dict[str, Any] = dict(params) if isinstance(params, dict) else {}
    if "rope_theta" not in out and getattr(hf_config, "rope_theta", None) is not None:
        out["rope_theta"] = hf_config.rope_theta
    scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(scaling, dict) and scaling:
        out.setdefault("rope_type", scaling.get("rope_type", scaling.get("type")))
        for k, v in scaling.items():
            out.setdefault(k, v)
    factor = getattr(hf_config, "partial_rotary_factor", None)
    if factor is not None:
        out.setdefault("partial_rotary_factor", factor)
    return out


def rope_config(model: Any, hf_config: Any | None) -> RopeConfig:
    """hdp's :class:`RopeConfig` for a built Megatron ``GPTModel`` (unwrapped) and its HF config.

    Megatron's model is the source of truth (it is what trains); the HF config is cross-checked.
    Raises ``ValueError`` naming the unsupported or inconsistent field.
    """
    kind = getattr(model, "position_embedding_type", "rope")
    if kind == "none":
        return RopeConfig(enabled=False)
    if kind != "rope":
        raise ValueError(
            f"Megatron position_embedding_type={kind!r}: hdp's core attention applies plain RoPE only "
            "(mrope / yarn / learned_absolute are not supported)"
        )
    tf = getattr(model, "config", None)
    if getattr(tf, "rotary_interleaved", False):
        raise ValueError("Megatron rotary_interleaved=True: hdp's RoPE is the non-interleaved (rotate-half) form")
    if getattr(tf, "multi_latent_attention", False):
        raise ValueError("Megatron multi_latent_attention=True: MLA's decoupled RoPE is not supported by hdp")
    if getattr(model, "rotary_scaling", False):
        raise ValueError("Megatron rope_scaling=True (Llama-3 frequency scaling): not supported by hdp's RoPE")
    emb = getattr(model, "rotary_pos_emb", None)
    if getattr(emb, "seq_len_interpolation_factor", None) is not None:
        raise ValueError(
            f"Megatron seq_len_interpolation_factor={emb.seq_len_interpolation_factor!r}: "
            "linear position interpolation is not supported by hdp's RoPE"
        )
    base = float(getattr(model, "rotary_base", 10000.0))
    percent = float(getattr(model, "rotary_percent", 1.0))
    if hf_config is not None:
        hf = hf_rope_parameters(hf_config)
        rope_type = hf.get("rope_type")
        if rope_type not in _DEFAULT_TYPES:
            raise ValueError(
                f"hf_config.rope_parameters.rope_type={rope_type!r}: hdp supports the default RoPE only "
                "(YaRN, llama3, linear, dynamic scaling are not implemented in hdp's core attention)"
            )
        theta = hf.get("rope_theta")
        if theta is not None and not math.isclose(float(theta), base, rel_tol=1e-9):
            raise ValueError(
                f"hf_config rope_theta={theta!r} but the Megatron model was built with rotary_base={base!r}: "
                "rebuild the model from this HF config"
            )
        factor = hf.get("partial_rotary_factor")
        if factor is not None and not math.isclose(float(factor), percent, rel_tol=1e-9):
            raise ValueError(
                f"hf_config partial_rotary_factor={factor!r} but Megatron rotary_percent={percent!r}: "
                "they must agree"
            )
    return RopeConfig(base=base, percent=percent)
