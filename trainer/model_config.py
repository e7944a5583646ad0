"""The model and optimizer configurations of the library door: frozen, validated dataclasses.

:class:`ModelConfig` (a Megatron GPT's shape and the attention, RoPE, MoE and MLA settings hdp computes or
refuses), :class:`MLAConfig` (multi-latent attention's dimensions) and :class:`OptimConfig`; the builders that
turn them into Megatron modules are :mod:`hdp.trainer.model`'s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import torch

from hdp.rope import RopeScaling, RopeType
from hdp.core.attention_config import SoftmaxType
from hdp.core.attention_spec import CoreAttentionBackend
from hdp.packing.model_shape import ModelShape
from hdp.packing.moved import Moved, MovedFields
from hdp.trainer.parallel import ParallelConfig

__all__ = ["MLAConfig", "ModelConfig", "OptimConfig"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


@dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Multi-latent attention (DeepSeek-V2 / V3, Kimi-K2): the fields of Megatron's ``MLATransformerConfig``
    (HF ``DeepseekV3Config`` names in brackets).  Its RoPE is the model's (``ModelConfig.rotary_base`` and
    ``rope_scaling``: plain or ``yarn``) applied to the decoupled part of each head; see :mod:`hdp.core.mla`."""

    q_lora_rank: int | None = None
    """Rank of the query down-projection (``q_lora_rank``); ``None``: one query projection (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 512
    """Rank of the key/value down-projection (``kv_lora_rank``)."""
    qk_head_dim: int = 128
    """Un-rotated part of each query/key head (``qk_nope_head_dim``)."""
    qk_pos_emb_head_dim: int = 64
    """Decoupled RoPE part of each query/key head, one key part shared by the heads (``qk_rope_head_dim``)."""
    v_head_dim: int = 128
    """Value head dim (``v_head_dim``)."""
    rope_interleaved: bool = True
    """The RoPE part rotates adjacent pairs (``rope_interleave``; Megatron's MLA always does); ``False`` rotates
    halves (computed by hdp; Megatron's own MLA cannot)."""

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if not _positive_int(getattr(self, name)):
                raise ValueError(f"MLAConfig.{name}={getattr(self, name)!r}: pass a positive integer")
        if self.q_lora_rank is not None and not _positive_int(self.q_lora_rank):
            raise ValueError(f"MLAConfig.q_lora_rank={self.q_lora_rank!r}: pass a positive integer or None")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"MLAConfig.qk_pos_emb_head_dim={self.qk_pos_emb_head_dim}: must be even (pairs of "
                             "dims rotate together)")
        if not isinstance(self.rope_interleaved, bool):
            raise ValueError(f"MLAConfig.rope_interleaved={self.rope_interleaved!r}: pass True or False")

    @property
    def qk_dim(self) -> int:
        """Query/key head dim: ``qk_head_dim + qk_pos_emb_head_dim``."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim


@dataclass(frozen=True, kw_only=True)
class ModelConfig(MovedFields):
    """Shape of the GPT model."""

    _MOVED: ClassVar[Mapping[str, Moved]] = {
        "expert_model_parallel_size": Moved("ParallelConfig.ep", "2026-12-01",
                                            how="EngineConfig(parallel=ParallelConfig(ep=...))",
                                            read="EngineConfig.parallel.ep"),
    }
    """Keywords that moved (`hdp.packing.moved`): a TypeError naming the new place."""

    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int | None = None
    """Key/value heads (GQA); ``None``: same as ``num_attention_heads``."""
    ffn_hidden_size: int | None = None
    """Dense MLP width; ``None``: 4 × hidden_size."""
    vocab_size: int = 256
    """Vocabulary size."""
    max_sequence_length: int = 65536
    """Longest sample the model accepts."""
    rotary_base: float = 10000.0
    """RoPE base theta (applied by hdp attention)."""
    rotary_percent: float = 1.0
    """Fraction of the head dim RoPE rotates (HF ``partial_rotary_factor``)."""
    rope_scaling: RopeScaling | None = None
    """RoPE frequency variant (``llama3``, ``yarn``, ``linear``, ``dynamic``; :class:`hdp.rope.RopeScaling`);
    ``None``: plain RoPE."""
    kv_channels: int | None = None
    """Head dim; ``None``: hidden_size / num_attention_heads."""
    qk_layernorm: bool = False
    """RMS/LayerNorm on each query and key head before RoPE (Qwen3)."""
    add_qkv_bias: bool = False
    """Bias in the QKV projection (Qwen2)."""
    norm_epsilon: float = 1e-5
    """Epsilon of every norm layer (HF ``rms_norm_eps``)."""
    window_size: int | None = None
    """Sliding-window attention: each token sees the keys at most this many positions before it (Megatron
    ``window_size=(w, 0)``; HF ``sliding_window = w + 1``); ``None``: full causal attention."""
    window_attn_skip_freq: int | tuple[bool, ...] | None = None
    """Which layers use the window (Megatron's): an int n keeps full attention on every n-th layer, a tuple has
    one entry per layer (True: window); ``None``: every layer."""
    softmax_type: SoftmaxType = SoftmaxType.VANILLA
    """Softmax sinks: ``off-by-one`` (+1 in every denominator) or ``learnable`` (one logit per head, gpt-oss)."""
    softmax_scale: float | None = None
    """Attention logit scale; ``None``: 1 / sqrt(head dim)."""
    mla: MLAConfig | None = None
    """Multi-latent attention (:class:`MLAConfig`); ``None``: multi-head / grouped-query attention.  With it,
    ``qk_layernorm`` puts RMS norms on the query and key/value latents (DeepSeek's ``q_a_layernorm`` /
    ``kv_a_layernorm``), and ``num_query_groups`` / ``kv_channels`` / ``add_qkv_bias`` do not apply."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "RMSNorm"
    """Norm layer type."""
    num_moe_experts: int | None = None
    """Experts per MoE layer; ``None``: dense MLP."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """Expert MLP width; ``None``: ffn_hidden_size."""
    moe_layer_freq: int | tuple[int, ...] = 1
    """Which layers are MoE (Megatron's): an int n makes every n-th layer (0, n, 2n, ...) MoE, a tuple has one
    entry per layer (1: MoE, 0: dense MLP of ``ffn_hidden_size``; DeepSeek's ``first_k_dense_replace`` = k
    leading zeros)."""
    moe_shared_expert_intermediate_size: int | None = None
    """Width of the shared experts every token also runs (DeepSeek: ``moe_intermediate_size · n_shared_experts``);
    ``None``: none."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: ``softmax`` over the top-k logits (Qwen-MoE, Mixtral) or ``sigmoid`` of each logit,
    normalised over the top k (DeepSeek-V3)."""
    moe_router_enable_expert_bias: bool = False
    """A per-expert bias added to the scores for the choice only (DeepSeek-V3's ``e_score_correction_bias``),
    updated after every step by Megatron from the tokens each expert got (``moe_router_bias_update_rate``)."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of that update."""
    moe_router_num_groups: int | None = None
    """Group-limited routing: experts in this many equal groups (DeepSeek-V3's ``n_group``); ``None``: off."""
    moe_router_group_topk: int | None = None
    """Groups each token may use (``topk_group``), ranked by the sum of their top ``topk / group_topk`` scores."""
    moe_router_topk_scaling_factor: float | None = None
    """Multiplies the routing weights (DeepSeek's ``routed_scaling_factor``); ``None``: 1."""
    moe_grouped_gemm: bool = False
    """Experts as Megatron's ``GroupedMLP`` (all local experts in one grouped GEMM per projection;
    weights ``experts.weight1`` [H, L·F1] and ``experts.weight2`` [L·F, H]) instead of per-expert MLPs
    (``SequentialMLP``).  Megatron's ``GroupedMLP`` runs bfloat16 only (``params_dtype='bfloat16'``);
    on CPU its grouped-GEMM calls run torch's ``grouped_mm`` (hdp's CPU shim), on GPUs Megatron calls
    the ``grouped_gemm`` package.  MoE zero-memory takes both kinds."""
    attention_backend: CoreAttentionBackend = CoreAttentionBackend.HDP
    """Core attention module."""
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype."""
    init_method_std: float = 0.02
    """Std of the normal weight init."""
    share_embeddings_and_output_weights: bool = False
    """Tie input embedding and output layer."""
    activation: Literal["gelu", "swiglu"] = "gelu"
    """MLP (dense and expert) activation: ``gelu`` (plain fc1 -> gelu -> fc2) or ``swiglu`` (gated:
    fc1 is 2 × ffn wide, silu(first half) · second half, as in Llama / Qwen3)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute (Megatron's): ``none``; ``selective`` (core attention recomputed in
    backward: ``recompute_modules=['core_attn']``); ``full`` (every layer keeps only its input and
    reruns its forward in backward: ``recompute_granularity='full'``, uniform, one layer per unit).
    The memory model (`hdp.packing.memory`) prices each mode."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"ModelConfig.hidden_size={self.hidden_size}: must be a multiple of "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"ModelConfig.num_query_groups={self.num_query_groups}: must divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.activation not in ("gelu", "swiglu"):
            raise ValueError(f"ModelConfig.activation={self.activation!r}: choose 'gelu' or 'swiglu'")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"ModelConfig.recompute={self.recompute!r}: choose 'none', 'selective' or 'full'")
        if self.params_dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.params_dtype={self.params_dtype!r}: choose one of {list(_DTYPES)}")
        if self.moe_grouped_gemm and self.num_moe_experts is None:
            raise ValueError("ModelConfig.moe_grouped_gemm=True: needs a MoE model; set num_moe_experts "
                             "or moe_grouped_gemm=False")
        if self.moe_grouped_gemm and self.params_dtype != "bfloat16":
            raise ValueError(f"ModelConfig.moe_grouped_gemm=True with params_dtype={self.params_dtype!r}: Megatron's "
                             "GroupedMLP runs bfloat16 only; set params_dtype='bfloat16' or moe_grouped_gemm=False")
        if self.num_moe_experts is not None and not 1 <= self.moe_router_topk <= self.num_moe_experts:
            raise ValueError(
                f"ModelConfig.moe_router_topk={self.moe_router_topk}: must be in [1, {self.num_moe_experts}]"
            )
        self._check_attention()
        self._check_mla()
        self._check_moe()

    def _check_mla(self) -> None:
        """MLA's fields against the rest (Megatron's MLA takes the RoPE variants ``rope`` and ``yarn`` only)."""
        if self.mla is None:
            return
        if not isinstance(self.mla, MLAConfig):
            raise ValueError(f"ModelConfig.mla={self.mla!r}: pass a hdp.trainer.model.MLAConfig or None")
        rs = self.rope_scaling
        if rs is not None and rs.type is not RopeType.YARN:
            raise ValueError(f"ModelConfig.rope_scaling type {rs.type.value!r} with mla: Megatron's MLA computes plain "
                             "RoPE or yarn only; pass rope_scaling=None or a yarn RopeScaling")
        if rs is not None and rs.attention_factor is not None:
            raise ValueError(f"ModelConfig.rope_scaling.attention_factor={rs.attention_factor} with mla: Megatron's MLA "
                             "derives it from mscale / mscale_all_dim; pass those instead")
        if rs is not None and not rs.truncate:
            raise ValueError("ModelConfig.rope_scaling.truncate=False with mla: Megatron's MLA rounds YaRN's correction "
                             "range to whole dims; pass truncate=True")
        if rs is not None and self.rotary_percent != 1.0:
            raise ValueError(f"ModelConfig.rotary_percent={self.rotary_percent} with mla and yarn: Megatron's MLA rotates "
                             "the whole RoPE part under yarn; pass rotary_percent=1.0")
        for name in ("num_query_groups", "kv_channels"):
            if getattr(self, name) is not None:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} with mla: MLA's heads are set by "
                                 "MLAConfig (every head has its own key and value); pass None")
        if self.add_qkv_bias:
            raise ValueError("ModelConfig.add_qkv_bias=True with mla: MLA's projections have no bias")

    def _check_moe(self) -> None:
        """The MoE router and layer-pattern fields."""
        moe_only = {"moe_shared_expert_intermediate_size": self.moe_shared_expert_intermediate_size is not None,
                    "moe_router_score_function": self.moe_router_score_function != "softmax",
                    "moe_router_enable_expert_bias": self.moe_router_enable_expert_bias,
                    "moe_router_num_groups": self.moe_router_num_groups is not None,
                    "moe_router_topk_scaling_factor": self.moe_router_topk_scaling_factor is not None,
                    "moe_layer_freq": self.moe_layer_freq != 1}
        if self.num_moe_experts is None:
            for name, set_ in moe_only.items():
                if set_:
                    raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}: needs a MoE model; set "
                                     "num_moe_experts")
            return
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"ModelConfig.moe_router_score_function={self.moe_router_score_function!r}: choose "
                             "'softmax' or 'sigmoid'")
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError("ModelConfig.moe_router_enable_expert_bias=True: Megatron's expert bias needs "
                             "moe_router_score_function='sigmoid'")
        if self.moe_shared_expert_intermediate_size is not None and not _positive_int(
                self.moe_shared_expert_intermediate_size):
            raise ValueError(f"ModelConfig.moe_shared_expert_intermediate_size="
                             f"{self.moe_shared_expert_intermediate_size!r}: pass a positive integer or None")
        groups, gtop = self.moe_router_num_groups, self.moe_router_group_topk
        if (groups is None) != (gtop is None):
            raise ValueError(f"ModelConfig.moe_router_num_groups={groups!r}, moe_router_group_topk={gtop!r}: set both "
                             "(group-limited routing) or neither")
        if groups is not None:
            if not (_positive_int(groups) and _positive_int(gtop) and self.num_moe_experts % groups == 0
                    and gtop <= groups and self.moe_router_topk % gtop == 0):
                raise ValueError(
                    f"ModelConfig.moe_router_num_groups={groups}, moe_router_group_topk={gtop}: need groups dividing "
                    f"num_moe_experts={self.num_moe_experts}, group_topk <= groups and dividing "
                    f"moe_router_topk={self.moe_router_topk}")
        factor = self.moe_router_topk_scaling_factor
        if factor is not None and not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"ModelConfig.moe_router_topk_scaling_factor={factor!r}: pass a finite number > 0 or None")
        freq = self.moe_layer_freq
        if isinstance(freq, bool) or not isinstance(freq, (int, tuple)):
            raise ValueError(f"ModelConfig.moe_layer_freq={freq!r}: pass an int or a tuple of 0/1 per layer")
        if isinstance(freq, int) and freq < 1:
            raise ValueError(f"ModelConfig.moe_layer_freq={freq}: must be >= 1")
        if isinstance(freq, tuple) and (len(freq) != self.num_layers or any(x not in (0, 1) for x in freq)):
            raise ValueError(f"ModelConfig.moe_layer_freq={freq!r}: give one 0 (dense) or 1 (MoE) per layer "
                             f"(num_layers={self.num_layers})")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether 0-based layer ``layer`` has a MoE MLP (Megatron's ``moe_layer_freq``)."""
        if self.num_moe_experts is None:
            return False
        freq = self.moe_layer_freq
        return bool(freq[layer]) if isinstance(freq, tuple) else layer % freq == 0

    def _check_attention(self) -> None:
        """The attention fields (typed and validated here; the Megatron side by ``check_attention_config``)."""
        if not (isinstance(self.norm_epsilon, (int, float)) and 0 < self.norm_epsilon < 1):
            raise ValueError(f"ModelConfig.norm_epsilon={self.norm_epsilon!r}: pass a small positive number (1e-5, 1e-6)")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"ModelConfig.rotary_percent={self.rotary_percent}: must be in (0, 1]")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"ModelConfig.rope_scaling={self.rope_scaling!r}: pass a hdp.rope.RopeScaling or None")
        limit = self.rope_scaling.max_positions if self.rope_scaling is not None else None
        if limit is not None and self.max_sequence_length > limit:
            raise ValueError(
                f"ModelConfig.max_sequence_length={self.max_sequence_length}: rope_scaling type "
                f"{self.rope_scaling.type.value} is exact only for samples of at most "  # type: ignore[union-attr]
                f"original_max_position_embeddings={limit} tokens; set max_sequence_length <= {limit}"
            )
        if self.kv_channels is not None and (isinstance(self.kv_channels, bool) or not isinstance(self.kv_channels, int)
                                             or self.kv_channels < 2):
            raise ValueError(f"ModelConfig.kv_channels={self.kv_channels!r}: pass the head dim (an integer >= 2) or None")
        if self.window_size is not None and (isinstance(self.window_size, bool) or not isinstance(self.window_size, int)
                                             or self.window_size < 0):
            raise ValueError(f"ModelConfig.window_size={self.window_size!r}: pass an integer >= 0 or None")
        skip = self.window_attn_skip_freq
        if skip is not None:
            if self.window_size is None:
                raise ValueError(f"ModelConfig.window_attn_skip_freq={skip!r}: set window_size too")
            if isinstance(skip, bool) or not isinstance(skip, (int, tuple)):
                raise ValueError(f"ModelConfig.window_attn_skip_freq={skip!r}: pass an int or a tuple of bools")
            if isinstance(skip, int) and skip < 1:
                raise ValueError(f"ModelConfig.window_attn_skip_freq={skip}: must be >= 1")
            if isinstance(skip, tuple) and len(skip) != self.num_layers:
                raise ValueError(
                    f"ModelConfig.window_attn_skip_freq has {len(skip)} entries for num_layers={self.num_layers}"
                )
        if not isinstance(self.softmax_type, SoftmaxType):
            try:
                object.__setattr__(self, "softmax_type", SoftmaxType(self.softmax_type))
            except ValueError as exc:
                raise ValueError(
                    f"ModelConfig.softmax_type={self.softmax_type!r}: choose one of {[t.value for t in SoftmaxType]}"
                ) from exc
        if self.softmax_scale is not None and not (isinstance(self.softmax_scale, (int, float))
                                                   and math.isfinite(self.softmax_scale) and self.softmax_scale > 0):
            raise ValueError(f"ModelConfig.softmax_scale={self.softmax_scale!r}: pass a finite number > 0 or None")

    @property
    def head_dim(self) -> int:
        """Query/key head dim (MLA: ``qk_head_dim + qk_pos_emb_head_dim``)."""
        if self.mla is not None:
            return self.mla.qk_dim
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixture-of-experts layers."""
        return self.num_moe_experts is not None

    def shape(self) -> ModelShape:
        """This model's `hdp.packing.model_shape.ModelShape` (the planner's view: cost and memory models)."""
        heads = self.num_attention_heads
        ffn = self.ffn_hidden_size or 4 * self.hidden_size
        return ModelShape(
            name="hdp-gpt", num_layers=self.num_layers, hidden_size=self.hidden_size, num_heads=heads,
            num_kv_heads=(self.num_query_groups if self.mla is None else None) or heads, head_dim=self.head_dim,
            ffn_hidden_size=ffn, v_head_dim=self.mla.v_head_dim if self.mla is not None else None,
            shared_ffn_hidden_size=self.moe_shared_expert_intermediate_size or 0,
            vocab_size=self.vocab_size, num_experts=self.num_moe_experts or 0,
            topk=self.moe_router_topk if self.num_moe_experts else 0,
            moe_ffn_hidden_size=(self.moe_ffn_hidden_size or ffn) if self.num_moe_experts else 0,
            gated=self.activation == "swiglu", dtype_bytes=4 if self.params_dtype == "float32" else 2,
        )


@dataclass(frozen=True, kw_only=True)
class OptimConfig(MovedFields):
    """Adam with Megatron's distributed optimizer."""

    lr: float = 1e-3
    """Learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 0.0
    """Global grad-norm clip; 0 disables clipping."""
    bucket_size: int | None = None
    """DDP bucket size in elements; ``None``: Megatron's default."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"OptimConfig.lr={self.lr}: must be > 0")
        if self.clip_grad < 0:
            raise ValueError(f"OptimConfig.clip_grad={self.clip_grad}: must be >= 0 (0 disables)")
