"""The RoPE hdp's core attention applies, read from the built Megatron model and the HF config.

hdp moves RoPE into its core attention (positions of the unsplit sample, see
``hdp.core.attention_spec``), so it must rotate exactly as the model does.  Under verl the HF
config is the model's definition — the rollout engine reads it, and the weights come from that
checkpoint — while the Megatron model is mbridge's translation of it, which may lose the frequency
variant: mbridge's Llama bridge carries only a Llama-3 ``factor`` (as linear
``seq_len_interpolation_factor``), its Qwen bridges drop ``rope_scaling`` altogether.  So:

* base (``rope_theta`` / ``rotary_base``) and rotated fraction (``partial_rotary_factor`` /
  ``rotary_percent``) must agree, or ``ValueError``;
* the frequency variant is HF's when the HF config declares one (``default``, ``linear``, ``dynamic``,
  ``llama3``, ``yarn``; :class:`hdp.rope.RopeScaling`): hdp computes it exactly, and logs when
  Megatron's own RoPE would have differed.  A variant only Megatron declares (HF says ``default``) is
  refused, naming both;
* without an HF config, Megatron's: ``seq_len_interpolation_factor`` (linear), ``position_embedding_type
  = "yarn"`` with the ``yarn_*`` config fields; ``rope_scaling=True`` (Llama 3) is refused there, since
  Megatron keeps neither its factor nor its other parameters on the model;
* refused, naming the field: HF rope types hdp does not compute (``longrope``, ``proportional``,
  ``mrope`` / ``mrope_section``, ...), per-attention-type RoPE that differs between types, Megatron's
  ``rotary_interleaved`` and position embeddings other than RoPE / YaRN.

Multi-latent attention (:func:`mla_rope_config`, DeepSeek-V3): the RoPE of the decoupled part.  The same rules
with HF's pairing (``rope_interleave``, DeepSeek-V3's default ``True``) on top; Megatron's own (without an HF
config) is :func:`hdp.core.mla.mla_rope_config` of the MLA fields (``rope_type``, ``rotary_scaling_factor``,
``mscale`` / ``mscale_all_dim``, interleaved pairs).  mbridge 0.15's DeepSeek-V3 bridge looks YaRN up in a
``rope_scaling`` the transformers 5 config does not expose by that test (``"rope_scaling" in hf_config``), so its
Megatron config says plain RoPE: hdp computes the HF config's YaRN and logs the difference.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from hdp.rope import RopeScaling, RopeType
from hdp.core.attention_spec import RopeConfig

__all__ = ["rope_config", "mla_rope_config", "hf_rope_parameters", "hf_rope_scaling", "megatron_rope_scaling"]

logger = logging.getLogger(__name__)

_DEFAULT_TYPES = (None, "default")
_HF_TYPES = {"linear": RopeType.LINEAR, "dynamic": RopeType.DYNAMIC, "llama3": RopeType.LLAMA3, "yarn": RopeType.YARN}


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
    if out.get("rope_type") is None and out.get("type") is not None:
        out["rope_type"] = out["type"]
    factor = getattr(hf_config, "partial_rotary_factor", None)
    if factor is not None:
        out.setdefault("partial_rotary_factor", factor)
    return out


def hf_rope_scaling(hf_config: Any) -> RopeScaling | None:
    """hdp's :class:`RopeScaling` for the HF config's ``rope_type`` (``None``: plain RoPE), with transformers'
    defaults; ``ValueError`` naming the field for a type hdp does not compute."""
    hf = hf_rope_parameters(hf_config)
    if hf.get("mrope_section") is not None:
        raise ValueError(
            f"hf_config.rope_parameters.mrope_section={hf['mrope_section']!r}: multimodal RoPE (mrope) is not "
            "computed by hdp's core attention (1-D positions only)"
        )
    rope_type = hf.get("rope_type")
    if rope_type in _DEFAULT_TYPES:
        return None
    kind = _HF_TYPES.get(rope_type)
    if kind is None:
        raise ValueError(
            f"hf_config.rope_parameters.rope_type={rope_type!r}: hdp computes {['default', *_HF_TYPES]} "
            "(longrope, proportional, mrope and others are not implemented in hdp's core attention)"
        )
    mpe = getattr(hf_config, "max_position_embeddings", None)
    # transformers gives a config-level original_max_position_embeddings (Phi-3) priority, then the parameter,
    # then max_position_embeddings
    orig = getattr(hf_config, "original_max_position_embeddings", None) or hf.get("original_max_position_embeddings")
    orig = orig if orig is not None else mpe
    factor = hf.get("factor")
    try:
        if kind is RopeType.LINEAR:
            return RopeScaling(type=kind, factor=float(factor))
        if kind is RopeType.DYNAMIC:
            return RopeScaling(type=kind, factor=float(factor), original_max_position_embeddings=mpe)
        if kind is RopeType.LLAMA3:
            return RopeScaling(type=kind, factor=float(factor), original_max_position_embeddings=int(orig),
                               low_freq_factor=float(hf["low_freq_factor"]),
                               high_freq_factor=float(hf["high_freq_factor"]))
        if factor is None:  # yarn without a factor: transformers takes max / original
            factor = mpe / orig
        mscale, mscale_all_dim = hf.get("mscale"), hf.get("mscale_all_dim")
        attention_factor = hf.get("attention_factor")
        return RopeScaling(
            type=kind, factor=float(factor), original_max_position_embeddings=int(orig),
            beta_fast=float(hf.get("beta_fast") or 32), beta_slow=float(hf.get("beta_slow") or 1),
            mscale=None if mscale is None else float(mscale),
            mscale_all_dim=None if mscale_all_dim is None else float(mscale_all_dim),
            attention_factor=None if attention_factor is None else float(attention_factor),
            truncate=bool(hf.get("truncate", True)),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"hf_config.rope_parameters={hf!r}: rope_type {rope_type!r} lacks or mistypes {exc}; "
            "fix the checkpoint's config.json"
        ) from exc
    except ValueError as exc:
        raise ValueError(f"hf_config.rope_parameters (rope_type {rope_type!r}): {exc}") from exc


def megatron_rope_scaling(model: Any) -> tuple[RopeScaling | None, str]:
    """The frequency variant the Megatron model itself was built with, and a phrase naming its fields.

    ``rope_scaling=True`` gives a :class:`RopeScaling` of type ``llama3`` whose factor is unknown (1.0):
    Megatron keeps it only inside its inverse frequencies.
    """
    kind = getattr(model, "position_embedding_type", "rope")
    emb = getattr(model, "rotary_pos_emb", None)
    if kind == "yarn":
        tf = getattr(model, "config", None)
        orig = getattr(tf, "yarn_original_max_position_embeddings", None)
        return RopeScaling(
            type=RopeType.YARN, factor=float(getattr(tf, "yarn_rotary_scaling_factor")),
            original_max_position_embeddings=int(orig) if orig is not None else None,
            beta_fast=float(getattr(tf, "yarn_beta_fast", 32.0)), beta_slow=float(getattr(tf, "yarn_beta_slow", 1.0)),
            mscale=getattr(tf, "yarn_mscale", None), mscale_all_dim=getattr(tf, "yarn_mscale_all_dim", None),
            truncate=bool(getattr(tf, "yarn_correction_range_round_to_int", True)),
        ), "Megatron position_embedding_type='yarn'"
    if getattr(model, "rotary_scaling", False):
        return RopeScaling(type=RopeType.LLAMA3, factor=1.0, original_max_position_embeddings=8192), \
            "Megatron rope_scaling=True (Llama 3)"
    factor = getattr(emb, "seq_len_interpolation_factor", None)
    if factor is not None:
        return RopeScaling(type=RopeType.LINEAR, factor=float(factor)), \
            f"Megatron seq_len_interpolation_factor={factor!r}"
    return None, "Megatron's plain RoPE"


def rope_config(model: Any, hf_config: Any | None) -> RopeConfig:
    """hdp's :class:`RopeConfig` for a built Megatron ``GPTModel`` (unwrapped) and its HF config (module docstring).

    Raises ``ValueError`` naming the unsupported or inconsistent field.
    """
    kind = getattr(model, "position_embedding_type", "rope")
    if kind == "none":
        return RopeConfig(enabled=False)
    if kind not in ("rope", "yarn"):
        raise ValueError(
            f"Megatron position_embedding_type={kind!r}: hdp's core attention applies RoPE (and YaRN) only "
            "(mrope / learned_absolute are not supported)"
        )
    tf = getattr(model, "config", None)
    if getattr(tf, "rotary_interleaved", False):
        raise ValueError("Megatron rotary_interleaved=True: hdp's RoPE is the non-interleaved (rotate-half) form")
    if getattr(tf, "multi_latent_attention", False):
        return mla_rope_config(tf, hf_config)
    base = float(getattr(model, "rotary_base", 10000.0))
    percent = float(getattr(model, "rotary_percent", 1.0))
    mega, mega_what = megatron_rope_scaling(model)
    if hf_config is None:
        if mega is not None and mega.type is RopeType.LLAMA3:
            raise ValueError(
                "Megatron rope_scaling=True (Llama 3) without an HF config: Megatron keeps neither its factor nor "
                "low/high_freq_factor on the model; pass the HF config (rope_parameters) so hdp can compute it"
            )
        if mega is not None and mega.type is RopeType.YARN and percent < 1.0:
            raise ValueError(
                f"Megatron position_embedding_type='yarn' with rotary_percent={percent}: Megatron ramps YaRN over the "
                "whole head dim and transformers over the rotated part; pass the HF config to pick one"
            )
        return RopeConfig(base=base, percent=percent, scaling=mega)
    hf = _check_base(hf_config, base, percent)
    scaling = hf_rope_scaling(hf_config)
    if scaling is None and mega is not None:
        raise ValueError(
            f"{mega_what} but hf_config.rope_parameters.rope_type={hf.get('rope_type', 'default')!r}: the checkpoint "
            "declares plain RoPE; build the model from the HF config (or declare the scaling in its rope_parameters)"
        )
    if scaling is not None and mega != scaling:
        logger.warning("RoPE: the HF config declares %s (factor %s) and the Megatron model was built with %s; hdp "
                       "computes the HF config's exactly", scaling.type.value, scaling.factor, mega_what)
    return RopeConfig(base=base, percent=percent, scaling=scaling)


def _check_base(hf_config: Any, base: float, percent: float) -> dict[str, Any]:
    """HF's ``rope_theta`` / ``partial_rotary_factor`` against Megatron's ``rotary_base`` / ``rotary_percent``;
    returns :func:`hf_rope_parameters`."""
    hf = hf_rope_parameters(hf_config)
    theta = hf.get("rope_theta")
    if theta is not None and not math.isclose(float(theta), base, rel_tol=1e-9):
        raise ValueError(
            f"hf_config rope_theta={theta!r} but the Megatron model was built with rotary_base={base!r}: "
            "rebuild the model from this HF config"
        )
    factor = hf.get("partial_rotary_factor")
    if factor is not None and not math.isclose(float(factor), percent, rel_tol=1e-9):
        raise ValueError(
            f"hf_config partial_rotary_factor={factor!r} but Megatron rotary_percent={percent!r}: they must agree"
        )
    return hf


def mla_rope_config(tf_config: Any, hf_config: Any | None) -> RopeConfig:
    """hdp's :class:`RopeConfig` of MLA's decoupled RoPE part for an ``MLATransformerConfig`` and its HF config
    (module docstring): HF's frequencies and pairing when given, else Megatron's."""
    from hdp.core.mla import mla_rope_config as megatron_mla_rope

    mega = megatron_mla_rope(tf_config)  # raises on a rope_type MLA does not have
    if hf_config is None:
        return mega
    base, percent = float(tf_config.rotary_base), float(getattr(tf_config, "rotary_percent", 1.0))
    _check_base(hf_config, base, percent)
    scaling = hf_rope_scaling(hf_config)
    if scaling is not None and scaling.type is not RopeType.YARN:
        raise ValueError(f"hf_config.rope_parameters.rope_type={scaling.type.value!r} with multi-latent attention: "
                         "hdp computes MLA's decoupled RoPE plain or yarn (as Megatron's MLA)")
    interleaved = bool(getattr(hf_config, "rope_interleave", True))
    rope = RopeConfig(base=base, percent=percent, scaling=scaling, interleaved=interleaved)
    mine = (None if mega.scaling is None else (mega.scaling.type, mega.scaling.factor), mega.interleaved)
    theirs = (None if scaling is None else (scaling.type, scaling.factor), interleaved)
    if mine != theirs:
        logger.warning("MLA RoPE: the HF config declares %s (factor %s, %s pairs) and the Megatron config "
                       "rope_type=%r (rotary_scaling_factor %s, interleaved pairs); hdp computes the HF config's "
                       "exactly",
                       "yarn" if scaling else "plain RoPE", scaling.factor if scaling else 1.0,
                       "interleaved" if interleaved else "half-split", getattr(tf_config, "rope_type", None),
                       getattr(tf_config, "rotary_scaling_factor", None))
    return rope
