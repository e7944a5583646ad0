"""Frozen, validated configuration of :class:`hdp.trainer.engine.HdpEngine`.

An :class:`EngineConfig` is everything a worker process needs to build an engine: the model
shape (:class:`hdp.trainer.model.ModelConfig`), the optimizer
(:class:`hdp.trainer.model.OptimConfig`), how each step is planned (:class:`PlanningConfig`) and
how the per-token loss is aggregated.  It is plain data: picklable, so a launcher can hand it to
spawned workers.  Validation raises ``ValueError`` naming the dotted field, the value and the fix;
it never probes hardware.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hdp.device import DEVICE_KINDS
from hdp.packing.config import parse_enum
from hdp.cp import CPAlgorithm
from hdp.loss import LossAggregation
from hdp.moe.levels import ZeroMemoryLevel
from hdp.packing import CostModel, GroupShape, PlannerConfig, Policy, cost_model
from hdp.trainer.model import ModelConfig, OptimConfig
from hdp.trainer.parallel import ParallelConfig

__all__ = ["PlanningConfig", "EngineConfig", "ParallelConfig"]


def _default_cost() -> CostModel:
    return cost_model("cpu-tiny", "cpu-gloo")


@dataclass(frozen=True, kw_only=True)
class PlanningConfig:
    """How every step is planned; the domain size N is added by the engine."""

    max_tokens_per_rank: int = 4096
    """B: tokens one rank may hold in one round (activation memory is linear in tokens)."""
    policy: Policy = Policy.HDP
    """Packing policy (``hdp``, ``static-cp``, ...)."""
    group_shape: GroupShape = GroupShape.ANY
    """CP group shapes the hdp policy may use: ``any`` contiguous range or aligned ``pow2`` blocks."""
    static_cp_size: int | None = None
    """CP size for static-cp; ``None``: the smallest power of two that fits the longest sample."""
    cost: CostModel = field(default_factory=_default_cost)
    """Cost model the planner scores plans with (default: ``cpu-tiny`` on ``cpu-gloo``)."""
    max_extra_rounds: int = 3
    """hdp policy: rounds beyond the minimum it may try."""
    search_max_samples: int = 2048
    """hdp policy: batches up to this many samples also get the planner's local search (0: off)."""
    cp_algorithm: CPAlgorithm = CPAlgorithm.RING
    """CP attention: ``ring`` for every group, or ``allgather`` on aligned power-of-two blocks (ring elsewhere)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", parse_enum(Policy, self.policy, "PlanningConfig.policy"))
        object.__setattr__(self, "group_shape", parse_enum(GroupShape, self.group_shape, "PlanningConfig.group_shape"))
        object.__setattr__(
            self, "cp_algorithm", parse_enum(CPAlgorithm, self.cp_algorithm, "PlanningConfig.cp_algorithm")
        )
        b = self.max_tokens_per_rank
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"PlanningConfig.max_tokens_per_rank={b!r}: pass a positive integer token budget, e.g. 4096")
        if self.static_cp_size is not None and (
            isinstance(self.static_cp_size, bool) or not isinstance(self.static_cp_size, int) or self.static_cp_size < 1
        ):
            raise ValueError(f"PlanningConfig.static_cp_size={self.static_cp_size!r}: pass a positive integer or None")
        if not isinstance(self.cost, CostModel):
            raise ValueError(f"PlanningConfig.cost={self.cost!r}: pass a hdp.packing.CostModel (hdp.packing.cost_model)")
        if self.max_extra_rounds < 0:
            raise ValueError(f"PlanningConfig.max_extra_rounds={self.max_extra_rounds}: must be >= 0")
        s = self.search_max_samples
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"PlanningConfig.search_max_samples={s!r}: pass an integer >= 0 (0 turns the search off)")

    def planner_config(self, num_ranks: int) -> PlannerConfig:
        """The planner's config for a domain of ``num_ranks`` ranks."""
        return PlannerConfig(
            num_ranks=num_ranks,
            max_tokens_per_rank=self.max_tokens_per_rank,
            policy=self.policy,
            group_shape=self.group_shape,
            cost=self.cost,
            static_cp_size=self.static_cp_size,
            max_extra_rounds=self.max_extra_rounds,
            search_max_samples=self.search_max_samples,
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
        if self.loss_scale_factor is not None and not self.loss_scale_factor > 0:
            raise ValueError(f"EngineConfig.loss_scale_factor={self.loss_scale_factor}: must be > 0 or None")
        kind = str(self.device).split(":", 1)[0]
        if kind not in DEVICE_KINDS:
            raise ValueError(
                f"EngineConfig.device={self.device!r}: pass one of {', '.join(DEVICE_KINDS)} (with ':i' for an index)"
            )
        if not 0 <= self.pad_token_id < self.model.vocab_size:
            raise ValueError(
                f"EngineConfig.pad_token_id={self.pad_token_id}: must be in [0, model.vocab_size={self.model.vocab_size})"
            )
