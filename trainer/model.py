"""Megatron-core GPT models for hdp: build, wrap in DDP, distributed optimizer, packed forward.

The model is Megatron's ``GPTModel`` (dense, or MoE with the alltoall token dispatcher) from the
local (non-TE) layer spec, with core attention swapped for :mod:`hdp.core.attention_spec`'s
backend, hdp's norm (:class:`HdpNorm`, sequence-parallel aware) and Megatron's RoPE off (hdp
applies RoPE inside attention, at per-sample positions of the local zigzag tokens).  Megatron is
initialised with the job's TP × PP (× EP) layout and CP = 1 over the domain
(:func:`hdp.megatron_compat.initialize_megatron`); hdp supplies CP inside attention.  Every
builder takes Megatron's process groups explicitly (``groups``, a ``ProcessGroupCollection``).

Per-token loss: ``TransformerConfig.calculate_per_token_loss=True`` makes Megatron's DDP *sum*
gradients over the domain (no 1/N scaling), so each rank's loss is the sum of its tokens' losses
divided by the *global* token count and the reduced gradient is the global token-mean gradient,
however many tokens each rank holds.

Under tensor parallelism the output layer's logits are this TP rank's vocabulary shard
[T, V/TP]; :func:`hdp.logprobs.logprobs_entropy` reduces over the TP group (explicitly named) so
every TP rank gets the full-vocabulary log-probabilities and entropies.

Legend: T packed tokens of a micro-batch, V vocabulary, Vl = V/TP local vocabulary shard.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Callable, ClassVar, Literal, Sequence

import torch

from hdp import megatron_compat as mc
from hdp.rope import RopeScaling, RopeType
from hdp.core.attention_config import SoftmaxType
from hdp.core.attention_spec import (
    CoreAttentionBackend,
    HdpPackedSeqParams,
    RopeConfig,
    core_attention_module,
)
from hdp.packing.model_shape import ModelShape
from hdp.packing.moved import Moved, MovedFields
from hdp.trainer.parallel import ParallelConfig

__all__ = [
    "MLAConfig",
    "ModelConfig",
    "OptimConfig",
    "HdpNorm",
    "transformer_config",
    "layer_spec",
    "build_gpt_model",
    "build_model_chunks",
    "wrap_ddp",
    "build_optimizer",
    "packed_logits",
    "token_logprobs",
    "global_param_name",
    "global_param_names",
    "init_parameters",
]

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


class HdpNorm:
    """Megatron's torch norm (``LayerNorm`` / ``RMSNorm``) that also runs under sequence parallelism.

    Megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel`` because torch's norms do not mark
    their weights; this builds the same torch module and marks each weight with
    ``sequence_parallel`` so that Megatron's ``finalize_model_grads`` all-reduces its gradient over
    the TP group (each TP rank saw only its sequence shard).  Same numerics as ``WrappedTorchNorm``.
    """

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> torch.nn.Module:  # type: ignore[misc]
        del kwargs
        if config.normalization == "LayerNorm":
            norm: torch.nn.Module = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization={config.normalization!r}: HdpNorm supports LayerNorm and RMSNorm")
        for p in norm.parameters():
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))
        return norm


def transformer_config(
    cfg: ModelConfig, parallel: ParallelConfig, device: torch.device | str
) -> mc.TransformerConfig:
    """Megatron ``TransformerConfig`` for ``cfg`` under ``parallel`` (CP = 1, no dropout, per-token
    loss, variable sequence lengths between pipeline stages)."""
    dtype = _DTYPES[cfg.params_dtype]
    kwargs: dict[str, object] = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization=cfg.normalization,
        kv_channels=cfg.kv_channels,
        qk_layernorm=cfg.qk_layernorm,
        add_qkv_bias=cfg.add_qkv_bias,
        layernorm_epsilon=cfg.norm_epsilon,
        window_size=(cfg.window_size, 0) if cfg.window_size is not None else None,
        window_attn_skip_freq=(list(cfg.window_attn_skip_freq) if isinstance(cfg.window_attn_skip_freq, tuple)
                               else cfg.window_attn_skip_freq),
        softmax_type=cfg.softmax_type.value,
        softmax_scale=cfg.softmax_scale,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False,
        gated_linear_unit=cfg.activation == "swiglu",
        activation_func=torch.nn.functional.silu if cfg.activation == "swiglu" else torch.nn.functional.gelu,
        init_method_std=cfg.init_method_std,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        use_cpu_initialization=torch.device(device).type == "cpu",
        calculate_per_token_loss=True,
        tensor_model_parallel_size=parallel.tp,
        sequence_parallel=parallel.uses_sequence_parallel,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.virtual_pp if parallel.vpp > 1 else None,
        # every hdp round is one micro-batch with its own packed length: pipeline stages exchange
        # the shape before each send
        variable_seq_lengths=parallel.pp > 1,
        # non-batched sends: with two stages Megatron routes one direction over another group so the
        # forward and backward messages between the same two ranks cannot pair up wrongly
        batch_p2p_comm=False,
        moe_token_dispatcher_type="alltoall",
        context_parallel_size=1,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    if cfg.recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif cfg.recompute == "selective":
        kwargs.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    if cfg.is_moe:
        kwargs.update(
            num_moe_experts=cfg.num_moe_experts,
            moe_router_topk=cfg.moe_router_topk,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size or 4 * cfg.hidden_size,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=cfg.moe_grouped_gemm,
            moe_permute_fusion=False,
            moe_router_dtype="fp32",
            moe_layer_freq=list(cfg.moe_layer_freq) if isinstance(cfg.moe_layer_freq, tuple) else cfg.moe_layer_freq,
            moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
            moe_shared_expert_overlap=False,
            moe_router_score_function=cfg.moe_router_score_function,
            moe_router_enable_expert_bias=cfg.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=cfg.moe_router_bias_update_rate,
            moe_router_num_groups=cfg.moe_router_num_groups,
            moe_router_group_topk=cfg.moe_router_group_topk,
            moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
        )
    if cfg.mla is not None:
        kwargs.update(_mla_fields(cfg))
        return mc.MLATransformerConfig(**kwargs)
    return mc.TransformerConfig(**kwargs)


def _mla_fields(cfg: ModelConfig) -> dict[str, object]:
    """``MLATransformerConfig``'s MLA and RoPE fields for ``cfg`` (HF's YaRN mapped to Megatron's: the attention
    factor ``mscale(f)`` when HF has no ``mscale`` pair is Megatron's with ``mscale=1, mscale_all_dim=0``)."""
    mla, rs = cfg.mla, cfg.rope_scaling
    assert mla is not None
    out: dict[str, object] = dict(
        multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_head_dim, qk_pos_emb_head_dim=mla.qk_pos_emb_head_dim, v_head_dim=mla.v_head_dim,
        rotary_base=cfg.rotary_base, rotary_percent=cfg.rotary_percent, kv_channels=None, num_query_groups=None,
    )
    if rs is None:  # plain RoPE; a factor of 1 keeps MLA's softmax_scale at 1/sqrt(head dim)
        out.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
        return out
    pair = bool(rs.mscale and rs.mscale_all_dim)
    out.update(rope_type="yarn", rotary_scaling_factor=rs.factor,
               original_max_position_embeddings=rs.original_max_position_embeddings, beta_fast=rs.beta_fast,
               beta_slow=rs.beta_slow, mscale=float(rs.mscale) if pair else 1.0,
               mscale_all_dim=float(rs.mscale_all_dim or 0.0))
    return out


