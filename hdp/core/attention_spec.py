"""The core-attention seam of hdp's Megatron GPT: backends, the per-micro-batch CP context, RoPE.

Megatron's ``SelfAttention`` computes q/k/v, (optionally) applies its own RoPE, and calls
``core_attention(query, key, value, attention_mask, attn_mask_type=, attention_bias=,
packed_seq_params=)``.  hdp builds the model with ``position_embedding_type="none"`` and does both
RoPE and attention in :class:`HdpCoreAttention`, because Megatron's THD RoPE cannot express hdp's
context-parallel layout (see below).  Other backends (TransformerEngine on CUDA, MindSpeed on
Ascend) plug in through :func:`core_attention_module` later.

Why not Megatron's RoPE (megatron-core 0.16.1, ``rope_utils._apply_rotary_pos_emb_thd``): it takes
the CP split from Megatron's context-parallel group (``cp_group.size()/rank()``, here size 1 since
hdp initialises Megatron with CP = 1) and assumes every sample is cut into ``2·cp`` *equal* chunks
of a *padded* ``cu_seqlens``.  hdp's groups vary per round (k ranks, not Megatron's CP group), the
zigzag chunks are ``floor(c·L/2k)`` (unequal, no padding) and the local ``cu_seqlens`` covers only
this rank's front+back chunks, so Megatron would give the back chunk positions ``front_len ..``
instead of its true positions.  Correct RoPE needs each local token's position inside its sample,
which :func:`hdp.cp.metadata.positions` provides and :class:`CPContext` carries.

Padding.  A packed micro-batch may end in ``pad_tokens`` padding tokens (loss weight 0): one
token for a rank without tokens (Megatron cannot run an empty micro-batch), and up to TP − 1
more so that sequence parallelism can split the micro-batch evenly over the TP ranks.  Padding
attends to nothing and nothing attends to it: :class:`HdpCoreAttention` returns zeros for it, and
``cu_seqlens`` / ``positions`` describe the real tokens only.

Tensor parallelism.  Megatron's QKV projection hands core attention this TP rank's heads
(Hq/TP query and Hkv/TP KV heads) for every token of the micro-batch (sequence parallelism
gathers the sequence before it); hdp's attention runs on those local heads, and a CP ring or
all-gather connects the domain ranks of the same TP rank and pipeline stage.

Attention variants.  :func:`hdp.core.attention_config.check_attention_config` classifies every
attention setting of the ``TransformerConfig`` (computed here, refused at build, or Megatron's own
outside core attention); :class:`HdpCoreAttention` computes the handled ones exactly under CP: RoPE
frequency variants (:class:`RopeConfig.scaling`, :mod:`hdp.rope`), a custom ``softmax_scale``,
sliding windows by sample position (per-layer patterns, across CP chunk boundaries) and softmax
sinks (``off-by-one``, or ``learnable``: the parameter ``softmax_offset`` [Hq], Megatron's name).

Legend: T local tokens (THD, packed; Tr real ones, the rest padding), Hq/Hkv query/kv heads of
this TP rank, D query/key head dim, Dv value head dim, S samples.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from hdp.cp import CPAlgorithm, cp_attention
from hdp.cp import metadata as cp_metadata
from hdp.groups import DomainGroups, RingSpec
from hdp.kernels import AttentionKernel, KeyWindow, fusions, get_kernel, kernel_attention
from hdp.megatron_compat import AttnMaskType, MegatronModule, PackedSeqParams, TransformerConfig
from hdp.rope import RopeScaling, apply_rope, rope_cos_sin
from hdp.core.attention_config import AttentionSettings, SoftmaxType, check_attention_config

__all__ = [
    "CoreAttentionBackend",
    "RopeConfig",
    "CPContext",
    "HdpPackedSeqParams",
    "packed_seq_params",
    "pad_count",
    "HdpCoreAttention",
    "core_attention_module",
    "sample_positions",
]


class CoreAttentionBackend(enum.Enum):
    """Which module computes core attention inside Megatron's ``SelfAttention``."""

    HDP = "hdp"
    """hdp's context-parallel attention over packed THD samples (any device)."""
    TE = "te"
    """TransformerEngine ``TEDotProductAttention`` (CUDA); not wired yet."""
    MINDSPEED = "mindspeed"
    """MindSpeed flash attention (Ascend NPU); not wired yet."""


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary position embedding applied by :class:`HdpCoreAttention`."""

    base: float = 10000.0
    """Rotary base theta."""
    percent: float = 1.0
    """Fraction of the head dim that is rotated (Megatron's ``rotary_percent``)."""
    enabled: bool = True
    """Whether to apply RoPE at all."""
    fused: bool = False
    """Rotate with the device's fused kernel where one exists (:func:`hdp.kernels.fusions.rotate`; Megatron's
    ``apply_rope_fusion``, MindSpeed's ``use_fused_rotary_pos_emb``); the plain form elsewhere."""
    scaling: RopeScaling | None = None
    """Frequency variant (llama3, yarn, linear, dynamic; :class:`hdp.rope.RopeScaling`); ``None``: plain RoPE."""
    interleaved: bool = False
    """Rotate adjacent pairs (2i, 2i+1) (DeepSeek-V3's ``rope_interleave``, Megatron's MLA) instead of halves
    (Llama / Qwen); see :func:`hdp.rope.apply_rope`."""

    def __post_init__(self) -> None:
        if not 0.0 < self.percent <= 1.0:
            raise ValueError(f"RopeConfig.percent={self.percent}: must be in (0, 1]")
        if self.base <= 0:
            raise ValueError(f"RopeConfig.base={self.base}: must be > 0")
        if self.scaling is not None and not isinstance(self.scaling, RopeScaling):
            raise ValueError(f"RopeConfig.scaling={self.scaling!r}: pass a hdp.rope.RopeScaling or None")


@dataclass(frozen=True, kw_only=True, eq=False)
class CPContext:
    """This rank's part of one packed CP group in one micro-batch (round).

    Built per micro-batch by the engine and handed to attention through
    :class:`HdpPackedSeqParams` — never through module state.
    """

    group_lengths: tuple[int, ...]
    """Full lengths of the group's samples, in group order."""
    k_group: int
    """Ranks in the CP group (1: plain data parallel)."""
    ring: RingSpec | None = None
    """This rank's ring (``DomainGroups.ring``); required when ``k_group > 1``."""
    groups: DomainGroups | None = None
    """The domain's groups; required for ``CPAlgorithm.ALLGATHER``."""
    algo: CPAlgorithm = CPAlgorithm.RING
    """CP attention algorithm."""
    kernel: AttentionKernel | None = None
    """Local kernel; ``None``: :func:`hdp.kernels.get_kernel` of the input's device."""

    def __post_init__(self) -> None:
        if self.k_group < 1:
            raise ValueError(f"CPContext.k_group={self.k_group}: must be >= 1")
        if self.k_group > 1 and self.ring is None:
            raise ValueError(f"CPContext.ring=None: k_group={self.k_group} needs this rank's RingSpec")
        if self.ring is not None and self.ring.size != self.k_group:
            raise ValueError(f"CPContext.ring has {self.ring.size} ranks but k_group={self.k_group}")

    @property
    def position(self) -> int:
        """This rank's position j in the group."""
        return self.ring.position if self.ring is not None and self.k_group > 1 else 0

    def layout(self) -> cp_metadata.RankLayout:
        """This rank's zigzag token layout."""
        return cp_metadata.rank_layout(self.group_lengths, self.k_group, self.position)

    def positions(self) -> torch.Tensor:
        """[T] int64: each local token's position inside its sample (for RoPE)."""
        return cp_metadata.positions(self.group_lengths, self.k_group, self.position)


@dataclass
class HdpPackedSeqParams(PackedSeqParams):
    """Megatron's ``PackedSeqParams`` (``qkv_format='thd'``) plus hdp's per-micro-batch state.

    Megatron passes ``packed_seq_params`` unchanged from ``GPTModel.forward`` to every core
    attention call, so this is the explicit channel for the CP context and the RoPE positions.
    """

    cp: CPContext | None = None
    """The CP context of this micro-batch; ``None``: every sample is local (k = 1)."""
    positions: torch.Tensor | None = field(default=None, repr=False)
    """[T] int64 position of every local token inside its sample (precomputed once per micro-batch)."""
    rope_cache: dict[Any, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    """RoPE cos/sin of this micro-batch, filled by the first attention layer and reused by the rest."""
    pad_tokens: int = 0
    """Padding tokens at the end of the micro-batch (after the real tokens ``cu_seqlens`` covers)."""

    @property
    def total_tokens(self) -> int:
        """Real plus padding tokens: the length of the packed micro-batch."""
        return int(self.cu_seqlens_q[-1]) + self.pad_tokens


def _cu(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)  # [S+1]
    if lengths:
        cu[1:] = torch.cumsum(torch.tensor(list(lengths), dtype=torch.int64), 0).to(torch.int32)
    return cu.to(device)


def sample_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] int64 positions 0..L-1 of each sample of a packed batch with boundaries ``cu_seqlens``."""
    cu = cu_seqlens.to(torch.int64)
    lens = cu[1:] - cu[:-1]  # [S]
    total = int(cu[-1])
    starts = torch.repeat_interleave(cu[:-1], lens, output_size=total)  # [T]
    return torch.arange(total, dtype=torch.int64, device=cu.device) - starts


def pad_count(num_tokens: int, multiple: int = 1) -> int:
    """Padding tokens after ``num_tokens`` real ones: up to a multiple of ``multiple``, at least one
    micro-batch of ``multiple`` tokens when there is no real token."""
    if multiple < 1:
        raise ValueError(f"multiple={multiple}: must be >= 1")
    pad = -num_tokens % multiple
    return multiple if num_tokens + pad == 0 else pad


def packed_seq_params(
    lengths: Sequence[int],
    device: torch.device,
    cp: CPContext | None = None,
    *,
    token_multiple: int = 1,
) -> HdpPackedSeqParams:
    """THD ``PackedSeqParams`` for one micro-batch.

    Without ``cp``: ``lengths`` are the local samples, each whole.  With ``cp``: ``lengths`` must be
    ``cp.group_lengths`` and the batch holds this rank's zigzag chunks (front then back per
    sample); ``cu_seqlens`` then delimits the local chunks of each sample.  The micro-batch ends in
    :func:`pad_count` padding tokens (``token_multiple``: TP under sequence parallelism): a rank
    whose layout holds no token runs only padding, and :class:`HdpCoreAttention` still runs the
    group's communication with 0 local tokens.
    """
    lengths = tuple(int(x) for x in lengths)
    if cp is not None:
        if lengths != tuple(cp.group_lengths):
            raise ValueError(f"lengths={list(lengths)} differ from cp.group_lengths={list(cp.group_lengths)}")
        lay = cp.layout()
        cu = lay.cu_seqlens.to(device)
        positions = cp.positions().to(device)
    else:
        if any(n < 0 for n in lengths):
            raise ValueError(f"lengths={list(lengths)}: sample lengths must be >= 0")
        cu = _cu(lengths, device)
        positions = sample_positions(cu)
    local = (cu[1:] - cu[:-1]).tolist()
    max_len = int(max(local)) if local else 0
    return HdpPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=max_len,
        max_seqlen_kv=max_len,
        cp=cp,
        positions=positions,
        pad_tokens=pad_count(int(positions.shape[0]), token_multiple),
    )


# ---- RoPE ----------------------------------------------------------------------------------------


def _rope_cos_sin(
    psp: "HdpPackedSeqParams", positions: torch.Tensor, span: int, rope: RopeConfig, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, 1, Dr] for this micro-batch (``span``: the dims of the RoPE part, ``rope.percent`` of them
    rotated), built once and reused by every layer (cached on ``psp``)."""
    rotary_dim = int(span * rope.percent)
    rotary_dim -= rotary_dim % 2
    key = (rotary_dim, float(rope.base), rope.scaling, dtype, positions.device)
    hit = psp.rope_cache.get(key)
    if hit is None:
        hit = rope_cos_sin(positions, rotary_dim, base=rope.base, dtype=dtype, scaling=rope.scaling)
        psp.rope_cache[key] = hit
    return hit


