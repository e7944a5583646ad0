"""The frozen `Plan`: rounds -> groups (rank ranges) -> samples -> zigzag chunk boundaries.

Storage is columnar (one entry per sample, in the caller's order): the round of the sample and
the first rank and size of its group.  Everything else — rounds, groups, the samples of a rank,
per-rank token counts, a checksum — is derived from those columns, so a plan is cheap to build for
100K samples and still reads as rounds -> groups -> samples.  Ranks that no group covers in a
round are idle: they run an empty micro-batch so collectives line up (docs/design.md, invariant 2).
Within a group, samples run in ascending caller index.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from hdp.packing.chunks import rank_chunks, zigzag_bounds
from hdp.packing.topology import check_node_of

__all__ = ["Plan", "Round", "Group", "PlanStats"]


@dataclass(frozen=True)
class Group:
    """A group of ``size`` contiguous ranks starting at ``start`` running ``samples`` packed."""

    start: int
    size: int
    samples: tuple[int, ...]
    """Caller indices of the samples, in execution order."""
    lengths: tuple[int, ...]
    """Lengths of those samples."""

    @property
    def ranks(self) -> range:
        """Domain ranks of the group, in ring order."""
        return range(self.start, self.start + self.size)

    def chunk_bounds(self, position: int) -> np.ndarray:
        """The 2k+1 zigzag chunk boundaries of the sample at ``position`` in this group."""
        return zigzag_bounds(self.lengths[position], self.size)

    def rank_chunks(self, rank: int) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
        """``(caller_index, front, back)`` token ranges that domain ``rank`` holds in this group."""
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not in group ranks {self.start}..{self.start + self.size - 1}")
        j = rank - self.start
        return [(s, *rank_chunks(length, self.size, j)) for s, length in zip(self.samples, self.lengths)]

    @property
    def tokens(self) -> int:
        """Total tokens of the group's samples."""
        return int(sum(self.lengths))


@dataclass(frozen=True)
class Round:
    """One round: disjoint groups; ranks not covered are idle."""

    index: int
    groups: tuple[Group, ...]

    def group_of(self, rank: int) -> Group | None:
        """The group that ``rank`` belongs to in this round, or None when it is idle."""
        for g in self.groups:
            if g.start <= rank < g.start + g.size:
                return g
        return None


