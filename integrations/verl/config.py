"""hdp's config classes for verl: ``actor_rollout_ref.actor.strategy=hdp`` with stock verl 0.9.x.

verl picks the engine by ``engine_config.strategy`` (verl/workers/engine_workers.py:138), but its
Megatron classes cannot carry ``"hdp"``: ``McoreEngineConfig.__post_init__`` asserts "megatron" and
``McoreActorConfig`` never copies ``actor.strategy`` into its engine config.  So hdp ships its own:

* :class:`HdpOptions` — hdp's knobs, under the one key ``actor_rollout_ref.actor.hdp``;
* :class:`HdpEngineConfig` — verl's Megatron engine config with ``strategy="hdp"`` and the options;
* :class:`HdpActorConfig` — verl's Megatron actor config that hands both to the engine (actor and ref);
* converters from whatever engine/optimizer/checkpoint config verl built (stock ``ppo_trainer`` with
  only ``strategy=hdp`` gives FSDP-shaped ones) to the Megatron-shaped ones the engine needs.

Two ways in (see integrations/verl/VERL_NOTES.md, "Switching to hdp"):

1. ``actor_rollout_ref.actor.strategy=hdp`` on verl's own ``ppo_trainer``: actor and ref resolve to
   the hdp engine, which converts the FSDP-shaped configs with :func:`to_hdp_engine_config` (TP = PP =
   EP = 1, hdp defaults, token budget = verl's ``ppo_max_token_len_per_gpu``).
2. ``model_engine=hdp`` (the plugin adds hdp's config directory to Hydra's search path) or
   ``--config-name hdp_ppo_trainer``: :class:`HdpActorConfig` with every ``megatron.*`` option and
   ``hdp.*``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from hdp.cp import CPAlgorithm
from hdp.integrations.verl import compat
from hdp.integrations.verl.checks import (
    check_actor_config,
    check_fused_kernels,
    check_parallel_size,
    check_remove_padding,
    check_ulysses,
    role_key,
)
from hdp.moe.zero_memory import ZeroMemoryLevel
from hdp.packing import CostModel, PlannerConfig
from hdp.packing.autocal import auto_calibrate_config
from hdp.packing.config import PlannerOptions, check_token_budget, parse_enum
from hdp.packing.cost_file import AUTO, resolve_cost
from hdp.packing.memory import MemoryModel
from hdp.trainer.memory import check_max_memory_gb

__all__ = [
    "HDP_STRATEGY",
    "HdpOptions",
    "HdpEngineConfig",
    "HdpActorConfig",
    "to_hdp_engine_config",
    "to_mcore_optimizer_config",
    "to_mcore_checkpoint_config",
]

HDP_STRATEGY = "hdp"
"""The value of ``actor_rollout_ref.actor.strategy`` (and the EngineRegistry backend) that selects hdp."""

_KEY = "actor_rollout_ref.actor"
_FUSED = (
    "actor_rollout_ref.model.use_fused_kernels=True: verl's fused Megatron forward bypasses hdp's chunked "
    "log-probs and CP packing; set it to False (hdp computes log-probs in vocabulary chunks itself)"
)


@dataclass(frozen=True, kw_only=True)
class HdpOptions(PlannerOptions):
    """hdp's options for verl (``actor_rollout_ref.actor.hdp.*``): the planner's options (declared once in
    `hdp.packing.PlannerOptions`: policy, group_shape, static_cp_size, max_extra_rounds, search_budget)
    plus the token budget, the cost model and its self-calibration, CP attention and MoE zero-memory.
    The domain size comes from Megatron."""

    _FIELD_PREFIX: ClassVar[str] = f"{_KEY}.hdp"

    _target_: str = "hdp.integrations.verl.config.HdpOptions"
    """Hydra instantiation target (verl builds configs with ``hydra.utils.instantiate``)."""
    max_tokens_per_rank: Optional[int] = None
    """B: tokens one rank holds in one round; None: verl's per-GPU budget (ppo/log_prob_max_token_len_per_gpu)."""
    cp_algorithm: CPAlgorithm = CPAlgorithm.RING
    """CP attention: ``ring`` everywhere, or ``allgather`` on aligned power-of-two groups."""
    zero_memory: ZeroMemoryLevel = ZeroMemoryLevel.NONE
    """MoE expert-path recomputation: none, level0, level1 (MindSpeed ``--moe-zero-memory`` semantics)."""
    cost_model: str = AUTO
    """Where the planner's cost model comes from (the same meaning in the library and the CLI):
    ``auto`` (default: this model's shape on the device's profile, refined by auto-calibration), a
    preset ``MODEL@PROFILE`` (e.g. ``qwen3-235b-a22b@h100-nvlink``) or the path of a cost-model file
    (``hdp calibrate --records R.jsonl --out COST.json``)."""
    auto_calibrate: Any = True
    """Refit the cost model from the timed rounds of training steps (`hdp.packing.autocal.AutoCalibrate`:
    true/false, or a mapping of its fields such as ``{every_steps: 20}``)."""
    calibration_path: Optional[str] = "hdp_calibration/{role}.jsonl"
    """Where each training step's calibration records go (``hdp calibrate --records``); relative paths are
    taken from the worker's working directory, ``{role}`` is ``actor``; null: no records."""
    collective_timeout_s: float = 600.0
    """Seconds hdp's own collectives (agreement, CP groups, the whole-sample exchange) may wait before
    every rank raises naming the step and phase."""
    max_memory_gb: Any = "auto"
    """GB per device every round's predicted peak stays within (`hdp.packing.memory`: this model on this
    layout, calibrated from measured peaks); ``auto``: the device's memory ×
    `hdp.trainer.memory.DEVICE_MEMORY_FRACTION` (none on CPU); null: the token budget only.  The token
    budget (``max_tokens_per_rank`` or verl's per-GPU one) still caps the derived budget."""
    measure_memory: bool = True
    """Measure each round's peak memory (allocator peaks on CUDA/NPU), record it and calibrate the model."""

    def __post_init__(self) -> None:
        self._check_planner_options()
        object.__setattr__(self, "cp_algorithm", parse_enum(CPAlgorithm, self.cp_algorithm, f"{_KEY}.hdp.cp_algorithm"))
        object.__setattr__(
            self, "zero_memory", parse_enum(ZeroMemoryLevel, self.zero_memory, f"{_KEY}.hdp.zero_memory")
        )
        check_token_budget(
            self.max_tokens_per_rank, f"{_KEY}.hdp.max_tokens_per_rank",
            none_means="actor.ppo_max_token_len_per_gpu (log-prob passes: their budget)",
        )
        if self.cp_algorithm is CPAlgorithm.ALLGATHER and self.group_shape.value != "pow2":
            raise ValueError(
                f"{_KEY}.hdp.cp_algorithm=allgather with {_KEY}.hdp.group_shape={self.group_shape.value}: the "
                "all-gather runs only on aligned power-of-two groups, so most groups of 'any' would silently run "
                f"the ring; set {_KEY}.hdp.group_shape=pow2 or {_KEY}.hdp.cp_algorithm=ring")
        object.__setattr__(self, "auto_calibrate", auto_calibrate_config(self.auto_calibrate, f"{_KEY}.hdp.auto_calibrate"))
        t = self.collective_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 1.0 <= float(t) <= 86400.0:
            raise ValueError(f"{_KEY}.hdp.collective_timeout_s={t!r}: pass seconds in [1, 86400]")
        if self.cost_model != AUTO:
            self.cost(None)  # a bad preset or file fails at configuration time, naming the key
        check_max_memory_gb(self.max_memory_gb, f"{_KEY}.hdp.max_memory_gb")
        if not isinstance(self.measure_memory, bool):
            raise ValueError(f"{_KEY}.hdp.measure_memory={self.measure_memory!r}: pass true or false")

    def cost(self, auto: Any) -> CostModel:
        """The planner's cost model (read once, by the engine); ``auto()`` builds the ``auto`` model."""
        return resolve_cost(self.cost_model, f"{_KEY}.hdp.cost_model", auto=auto)

    def token_budgets(self, train: int | None, infer: int | None) -> tuple[int, int]:
        """(training, log-prob passes) token budgets: ``max_tokens_per_rank`` for both, else verl's
        ``ppo_max_token_len_per_gpu`` / ``log_prob_max_token_len_per_gpu`` (each falling back on the other)."""
        if self.max_tokens_per_rank is not None:
            return self.max_tokens_per_rank, self.max_tokens_per_rank
        if train is None and infer is None:
            raise ValueError(
                f"{_KEY}.hdp.max_tokens_per_rank is null and verl set no per-GPU token budget "
                "(ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu): set one of them")
        return int(train or infer), int(infer or train)

    def planner_config(self, num_ranks: int, budget: int, cost: CostModel, *, pipeline_stages: int = 1,
                       memory_model: MemoryModel | None = None, memory_limit: float | None = None) -> PlannerConfig:
        """The planner config for a domain of ``num_ranks`` under ``pipeline_stages`` (PP) with token budget
        ``budget`` (``max_tokens_per_rank``, or verl's per-GPU budget when it is null: the engine resolves it)
        and the job's memory model and limit in bytes (`hdp.trainer.memory.resolve_memory_limit`)."""
        return PlannerConfig(num_ranks=num_ranks, max_tokens_per_rank=int(budget), cost=cost,
                             pipeline_stages=pipeline_stages, memory_model=memory_model, memory_limit=memory_limit,
                             memory_limit_name=f"{_KEY}.hdp.max_memory_gb", **self.planner_options())