# ---- core attention ------------------------------------------------------------------------------


class HdpCoreAttention(MegatronModule):
    """Core attention with Megatron's call signature, over packed THD micro-batches.

    ``forward(query [T,Hq,D], key [T,Hkv,D], value [T,Hkv,Dv], attention_mask, attn_mask_type=,
    attention_bias=, packed_seq_params=) -> [T, Hq·Dv]``.  Applies RoPE at the positions carried by
    ``packed_seq_params`` (see :class:`HdpPackedSeqParams`) — to the whole head, or to MLA's decoupled
    part after ``qk_head_dim`` (:attr:`AttentionSettings.rope_start`) — then causal attention per sample:
    :func:`hdp.cp.cp_attention` when a :class:`CPContext` is set, else the local kernel (k = 1).
    The trailing ``packed_seq_params.pad_tokens`` padding tokens get zeros; a group rank whose
    layout holds no token still runs the group's communication with 0 local tokens.

    The attention settings come from ``config`` (:func:`~hdp.core.attention_config.check_attention_config`,
    which refuses what hdp does not compute) unless ``settings`` is given (the verl door reconciles
    them with the HF config first); ``softmax_scale`` (Megatron passes ``config.softmax_scale``)
    overrides theirs.  This layer's sliding window and RoPE follow its ``layer_number``.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
        rope: RopeConfig | None = None,
        settings: AttentionSettings | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ) -> None:
        super().__init__(config=config)
        del cp_comm_type  # Megatron's CP is off (size 1); hdp supplies CP itself
        del k_channels, v_channels  # MLA's query/key and value head dims: read from the tensors
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"attn_mask_type={attn_mask_type}: hdp core attention is causal only")
        if attention_type != "self":
            raise ValueError(f"attention_type={attention_type!r}: hdp core attention supports 'self' only")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"TransformerConfig.attention_dropout={dropout}: hdp core attention has no dropout; set it to 0.0"
            )
        checked = check_attention_config(config)  # raises on every setting hdp does not compute
        self.settings = settings if settings is not None else checked
        self.layer_number = layer_number
        self.rope = rope if rope is not None else RopeConfig()
        self.rope_enabled = self.rope.enabled and self.settings.rope_for(layer_number)
        self.rope_fused = self.rope.fused or bool(getattr(config, "apply_rope_fusion", False))
        self.window = self.settings.window_for(layer_number)
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.settings.softmax_scale
        self.softmax_type = self.settings.softmax_type
        tp = pg_collection.tp if pg_collection is not None and getattr(pg_collection, "tp", None) is not None else None
        self.tp_group = tp
        tp_size = tp.size() if tp is not None else int(getattr(config, "tensor_model_parallel_size", 1) or 1)
        heads = config.num_attention_heads // tp_size
        if self.softmax_type is SoftmaxType.LEARNABLE:
            # Megatron's name and layout: one logit per local query head, TP-sharded on dim 0
            self.softmax_offset = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype))
            from hdp.megatron_compat import tensor_parallel

            tensor_parallel.set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
            if config.perform_initialization:
                config.init_method(self.softmax_offset.data)
            else:
                torch.nn.init.zeros_(self.softmax_offset)
        else:
            self.softmax_offset = None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        """Megatron's sharded state of the learnable sinks (as ``DotProductAttention``'s); empty otherwise."""
        from hdp.megatron_compat import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True) if self.softmax_offset is not None else {}
        return make_sharded_tensors_for_checkpoint(state, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Causal attention of the packed samples; returns [T, Hq·Dv]."""
        del attention_mask  # causality and sample boundaries come from packed_seq_params
        if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"attn_mask_type={attn_mask_type}: hdp core attention is causal only")
        if attention_bias is not None:
            raise ValueError("attention_bias: not supported by hdp core attention")
        if not isinstance(packed_seq_params, HdpPackedSeqParams) or packed_seq_params.qkv_format != "thd":
            raise ValueError(
                "packed_seq_params: hdp core attention needs an HdpPackedSeqParams with qkv_format='thd' "
                "(build it with hdp.core.attention_spec.packed_seq_params)"
            )
        psp = packed_seq_params
        pad = psp.pad_tokens
        real = query.shape[0] - pad
        q, k, v = query[:real], key[:real], value[:real]  # [Tr, Hq, D], [Tr, Hkv, D], [Tr, Hkv, Dv]
        out = self._attend(q, k, v, psp)  # [Tr, Hq, Dv]
        if pad:
            out = torch.cat([out, out.new_zeros((pad, *out.shape[1:]))])  # padding: zeros, no grad path
        return out.reshape(out.shape[0], -1)  # [T, Hq*Dv]

    def _sink(self, q: torch.Tensor) -> torch.Tensor | None:
        """[Hq] sink logits of this layer (``None``: vanilla softmax)."""
        if self.softmax_type is SoftmaxType.VANILLA:
            return None
        if self.softmax_type is SoftmaxType.OFF_BY_ONE:
            return q.new_zeros(q.shape[1], dtype=torch.float32)
        assert self.softmax_offset is not None
        if self.softmax_offset.shape[0] != q.shape[1]:
            raise ValueError(f"softmax_offset has {self.softmax_offset.shape[0]} heads but the query {q.shape[1]}")
        return self.softmax_offset

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, psp: HdpPackedSeqParams) -> torch.Tensor:
        """[Tr, Hq, Dv] causal attention of the real tokens (RoPE first), inside the group's CP context."""
        cp = psp.cp
        positions = psp.positions if psp.positions is not None else sample_positions(psp.cu_seqlens_q)
        if positions.shape[0] != q.shape[0]:
            raise ValueError(
                f"packed_seq_params.positions has {positions.shape[0]} tokens, q has {q.shape[0]} real tokens "
                f"(+{psp.pad_tokens} padding)"
            )
        start = self.settings.rope_start
        if self.settings.is_mla and q.shape[-1] != start + self.settings.rope_dim:
            raise ValueError(
                f"query heads of dim {q.shape[-1]}: MLA's are qk_head_dim {start} + qk_pos_emb_head_dim "
                f"{self.settings.rope_dim}"
            )
        if q.shape[0] and self.rope_enabled:
            span = self.settings.rope_dim if self.settings.rope_dim is not None else q.shape[-1] - start
            cos, sin = _rope_cos_sin(psp, positions.to(q.device), span, self.rope, q.dtype)  # [Tr, 1, Dr]
            if self.rope.interleaved:  # MLA's interleaved pairs: the plain form (no fused kernel takes them)
                q = apply_rope(q, cos, sin, start=start, interleaved=True)
                k = apply_rope(k, cos, sin, start=start, interleaved=True)
            else:
                q = fusions.rotate(q, cos, sin, fused=self.rope_fused, start=start)
                k = fusions.rotate(k, cos, sin, fused=self.rope_fused, start=start)
        scale = self._scale(q)
        sink = self._sink(q)
        if cp is None:
            if q.shape[0] == 0:  # an idle rank: padding only
                return q.new_zeros((*q.shape[:2], v.shape[-1]))
            cu = psp.cu_seqlens_q
            win = None
            if self.window is not None:
                pos = positions.to(q.device)
                win = KeyWindow(self.window, pos, pos)
            out, _ = kernel_attention(q, k, v, cu, cu, True, scale, get_kernel(q.device), window=win,
                                      sink=sink)  # [Tr, Hq, Dv]
            return out
        # a group rank whose layout holds no token still joins the ring / all-gather (forward and
        # backward) with 0 local tokens, so its peers' communication lines up
        return cp_attention(
            q,
            k,
            v,
            cp.group_lengths,
            cp.k_group,
            ring=cp.ring,
            groups=cp.groups,
            algo=cp.algo,
            kernel=cp.kernel,
            scale=scale,
            window=self.window,
            sink=sink,
        )  # [Tr, Hq, Dv]

    def _scale(self, q: torch.Tensor) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])


