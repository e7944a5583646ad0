"""Which of Megatron's ``TransformerConfig`` settings change attention's math, and what hdp does with each.

hdp replaces Megatron's core attention (and its RoPE) by :class:`hdp.core.attention_spec.HdpCoreAttention`,
so every setting that changes what core attention computes must be either computed by hdp exactly or
refused at build, naming the field — never silently dropped.  :data:`FIELDS` classifies each such field
of ``TransformerConfig`` once, and :func:`check_attention_config` applies the table: both doors call
it when they install hdp's attention (through ``HdpCoreAttention``'s constructor).  A test enumerates
the fields of the installed Megatron whose names look attention-related (:data:`ATTENTION_NAME`) and
fails on one the table does not classify, so a Megatron upgrade cannot slip a new one past.

The classes (:class:`Handling`):

* ``handled``: hdp computes it exactly — ``softmax_scale`` (replaces 1/sqrt(d)), ``softmax_type``
  (``off-by-one`` / ``learnable`` sinks, merged once after every key block), ``window_size`` (a
  sliding window by sample position, across CP chunks), ``window_attn_skip_freq`` (which layers
  use it), ``no_rope_freq`` (layers without RoPE), head counts and dims;
* ``refused``: a value other than the default raises ``ValueError`` at build (:attr:`Rule.allowed`);
* ``outside``: Megatron computes it outside core attention (projections, q/k norms, the output
  gate), before or after hdp's part, in the same order as with its own core attention;
* ``no-math``: kernel choices, fusions, precision of the softmax (hdp's kernels accumulate in
  float32 or float64), Megatron's own CP (hdp runs CP itself) — nothing attention computes changes.

Multi-latent attention (``MLATransformerConfig``: DeepSeek-V2 / V3, Kimi-K2) is handled: its fields are in the
table too (a test enumerates ``MLATransformerConfig`` as well).  Megatron's ``MLASelfAttention`` computes the
low-rank projections and hands core attention q/k heads of ``qk_head_dim + qk_pos_emb_head_dim`` and value heads
of ``v_head_dim``; hdp rotates the decoupled tail (:attr:`AttentionSettings.rope_start` / ``rope_dim``) at the
sample positions with the RoPE of the MLA fields (:func:`hdp.core.mla.mla_rope_config`), and takes MLA's
``softmax_scale`` (YaRN's mscale² included) from its constructor argument.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

__all__ = [
    "Handling",
    "Rule",
    "SoftmaxType",
    "AttentionSettings",
    "FIELDS",
    "ATTENTION_NAME",
    "check_attention_config",
    "unclassified_fields",
]

ATTENTION_NAME = re.compile(
    r"attn|attention|softmax|window|rope|rotary|qk|kv|head|query|latent|sink|yarn|mscale|position|"
    r"context_parallel|cp_comm|dsa|mrope|flash|linear_|heterogen|hybrid|lora|beta_fast|beta_slow"
)
"""Field names of ``TransformerConfig`` that look attention-related: each must be in :data:`FIELDS`."""


class Handling(enum.Enum):
    """What hdp does with one ``TransformerConfig`` field (module docstring)."""

    HANDLED = "handled"
    REFUSED = "refused"
    OUTSIDE = "outside core attention (Megatron computes it)"
    NO_MATH = "no-math"


class SoftmaxType(enum.Enum):
    """Megatron's ``softmax_type``."""

    VANILLA = "vanilla"
    """Plain softmax."""
    OFF_BY_ONE = "off-by-one"
    """A constant 0 logit (``+1``) in every softmax denominator."""
    LEARNABLE = "learnable"
    """A learned logit per head (``softmax_offset``; gpt-oss ``sinks``)."""