def _rope(cfg: ModelConfig) -> RopeConfig:
    """The RoPE hdp's core attention applies for ``cfg`` (MLA: the RoPE its ``MLATransformerConfig`` fields
    give, :func:`hdp.core.mla.mla_rope_config`, with ``MLAConfig.rope_interleaved``)."""
    if cfg.mla is None:
        return RopeConfig(base=cfg.rotary_base, percent=cfg.rotary_percent, scaling=cfg.rope_scaling)
    from types import SimpleNamespace

    from hdp.core.mla import mla_rope_config

    rope = mla_rope_config(SimpleNamespace(**_mla_fields(cfg)))
    return dataclasses.replace(rope, interleaved=cfg.mla.rope_interleaved)


def layer_spec(cfg: ModelConfig, *, moe: bool | None = None) -> mc.ModuleSpec:
    """Megatron's local GPT layer spec with the core attention of ``cfg.attention_backend`` and
    :class:`HdpNorm` for the layer norms; with ``cfg.mla``, Megatron's MLA layer with
    :class:`hdp.core.mla.HdpMLASelfAttention` (its RoPE in hdp's core attention).  ``moe``: a MoE MLP or a
    dense one (``None``: MoE whenever ``cfg`` has experts; see :meth:`ModelConfig.is_moe_layer`)."""
    moe = cfg.is_moe if moe is None else moe
    base = mc.get_gpt_layer_local_spec(
        num_experts=cfg.num_moe_experts if moe else None,
        moe_grouped_gemm=cfg.moe_grouped_gemm and moe,
        normalization=cfg.normalization,
        qk_layernorm=cfg.qk_layernorm,
        multi_latent_attention=cfg.mla is not None,
    )
    core = core_attention_module(cfg.attention_backend, _rope(cfg))
    attn = base.submodules.self_attention
    norm_names = ("q_layernorm", "kv_layernorm") if cfg.mla is not None else ("q_layernorm", "k_layernorm")
    norms = {n: HdpNorm for n in norm_names if cfg.qk_layernorm}  # runs under SP too
    attn_sub = dataclasses.replace(attn.submodules, core_attention=core, **norms)
    new_attn = dataclasses.replace(attn, submodules=attn_sub)
    if cfg.mla is not None:
        from hdp.core.mla import HdpMLASelfAttention

        new_attn = dataclasses.replace(new_attn, module=HdpMLASelfAttention)
    sub = dataclasses.replace(
        base.submodules, self_attention=new_attn, input_layernorm=HdpNorm, pre_mlp_layernorm=HdpNorm
    )
    return dataclasses.replace(base, submodules=sub)


