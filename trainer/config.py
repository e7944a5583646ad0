"""Frozen, validated configuration of :class:`hdp.trainer.engine.HdpEngine`.

An :class:`EngineConfig` is everything a worker process needs to build an engine: the model
shape (:class:`hdp.trainer.model.ModelConfig`), the optimizer
(:class:`hdp.trainer.model.OptimConfig`), how each step is planned (:class:`PlanningConfig`) and
how the per-token loss is aggregated.  It is plain data: picklable, so a launcher can hand it to
spawned workers.  Validation raises ``ValueError`` naming the dotted field, the value and the fix;
it never probes hardware.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import ClassVar

from hdp.cp import CPAlgorithm
from hdp.device import DEVICE_KINDS
from hdp.loss import LossAggregation
from hdp.moe.levels import ZeroMemoryLevel
from hdp.packing import CostModel, PlannerConfig
from hdp.packing.config import PlannerOptions, check_token_budget, parse_enum
from hdp.packing.autocal import AutoCalibrate, auto_calibrate_config
from hdp.packing.cost_file import AUTO, resolve_cost
from hdp.packing.memory import MemoryCoefficients, MemoryModel
from hdp.trainer.memory import check_max_memory_gb
from hdp.trainer.model import ModelConfig, OptimConfig
from hdp.trainer.parallel import ParallelConfig

__all__ = ["PlanningConfig", "EngineConfig", "ParallelConfig"]


@dataclass(frozen=True, kw_only=True)
class PlanningConfig(PlannerOptions):
    """How every step is planned: the planner's options (`hdp.packing.PlannerOptions`, declared there
    once), the token budget, the cost model and the CP algorithm; the domain size N comes from the engine."""

    _FIELD_PREFIX: ClassVar[str] = "PlanningConfig"

    max_tokens_per_rank: int | None = 4096
    """B: tokens one rank may hold in one round.  With a memory limit (``max_memory_gb``) it caps the
    budget the memory model derives; ``None``: only the derived one (needs a limit)."""
    max_memory_gb: float | str | None = "auto"
    """GB per device every round's predicted peak stays within (`hdp.packing.memory`: the job's model on
    its layout, calibrated from measured peaks).  ``"auto"`` (default): the device's memory ×
    `hdp.trainer.memory.DEVICE_MEMORY_FRACTION` on CUDA/NPU, none on CPU; ``None``: plan to the token
    budget only."""
    memory_coefficients: MemoryCoefficients | None = None
    """The memory model's fitted coefficients (`hdp.packing.memory.fit_memory`, ``hdp calibrate``);
    ``None``: the formulas as written, refined by self-calibration."""
    measure_memory: bool = True
    """Measure each round's peak memory (allocator peaks on CUDA/NPU; on CPU the bytes autograd saves
    and hdp's CP buffers, `hdp.memory_meter`), record it and calibrate the memory model from it."""
    cost_model: CostModel | str | os.PathLike[str] = AUTO
    """Where the planner's cost model comes from (the one meaning of ``cost_model`` in every door,
    `hdp.packing.cost_file.resolve_cost`): a ``hdp.packing.CostModel``, ``"auto"`` (default: the
    engine's own model shape on its device's profile, `hdp.trainer.planning.auto_cost_model`), a preset
    ``"MODEL@PROFILE"`` or the path of a cost-model file (read once, here).  After construction it holds
    the `CostModel`, or ``"auto"`` until `EngineConfig` resolves it."""
    cp_algorithm: CPAlgorithm = CPAlgorithm.RING
    """CP attention: ``ring`` for every group, or ``allgather`` on aligned power-of-two blocks (ring elsewhere)."""
    auto_calibrate: AutoCalibrate | bool = field(default_factory=AutoCalibrate)
    """Self-calibration of the cost model from the rounds the engine times (`hdp.packing.autocal.AutoCalibrate`:
    refit every ``every_steps`` steps, adopted when it predicts held-out rounds better); True/False: on with
    the defaults / off.  After construction it always holds the `AutoCalibrate`."""

    def __post_init__(self) -> None:
        self._check_planner_options()
        object.__setattr__(
            self, "cp_algorithm", parse_enum(CPAlgorithm, self.cp_algorithm, "PlanningConfig.cp_algorithm")
        )
        check_token_budget(self.max_tokens_per_rank, "PlanningConfig.max_tokens_per_rank",
                           none_means="the budget derived from max_memory_gb")
        check_max_memory_gb(self.max_memory_gb, "PlanningConfig.max_memory_gb")
        if self.max_tokens_per_rank is None and self.max_memory_gb is None:
            raise ValueError("PlanningConfig.max_tokens_per_rank=None needs a memory limit to derive the budget from; "
                             "set max_memory_gb (GB per device, or 'auto' on CUDA/NPU) or a max_tokens_per_rank")
        if self.memory_coefficients is not None and not isinstance(self.memory_coefficients, MemoryCoefficients):
            raise ValueError(f"PlanningConfig.memory_coefficients={self.memory_coefficients!r}: pass a "
                             "hdp.packing.memory.MemoryCoefficients (fitted by hdp calibrate) or None")
        if not isinstance(self.measure_memory, bool):
            raise ValueError(f"PlanningConfig.measure_memory={self.measure_memory!r}: pass True or False")
        if self.cost_model != AUTO:
            object.__setattr__(self, "cost_model", resolve_cost(self.cost_model, "PlanningConfig.cost_model"))
        object.__setattr__(self, "auto_calibrate", auto_calibrate_config(self.auto_calibrate, "PlanningConfig.auto_calibrate"))

    @property
    def cost(self) -> CostModel:
        """The cost model (`cost_model` resolved to a `CostModel`)."""
        if not isinstance(self.cost_model, CostModel):
            raise ValueError("PlanningConfig.cost_model='auto' is resolved by EngineConfig (it needs the model and "
                             "the device); pass a CostModel, a preset 'MODEL@PROFILE' or a cost-model file here")
        return self.cost_model

    def planner_config(self, num_ranks: int, pipeline_stages: int = 1, *, memory_model: MemoryModel | None = None,
                       memory_limit: float | None = None, memory_limit_name: str = "memory_limit") -> PlannerConfig:
        """The planner's config for a domain of ``num_ranks`` ranks whose model runs in
        ``pipeline_stages`` pipeline stages (the engine knows both), with the job's memory model and
        the resolved limit in bytes (`hdp.trainer.memory.resolve_memory_limit`)."""
        if memory_limit is None and self.max_tokens_per_rank is None:
            raise ValueError("PlanningConfig.max_tokens_per_rank=None: this device has no memory limit to derive the "
                             "budget from (max_memory_gb='auto' is none on CPU); set max_tokens_per_rank or max_memory_gb")
        return PlannerConfig(
            num_ranks=num_ranks,
            max_tokens_per_rank=self.max_tokens_per_rank,
            cost=self.cost,
            pipeline_stages=pipeline_stages,
            memory_limit=memory_limit,
            memory_model=memory_model,
            memory_limit_name=memory_limit_name,
            **self.planner_options(),
        )


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything :meth:`hdp.trainer.engine.HdpEngine.build` needs (picklable)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Shape of the Megatron GPT model (dense or MoE)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Adam with Megatron's distributed optimizer."""
    planning: PlanningConfig = field(default_factory=PlanningConfig)
    """Token budget, policy, group shape, CP algorithm."""
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
    calibration_path: str | None = None
    """If set, every rank appends measured (lengths, group size, seconds) records here (JSON lines)."""
    pad_token_id: int = 0
    """Token an idle rank runs in a round (one token, loss weight 0)."""
    moe_zero_memory: ZeroMemoryLevel = ZeroMemoryLevel.NONE
    """MoE zero-memory recomputation level (`hdp.moe`): none, level0 or level1."""
    moe_zero_memory_num_layers: int | None = None
    """level1 only on the first n MoE layers of the stage (the others level0); None: all layers."""
    collective_timeout_s: float = 300.0
    """Seconds any collective or P2P op of the job may wait before it fails (Megatron's parallel-state
    groups, the CP block groups, and the engine's agreement group).  A rank that dies or hangs then
    makes every other rank raise within about this time, naming the step and the phase, instead of
    waiting for torch's default (30 min).  300 s suits CPU tests; on GPU/NPU set it above the
    slowest legitimate wait of a step (the longest round plus a checkpoint write), e.g. 600-1800 s."""

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
        object.__setattr__(
            self, "moe_zero_memory", parse_enum(ZeroMemoryLevel, self.moe_zero_memory, "EngineConfig.moe_zero_memory")
        )
        if self.moe_zero_memory is not ZeroMemoryLevel.NONE and not self.model.num_moe_experts:
            raise ValueError(
                f"EngineConfig.moe_zero_memory={self.moe_zero_memory.value!r} needs a MoE model; "
                "set model.num_moe_experts or moe_zero_memory='none'"
            )
        if self.moe_zero_memory_num_layers is not None and self.moe_zero_memory is not ZeroMemoryLevel.LEVEL1:
            raise ValueError(
                f"EngineConfig.moe_zero_memory_num_layers={self.moe_zero_memory_num_layers}: only with "
                "moe_zero_memory='level1' (the first n layers level1, the rest level0)"
            )
        t = self.collective_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 1.0 <= float(t) <= 86400.0:
            raise ValueError(
                f"EngineConfig.collective_timeout_s={t!r}: pass seconds in [1, 86400] (300 on CPU; above the "
                "longest round plus a checkpoint write on GPU/NPU)"
            )
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
