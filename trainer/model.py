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

The configurations (:class:`ModelConfig`, :class:`MLAConfig`, :class:`OptimConfig`) live in
:mod:`hdp.trainer.model_config` and are exported here too.

Legend: T packed tokens of a micro-batch, V vocabulary, Vl = V/TP local vocabulary shard.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Sequence

import torch

from hdp import megatron_compat as mc
from hdp.core.attention_spec import (
    HdpPackedSeqParams,
    RopeConfig,
    core_attention_module,
)
from hdp.trainer.model_config import _DTYPES, MLAConfig, ModelConfig, OptimConfig
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
