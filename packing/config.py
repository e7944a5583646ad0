"""Planner configuration: typed choices and the frozen, validated `PlannerConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar

from hdp.packing.cost import CostModel
from hdp.packing.profiles import cost_model

__all__ = ["Policy", "GroupShape", "PlannerOptions", "PlannerConfig", "parse_enum", "check_token_budget"]


class Policy(str, Enum):
    """Packing policies; each lives in ``hdp.packing.policies.<name>``."""

    HDP = "hdp"
    STATIC_CP = "static-cp"
    MEGATRON_DCP = "megatron-dcp"
    ASCEND_HDP = "ascend-hdp"
    VERL_KK = "verl-kk"


class GroupShape(str, Enum):
    """Allowed context-parallel group shapes."""

    ANY = "any"
    """Contiguous rank ranges of any size (point-to-point rings; CP3, CP5, CP6 allowed)."""
    POW2 = "pow2"
    """Aligned power-of-two blocks (cached process groups; all-gather kernels allowed)."""


def parse_enum(enum_cls: type[Enum], value: object, field_name: str) -> Enum:
    """``value`` as a member of ``enum_cls``; ValueError naming the field, the value and the choices."""
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError as exc:
        choices = ", ".join(m.value for m in enum_cls)  # type: ignore[attr-defined]
        raise ValueError(f"{field_name}={value!r} is unknown; choose one of: {choices}") from exc


def check_token_budget(value: object, field_name: str, *, none_means: str | None = None) -> None:
    """Raise ValueError unless ``value`` is a positive integer token budget (or None where allowed).

    ``none_means``: what ``None`` stands for where it is allowed (used in the message); ``None``
    rejects it.
    """
    if value is None and none_means is not None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        alt = f", or null for {none_means}" if none_means else ""
        raise ValueError(
            f"{field_name}={value!r}: the per-rank token budget B of one round must be an integer > 0 "
            f"(e.g. 4096){alt}"
        )


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """How the planner plans a step, apart from the domain, the token budget and the cost model.

    Declared once here and inherited by every place that configures the planner: `PlannerConfig`
    (adds the domain size N, the budget B and the cost model), the engine's
    ``hdp.trainer.config.PlanningConfig`` and verl's ``actor_rollout_ref.actor.hdp`` options
    (``hdp.integrations.verl.config.HdpOptions``).  Each subclass names its fields in errors under
    its own dotted prefix (`_FIELD_PREFIX`).
    """

    _FIELD_PREFIX: ClassVar[str] = "PlannerOptions"

    policy: Policy = Policy.HDP
    """Packing policy: ``hdp`` (ours), or a baseline: ``static-cp``, ``megatron-dcp``, ``ascend-hdp``, ``verl-kk``."""
    group_shape: GroupShape = GroupShape.ANY
    """CP group shapes: ``any`` contiguous rank range (P2P rings; CP3, CP5, CP6 allowed) or aligned ``pow2`` blocks."""
    static_cp_size: int | None = None
    """CP size k for static-cp / ascend-hdp / verl-kk; None: the smallest power of two fitting the longest sample."""
    max_extra_rounds: int = 3
    """hdp policy: rounds beyond the minimum it tries per candidate family; on batches of up to 4,096
    samples it goes on (to 8) while each further round still lowers the step time."""
    search_max_samples: int = 2048
    """hdp policy: batches of up to this many samples are also planned with a first round around their
    tallest samples and improved by local search (`policies/polish.py`); 0 turns the search off."""

    def __post_init__(self) -> None:
        self._check_planner_options()

    def _field(self, name: str) -> str:
        return f"{self._FIELD_PREFIX}.{name}"

    def _check_planner_options(self) -> None:
        """Validate (and normalise the enums of) the fields declared by `PlannerOptions`."""
        object.__setattr__(self, "policy", parse_enum(Policy, self.policy, self._field("policy")))
        object.__setattr__(
            self, "group_shape", parse_enum(GroupShape, self.group_shape, self._field("group_shape"))
        )
        k = self.static_cp_size
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(
                f"{self._field('static_cp_size')}={k!r}: pass a CP size >= 1 (at most the domain size) "
                "or None for the smallest power of two fitting the longest sample"
            )
        e = self.max_extra_rounds
        if isinstance(e, bool) or not isinstance(e, int) or e < 0:
            raise ValueError(f"{self._field('max_extra_rounds')}={e!r}: pass an integer >= 0")
        s = self.search_max_samples
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(
                f"{self._field('search_max_samples')}={s!r}: pass an integer >= 0 (0 turns the local search off)"
            )

    def planner_options(self) -> dict[str, Any]:
        """The values of the `PlannerOptions` fields (to build a `PlannerConfig` from any subclass)."""
        return {f.name: getattr(self, f.name) for f in fields(PlannerOptions)}


@dataclass(frozen=True, kw_only=True)
class PlannerConfig(PlannerOptions):
    """Everything `plan()` needs besides the lengths: the options, the domain, B and the cost model."""

    _FIELD_PREFIX: ClassVar[str] = "config"

    num_ranks: int
    """N: ranks in the domain (Megatron's DP x CP ranks of one TP/PP coordinate)."""
    max_tokens_per_rank: int
    """B: token budget of one rank in one round (activation memory is linear in tokens)."""
    cost: CostModel = field(default_factory=cost_model)
    """Cost model (a, beta, CP overheads); default: deepseek-v3 on the h100-nvlink profile."""

    def __post_init__(self) -> None:
        self._check_planner_options()
        n = self.num_ranks
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"config.num_ranks={n!r}: the domain needs at least 1 rank; pass an integer N >= 1")
        check_token_budget(self.max_tokens_per_rank, "config.max_tokens_per_rank")
        if not isinstance(self.cost, CostModel):
            raise ValueError(f"config.cost={self.cost!r}: must be a hdp.packing.CostModel")
        if self.static_cp_size is not None and self.static_cp_size > n:
            raise ValueError(
                f"config.static_cp_size={self.static_cp_size}: must be in [1, num_ranks={n}] or None "
                "(smallest power of two fitting the longest sample)"
            )
