"""Planner configuration: typed choices and the frozen, validated `PlannerConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from hdp.packing.cost import CostModel
from hdp.packing.profiles import cost_model

__all__ = ["Policy", "GroupShape", "PlannerConfig", "parse_enum"]


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


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """Everything `plan()` needs besides the lengths. Validated on construction."""

    num_ranks: int
    """N: ranks in the domain (Megatron's DP x CP ranks of one TP/PP coordinate)."""
    max_tokens_per_rank: int
    """B: token budget of one rank in one round (activation memory is linear in tokens)."""
    policy: Policy = Policy.HDP
    """Which packing policy plans the step."""
    group_shape: GroupShape = GroupShape.ANY
    """Group shapes the hdp policy may use (`any` contiguous ranges or `pow2` aligned blocks)."""
    cost: CostModel = field(default_factory=cost_model)
    """Cost model (a, beta, CP overheads); default: deepseek-v3 on the h100-nvlink profile."""
    static_cp_size: int | None = None
    """CP size k for static-cp / ascend-hdp / verl-kk; None = smallest power of two fitting the longest sample."""
    max_extra_rounds: int = 3
    """hdp: rounds beyond the minimum it tries per candidate family; on batches of up to 4,096
    samples it goes on (to 8) while each further round still lowers the step time."""
    search_max_samples: int = 2048
    """hdp: batches of up to this many samples are also planned with a first round around their
    tallest samples and improved by local search (`policies/polish.py`): the best plans, at a
    cost of about 2 s per 1,024 samples on 64 ranks (one CPU core).  0 turns the search off."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", parse_enum(Policy, self.policy, "config.policy"))
        object.__setattr__(
            self, "group_shape", parse_enum(GroupShape, self.group_shape, "config.group_shape")
        )
        if isinstance(self.num_ranks, bool) or not isinstance(self.num_ranks, int):
            raise ValueError(f"config.num_ranks={self.num_ranks!r}: must be an integer >= 1")
        if self.num_ranks < 1:
            raise ValueError(
                f"config.num_ranks={self.num_ranks}: the domain needs at least 1 rank; pass N >= 1"
            )
        if isinstance(self.max_tokens_per_rank, bool) or not isinstance(
            self.max_tokens_per_rank, int
        ):
            raise ValueError(
                f"config.max_tokens_per_rank={self.max_tokens_per_rank!r}: must be an integer > 0"
            )
        if self.max_tokens_per_rank <= 0:
            raise ValueError(
                f"config.max_tokens_per_rank={self.max_tokens_per_rank}: the per-rank token "
                "budget B must be > 0 (e.g. 4096)"
            )
        if not isinstance(self.cost, CostModel):
            raise ValueError(f"config.cost={self.cost!r}: must be a hdp.packing.CostModel")
        if self.static_cp_size is not None:
            k = self.static_cp_size
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.num_ranks:
                raise ValueError(
                    f"config.static_cp_size={k!r}: must be an integer in [1, num_ranks="
                    f"{self.num_ranks}] or None (smallest power of two fitting the longest sample)"
                )
        if not isinstance(self.max_extra_rounds, int) or self.max_extra_rounds < 0:
            raise ValueError(
                f"config.max_extra_rounds={self.max_extra_rounds!r}: must be an integer >= 0"
            )
        if isinstance(self.search_max_samples, bool) or not isinstance(self.search_max_samples, int) \
                or self.search_max_samples < 0:
            raise ValueError(
                f"config.search_max_samples={self.search_max_samples!r}: must be an integer >= 0 "
                "(0 turns the local search off)"
            )
