"""Megatron-core GPT models for hdp: build, wrap in DDP, distributed optimizer, packed forward.

The model is Megatron's ``GPTModel`` (dense, or MoE with the alltoall token dispatcher) from the
local (non-TE) layer spec, with core attention swapped for :mod:`hdp.trainer.attention_spec`'s
backend and Megatron's RoPE off (hdp applies RoPE inside attention, at per-sample positions of the
local zigzag tokens).  Megatron is initialised with TP = PP = CP = 1 over the domain
(:func:`hdp.megatron_compat.initialize_megatron`); hdp supplies CP inside attention.

Per-token loss: ``TransformerConfig.calculate_per_token_loss=True`` makes Megatron's DDP *sum*
gradients over the domain (no 1/N scaling), so each rank's loss is the sum of its tokens' losses
divided by the *global* token count and the reduced gradient is the global token-mean gradient,
however many tokens each rank holds.

Legend: T packed tokens of a micro-batch, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from hdp import megatron_compat as mc
from hdp.trainer.attention_spec import (
    CoreAttentionBackend,
    HdpPackedSeqParams,
    RopeConfig,
    core_attention_module,
)

__all__ = [
    "ModelConfig",
    "OptimConfig",
    "transformer_config",
    "layer_spec",
    "build_gpt_model",
    "wrap_ddp",
    "build_optimizer",
    "packed_logits",
    "token_logprobs",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the GPT model."""

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
    normalization: Literal["LayerNorm", "RMSNorm"] = "RMSNorm"
    """Norm layer type."""
    num_moe_experts: int | None = None
    """Experts per MoE layer; ``None``: dense MLP."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """Expert MLP width; ``None``: ffn_hidden_size."""
    expert_model_parallel_size: int = 1
    """Expert-parallel ranks (must divide the domain and num_moe_experts)."""
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
        if self.params_dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.params_dtype={self.params_dtype!r}: choose one of {list(_DTYPES)}")
        if self.num_moe_experts is not None:
            if self.num_moe_experts % self.expert_model_parallel_size:
                raise ValueError(
                    f"ModelConfig.expert_model_parallel_size={self.expert_model_parallel_size}: must divide "
                    f"num_moe_experts={self.num_moe_experts}"
                )
            if not 1 <= self.moe_router_topk <= self.num_moe_experts:
                raise ValueError(
                    f"ModelConfig.moe_router_topk={self.moe_router_topk}: must be in [1, {self.num_moe_experts}]"
                )
        elif self.expert_model_parallel_size != 1:
            raise ValueError(
                f"ModelConfig.expert_model_parallel_size={self.expert_model_parallel_size}: needs num_moe_experts"
            )

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixture-of-experts layers."""
        return self.num_moe_experts is not None


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
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


def transformer_config(cfg: ModelConfig, device: torch.device | str = "cpu") -> mc.TransformerConfig:
    """Megatron ``TransformerConfig`` for ``cfg`` (TP = PP = CP = 1, no dropout, per-token loss)."""
    dtype = _DTYPES[cfg.params_dtype]
    kwargs: dict[str, object] = dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        normalization=cfg.normalization,
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
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    if cfg.is_moe:
        kwargs.update(
            num_moe_experts=cfg.num_moe_experts,
            moe_router_topk=cfg.moe_router_topk,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size or 4 * cfg.hidden_size,
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_router_dtype="fp32",
        )
    return mc.TransformerConfig(**kwargs)


def layer_spec(cfg: ModelConfig) -> mc.ModuleSpec:
    """Megatron's local GPT layer spec with the core attention of ``cfg.attention_backend``."""
    base = mc.get_gpt_layer_local_spec(
        num_experts=cfg.num_moe_experts,
        moe_grouped_gemm=False,
        normalization=cfg.normalization,
    )
    core = core_attention_module(cfg.attention_backend, RopeConfig(base=cfg.rotary_base))
    attn = base.submodules.self_attention
    attn_sub = dataclasses.replace(attn.submodules, core_attention=core)
    new_attn = dataclasses.replace(attn, submodules=attn_sub)
    return dataclasses.replace(base, submodules=dataclasses.replace(base.submodules, self_attention=new_attn))


def build_gpt_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> mc.GPTModel:
    """Build the GPT model on ``device``; Megatron must be initialised (``initialize_megatron``)."""
    if not mc.parallel_state.model_parallel_is_initialized():
        raise ValueError("build_gpt_model: Megatron is not initialised; call hdp.megatron_compat.initialize_megatron")
    ep = mc.parallel_state.get_expert_model_parallel_world_size()
    if ep != cfg.expert_model_parallel_size:
        raise ValueError(
            f"ModelConfig.expert_model_parallel_size={cfg.expert_model_parallel_size} but Megatron was "
            f"initialised with expert parallel size {ep}"
        )
    mc.apply_cpu_shim(device)
    model = mc.GPTModel(
        config=transformer_config(cfg, device),
        transformer_layer_spec=layer_spec(cfg),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_sequence_length,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
        position_embedding_type="none",
    )
    return model.to(device)


def wrap_ddp(model: mc.GPTModel, opt: OptimConfig) -> mc.DistributedDataParallel:
    """Megatron DDP over the domain (grads in fp32, reduce-scatter for the distributed optimizer)."""
    ddp_cfg = mc.DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=True,
        check_for_nan_in_grad=False,
        bucket_size=opt.bucket_size,
        average_in_collective=False,
    )
    return mc.DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model)


def build_optimizer(model: mc.DistributedDataParallel, opt: OptimConfig) -> object:
    """Megatron's distributed Adam over ``model``'s grad buffers."""
    ocfg = mc.OptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        use_distributed_optimizer=True,
        bf16=model.config.bf16,
        params_dtype=model.config.params_dtype,
    )
    return mc.get_megatron_optimizer(ocfg, [model])


def packed_logits(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    psp: HdpPackedSeqParams,
) -> torch.Tensor:
    """Logits [T, V] of a packed micro-batch ``tokens`` [T] described by ``psp``."""
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
    """[T] log-probability of ``targets`` [T] under ``logits`` [T, V] (float32)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [T, V]
    return logp.gather(-1, targets.long()[:, None])[:, 0]