def _check_megatron(cfg: ModelConfig, parallel: ParallelConfig, groups: Any) -> None:
    if not mc.parallel_state.model_parallel_is_initialized():
        raise ValueError("build_gpt_model: Megatron is not initialised; call hdp.megatron_compat.initialize_megatron")
    if not isinstance(groups, mc.ProcessGroupCollection):
        raise ValueError(
            f"groups={groups!r}: pass Megatron's process groups explicitly "
            "(hdp.megatron_compat.initialize_megatron(...).groups)"
        )
    have = {"tp": groups.tp.size(), "pp": groups.pp.size(), "ep": groups.ep.size()}
    want = {"tp": parallel.tp, "pp": parallel.pp, "ep": parallel.ep}
    for key in have:
        if have[key] != want[key]:
            raise ValueError(
                f"ParallelConfig.{key}={want[key]} but Megatron was initialised with {key} size {have[key]}; "
                "initialise Megatron with the same layout (initialize_megatron)"
            )
    parallel.check_model(cfg, where="ParallelConfig")


def build_gpt_model(
    cfg: ModelConfig,
    device: torch.device | str,
    *,
    groups: Any,
    parallel: ParallelConfig = ParallelConfig(),
    vp_stage: int | None = None,
) -> mc.GPTModel:
    """Build this rank's GPT model chunk on ``device`` (its pipeline stage, its TP shard).

    Megatron must be initialised with the same layout (``initialize_megatron``); ``groups`` are
    its process groups (``MegatronRuntime.groups``), passed to Megatron explicitly.  ``device`` is
    required; on CPU the CPU shim must be held (``initialize_megatron(device='cpu')`` takes it).
    ``vp_stage``: the virtual stage of this chunk (interleaved schedule), ``None`` without.
    """
    _check_megatron(cfg, parallel, groups)
    if torch.device(device).type == "cpu" and not mc.cpu_shim_applied():
        raise ValueError(
            "build_gpt_model(device='cpu'): the Megatron CPU shim is not held; initialise Megatron with "
            "hdp.megatron_compat.initialize_megatron(device='cpu', ...) first"
        )
    config = transformer_config(cfg, parallel, device)
    pp_rank, pp_size = groups.pp.rank(), groups.pp.size()
    vpp = parallel.vpp
    stage = 0 if vp_stage is None else vp_stage
    if not 0 <= stage < vpp:
        raise ValueError(f"vp_stage={vp_stage}: must be in [0, {vpp}) (virtual_pp={parallel.virtual_pp})")
    first = pp_rank == 0 and stage == 0
    last = pp_rank == pp_size - 1 and stage == vpp - 1
    vp = vp_stage if vpp > 1 else None
    num = mc.get_num_layers_to_build(config, vp_stage=vp, pp_rank=pp_rank)
    offset = mc.get_transformer_layer_offset(config, vp_stage=vp, pp_rank=pp_rank)
    specs = {moe: layer_spec(cfg, moe=moe) for moe in {cfg.is_moe_layer(i) for i in range(offset, offset + num)}}
    block = mc.TransformerBlockSubmodules(
        layer_specs=[specs[cfg.is_moe_layer(i)] for i in range(offset, offset + num)], layer_norm=HdpNorm)
    model = mc.GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_sequence_length,
        pre_process=first,
        post_process=last,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
        position_embedding_type="none",
        pg_collection=groups,
        vp_stage=vp_stage if vpp > 1 else None,
    )
    return model.to(device)