def _unset(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == () or value == []


@dataclass(frozen=True)
class Rule:
    """How one field is treated."""

    handling: Handling
    """Its class."""
    why: str
    """What the field does, and why it is in this class (the refusal message for ``refused``)."""
    allowed: Callable[[Any], bool] = _unset
    """``refused`` only: the values that are accepted (the field's off state)."""


def _outside(why: str) -> Rule:
    return Rule(Handling.OUTSIDE, why)


def _no_math(why: str) -> Rule:
    return Rule(Handling.NO_MATH, why)


def _handled(why: str) -> Rule:
    return Rule(Handling.HANDLED, why)


def _refused(why: str, allowed: Callable[[Any], bool] = _unset) -> Rule:
    return Rule(Handling.REFUSED, why, allowed)


FIELDS: dict[str, Rule] = {
    # -- computed by hdp's core attention
    "softmax_scale": _handled("replaces 1/sqrt(head dim) in the logits"),
    "softmax_type": _handled("off-by-one / learnable softmax sinks, merged once after every key block"),
    "window_size": _handled("sliding window (left, 0) by sample position, across CP chunk boundaries"),
    "window_attn_skip_freq": _handled("which layers use the sliding window"),
    "no_rope_freq": _handled("layers whose attention applies no RoPE"),
    "num_attention_heads": _handled("query heads"),
    "num_query_groups": _handled("key/value heads (GQA)"),
    "kv_channels": _handled("head dim"),
    "apply_query_key_layer_scaling": _handled(
        "divides the logits by the layer number and the softmax multiplies them back: the same probabilities"),
    "multi_latent_attention": _handled(
        "multi-latent attention (DeepSeek-V2 / V3, Kimi-K2): Megatron's MLASelfAttention projects, hdp's core "
        "attention rotates the decoupled RoPE part at sample positions and attends with Dv != D"),
    "qk_head_dim": _handled("MLA: the un-rotated part of each query/key head"),
    "qk_pos_emb_head_dim": _handled("MLA: the decoupled RoPE part after it (hdp rotates it, interleaved pairs)"),
    "v_head_dim": _handled("MLA: value head dim (Dv != D in the kernels and both CP algorithms)"),
    "rope_type": _handled("MLA: 'rope' or 'yarn' frequencies of the decoupled part (hdp.core.mla.mla_rope_config)"),
    "rotary_base": _handled("MLA: RoPE base of the decoupled part"),
    "rotary_percent": _handled("MLA: fraction of the decoupled part that is rotated"),
    "rotary_scaling_factor": _handled("MLA yarn: factor f (and, with mscale_all_dim, MLA's softmax_scale)"),
    "original_max_position_embeddings": _handled("MLA yarn: pretraining length L0"),
    "beta_fast": _handled("MLA yarn: ramp bound"),
    "beta_slow": _handled("MLA yarn: ramp bound"),
    "mscale": _handled("MLA yarn: numerator of the attention factor on cos/sin"),
    "mscale_all_dim": _handled("MLA yarn: denominator of the attention factor; MLA's softmax_scale takes its square"),
    # -- refused unless off
    "attention_dropout": _refused("attention dropout: hdp's kernels have none; set it to 0.0"),
    "rotary_interleaved": _refused("interleaved RoPE: hdp rotates halves (Llama / Qwen layout); set it to False"),
    "cache_mla_latents": _refused("MLA latent caching is for Megatron's dynamic inference; hdp trains: set it to "
                                  "False"),
    "experimental_attention_variant": _refused(
        "experimental attention variants (gated delta net, DSA): not computed by hdp's core attention"),
    "linear_attention_freq": _refused("hybrid linear-attention layers (Qwen3-Next): not computed by hdp"),
    "dsa_indexer_n_heads": _refused("DeepSeek sparse attention's indexer: not computed by hdp"),
    "dsa_indexer_head_dim": _refused("DeepSeek sparse attention's indexer: not computed by hdp"),
    "dsa_indexer_topk": _refused("DeepSeek sparse attention's indexer: not computed by hdp"),
    "dsa_indexer_loss_coeff": _refused("DeepSeek sparse attention's indexer loss: not computed by hdp"),
    "dsa_indexer_use_sparse_loss": _refused("DeepSeek sparse attention's indexer loss: not computed by hdp"),
    "qk_clip": _refused("QK-clip needs the max attention logit of every head, which hdp's core attention does "
                        "not record; set it to False"),
    "log_max_attention_logit": _refused("hdp's core attention does not record the max attention logit; set it "
                                        "to False"),
    "fp8_dot_product_attention": _refused("FP8 attention: hdp's kernels run in the input dtype; set it to False"),
    "fp8_multi_head_attention": _refused("FP8 attention: hdp's kernels run in the input dtype; set it to False"),
    "use_kitchen_attention": _refused("Kitchen attention replaces core attention, as hdp does; set it to False"),
    "flash_decode": _refused("flash decoding (inference): hdp's core attention trains; set it to False"),
    "mrope_section": _refused("multimodal RoPE (mrope, Qwen2-VL): hdp applies 1-D RoPE only"),
    "context_parallel_size": _refused("Megatron's CP: hdp runs context parallelism itself (Megatron CP = 1)",
                                      lambda v: v in (None, 1)),
    "hierarchical_context_parallel_sizes": _refused("Megatron's hierarchical CP: hdp runs CP itself"),
    "hybrid_context_parallel": _refused("Megatron's hybrid CP: hdp runs CP itself"),
    "is_hybrid_model": _refused("hybrid Mamba / attention models: hdp's engine builds transformer layers"),
    "heterogeneous_block_specs": _refused("per-layer block configs: hdp classifies one TransformerConfig"),
    # -- Megatron computes these outside core attention, in the same order as with its own
    "add_qkv_bias": _outside("bias of the QKV projection"),
    "q_lora_rank": _outside("MLA: rank of the query down-projection (None: one projection), Megatron's"),
    "kv_lora_rank": _outside("MLA: rank of the key/value down-projection, Megatron's"),
    "qk_layernorm": _outside("q/k norms, applied by Megatron's self-attention before RoPE"),
    "qk_l2_norm": _outside("q/k L2 norms (Llama 4), in the q/k norm slot before RoPE"),
    "attention_output_gate": _outside("gate on the attention output, applied by Megatron's self-attention"),
    "qk_clip_alpha": _outside("QK-clip's optimizer-side parameter (QK-clip itself is refused)"),
    "qk_clip_threshold": _outside("QK-clip's optimizer-side parameter (QK-clip itself is refused)"),
    "glu_linear_offset": _outside("MLP activation"),
    "gated_linear_unit": _outside("MLP activation (gated)"),
    "linear_conv_kernel_dim": _outside("linear-attention layers only (refused with linear_attention_freq)"),
    "linear_key_head_dim": _outside("linear-attention layers only (refused with linear_attention_freq)"),
    "linear_value_head_dim": _outside("linear-attention layers only (refused with linear_attention_freq)"),
    "linear_num_key_heads": _outside("linear-attention layers only (refused with linear_attention_freq)"),
    "linear_num_value_heads": _outside("linear-attention layers only (refused with linear_attention_freq)"),
    "moe_router_pre_softmax": _outside("MoE router"),
    "moe_latent_size": _outside("MoE latent projection"),
    "moe_hybridep_num_sms": _outside("MoE dispatcher"),
    "mamba_head_dim": _outside("Mamba layers (hybrid models are refused)"),
    "mamba_num_heads": _outside("Mamba layers (hybrid models are refused)"),
    # -- no change to the math
    "attention_backend": _no_math("which core attention Megatron builds; hdp replaces it"),
    "attention_softmax_in_fp32": _no_math("softmax precision: hdp's kernels accumulate in float32 (float64 inputs: "
                                          "float64)"),
    "masked_softmax_fusion": _no_math("a fused kernel of Megatron's softmax"),
    "apply_rope_fusion": _no_math("a fused RoPE kernel: hdp applies RoPE itself and then takes the device's fused "
                                  "kernel (hdp.kernels.fusions.rotate); same math"),
    "fused_single_qkv_rope": _no_math("a fused QKV + RoPE kernel; Megatron's RoPE is off under hdp"),
    "kitchen_attention_backend": _no_math("Kitchen's backend (Kitchen attention itself is refused)"),
    "tp_comm_overlap_disable_qkv": _no_math("TP communication overlap"),
    "ep_overlap_early_attn_memory_release": _no_math("memory release timing"),
    "cp_comm_type": _no_math("Megatron's CP communication (Megatron CP is 1 under hdp)"),
}
"""Every attention-related ``TransformerConfig`` field (:data:`ATTENTION_NAME`), classified."""


@dataclass(frozen=True, kw_only=True)
class AttentionSettings:
    """The attention math a ``TransformerConfig`` asks for, as hdp computes it (one per model)."""

    softmax_scale: float | None = None
    """Logit scale; ``None``: 1/sqrt(head dim)."""
    softmax_type: SoftmaxType = SoftmaxType.VANILLA
    """Softmax sinks."""
    window: int | None = None
    """Sliding window: keys at most this many sample positions before the query; ``None``: none."""
    window_layers: tuple[bool, ...] | None = None
    """Per layer (1-based layer l at index l-1): whether it uses :attr:`window`; ``None``: every layer."""
    no_rope_layers: tuple[bool, ...] | None = None
    """Per layer: whether it skips RoPE; ``None``: no layer does."""
    rope_start: int = 0
    """First rotated dim of each query/key head: 0, or MLA's ``qk_head_dim`` (its decoupled RoPE part follows)."""
    rope_dim: int | None = None
    """Dims of the RoPE part from :attr:`rope_start` (MLA's ``qk_pos_emb_head_dim``); ``None``: the rest of the
    head.  ``RopeConfig.percent`` of it is rotated."""

    def __post_init__(self) -> None:
        if self.softmax_scale is not None and not (math.isfinite(self.softmax_scale) and self.softmax_scale > 0):
            raise ValueError(f"softmax_scale={self.softmax_scale!r}: must be a finite number > 0, or None")
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 0):
            raise ValueError(f"window={self.window!r}: must be an integer >= 0, or None")
        if isinstance(self.rope_start, bool) or not isinstance(self.rope_start, int) or self.rope_start < 0:
            raise ValueError(f"rope_start={self.rope_start!r}: must be an integer >= 0")
        if self.rope_dim is not None and (isinstance(self.rope_dim, bool) or not isinstance(self.rope_dim, int)
                                          or self.rope_dim < 2 or self.rope_dim % 2):
            raise ValueError(f"rope_dim={self.rope_dim!r}: must be an even integer >= 2, or None")

    @property
    def is_mla(self) -> bool:
        """Whether the heads carry a decoupled RoPE part (multi-latent attention)."""
        return self.rope_dim is not None

    def window_for(self, layer_number: int) -> int | None:
        """The window of 1-based layer ``layer_number`` (``None``: full causal attention)."""
        if self.window is None:
            return None
        if self.window_layers is None:
            return self.window
        if not 1 <= layer_number <= len(self.window_layers):
            raise ValueError(f"layer_number={layer_number}: the window pattern covers layers 1..{len(self.window_layers)}")
        return self.window if self.window_layers[layer_number - 1] else None

    def rope_for(self, layer_number: int) -> bool:
        """Whether 1-based layer ``layer_number`` applies RoPE."""
        if self.no_rope_layers is None:
            return True
        if not 1 <= layer_number <= len(self.no_rope_layers):
            raise ValueError(f"layer_number={layer_number}: no_rope_freq covers layers 1..{len(self.no_rope_layers)}")
        return not self.no_rope_layers[layer_number - 1]