@dataclass
class HdpEngineConfig(compat.McoreEngineConfig):
    """verl's ``McoreEngineConfig`` with ``strategy="hdp"`` and hdp's options (what the hdp engine receives)."""

    strategy: str = HDP_STRATEGY
    hdp: HdpOptions = field(default_factory=HdpOptions)

    def __post_init__(self) -> None:
        if self.strategy != HDP_STRATEGY:
            raise ValueError(
                f"{role_key(self)}.megatron.strategy={self.strategy!r}: HdpEngineConfig is the hdp engine's config; "
                f"set it to {HDP_STRATEGY!r} or use verl's McoreEngineConfig"
            )
        if isinstance(self.hdp, dict):  # OmegaConf merge paths hand plain dicts
            object.__setattr__(self, "hdp", HdpOptions(**{k: v for k, v in self.hdp.items() if k != "_target_"}))
        key = f"{role_key(self)}.megatron"
        # hdp supplies CP inside attention over the domain (the DP ranks of one TP rank and PP stage)
        fixes = {
            "context_parallel_size": (1, "hdp splits long samples itself; bound memory with hdp.max_tokens_per_rank"),
            "dynamic_context_parallel": (False, "hdp replaces Megatron's dynamic CP"),
        }
        for name, (want, why) in fixes.items():
            if getattr(self, name) != want:
                raise ValueError(f"{key}.{name}={getattr(self, name)!r}: set {want!r} ({why})")
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
            check_parallel_size(getattr(self, name), f"{key}.{name}")
        if self.expert_tensor_parallel_size is not None:
            check_parallel_size(self.expert_tensor_parallel_size, f"{key}.expert_tensor_parallel_size")
        etp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size  # Megatron's default: TP
        if self.hdp.zero_memory is not ZeroMemoryLevel.NONE and etp != 1:
            raise ValueError(
                f"{key}.expert_tensor_parallel_size={self.expert_tensor_parallel_size!r} (expert TP {etp}; null means "
                f"TP = {self.tensor_model_parallel_size}): {_KEY}.hdp.zero_memory={self.hdp.zero_memory.value} "
                f"recomputes whole experts and needs expert TP 1; set {key}.expert_tensor_parallel_size=1 "
                "(experts then spread over EP instead) or hdp.zero_memory=none"
            )
        overrides = dict(self.override_transformer_config or {})
        if self.hdp.zero_memory is not ZeroMemoryLevel.NONE and overrides.get("moe_grouped_gemm", False):
            raise ValueError(
                f"{key}.override_transformer_config.moe_grouped_gemm=True with {_KEY}.hdp.zero_memory="
                f"{self.hdp.zero_memory.value}: zero-memory recomputes the per-expert MLPs (SequentialMLP) and "
                f"cannot run grouped GEMM experts; set {key}.override_transformer_config.moe_grouped_gemm=False "
                "or hdp.zero_memory=none")
        if getattr(self, "use_fused_kernels", False):
            raise ValueError(_FUSED)
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            check_parallel_size(vpp, f"{key}.virtual_pipeline_model_parallel_size")
            if vpp > 1 and self.pipeline_model_parallel_size < 2:
                raise ValueError(
                    f"{key}.virtual_pipeline_model_parallel_size={vpp}: virtual stages need "
                    f"{key}.pipeline_model_parallel_size >= 2 (it is {self.pipeline_model_parallel_size}); set it to null"
                )
        with compat.without_megatron_strategy_assert(self):
            super().__post_init__()