def core_attention_module(backend: CoreAttentionBackend | str, rope: RopeConfig | None = None) -> Any:
    """The ``core_attention`` entry of Megatron's ``SelfAttentionSubmodules`` for ``backend``.

    Returns a ``ModuleSpec`` (HDP).  TE and MindSpeed raise ``NotImplementedError`` naming the
    dependency they need.
    """
    from hdp.megatron_compat import ModuleSpec

    try:
        backend = CoreAttentionBackend(backend)
    except ValueError as exc:
        raise ValueError(
            f"attention_backend={backend!r}: choose one of {[b.value for b in CoreAttentionBackend]}"
        ) from exc
    if backend is CoreAttentionBackend.HDP:
        return ModuleSpec(module=HdpCoreAttention, params={"rope": rope if rope is not None else RopeConfig()})
    if backend is CoreAttentionBackend.TE:
        raise NotImplementedError(
            "attention_backend=te: needs NVIDIA TransformerEngine (transformer_engine.pytorch, CUDA) and its "
            "TEDotProductAttention adapter, which hdp does not ship yet; use attention_backend=hdp"
        )
    raise NotImplementedError(
        "attention_backend=mindspeed: needs MindSpeed (mindspeed, with torch_npu on Ascend) and an hdp adapter, "
        "which hdp does not ship yet; use attention_backend=hdp"
    )
