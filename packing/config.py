"""Planner configuration: typed choices and the frozen, validated `PlannerConfig`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, ClassVar

import numpy as np

from hdp.packing.cost import CostModel
from hdp.packing.memory import MemoryBudget, MemoryModel
from hdp.packing.moved import Moved, MovedFields
from hdp.packing.profiles import cost_model
from hdp.packing.topology import check_node_of

__all__ = [
    "Policy", "GroupShape", "SearchBudget", "PlannerOptions", "PlannerConfig", "parse_enum", "check_token_budget",
]


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
class SearchBudget:
    """How much work the ``hdp`` policy may spend on one batch beyond its first plan.

    Work is *counted*, never timed: every rank of the domain plans the same batch with the same
    budget, stops at the same point and gets the same plan (a wall-clock limit would not).  The
    planner is anytime: whatever the budget, it returns the best valid plan found so far; from the
    same start the local search never ends worse with more budget (the whole pipeline may: another
    candidate can win the construction, or more levelling take another path, and end lower; measured
    on the suite in docs/results.md).  Three pools, each in its own unit (see ``hdp.packing.policies.hdp``
    for what charges what):

    * ``construct`` -- *sample placements* of the construction: every candidate plan (a choice of
      group sizes and a round count) costs the samples it places plus its layout and levelling
      work (wide groups, rounds x ranks), and the level pass the samples it moves or re-plans.  The
      first two candidates (the likeliest variant and static CP's shape) are always built,
      whatever is left, so a huge batch still gets a plan; then candidates are built, likeliest
      first, while the pool lasts.
    * ``search`` -- *moves evaluated* by the local search (`polish`): every (sample, target column)
      pair, trade pair and widening scored costs one unit, every evaluation a fixed 1,500, and every
      step its bookkeeping (samples / 8 + columns).  The search runs compiled
      (``hdp.packing.policies.hdp.kernels``), so a unit is bounded work and the pool bounds the time
      as well as the plan (the time per unit: docs/results.md).  The starting plans of the tall-round
      pass take their short searches from this pool too.
    * ``rivals`` -- the plans the package's other policies (static-cp, verl-kk, megatron-dcp,
      ascend-hdp, and hdp with power-of-two groups) would build for the batch, taken as candidates
      so that hdp is never worse than any of them.  Each costs an estimate of its work (samples x
      (ranks + 32), four times that for hdp-pow2); rivals are built, cheapest first, while their
      estimates fit.

    What ``plan()`` costs with the defaults, and which bench batches the search pool binds:
    ``hdp bench planner``, figures in docs/results.md.
    """

    construct: int = 20_000
    """Sample placements the construction may spend on candidate plans after the first (each costs
    its number of samples plus its layout and levelling) and on levelling the chosen plan; 0
    builds one candidate only."""
    search: int = 2_000_000
    """Moves the local search may evaluate (sample x target pairs scored, plus per-evaluation and
    per-step bookkeeping; each unit bounded compiled work) and the tall-round starts cost (built
    only when they take at most a quarter of the pool); 0 turns the local search and the tall-round
    starts off."""
    rivals: int = 65_536
    """Estimated work (samples x (ranks + 32), four times that for hdp-pow2) of the other policies'
    plans taken as candidates; 0 takes none.  The default covers every rival up to about 128
    samples on 32 ranks."""

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"search_budget.{f.name}={v!r}: pass an integer >= 0 (0 turns that part off)")

    @classmethod
    def parse(cls, value: object, field_name: str = "search_budget") -> SearchBudget:
        """A `SearchBudget` from itself, ``None`` (the defaults), a mapping of its fields (YAML / JSON),
        or the text ``default``, ``off`` (no local search) or ``key=value,...``; ValueError naming the
        field otherwise."""
        if isinstance(value, SearchBudget):
            return value
        if value is None or value == "default":
            return cls()
        if value == "off":
            return cls(search=0)
        if isinstance(value, str):
            try:
                pairs = dict(item.split("=", 1) for item in value.split(",") if item.strip())
                value = {k.strip(): int(v) for k, v in pairs.items()}
            except ValueError as exc:
                raise ValueError(
                    f"{field_name}={value!r}: pass 'default', 'off' or key=value pairs such as "
                    "'construct=20000,search=2000000,rivals=65536'"
                ) from exc
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            extra = sorted(set(map(str, value)) - known - {"_target_"})
            if extra:
                raise ValueError(f"{field_name}: unknown key(s) {extra}; the budget has {sorted(known)}")
            try:
                return cls(**{k: v for k, v in value.items() if k != "_target_"})
            except ValueError as exc:
                raise ValueError(f"{field_name}.{str(exc).removeprefix('search_budget.')}") from exc
        raise ValueError(
            f"{field_name}={value!r}: pass a hdp.packing.SearchBudget, a mapping of its fields, "
            "'default' or 'off'"
        )


@dataclass(frozen=True, kw_only=True)
class PlannerOptions(MovedFields):
    """How the planner plans a step, apart from the domain, the token budget and the cost model.

    Declared once here and inherited by every place that configures the planner: `PlannerConfig`
    (adds the domain size N, the budget B and the cost model), the engine's
    ``hdp.trainer.config.PlanningConfig`` and verl's ``actor_rollout_ref.actor.hdp`` options
    (``hdp.integrations.verl.config.HdpOptions``).  Each subclass names its fields in errors under
    its own dotted prefix (`_FIELD_PREFIX`).
    """

    _FIELD_PREFIX: ClassVar[str] = "PlannerOptions"
    _MOVED: ClassVar[Mapping[str, Moved]] = {
        "search_max_samples": Moved("search_budget", "2026-12-01",
                                    note="it takes a counted work budget: a SearchBudget, 'default', 'off' or its pools"),
    }

    policy: Policy = Policy.HDP
    """Packing policy: ``hdp`` (ours), or a baseline: ``static-cp``, ``megatron-dcp``, ``ascend-hdp``, ``verl-kk``."""
    group_shape: GroupShape = GroupShape.ANY
    """CP group shapes: ``any`` contiguous rank range (P2P rings; CP3, CP5, CP6 allowed) or aligned ``pow2`` blocks."""
    static_cp_size: int | None = None
    """CP size k for static-cp / ascend-hdp / verl-kk; None: the smallest power of two fitting the longest sample."""
    max_extra_rounds: int = 3
    """hdp policy: rounds beyond the minimum it tries per candidate family (more while each further
    round still lowers the step time, at most 8), as far as ``search_budget.construct`` allows."""
    search_budget: SearchBudget = field(default_factory=SearchBudget)
    """hdp policy: the work it may spend beyond its first plan (construction candidates, local
    search, the other policies' plans as candidates), counted so every rank gets the same plan."""

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
        object.__setattr__(
            self, "search_budget", SearchBudget.parse(self.search_budget, self._field("search_budget"))
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
    max_tokens_per_rank: int | None
    """B: token budget of one rank in one round.  With ``memory_limit`` it is an upper bound on the
    budget the memory model derives (``None``: only the derived one)."""
    cost: CostModel = field(default_factory=cost_model)
    """Cost model (a, beta, CP overheads); default: deepseek-v3 on the h100-nvlink profile."""
    pipeline_stages: int = 1
    """PP: pipeline stages every domain rank's model is split over (given by the engine, like N).  A
    step then costs about the sum of round times plus (PP - 1) times the longest round (the
    pipeline's fill and drain), so more, smaller rounds can be cheaper; 1: no pipeline."""
    memory_limit: float | None = None
    """Bytes per device every rank's predicted peak must stay within (`hdp.packing.memory`); the token
    budget is then derived from ``memory_model`` (`token_budget`).  ``None``: plan to B only."""
    memory_model: MemoryModel | None = None
    """The per-rank memory model of the job's model and layout (needed with ``memory_limit``; given
    alone, plans still carry its predicted peaks)."""
    node_of: tuple[int, ...] | None = None
    """The node of every domain rank (`hdp.packing.topology`: contiguous runs of ranks, given by the
    engine from its layout like N, or ``hdp plan --ranks-per-node``); the planner prices a ring that
    crosses nodes by the cost model's inter-node link and places groups inside nodes when that is
    cheaper.  ``None`` (or every rank on one node, normalised to ``None``): one node, planned
    exactly as without a topology."""
    memory_limit_name: str = field(default="memory_limit", compare=False)
    """The setting the limit came from, as errors name it (``PlanningConfig.max_memory_gb``, verl's
    ``actor_rollout_ref.actor.hdp.max_memory_gb``, ``--memory-gb``); a label, not part of the plan's
    inputs (configs differing only here are equal)."""

    def __post_init__(self) -> None:
        self._check_planner_options()
        n = self.num_ranks
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"config.num_ranks={n!r}: the domain needs at least 1 rank; pass an integer N >= 1")
        object.__setattr__(self, "node_of", check_node_of(self.node_of, n, "config.node_of"))
        check_token_budget(self.max_tokens_per_rank, "config.max_tokens_per_rank",
                           none_means="the budget derived from memory_limit" if self.memory_limit is not None else None)
        self._check_memory()
        if not isinstance(self.cost, CostModel):
            raise ValueError(f"config.cost={self.cost!r}: must be a hdp.packing.CostModel")
        pp = self.pipeline_stages
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
            raise ValueError(
                f"config.pipeline_stages={pp!r}: pass the number of pipeline stages, an integer >= 1 (1: no PP)"
            )
        if self.static_cp_size is not None and self.static_cp_size > n:
            raise ValueError(
                f"config.static_cp_size={self.static_cp_size}: must be in [1, num_ranks={n}] or None "
                "(smallest power of two fitting the longest sample)"
            )

    def _check_memory(self) -> None:
        lim, mm = self.memory_limit, self.memory_model
        if lim is not None:
            if isinstance(lim, bool) or not isinstance(lim, (int, float)) or not math.isfinite(lim) or lim <= 0:
                raise ValueError(f"config.memory_limit={lim!r}: pass bytes per device > 0 (e.g. 64 * 2**30) or None")
            if mm is None:
                raise ValueError("config.memory_limit needs config.memory_model: the model and layout that price a "
                                 "round's bytes (hdp.packing.memory.model_for(...))")
        if mm is None:
            return
        if not isinstance(mm, MemoryModel):
            raise ValueError(f"config.memory_model={mm!r}: pass a hdp.packing.memory.MemoryModel")
        if mm.layout.domain != self.num_ranks:
            raise ValueError(f"config.memory_model.layout.domain={mm.layout.domain} but num_ranks={self.num_ranks}: "
                             "build the memory model for this domain (MemoryLayout(domain=N))")
        if mm.layout.pp != self.pipeline_stages:
            raise ValueError(f"config.memory_model.layout.pp={mm.layout.pp} but pipeline_stages={self.pipeline_stages}: "
                             "give the memory model the job's PP")

    def budget(self, lengths: np.ndarray) -> int:
        """The token budget B of a batch: ``max_tokens_per_rank``, or with ``memory_limit`` the largest
        that keeps every round's predicted peak within it (at most ``max_tokens_per_rank``).  ValueError
        naming the limit, the figure needed and the fix when the static memory or a sample does not fit."""
        if self.memory_limit is None:
            assert self.max_tokens_per_rank is not None
            return self.max_tokens_per_rank
        assert self.memory_model is not None
        b = MemoryBudget(model=self.memory_model, limit_bytes=float(self.memory_limit)).check(
            self.num_ranks, np.asarray(lengths), self.memory_limit_name)
        return b if self.max_tokens_per_rank is None else min(b, self.max_tokens_per_rank)