@dataclass
class HdpActorConfig(compat.McoreActorConfig):
    """verl's ``McoreActorConfig`` whose engine is a :class:`HdpEngineConfig` carrying ``hdp`` (actor and ref)."""

    strategy: str = HDP_STRATEGY
    megatron: HdpEngineConfig = field(default_factory=HdpEngineConfig)
    hdp: HdpOptions = field(default_factory=HdpOptions)

    def __post_init__(self) -> None:
        if self.strategy != HDP_STRATEGY:
            raise ValueError(
                f"{_KEY}.strategy={self.strategy!r}: HdpActorConfig runs the hdp engine; set {HDP_STRATEGY!r}"
            )
        if isinstance(self.hdp, dict):
            object.__setattr__(self, "hdp", HdpOptions(**{k: v for k, v in self.hdp.items() if k != "_target_"}))
        super().__post_init__()  # ActorConfig checks; engine = megatron
        engine = to_hdp_engine_config(self.megatron, self.hdp)
        object.__setattr__(self, "megatron", engine)
        self.engine = engine
        check_actor_config(self)

    def validate(self, n_gpus: int, train_batch_size: int, model_config: Any = None) -> None:
        """verl's ``validate_config`` hook: verl's actor checks, then hdp's on the model config."""
        super().validate(n_gpus, train_batch_size, model_config)
        if model_config is not None:
            check_remove_padding(model_config.get("use_remove_padding", True))
            check_fused_kernels(model_config.get("use_fused_kernels", False))


