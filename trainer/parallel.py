"""The parallel layout of an hdp job: world = TP × PP × N, and the domain of N ranks underneath.

A job keeps the tensor (TP), pipeline (PP, optionally interleaved with virtual stages) and expert
(EP, expert-TP) layout its model needs; hdp plans over the **domain** — the N = world / (TP · PP)
data-parallel × context-parallel ranks that share one (TP rank, PP stage) position.  Every TP rank
and every PP stage of a domain rank runs the same plan; CP rings and all-gathers connect the domain
ranks of the same TP rank and PP stage.  Megatron's rank order (``tp-cp-ep-dp-pp``, CP = 1 here):

    global rank = tp_rank + TP · (domain_rank + N · pp_stage)

:class:`ParallelConfig` is the user's choice (frozen, validated on construction);
:meth:`ParallelConfig.check_model` validates it against a model shape and
:meth:`ParallelConfig.check_world` against a world size — both pure, so every rank raises the
same ``ValueError`` before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hdp.packing.moved import MovedFields

__all__ = ["ParallelConfig"]


def _positive_int(value: Any, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ParallelConfig.{field}={value!r}: pass a positive integer (1 turns it off)")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig(MovedFields):
    """Tensor, pipeline and expert parallel sizes kept under hdp (the domain is what is left)."""

    tp: int = 1
    """Tensor-parallel size (Megatron ``tensor_model_parallel_size``)."""
    pp: int = 1
    """Pipeline stages (Megatron ``pipeline_model_parallel_size``); each hdp round is one micro-batch."""
    virtual_pp: int | None = None
    """Virtual stages per pipeline rank (interleaved 1F1B); ``None``: the plain 1F1B schedule."""
    ep: int = 1
    """Expert-parallel size (MoE; all-to-all dispatcher), carved from the TP × domain ranks of a stage."""
    expert_tp: int = 1
    """Expert tensor-parallel size; hdp supports 1 (experts whole on each EP rank)."""
    sequence_parallel: bool = True
    """Megatron sequence parallelism inside each TP group (only meaningful with ``tp > 1``); packed
    micro-batches are padded to a multiple of ``tp`` with zero-weight tokens."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "expert_tp"):
            _positive_int(getattr(self, name), name)
        if self.virtual_pp is not None:
            _positive_int(self.virtual_pp, "virtual_pp")
            if self.pp == 1 and self.virtual_pp > 1:
                raise ValueError(
                    f"ParallelConfig.virtual_pp={self.virtual_pp}: virtual stages need pp > 1; "
                    "set pp or virtual_pp=None"
                )
        if self.expert_tp != 1:
            raise ValueError(
                f"ParallelConfig.expert_tp={self.expert_tp}: hdp runs experts with expert-TP 1 (whole experts on "
                "each EP rank, the all-to-all dispatcher); set expert_tp=1 and use ep for the expert layout"
            )
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"ParallelConfig.sequence_parallel={self.sequence_parallel!r}: pass True or False")

    @property
    def model_parallel_size(self) -> int:
        """TP × PP: ranks that hold one copy of the model (one domain rank's position set)."""
        return self.tp * self.pp

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline rank (1 without virtual stages)."""
        return self.virtual_pp or 1

    @property
    def uses_sequence_parallel(self) -> bool:
        """Whether sequence parallelism is on (``sequence_parallel`` and ``tp > 1``)."""
        return self.sequence_parallel and self.tp > 1

    @property
    def token_multiple(self) -> int:
        """Packed micro-batch lengths are padded to a multiple of this (TP under sequence parallelism)."""
        return self.tp if self.uses_sequence_parallel else 1

    def domain_size(self, world_size: int) -> int:
        """N = world / (TP · PP) (call :meth:`check_world` first)."""
        return world_size // self.model_parallel_size

    def check_world(self, world_size: int, where: str = "EngineConfig.parallel") -> None:
        """Raise ``ValueError`` naming the field unless the layout fits ``world_size`` ranks (pure)."""
        mp = self.model_parallel_size
        if world_size % mp:
            raise ValueError(
                f"{where}: tp={self.tp} x pp={self.pp} = {mp} does not divide the world of {world_size} ranks; "
                f"the world is TP x PP x domain, so choose tp and pp whose product divides {world_size}"
            )
        per_stage = world_size // self.pp
        if per_stage % (self.ep * self.expert_tp):
            raise ValueError(
                f"{where}.ep={self.ep}: expert parallelism is carved from the TP x domain ranks of one stage "
                f"({self.tp} x {self.domain_size(world_size)} = {per_stage}); choose an ep that divides {per_stage}"
            )

    def check_model(self, model: Any, where: str = "EngineConfig.parallel") -> None:
        """Raise ``ValueError`` naming the field unless ``model`` (a ``ModelConfig``) splits this way (pure)."""
        heads = model.num_attention_heads
        kv = model.num_query_groups or heads
        if heads % self.tp:
            raise ValueError(
                f"{where}.tp={self.tp}: model.num_attention_heads={heads} is not divisible by tp; "
                "each TP rank needs whole query heads (choose a tp that divides the heads)"
            )
        if kv % self.tp:
            raise ValueError(
                f"{where}.tp={self.tp}: model.num_query_groups={kv} (KV heads) is not divisible by tp; "
                "each TP rank needs whole KV heads (choose a tp that divides the KV heads)"
            )
        if model.vocab_size % self.tp:
            raise ValueError(
                f"{where}.tp={self.tp}: model.vocab_size={model.vocab_size} is not divisible by tp "
                "(the vocabulary is split over TP ranks); pad the vocabulary to a multiple of tp"
            )
        ffn = model.ffn_hidden_size or 4 * model.hidden_size
        if ffn % self.tp:
            raise ValueError(
                f"{where}.tp={self.tp}: the MLP width {ffn} (model.ffn_hidden_size) is not divisible by tp"
            )
        stages = self.pp * self.vpp
        if model.num_layers % stages:
            raise ValueError(
                f"{where}: model.num_layers={model.num_layers} is not divisible by pp x virtual_pp = "
                f"{self.pp} x {self.vpp} = {stages}; every (virtual) stage needs the same number of layers"
            )
        if model.num_moe_experts is None:
            if self.ep != 1:
                raise ValueError(f"{where}.ep={self.ep}: expert parallelism needs a MoE model (model.num_moe_experts)")
        else:
            if model.num_moe_experts % self.ep:
                raise ValueError(
                    f"{where}.ep={self.ep}: model.num_moe_experts={model.num_moe_experts} is not divisible by ep"
                )
            if self.tp > 1 and not self.sequence_parallel:
                raise ValueError(
                    f"{where}.sequence_parallel=False: MoE with tp={self.tp} needs sequence parallelism "
                    "(Megatron's requirement for experts under TP); set sequence_parallel=True"
                )
        if self.pp > 1 and model.share_embeddings_and_output_weights:
            raise ValueError(
                f"{where}.pp={self.pp}: model.share_embeddings_and_output_weights=True is not supported with "
                "pipeline parallelism in hdp yet (the tied weight lives on the first and last stage); set it False"
            )
