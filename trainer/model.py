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
from hdp.rope import RopeScaling
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
    normalization: Literal["LayerNorm", "RMSNorm"] = "RMSNorm"
    """Norm layer type."""
    num_moe_experts: int | None = None
    """Experts per MoE layer; ``None``: dense MLP."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """Expert MLP width; ``None``: ffn_hidden_size."""
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
        """Query/key/value head dim."""
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
            num_kv_heads=self.num_query_groups or heads, head_dim=self.head_dim, ffn_hidden_size=ffn,
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
        )
    return mc.TransformerConfig(**kwargs)


def layer_spec(cfg: ModelConfig) -> mc.ModuleSpec:
    """Megatron's local GPT layer spec with the core attention of ``cfg.attention_backend`` and
    :class:`HdpNorm` for the layer norms."""
    base = mc.get_gpt_layer_local_spec(
        num_experts=cfg.num_moe_experts,
        moe_grouped_gemm=cfg.moe_grouped_gemm,
        normalization=cfg.normalization,
        qk_layernorm=cfg.qk_layernorm,
    )
    rope = RopeConfig(base=cfg.rotary_base, percent=cfg.rotary_percent, scaling=cfg.rope_scaling)
    core = core_attention_module(cfg.attention_backend, rope)
    attn = base.submodules.self_attention
    norms = {n: HdpNorm for n in ("q_layernorm", "k_layernorm") if cfg.qk_layernorm}  # runs under SP too
    attn_sub = dataclasses.replace(attn.submodules, core_attention=core, **norms)
    new_attn = dataclasses.replace(attn, submodules=attn_sub)
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
    spec = layer_spec(cfg)
    num = mc.get_num_layers_to_build(config, vp_stage=vp_stage if vpp > 1 else None, pp_rank=pp_rank)
    block = mc.TransformerBlockSubmodules(layer_specs=[spec] * num, layer_norm=HdpNorm)
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
    (:func:`global_param_names`) and its full, unsharded shape; this rank keeps its TP shard.  So
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