# ---- converters --------------------------------------------------------------------------------


def _common(src: Any, base: type, exclude: tuple[str, ...] = ("_target_",)) -> dict[str, Any]:
    """Values of ``src`` for the dataclass fields of ``base`` (a common ancestor)."""
    return {f.name: getattr(src, f.name) for f in dataclasses.fields(base) if f.init and f.name not in exclude}


def to_hdp_engine_config(engine: Any, hdp: HdpOptions | None = None) -> HdpEngineConfig:
    """The :class:`HdpEngineConfig` for any engine config verl built.

    * ``HdpEngineConfig``: itself (with ``hdp`` replaced when given);
    * ``McoreEngineConfig``: every Megatron field kept, strategy "hdp";
    * any other ``EngineConfig`` (stock ``ppo_trainer`` + ``strategy=hdp`` gives ``FSDPEngineConfig``):
      the fields all engines share (offload, dtype, batch budgets, seed, router replay), Megatron
      defaults for the rest.
    """
    if isinstance(engine, HdpEngineConfig):
        if hdp is None or hdp == engine.hdp:
            return engine
        return dataclasses.replace(engine, hdp=hdp)
    if not isinstance(engine, compat.EngineConfig):
        raise TypeError(
            f"engine config is {type(engine).__name__}; the hdp engine takes a verl EngineConfig "
            "(McoreEngineConfig, FSDPEngineConfig, ...) or HdpEngineConfig"
        )
    check_ulysses(getattr(engine, "ulysses_sequence_parallel_size", 1),
                  f"{role_key(engine)}.fsdp_config.ulysses_sequence_parallel_size")
    base = compat.McoreEngineConfig if isinstance(engine, compat.McoreEngineConfig) else compat.EngineConfig
    values = _common(engine, base, exclude=("_target_", "strategy"))
    return HdpEngineConfig(**values, strategy=HDP_STRATEGY, hdp=hdp if hdp is not None else HdpOptions())


def to_mcore_optimizer_config(optim: Any) -> Any:
    """verl's ``McoreOptimizerConfig`` for any verl optimizer config (FSDP's keeps lr, betas, decay, clip, warmup)."""
    if isinstance(optim, compat.McoreOptimizerConfig) or optim is None:
        return optim
    if not isinstance(optim, compat.OptimizerConfig):
        raise TypeError(f"optimizer config is {type(optim).__name__}; pass a verl OptimizerConfig")
    values = _common(optim, compat.OptimizerConfig)
    extra: dict[str, Any] = {}
    min_lr_ratio = getattr(optim, "min_lr_ratio", None)
    if min_lr_ratio is not None:
        extra["min_lr"] = float(optim.lr) * float(min_lr_ratio)
    style = getattr(optim, "lr_scheduler_type", None)
    if style in ("constant", "cosine"):
        extra["lr_decay_style"] = style
    return compat.McoreOptimizerConfig(**values, **extra)


def to_mcore_checkpoint_config(ckpt: Any) -> Any:
    """verl's ``McoreCheckpointConfig`` for a plain ``CheckpointConfig`` (adds empty ``mbridge_config``)."""
    if isinstance(ckpt, compat.McoreCheckpointConfig) or ckpt is None:
        return ckpt
    if not isinstance(ckpt, compat.CheckpointConfig):
        raise TypeError(f"checkpoint config is {type(ckpt).__name__}; pass a verl CheckpointConfig")
    return compat.McoreCheckpointConfig(**_common(ckpt, compat.CheckpointConfig))
