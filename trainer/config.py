"""Frozen, validated configuration of :class:`hdp.trainer.engine.HdpEngine`.

An :class:`EngineConfig` is everything a worker process needs to build an engine: the model
shape (:class:`hdp.trainer.model.ModelConfig`), the optimizer
(:class:`hdp.trainer.model.OptimConfig`), how each step is planned and run (:class:`PlanningConfig`:
hdp's options, declared once for both doors in `hdp.trainer.options`) and how the per-token loss is
aggregated.  It is plain data: picklable, so a launcher can hand it to
spawned workers.  Validation raises ``ValueError`` naming the dotted field, the value and the fix;
it never probes hardware.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import ClassVar

from hdp.device import DEVICE_KINDS
from hdp.fused_logprobs import FusedLogprobs
from hdp.loss import LossAggregation
from hdp.moe.levels import ZeroMemoryLevel
from hdp.packing.config import parse_enum
from hdp.packing.cost_file import AUTO
from hdp.packing.memory import MemoryCoefficients
from hdp.packing.moved import Moved, MovedFields
from hdp.trainer.model import ModelConfig, OptimConfig
from hdp.trainer.options import HdpOptions
from hdp.trainer.parallel import ParallelConfig

__all__ = ["PlanningConfig", "EngineConfig", "ParallelConfig"]


@dataclass(frozen=True, kw_only=True)
class PlanningConfig(HdpOptions):
    """The library door's hdp options: how every step is planned and run.  Every field but one is
    declared once for both doors in `hdp.trainer.options.HdpOptions` (the planner's options, the token
    budget, the memory limit, the cost model, CP attention, self-calibration, the calibration records,
    the collective timeout, MoE zero-memory); the domain size N comes from the engine."""

    _FIELD_PREFIX: ClassVar[str] = "PlanningConfig"
    _MOVED: ClassVar[Mapping[str, Moved]] = {
        "cost": Moved("cost_model", "2026-12-01", note="it takes a CostModel, 'auto', a preset 'MODEL@PROFILE' or a cost-model file"),
    }

    memory_coefficients: MemoryCoefficients | None = None
    """The memory model's fitted coefficients (`hdp.packing.memory.fit_memory`, ``hdp calibrate``);
    ``None``: the formulas as written, refined by self-calibration."""

    def __post_init__(self) -> None:
        self._check_options()
        if self.memory_coefficients is not None and not isinstance(self.memory_coefficients, MemoryCoefficients):
            raise ValueError(f"PlanningConfig.memory_coefficients={self.memory_coefficients!r}: pass a "
                             "hdp.packing.memory.MemoryCoefficients (fitted by hdp calibrate) or None")


def _to_planning(old: str, new: str) -> Moved:
    """``EngineConfig.old`` moved into `PlanningConfig` as ``new`` (2026-12-04: hdp's options declared once)."""
    return Moved(f"PlanningConfig.{new}", "2026-12-04", how=f"EngineConfig(planning=PlanningConfig({new}=...))",
                 read=f"EngineConfig.planning.{new}")


@dataclass(frozen=True, kw_only=True)
class EngineConfig(MovedFields):
    """Everything :meth:`hdp.trainer.engine.HdpEngine.build` needs (picklable)."""

    _MOVED: ClassVar[Mapping[str, Moved]] = {
        "collective_timeout_s": _to_planning("collective_timeout_s", "collective_timeout_s"),
        "calibration_path": _to_planning("calibration_path", "calibration_path"),
        "moe_zero_memory": _to_planning("moe_zero_memory", "zero_memory"),
        "moe_zero_memory_num_layers": _to_planning("moe_zero_memory_num_layers", "zero_memory_num_layers"),
    }
    """Keywords that moved (`hdp.packing.moved`): a TypeError naming the new place."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Shape of the Megatron GPT model (dense or MoE)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Adam with Megatron's distributed optimizer."""
    planning: PlanningConfig = field(default_factory=PlanningConfig)
    """hdp's options (`hdp.trainer.options.HdpOptions`, shared with the verl door): token budget, memory limit,
    policy, group shape, cost model, CP algorithm, calibration, collective timeout, MoE zero-memory."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """TP / PP (virtual PP) / EP layout kept under hdp; the domain is world / (TP · PP)."""
    loss_aggregation: LossAggregation = LossAggregation.TOKEN_MEAN
    """How per-token losses reduce to the step loss (verl's ``loss_agg_mode`` names)."""
    loss_scale_factor: float | None = None
    """seq-mean-token-sum-norm only: the divisor (default: the longest sample)."""
    seed: int = 1234
    """Seed of the initial weights (identical on every rank) and Megatron's RNG tracker."""
    device: str = "cpu"
    """``cpu``, ``cuda[:i]`` or ``npu[:i]``; the CPU shim for Megatron is applied only for ``cpu``."""
    pad_token_id: int = 0
    """Token an idle rank runs in a round (one token, loss weight 0)."""
    fused_logprobs: FusedLogprobs = FusedLogprobs.AUTO
    """Log-probs and entropies from the last hidden states and the output layer's weight, never holding the
    logits [T, V/TP] (`hdp.fused_logprobs`): ``auto`` / ``on`` (True) use it — exact, and the engine's
    Megatron GPT always allows it —, ``off`` (False) computes them from Megatron's logits (`hdp.logprobs`).
    The memory model prices the path in use.  On the fused path ``LocalTensors.logits`` builds the logits
    when a loss function reads them (memory the memory model does not count)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig):
            raise ValueError(f"EngineConfig.model={self.model!r}: pass a hdp.trainer.model.ModelConfig")
        if not isinstance(self.optim, OptimConfig):
            raise ValueError(f"EngineConfig.optim={self.optim!r}: pass a hdp.trainer.model.OptimConfig")
        if not isinstance(self.planning, PlanningConfig):
            raise ValueError(f"EngineConfig.planning={self.planning!r}: pass a hdp.trainer.config.PlanningConfig")
        if not isinstance(self.parallel, ParallelConfig):
            raise ValueError(f"EngineConfig.parallel={self.parallel!r}: pass a hdp.trainer.config.ParallelConfig")
        self.parallel.check_model(self.model)  # heads, KV heads, layers, experts divisible: names the field
        object.__setattr__(
            self,
            "loss_aggregation",
            parse_enum(LossAggregation, self.loss_aggregation, "EngineConfig.loss_aggregation"),
        )
        if self.planning.zero_memory is not ZeroMemoryLevel.NONE and not self.model.num_moe_experts:
            raise ValueError(
                f"EngineConfig.planning.zero_memory={self.planning.zero_memory.value!r} needs a MoE model; "
                "set model.num_moe_experts or planning.zero_memory='none'"
            )
        object.__setattr__(self, "fused_logprobs", FusedLogprobs.parse(self.fused_logprobs, "EngineConfig.fused_logprobs"))
        if self.loss_scale_factor is not None and not self.loss_scale_factor > 0:
            raise ValueError(f"EngineConfig.loss_scale_factor={self.loss_scale_factor}: must be > 0 or None")
        kind = str(self.device).split(":", 1)[0]
        if kind not in DEVICE_KINDS:
            raise ValueError(
                f"EngineConfig.device={self.device!r}: pass one of {', '.join(DEVICE_KINDS)} (with ':i' for an index)"
            )
        if self.planning.cost_model == AUTO:  # the model's own shape on the device's profile, resolved once
            from hdp.trainer.planning import auto_cost_model

            object.__setattr__(self, "planning", dataclasses.replace(
                self.planning, cost_model=auto_cost_model(self.model.shape(), kind)))
        if not 0 <= self.pad_token_id < self.model.vocab_size:
            raise ValueError(
                f"EngineConfig.pad_token_id={self.pad_token_id}: must be in [0, model.vocab_size={self.model.vocab_size})"
            )