def build_model_chunks(
    cfg: ModelConfig, device: torch.device | str, *, groups: Any, parallel: ParallelConfig
) -> list[mc.GPTModel]:
    """This rank's model chunks: one, or ``virtual_pp`` of them for the interleaved schedule."""
    if parallel.vpp == 1:
        return [build_gpt_model(cfg, device, groups=groups, parallel=parallel)]
    return [build_gpt_model(cfg, device, groups=groups, parallel=parallel, vp_stage=v) for v in range(parallel.vpp)]


def wrap_ddp(model: mc.GPTModel, opt: OptimConfig, *, groups: Any, chunk: int = 0) -> mc.DistributedDataParallel:
    """Megatron DDP over the domain (grads in fp32, reduce-scatter for the distributed optimizer)."""
    ddp_cfg = mc.DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=True,
        check_for_nan_in_grad=False,
        bucket_size=opt.bucket_size,
        average_in_collective=False,
    )
    return mc.DistributedDataParallel(
        config=model.config, ddp_config=ddp_cfg, module=model, disable_bucketing=chunk > 0, pg_collection=groups
    )


def build_optimizer(models: Sequence[mc.DistributedDataParallel] | mc.DistributedDataParallel,
                    opt: OptimConfig, *, groups: Any) -> Any:
    """Megatron's distributed Adam over the grad buffers of ``models`` (the DDP chunks)."""
    chunks = list(models) if isinstance(models, (list, tuple)) else [models]
    config = chunks[0].config
    ocfg = mc.OptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        use_distributed_optimizer=True,
        bf16=config.bf16,
        params_dtype=config.params_dtype,
    )
    # use_gloo_process_groups=False: Megatron takes no side gloo groups with explicit groups (its
    # gloo groups only serve checkpoint formats hdp does not use)
    return mc.get_megatron_optimizer(ocfg, chunks, use_gloo_process_groups=False, pg_collection=groups)


def packed_logits(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    psp: HdpPackedSeqParams,
) -> torch.Tensor:
    """Logits [T, V] (or [T, Vl] under TP) of a packed micro-batch ``tokens`` [T] described by ``psp``."""
    if tokens.dim() != 1:
        raise ValueError(f"tokens: expected a 1-D packed tensor [T], got shape {tuple(tokens.shape)}")
    out = model(
        input_ids=tokens[None, :],  # [1, T]
        position_ids=None,
        attention_mask=None,
        packed_seq_params=psp,
    )  # [1, T, V]
    return out[0]


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[T] log-probability of ``targets`` [T] under full-vocabulary ``logits`` [T, V] (float32; the naive
    one-process path, for references and benches: the engines use :func:`hdp.logprobs.logprobs_entropy`)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [T, V]
    return logp.gather(-1, targets.long()[:, None])[:, 0]


# ---- layout-independent parameters ------------------------------------------------------------------

_LAYER = re.compile(r"^(.*?decoder\.layers\.)(\d+)(\..*)$")


def global_param_name(name: str, ep_rank: int, experts_per_rank: int, layer_numbers: Sequence[int] | None = None) -> str:
    """``name`` with its local expert index made global (``ep_rank · experts_per_rank + i``) and, given
    ``layer_numbers`` (1-based global layer number of each local layer), its layer index made global."""
    if layer_numbers is not None:
        m = _LAYER.match(name)
        if m is not None:
            name = f"{m.group(1)}{layer_numbers[int(m.group(2))] - 1}{m.group(3)}"
    key = "local_experts."
    at = name.find(key)
    if at < 0:
        return name
    head, rest = name[: at + len(key)], name[at + len(key) :]
    idx, _, tail = rest.partition(".")
    glob = ep_rank * experts_per_rank + int(idx)
    return f"{head}{glob}.{tail}" if tail else f"{head}{glob}"