def unclassified_fields(config_cls: type) -> list[str]:
    """Fields of the dataclass ``config_cls`` whose names match :data:`ATTENTION_NAME` but are not in :data:`FIELDS`."""
    return [f.name for f in dataclasses.fields(config_cls) if ATTENTION_NAME.search(f.name) and f.name not in FIELDS]


def _window(config: Any) -> int | None:
    size = getattr(config, "window_size", None)
    if size is None:
        return None
    try:
        left, right = (int(x) for x in size)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"TransformerConfig.window_size={size!r}: expected (left, right), e.g. (4095, 0)") from exc
    if right != 0:
        raise ValueError(
            f"TransformerConfig.window_size={tuple(size)!r}: a right window of {right} lets tokens see later tokens "
            "(-1: all of them); hdp's attention is causal, so pass (left, 0)"
        )
    if left < 0:
        return None  # left = -1: unbounded on the left, i.e. full causal attention
    return left


def _layer_pattern(value: Any, num_layers: int, name: str, every: Callable[[int, int], bool]) -> tuple[bool, ...] | None:
    """Megatron's int-or-list per-layer patterns as one bool per layer (``every(layer, n)`` for an int ``n``)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"TransformerConfig.{name}={value}: must be a positive integer or a per-layer list")
        return tuple(every(layer, value) for layer in range(1, num_layers + 1))
    try:
        out = tuple(bool(x) for x in value)
    except TypeError as exc:
        raise ValueError(f"TransformerConfig.{name}={value!r}: expected an integer or one entry per layer") from exc
    if len(out) != num_layers:
        raise ValueError(f"TransformerConfig.{name} has {len(out)} entries for {num_layers} layers; give one per layer")
    return out


def _mla_head(config: Any) -> tuple[int, int]:
    """(rope_start, rope_dim) of an ``MLATransformerConfig``: its ``qk_head_dim`` and ``qk_pos_emb_head_dim``."""
    for name in ("qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        value = getattr(config, name, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"TransformerConfig.{name}={value!r}: multi_latent_attention=True needs a positive "
                             "integer (build an MLATransformerConfig)")
    if config.qk_pos_emb_head_dim % 2:
        raise ValueError(f"TransformerConfig.qk_pos_emb_head_dim={config.qk_pos_emb_head_dim}: the RoPE part must be "
                         "even (pairs of dims rotate together)")
    rope_type = getattr(config, "rope_type", "yarn")
    if rope_type not in ("rope", "yarn"):
        raise ValueError(f"TransformerConfig.rope_type={rope_type!r}: MLA's RoPE is 'rope' or 'yarn'")
    return int(config.qk_head_dim), int(config.qk_pos_emb_head_dim)


def check_attention_config(config: Any) -> AttentionSettings:
    """Apply :data:`FIELDS` to a Megatron ``TransformerConfig``: raise on a refused setting, return the settings
    hdp computes.

    ``ValueError`` names the field, its value and the fix.  A field the table does not know is not looked
    at here (the enumerating test keeps the table complete for the installed Megatron).
    """
    for name, rule in FIELDS.items():
        if rule.handling is not Handling.REFUSED or not hasattr(config, name):
            continue
        value = getattr(config, name)
        if not rule.allowed(value):
            raise ValueError(f"TransformerConfig.{name}={value!r}: {rule.why} (hdp's core attention refuses it)")
    try:
        kind = SoftmaxType(getattr(config, "softmax_type", "vanilla") or "vanilla")
    except ValueError as exc:
        raise ValueError(
            f"TransformerConfig.softmax_type={config.softmax_type!r}: choose one of {[t.value for t in SoftmaxType]}"
        ) from exc
    num_layers = int(getattr(config, "num_layers", 0) or 0)
    window = _window(config)
    window_layers = None
    if window is not None:
        # Megatron's is_layer_window_attention: an int n keeps full attention on every n-th layer
        window_layers = _layer_pattern(getattr(config, "window_attn_skip_freq", None), num_layers,
                                       "window_attn_skip_freq", lambda layer, n: layer % n != 0)
    no_rope = _layer_pattern(getattr(config, "no_rope_freq", None), num_layers, "no_rope_freq",
                             lambda layer, n: layer % n == 0)
    scale = getattr(config, "softmax_scale", None)
    rope_start, rope_dim = 0, None
    if getattr(config, "multi_latent_attention", False):
        rope_start, rope_dim = _mla_head(config)
        if no_rope is not None:
            raise ValueError(f"TransformerConfig.no_rope_freq={config.no_rope_freq!r} with multi_latent_attention: "
                             "Megatron's MLA rotates on every layer; set no_rope_freq=None")
    try:
        return AttentionSettings(softmax_scale=None if scale is None else float(scale), softmax_type=kind,
                                 window=window, window_layers=window_layers, no_rope_layers=no_rope,
                                 rope_start=rope_start, rope_dim=rope_dim)
    except ValueError as exc:
        raise ValueError(f"TransformerConfig.{exc}") from None