@dataclass(frozen=True, kw_only=True)
class PlanStats:
    """Figures of a plan under a cost model (all times in token² units unless suffixed _s)."""

    step_time: float
    """T(plan) = sum over rounds of the slowest rank + rounds * beta (+ (PP - 1) x the longest round)."""
    lower_bound: float
    """T* = cheapest rank-time of every sample / N + minimum rounds * beta."""
    efficiency: float
    """T* / T."""
    step_time_s: float
    """T in seconds (cost.unit_time_s)."""
    lower_bound_s: float
    """T* in seconds."""
    rounds: int
    """Number of rounds."""
    min_rounds: int
    """Fewest rounds the token budget allows (ceil(total tokens / (N * B)))."""
    busy: np.ndarray = field(repr=False)
    """[N] busy time of each rank over the step (units)."""
    idle_ratio: np.ndarray = field(repr=False)
    """[N] 1 - busy / (T - rounds * beta) for each rank."""
    max_idle_ratio: float
    """Largest idle ratio of any rank."""
    cp_degree_hist: dict[int, int]
    """Group size -> number of samples planned on groups of that size."""
    tokens_per_rank: np.ndarray = field(repr=False)
    """[R, N] tokens held by each rank in each round (exact zigzag counts)."""
    max_tokens_per_rank: int
    """Largest entry of tokens_per_rank."""
    planner_ms: float = 0.0
    """Wall time of the policy, milliseconds."""
    pipeline_stages: int = 1
    """PP stages the step time was computed with (1: no pipeline)."""
    pipeline_fill: float = 0.0
    """(PP - 1) x the longest round: the pipeline's fill and drain, part of step_time (units)."""
    lower_bound_tight: float | None = None
    """T*_tight (`hdp.packing.simulate.lower_bound_tight`): also counts the rank-time tall samples
    must spend on wide groups and what the round of the longest sample cannot fill; a second
    statistic next to ``lower_bound``, which ``efficiency`` keeps using (units); ``None`` unless
    asked for (``simulate(..., tight=True)``)."""
    efficiency_tight: float | None = None
    """T*_tight / T (``None`` unless asked for)."""
    token_budget: int = 0
    """B the plan was made with (tokens per rank per round; derived from the memory limit when one is set)."""
    nodes: int = 1
    """Nodes the domain spans (``Plan.node_of``; 1: one node)."""
    cross_node_fraction: float = 0.0
    """Fraction of the ring traffic (K/V blocks x ring steps) that runs between nodes (0 on one node)."""
    cross_node_groups: int = 0
    """Groups whose ring crosses a node boundary (their steps run at the inter-node link)."""
    memory: dict[str, Any] | None = None
    """Predicted memory of the plan when the planner has a memory model (`hdp.packing.memory.memory_stats`:
    ``peak_bytes``, ``round_peak_bytes``, ``limit_bytes``, ``token_budget``, ...); ``None`` without."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (arrays reduced to scalars)."""
        return {
            "rounds": self.rounds,
            "min_rounds": self.min_rounds,
            "step_time": self.step_time_s,
            "lower_bound": self.lower_bound_s,
            "step_time_units": self.step_time,
            "lower_bound_units": self.lower_bound,
            "efficiency": self.efficiency,
            "max_idle_ratio": self.max_idle_ratio,
            "mean_idle_ratio": float(self.idle_ratio.mean()) if self.idle_ratio.size else 0.0,
            "cp_degree_hist": {str(k): v for k, v in sorted(self.cp_degree_hist.items())},
            "max_tokens_per_rank": self.max_tokens_per_rank,
            "mean_tokens_per_rank_round": float(self.tokens_per_rank.mean()) if self.tokens_per_rank.size else 0.0,
            "planner_ms": self.planner_ms,
            "pipeline_stages": self.pipeline_stages,
            "pipeline_fill": self.pipeline_fill * self.step_time_s / self.step_time if self.step_time else 0.0,
            "lower_bound_tight": None if self.lower_bound_tight is None else (
                self.lower_bound_tight * self.step_time_s / self.step_time if self.step_time else 0.0),
            "lower_bound_tight_units": self.lower_bound_tight,
            "efficiency_tight": self.efficiency_tight,
            "token_budget": self.token_budget,
            "nodes": self.nodes,
            "cross_node_fraction": self.cross_node_fraction,
            "cross_node_groups": self.cross_node_groups,
            "memory": self.memory,
        }


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.int64)
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class Plan:
    """The plan of one step. Columns are per sample in the caller's order."""

    num_ranks: int
    max_tokens_per_rank: int
    policy: str
    lengths: np.ndarray
    """[S] sample lengths."""
    round_of: np.ndarray
    """[S] round of each sample."""
    group_start: np.ndarray
    """[S] first domain rank of each sample's group."""
    group_size: np.ndarray
    """[S] size k of each sample's group."""
    num_rounds: int
    stats: PlanStats | None = None
    node_of: tuple[int, ...] | None = None
    """The node of every domain rank the plan was made for (`hdp.packing.topology`; ``None``: one
    node); the simulator prices a group whose ring crosses nodes by the inter-node link."""

    def __post_init__(self) -> None:
        """Columns are 1-D int64, one entry per sample; sizes and counts are positive integers."""
        for name in ("num_ranks", "max_tokens_per_rank", "num_rounds"):
            v = getattr(self, name)
            lo = 0 if name == "num_rounds" else 1
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < lo:
                raise ValueError(f"Plan.{name}={v!r}: pass an integer >= {lo}")
        n = None
        for name in ("lengths", "round_of", "group_start", "group_size"):
            col = np.asarray(getattr(self, name))
            if col.ndim != 1 or not (np.issubdtype(col.dtype, np.integer) or col.size == 0):
                raise ValueError(f"Plan.{name}: expected a 1-D integer column (one entry per sample), got shape "
                                 f"{col.shape}, dtype {col.dtype}")
            if n is None:
                n = col.shape[0]
            elif col.shape[0] != n:
                raise ValueError(f"Plan.{name} has {col.shape[0]} entries but Plan.lengths has {n}: every column "
                                 "holds one entry per sample (build it from the same assignment)")
            object.__setattr__(self, name, _frozen(col))
        object.__setattr__(self, "node_of", check_node_of(self.node_of, int(self.num_ranks), "Plan.node_of"))

    @classmethod
    def from_columns(
        cls,
        *,
        num_ranks: int,
        max_tokens_per_rank: int,
        policy: str,
        lengths: np.ndarray,
        round_of: np.ndarray,
        group_start: np.ndarray,
        group_size: np.ndarray,
        num_rounds: int | None = None,
        node_of: tuple[int, ...] | None = None,
    ) -> "Plan":
        """Build a plan from per-sample columns; rounds are renumbered to drop empty ones."""
        lengths, round_of = _frozen(lengths), np.asarray(round_of)
        for name, col in (("round_of", round_of), ("group_start", np.asarray(group_start)),
                          ("group_size", np.asarray(group_size))):
            if col.shape != lengths.shape:
                raise ValueError(f"Plan.from_columns: {name} has shape {col.shape} but lengths has {lengths.shape}: "
                                 "pass one entry per sample in every column")
        round_of = round_of.astype(np.int64)
        if num_rounds is None:
            used = np.unique(round_of)
            remap = np.full(int(round_of.max(initial=-1)) + 1, -1, dtype=np.int64)
            remap[used] = np.arange(used.size)
            round_of = remap[round_of] if round_of.size else round_of
            num_rounds = int(used.size)
        return cls(
            num_ranks=int(num_ranks),
            max_tokens_per_rank=int(max_tokens_per_rank),
            policy=str(policy),
            lengths=lengths,
            round_of=_frozen(round_of),
            group_start=_frozen(group_start),
            group_size=_frozen(group_size),
            num_rounds=int(num_rounds),
            node_of=node_of,
        )

    def with_stats(self, stats: PlanStats) -> "Plan":
        """A copy of this plan carrying ``stats``."""
        return Plan(
            num_ranks=self.num_ranks, max_tokens_per_rank=self.max_tokens_per_rank,
            policy=self.policy, lengths=self.lengths, round_of=self.round_of,
            group_start=self.group_start, group_size=self.group_size,
            num_rounds=self.num_rounds, stats=stats, node_of=self.node_of,
        )

    def on_nodes(self, node_of: tuple[int, ...] | None) -> "Plan":
        """The same groups on a domain whose ranks sit on the nodes ``node_of`` (stats dropped): how
        a plan made without the topology runs on one that has it (`hdp.packing.simulate` prices it)."""
        return Plan(
            num_ranks=self.num_ranks, max_tokens_per_rank=self.max_tokens_per_rank,
            policy=self.policy, lengths=self.lengths, round_of=self.round_of,
            group_start=self.group_start, group_size=self.group_size,
            num_rounds=self.num_rounds, node_of=node_of,
        )

    @property
    def num_samples(self) -> int:
        """Number of samples in the step."""
        return int(self.lengths.size)

    @cached_property
    def _order(self) -> np.ndarray:
        # samples sorted by (round, group start, caller index): the global execution order
        return np.lexsort((np.arange(self.num_samples), self.group_start, self.round_of))

    @cached_property
    def rounds(self) -> tuple[Round, ...]:
        """The rounds, each with its groups in rank order (global execution order)."""
        groups: list[list[Group]] = [[] for _ in range(self.num_rounds)]
        order = self._order
        if order.size:
            r, s = self.round_of[order], self.group_start[order]
            cut = np.flatnonzero((np.diff(r) != 0) | (np.diff(s) != 0)) + 1
            for seg in np.split(order, cut):
                i0 = seg[0]
                groups[int(self.round_of[i0])].append(
                    Group(
                        start=int(self.group_start[i0]),
                        size=int(self.group_size[i0]),
                        samples=tuple(int(i) for i in seg),
                        lengths=tuple(int(x) for x in self.lengths[seg]),
                    )
                )
        return tuple(Round(index=i, groups=tuple(g)) for i, g in enumerate(groups))

    def rank_schedule(self, rank: int) -> list[Group | None]:
        """For each round, the group ``rank`` belongs to (None = idle, empty micro-batch)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank={rank}: outside the domain [0, {self.num_ranks})")
        return [rnd.group_of(rank) for rnd in self.rounds]

    def tokens_per_rank(self) -> np.ndarray:
        """[R, N] exact tokens held by each rank in each round under zigzag chunking."""
        out = np.zeros((self.num_rounds, self.num_ranks), dtype=np.int64)
        single = self.group_size == 1
        np.add.at(out, (self.round_of[single], self.group_start[single]), self.lengths[single])
        multi = np.flatnonzero(~single)
        for k in np.unique(self.group_size[multi]):
            sel = multi[self.group_size[multi] == k]
            length = self.lengths[sel][:, None]  # [S, 1]
            j = np.arange(k, dtype=np.int64)[None, :]  # [1, k]
            two_k = 2 * k
            lo, hi = j * length, (j + 1) * length
            # rank j holds chunk j (floor bounds) and chunk 2k-1-j (= ceil differences)
            count = (hi // two_k - lo // two_k) + (-(-hi // two_k) + (-lo // two_k))  # [S, k]
            rows = np.broadcast_to(self.round_of[sel][:, None], count.shape)
            cols = self.group_start[sel][:, None] + j
            np.add.at(out, (rows, cols), count)
        return out

    def checksum(self) -> str:
        """A short digest of everything that defines the plan (compared across the domain)."""
        h = hashlib.sha256()
        h.update(np.array([self.num_ranks, self.max_tokens_per_rank, self.num_rounds], np.int64).tobytes())
        h.update(self.policy.encode())
        for col in (self.lengths, self.round_of, self.group_start, self.group_size):
            h.update(col.tobytes())
        if self.node_of is not None:  # the topology is an input of the plan (one node: as before it existed)
            h.update(b"nodes")
            h.update(np.asarray(self.node_of, np.int64).tobytes())
        return h.hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """Serialisable form: columns plus the rounds -> groups -> samples view and stats."""
        out: dict[str, Any] = {
            "num_ranks": self.num_ranks,
            "max_tokens_per_rank": self.max_tokens_per_rank,
            "policy": self.policy,
            "num_rounds": self.num_rounds,
            "checksum": self.checksum(),
            **({"node_of": list(self.node_of)} if self.node_of is not None else {}),
            "lengths": self.lengths.tolist(),
            "rounds": [
                [{"ranks": [g.start, g.start + g.size - 1], "samples": list(g.samples)} for g in rnd.groups]
                for rnd in self.rounds
            ],
        }
        if self.stats is not None:
            out["stats"] = self.stats.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """Inverse of `to_dict` (stats are not restored)."""
        lengths = np.asarray(data["lengths"], dtype=np.int64)
        n = lengths.size
        round_of = np.full(n, -1, np.int64)
        start = np.zeros(n, np.int64)
        size = np.zeros(n, np.int64)
        for r, groups in enumerate(data["rounds"]):
            for g in groups:
                lo, hi = g["ranks"]
                idx = np.asarray(g["samples"], dtype=np.int64)
                round_of[idx], start[idx], size[idx] = r, lo, hi - lo + 1
        return cls.from_columns(
            num_ranks=data["num_ranks"], max_tokens_per_rank=data["max_tokens_per_rank"],
            policy=data["policy"], lengths=lengths, round_of=round_of, group_start=start,
            group_size=size, num_rounds=data["num_rounds"], node_of=data.get("node_of"),
        )

    def to_json(self) -> str:
        """JSON text of `to_dict`."""
        return json.dumps(self.to_dict())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return (
            self.num_ranks == other.num_ranks
            and self.max_tokens_per_rank == other.max_tokens_per_rank
            and self.policy == other.policy
            and self.num_rounds == other.num_rounds
            and self.node_of == other.node_of
            and all(
                np.array_equal(a, b)
                for a, b in (
                    (self.lengths, other.lengths), (self.round_of, other.round_of),
                    (self.group_start, other.group_start), (self.group_size, other.group_size),
                )
            )
        )

    __hash__ = None  # type: ignore[assignment]