def global_param_names(model: torch.nn.Module, *, ep_rank: int, experts_per_rank: int) -> dict[str, str]:
    """Local parameter name -> the name the same parameter has in a one-process model (TP = PP = EP = 1)."""
    decoder = getattr(model, "decoder", None)
    layers = [int(layer.layer_number) for layer in decoder.layers] if decoder is not None else None
    return {n: global_param_name(n, ep_rank, experts_per_rank, layers) for n, _ in model.named_parameters()}


def _tp_shard(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's shard of the full tensor ``full`` of ``param`` (Megatron's CPU-init split)."""
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = int(param.partition_dim), int(getattr(param, "partition_stride", 1))
    pieces = torch.split(full, full.shape[dim] // (tp_size * stride), dim=dim)
    return torch.cat(pieces[tp_rank :: tp_size], dim=dim)


_GROUPED_EXPERT_WEIGHT = re.compile(r"\.experts\.weight[12]$")


def _grouped_expert_shard(full: torch.Tensor, param: torch.Tensor, ep_rank: int) -> torch.Tensor:
    """This EP rank's ``GroupedMLP`` weight from the one-process one ``full``.

    ``GroupedMLP`` views ``weight1`` [H, L·F1] as [L, H, F1] (``weight2`` [L·F, H] as [L, F, H]), so
    local expert l's matrix is a contiguous block of the flat weight, and this rank's L experts are
    block ``ep_rank`` of the one-process weight's flat storage."""
    n = param.numel()
    return full.reshape(-1)[ep_rank * n:(ep_rank + 1) * n].view(param.shape)


def _full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    shape = list(param.shape)
    if tp_size > 1 and getattr(param, "tensor_model_parallel", False):
        shape[int(param.partition_dim)] *= tp_size
    return tuple(shape)


@torch.no_grad()
def init_parameters(
    model: torch.nn.Module,
    init_fn: Callable[[str, torch.Tensor], None],
    *,
    tp_rank: int,
    tp_size: int,
    ep_rank: int,
    experts_per_rank: int,
) -> None:
    """Fill every parameter of ``model`` (one chunk) from ``init_fn(global_name, full_tensor)``.

    ``init_fn`` sees the parameter as a one-process model has it: its global name
    (:func:`global_param_names`) and its full, unsharded shape; this rank keeps its TP shard.  The routers'
    ``expert_bias`` buffers (DeepSeek-V3) are filled the same way.  So
    a rank-independent ``init_fn`` gives the same model for every TP / PP / EP layout.  Expert
    parameters (expert-TP 1) are never TP-sharded.  ``GroupedMLP``'s ``experts.weight1`` /
    ``weight2`` hold all local experts: ``init_fn`` sees the one-process weight (every expert) and this
    rank keeps its experts' block.
    """
    names = global_param_names(model, ep_rank=ep_rank, experts_per_rank=experts_per_rank)
    num_experts = getattr(getattr(model, "config", None), "num_moe_experts", None) or experts_per_rank
    for name, p in model.named_parameters():
        if _GROUPED_EXPERT_WEIGHT.search(name):  # GroupedMLP: all local experts in one weight
            ep = num_experts // experts_per_rank
            shape = list(p.shape)
            shape[1 if name.endswith("weight1") else 0] *= ep  # [H, E·F1] / [E·F, H]
            full = torch.empty(shape, dtype=p.dtype, device=p.device)
            init_fn(names[name], full)
            p.copy_(_grouped_expert_shard(full, p, ep_rank))
            continue
        expert = not getattr(p, "allreduce", True)
        size = 1 if expert else tp_size
        full = torch.empty(_full_shape(p, size), dtype=p.dtype, device=p.device)
        init_fn(names[name], full)
        p.copy_(_tp_shard(full, p, tp_rank, size))
    decoder = getattr(model, "decoder", None)
    layers = [int(layer.layer_number) for layer in decoder.layers] if decoder is not None else None
    for name, buf in model.named_buffers():  # the router's expert bias (DeepSeek-V3): state, not a parameter
        if name.endswith(".router.expert_bias"):
            full = torch.empty_like(buf)
            init_fn(global_param_name(name, ep_rank, experts_per_rank, layers), full)
            buf.copy_(full)
