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
from collections.abc import Mapping
from typing import Any, ClassVar, Optional

from hdp.integrations.verl import compat
from hdp.integrations.verl.checks import (
    check_actor_config,
    check_fused_kernels,
    check_parallel_size,
    check_remove_padding,
    check_token_budgets,
    check_ulysses,
    role_key,
)
from hdp.moe.zero_memory import ZeroMemoryLevel
from hdp.packing.moved import Moved
from hdp.trainer import options

__all__ = [
    "HDP_STRATEGY",
    "HdpOptions",
    "HdpEngineConfig",
    "HdpActorConfig",
    "HdpCriticConfig",
    "to_hdp_engine_config",
    "to_mcore_optimizer_config",
    "to_mcore_checkpoint_config",
]

HDP_STRATEGY = "hdp"
"""The value of ``actor_rollout_ref.actor.strategy`` (and the EngineRegistry backend) that selects hdp."""

_KEY = "actor_rollout_ref.actor"


@dataclass(frozen=True, kw_only=True)
class HdpOptions(options.HdpOptions):
    """hdp's options for verl (``actor_rollout_ref.actor.hdp.*``): every field is declared, checked and
    documented once for both doors in `hdp.trainer.options.HdpOptions`; the defaults that differ on
    verl's door, and why, are `hdp.trainer.options.VERL_DEFAULTS`.  What is verl's: the Hydra target.
    The domain size comes from Megatron; a null token budget defers to verl's per-GPU ones."""

    _FIELD_PREFIX: ClassVar[str] = f"{_KEY}.hdp"
    _MOVED: ClassVar[Mapping[str, Moved]] = {  # the keys cost_model replaced (hdp.packing.moved)
        "cost_model_file": Moved("cost_model", "2026-12-02", note="it takes the file's path"),
        "hardware_profile": Moved("cost_model", "2026-12-02",
                                  note="it takes a preset MODEL@PROFILE (e.g. dense-8b@h100-nvlink), a cost-model file or auto"),
    }
    _DOOR_BUDGET: ClassVar[str | None] = "verl's ppo_max_token_len_per_gpu / log_prob_max_token_len_per_gpu"

    _target_: str = "hdp.integrations.verl.config.HdpOptions"
    """Hydra instantiation target (verl builds configs with ``hydra.utils.instantiate``)."""
    max_tokens_per_rank: Optional[int] = options.VERL_DEFAULTS["max_tokens_per_rank"]
    """As `hdp.trainer.options.HdpOptions.max_tokens_per_rank`; verl's default: null (`VERL_DEFAULTS`)."""
    calibration_path: Optional[str] = options.VERL_DEFAULTS["calibration_path"]
    """As `hdp.trainer.options.HdpOptions.calibration_path`; verl's default keeps the records (`VERL_DEFAULTS`)."""
    collective_timeout_s: float = options.VERL_DEFAULTS["collective_timeout_s"]
    """As `hdp.trainer.options.HdpOptions.collective_timeout_s`; verl's default: 600 s (`VERL_DEFAULTS`)."""
    skip_old_log_prob: bool | str = "auto"
    """The actor's old-log-prob pass on an on-policy step (`hdp.integrations.verl.old_log_prob`): ``auto`` skips
    it exactly when it is redundant (one mini-batch covering the batch, one PPO epoch, nothing reading the old
    log-probs before the update) and the update uses its own forward's log-probs, detached, as the old ones;
    ``true`` skips it and is a config error naming the keys that make the step need it; ``false`` always runs it.
    ``1``/``0`` read as ``true``/``false``; after construction it holds the
    `hdp.integrations.verl.old_log_prob.SkipOldLogProb` (one parser for this check and the driver's decision)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        from hdp.integrations.verl.old_log_prob import parse_option

        object.__setattr__(self, "skip_old_log_prob", parse_option(self.skip_old_log_prob,
                                                                   self._field("skip_old_log_prob")))


@dataclass
class HdpEngineConfig(compat.McoreEngineConfig):
    """verl's ``McoreEngineConfig`` with ``strategy="hdp"`` and hdp's options (what the hdp engine receives)."""

    strategy: str = HDP_STRATEGY
    hdp: HdpOptions = field(default_factory=HdpOptions)
    role: Optional[str] = None
    """``critic`` for the critic's engine (hdp's critic config sets it); null: the actor's, or the reference
    model's when ``forward_only`` (errors name the role's verl keys)."""

    def __post_init__(self) -> None:
        if self.role not in (None, "critic"):
            raise ValueError(f"{role_key(self)}.megatron.role={self.role!r}: set null (actor, ref) or 'critic'")
        if self.strategy != HDP_STRATEGY:
            raise ValueError(
                f"{role_key(self)}.megatron.strategy={self.strategy!r}: HdpEngineConfig is the hdp engine's config; "
                f"set it to {HDP_STRATEGY!r} or use verl's McoreEngineConfig"
            )
        if isinstance(self.hdp, dict):  # OmegaConf merge paths hand plain dicts
            object.__setattr__(self, "hdp", HdpOptions(**{k: v for k, v in self.hdp.items() if k != "_target_"}))
        key = f"{role_key(self)}.megatron"
        hkey = f"{role_key(self) if self.role == 'critic' else _KEY}.hdp"  # the ref follows the actor's options
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
                f"TP = {self.tensor_model_parallel_size}): {hkey}.zero_memory={self.hdp.zero_memory.value} "
                f"recomputes whole experts and needs expert TP 1; set {key}.expert_tensor_parallel_size=1 "
                "(experts then spread over EP instead) or hdp.zero_memory=none"
            )
        check_fused_kernels(getattr(self, "use_fused_kernels", False),
                            key="critic.model" if self.role == "critic" else "actor_rollout_ref.model")
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
            check_fused_kernels(model_config.get("use_fused_kernels", False), model_config.get("fused_kernel_options", None))


@dataclass
class HdpCriticConfig(compat.McoreCriticConfig):
    """verl's ``McoreCriticConfig`` whose engine is a :class:`HdpEngineConfig` (role ``critic``) carrying
    ``critic.hdp`` (by default the actor's options): the value model trains on hdp plans."""

    strategy: str = HDP_STRATEGY
    megatron: HdpEngineConfig = field(default_factory=lambda: HdpEngineConfig(role="critic"))
    hdp: HdpOptions = field(default_factory=HdpOptions)

    def __post_init__(self) -> None:
        if self.strategy != HDP_STRATEGY:
            raise ValueError(f"critic.strategy={self.strategy!r}: HdpCriticConfig runs the hdp engine; set {HDP_STRATEGY!r}")
        if isinstance(self.hdp, dict):
            object.__setattr__(self, "hdp", HdpOptions(**{k: v for k, v in self.hdp.items() if k != "_target_"}))
        super().__post_init__()  # CriticConfig checks; engine = megatron
        engine = to_hdp_engine_config(self.megatron, self.hdp)
        if engine.role != "critic" or engine.use_dynamic_bsz != self.use_dynamic_bsz:
            # the critic's batching reaches its engine as the actor's and the ref's do through verl's worker
            # (verl's critic leaves the engine at its default, and the engine refuses use_dynamic_bsz=False)
            engine = dataclasses.replace(engine, role="critic", use_dynamic_bsz=self.use_dynamic_bsz)
        object.__setattr__(self, "megatron", engine)
        self.engine = engine
        check_token_budgets(hdp_budget=self.hdp.max_tokens_per_rank, budgets={
            "critic.ppo_infer_max_token_len_per_gpu": getattr(self, "ppo_infer_max_token_len_per_gpu", None),
            "critic.ppo_max_token_len_per_gpu": self.ppo_max_token_len_per_gpu})


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
