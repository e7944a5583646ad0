"""`HdpOptions`: the engine options both doors share, declared, defaulted and validated once.

The library door's `hdp.trainer.config.PlanningConfig` (``EngineConfig.planning``) and the verl door's
``HdpOptions`` (``actor_rollout_ref.actor.hdp``, in the verl integration) extend this class with what
is theirs.  A field has one name, one meaning and one check in both; an error names it under the door's
prefix (`_FIELD_PREFIX`).  The planner's own options (policy, group shape, ...) are declared once in
`hdp.packing.PlannerOptions`, which this class extends.

Where the verl door's default differs, `VERL_DEFAULTS` holds it and says why; the verl class takes its
defaults from there (a test ties verl's shipped YAML, ``conf/actor/hdp_actor.yaml``, to that class).

Each setting is resolved once, when the engine is built: the cost model (a preset or a file is read here,
at construction; ``auto`` by the step stack's builder, `hdp.core.stack.build_steps`, for both doors: it knows the model
and the device), the token budgets
(`token_budgets`: hdp's budget, else the door's own, else the one the memory model derives from the limit)
and the calibration records' path (`records_path`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, ClassVar

from hdp.cp import CPAlgorithm
from hdp.moe.levels import ZeroMemoryLevel
from hdp.packing import CostModel, PlannerConfig
from hdp.packing.autocal import AutoCalibrate, auto_calibrate_config
from hdp.packing.config import GroupShape, PlannerOptions, check_token_budget, parse_enum
from hdp.packing.cost_file import AUTO, resolve_cost
from hdp.packing.memory import MemoryModel
from hdp.core.memory import check_max_memory_gb

__all__ = ["HdpOptions", "VERL_DEFAULTS", "MAX_TIMEOUT_S"]

MAX_TIMEOUT_S = 86400.0
"""The longest collective timeout accepted (a day)."""


@dataclass(frozen=True, kw_only=True)
class HdpOptions(PlannerOptions):
    """How an engine plans and runs its steps, the same in both doors (see the module docstring)."""

    _FIELD_PREFIX: ClassVar[str] = "HdpOptions"
    _DOOR_BUDGET: ClassVar[str | None] = None
    """The door's own per-rank token budget (its key), which a null ``max_tokens_per_rank`` defers to;
    ``None``: the door has none (the library)."""

    max_tokens_per_rank: int | None = 4096
    """B: tokens one rank may hold in one round.  ``None``: no budget of hdp's own — the door's where it has
    one (verl's ``ppo_max_token_len_per_gpu`` / ``log_prob_max_token_len_per_gpu``), else the one the memory
    model derives from ``max_memory_gb``.  With a memory limit, a budget caps the derived one.  verl's
    default is ``None`` (`VERL_DEFAULTS`)."""
    max_memory_gb: float | str | None = "auto"
    """GB per device every round's predicted peak stays within (`hdp.packing.memory`: the job's model on its
    layout, calibrated from measured peaks).  ``"auto"``: the device's memory ×
    `hdp.core.memory.DEVICE_MEMORY_FRACTION` on CUDA/NPU, none on CPU; ``None``: the token budget only."""
    measure_memory: bool = True
    """Measure each round's peak memory (allocator peaks on CUDA/NPU; on CPU the bytes autograd saves and
    hdp's CP buffers, `hdp.memory_meter`), record it and calibrate the memory model from it."""
    cost_model: CostModel | str | os.PathLike[str] = AUTO
    """Where the planner's cost model comes from (one meaning in every door and the CLI,
    `hdp.packing.cost_file.resolve_cost`): a `hdp.packing.CostModel`, ``"auto"`` (the engine's own model
    shape on its device's profile, `hdp.core.planning.auto_cost_model`, refined by auto-calibration), a
    preset ``"MODEL@PROFILE"`` or the path of a cost-model file (``hdp calibrate --out``).  A preset or a
    file is read once, at construction: afterwards the field holds the `CostModel`, or ``"auto"`` until the
    engine resolves it."""
    cp_algorithm: CPAlgorithm = CPAlgorithm.RING
    """CP attention: ``ring`` for every group, or ``allgather`` on aligned power-of-two groups (it needs
    ``group_shape='pow2'``: under ``any`` most groups would silently run the ring)."""
    auto_calibrate: AutoCalibrate | bool | Mapping[str, Any] = field(default_factory=AutoCalibrate)
    """Self-calibration of the cost model from the rounds the engine times (`hdp.packing.autocal.AutoCalibrate`:
    refit every ``every_steps`` steps, adopted when it predicts held-out rounds better); True/False: on with
    the defaults / off; a mapping: its fields.  After construction it holds the `AutoCalibrate`."""
    calibration_path: str | None = None
    """Where world rank 0 appends every training step's calibration records (JSON lines, ``hdp calibrate
    --records``; a failed write never fails a step: ``hdp/records_write_failed``); ``{role}`` is the engine's
    role (verl: ``actor``; the library: ``engine``), a relative path is taken from the working directory at
    build; ``None``: no records.  verl's default keeps them (`VERL_DEFAULTS`)."""
    collective_timeout_s: float = 300.0
    """Seconds any collective or P2P op of the engine may wait before it fails: hdp's own (the agreement,
    the CP groups, verl's whole-sample exchange), Megatron's groups the engine initialises and the groups of a
    dist checkpoint.  A rank that dies or hangs then makes every other rank raise within about this time,
    naming the step and the phase, instead of torch's 30 minutes.  On GPU/NPU set it above the slowest
    legitimate wait of a step (the longest round plus a checkpoint write), e.g. 600-1800 s; verl's default
    is 600 (`VERL_DEFAULTS`)."""
    max_consecutive_skips: int | None = 3
    """Updates skipped in a row (a NaN/inf loss or gradient on some rank, `hdp.core.step`) after which the
    step raises `hdp.core.step.SkippedUpdatesError` on every rank, naming the count and the first skipped
    step's cause, instead of skipping once more: one skip is a bad batch, a run of them a run that no longer
    trains (the verl door would otherwise log ``grad_norm`` NaN and exit 0).  It raises at every skip from
    there on until an update is applied.  ``None``: never (skip for ever)."""
    zero_memory: ZeroMemoryLevel = ZeroMemoryLevel.NONE
    """MoE expert-path recomputation (`hdp.moe`, MindSpeed ``--moe-zero-memory`` semantics): ``none``,
    ``level0`` or ``level1``; needs a MoE model and expert TP 1.  Takes every expert kind Megatron builds:
    per-expert MLPs (``SequentialMLP``), Megatron's grouped GEMM (``GroupedMLP``, ``moe_grouped_gemm=True``)
    and TransformerEngine's grouped experts (``TEGroupedMLP``, as mbridge and Megatron-Bridge build them); the
    expert GEMMs of the zero-memory path run as one grouped GEMM (`hdp.kernels.grouped_gemm`)."""
    zero_memory_num_layers: int | None = None
    """``level1`` only on the first n MoE layers of each pipeline stage (the others ``level0``); ``None``: all."""

    def __post_init__(self) -> None:
        self._check_options()

    def _check_options(self) -> None:
        """Validate (and normalise) every field this class declares, under the door's prefix."""
        self._check_planner_options()
        f = self._field
        object.__setattr__(self, "cp_algorithm", parse_enum(CPAlgorithm, self.cp_algorithm, f("cp_algorithm")))
        if self.cp_algorithm is CPAlgorithm.ALLGATHER and self.group_shape is not GroupShape.POW2:
            raise ValueError(
                f"{f('cp_algorithm')}=allgather with {f('group_shape')}={self.group_shape.value}: the all-gather runs "
                "only on aligned power-of-two groups, so most groups of 'any' would silently run the ring; set "
                f"{f('group_shape')}=pow2 or {f('cp_algorithm')}=ring")
        object.__setattr__(self, "zero_memory", parse_enum(ZeroMemoryLevel, self.zero_memory, f("zero_memory")))
        n = self.zero_memory_num_layers
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{f('zero_memory_num_layers')}={n!r}: pass a number of layers >= 1, or None for all")
            if self.zero_memory is not ZeroMemoryLevel.LEVEL1:
                raise ValueError(f"{f('zero_memory_num_layers')}={n}: only with {f('zero_memory')}='level1' (the "
                                 "first n layers level1, the rest level0)")
        own = f"{self._DOOR_BUDGET}, else " if self._DOOR_BUDGET else ""
        check_token_budget(self.max_tokens_per_rank, f("max_tokens_per_rank"),
                           none_means=f"{own}the budget derived from max_memory_gb")
        check_max_memory_gb(self.max_memory_gb, f("max_memory_gb"))
        if self.max_tokens_per_rank is None and self._DOOR_BUDGET is None and self.max_memory_gb is None:
            raise ValueError(f"{f('max_tokens_per_rank')}=None needs a memory limit to derive the budget from; set "
                             f"{f('max_memory_gb')} (GB per device, or 'auto' on CUDA/NPU) or a max_tokens_per_rank")
        if not isinstance(self.measure_memory, bool):
            raise ValueError(f"{f('measure_memory')}={self.measure_memory!r}: pass True or False")
        if self.cost_model != AUTO:  # a preset or a file: read once, here
            object.__setattr__(self, "cost_model", resolve_cost(self.cost_model, f("cost_model")))
        object.__setattr__(self, "auto_calibrate", auto_calibrate_config(self.auto_calibrate, f("auto_calibrate")))
        path = self.calibration_path
        if path is not None:
            try:
                ok = isinstance(path, str) and bool(path) and bool(path.format(role="engine"))
            except (KeyError, IndexError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"{f('calibration_path')}={path!r}: pass a file path (it may hold {{role}}), or None "
                                 "for no records")
        k = self.max_consecutive_skips
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"{f('max_consecutive_skips')}={k!r}: pass a number of skipped updates in a row >= 1 "
                             "(1: the first skip raises), or None to never raise")
        t = self.collective_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 1.0 <= float(t) <= MAX_TIMEOUT_S:
            raise ValueError(
                f"{f('collective_timeout_s')}={t!r}: pass seconds in [1, {MAX_TIMEOUT_S:g}] (above the longest round "
                "plus a checkpoint write on GPU/NPU)")

    def field_name(self, name: str) -> str:
        """Field ``name`` as this door's errors name it (``PlanningConfig.…``, ``actor_rollout_ref.actor.hdp.…``)."""
        return self._field(name)

    # -- resolved once, when the engine is built --

    @property
    def cost(self) -> CostModel:
        """The cost model; ``auto`` is resolved by the step stack (`hdp.core.stack.resolve_cost`), which knows the model
        and the device."""
        if not isinstance(self.cost_model, CostModel):
            raise ValueError(f"{self._field('cost_model')}='auto' is resolved by the engine (it needs the model and "
                             "the device); pass a CostModel, a preset 'MODEL@PROFILE' or a cost-model file here")
        return self.cost_model

    def with_cost(self, auto: Callable[[], CostModel]) -> CostModel:
        """The cost model, ``auto()`` building it for ``cost_model='auto'`` (presets and files were read already)."""
        return auto() if self.cost_model == AUTO else self.cost

    def token_budgets(self, train: int | None = None, infer: int | None = None, *,
                      memory_limit: float | None = None) -> tuple[int | None, int | None]:
        """(training passes, log-prob passes) token budgets: ``max_tokens_per_rank`` for both; else the door's
        own (verl's ``ppo_max_token_len_per_gpu`` / ``log_prob_max_token_len_per_gpu``, each falling back on
        the other); else ``None`` (the planner derives B from ``memory_limit`` bytes).  ValueError naming the
        field when there is none of these."""
        if self.max_tokens_per_rank is not None:
            return self.max_tokens_per_rank, self.max_tokens_per_rank
        if train is not None or infer is not None:
            return int(train or infer), int(infer or train)  # type: ignore[arg-type]
        if memory_limit is not None:
            return None, None
        own = self._DOOR_BUDGET
        door = f"the door set no budget of its own ({own})" if own else "the door has no budget of its own"
        raise ValueError(
            f"{self._field('max_tokens_per_rank')}=None: this device has no memory limit to derive the budget from "
            f"({self._field('max_memory_gb')}={self.max_memory_gb!r}; 'auto' is none on CPU) and {door}; set "
            f"max_tokens_per_rank{', ' + own if own else ''} or max_memory_gb")

    def planner_config(self, num_ranks: int, pipeline_stages: int = 1, *, door_budget: int | None = None,
                       cost: CostModel | None = None, memory_model: MemoryModel | None = None,
                       memory_limit: float | None = None) -> PlannerConfig:
        """The planner's config for a domain of ``num_ranks`` ranks whose model runs in ``pipeline_stages``
        stages (the engine knows both): the training passes' budget (`token_budgets`, ``door_budget`` being
        the door's own), ``cost`` (default: `cost`), the job's memory model and the limit in bytes
        (`hdp.core.memory.resolve_memory_limit`)."""
        budget, _ = self.token_budgets(door_budget, None, memory_limit=memory_limit)
        return PlannerConfig(
            num_ranks=num_ranks, max_tokens_per_rank=budget, cost=cost if cost is not None else self.cost,
            pipeline_stages=pipeline_stages, memory_limit=memory_limit, memory_model=memory_model,
            memory_limit_name=self._field("max_memory_gb"), **self.planner_options())

    def records_path(self, role: str) -> str | None:
        """The absolute path of this engine's calibration records (``{role}`` filled in), or None."""
        if self.calibration_path is None:
            return None
        return os.path.abspath(self.calibration_path.format(role=role))


VERL_DEFAULTS: Mapping[str, Any] = MappingProxyType({
    # verl's per-GPU budgets (ppo_max_token_len_per_gpu, log_prob_max_token_len_per_gpu) are the budget
    # of a verl run already, one per pass kind: hdp plans to them unless its own is set
    "max_tokens_per_rank": None,
    # a verl run keeps its calibration records by default (one file per role, beside the run's outputs), so
    # `hdp calibrate --records` can fit the cluster's cost model after any run; a library caller opts in
    "calibration_path": "hdp_calibration/{role}.jsonl",
    # verl's own process-group timeout (actor_rollout_ref.nccl_timeout) defaults to 600 s: hdp's collectives
    # wait as long as verl's own do
    "collective_timeout_s": 600.0,
})
"""Where the verl door's default differs from `HdpOptions`' (the library's), and why (the comments)."""
