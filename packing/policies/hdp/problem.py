"""`Problem`: what every pass of the hdp pipeline plans for -- the batch, the config, the
objective -- and `Meter`, the work it may still spend (`hdp.packing.SearchBudget`).

The objective is the simulator's step time (`hdp.packing.simulate`):

    T = sum_r top_r + R * beta + (PP - 1) * max_r top_r

where ``top_r`` is the round's tallest column (its groups are disjoint, so its slowest rank) and
the last term is the pipeline's fill and drain with PP stages (``config.pipeline_stages``).

On a domain over several nodes (``config.node_of``) the passes price a group by its size
(`cost.SizePricedCost`: wider than the largest node, across nodes), and `Problem.step_time` scores
a plan as `placement.place` lays it out, every group priced where it sits.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from hdp.packing.config import GroupShape, PlannerConfig, SearchBudget
from hdp.packing.cost import PARAMETERS, CostModel, SizePricedCost, min_group_size
from hdp.packing.policies.common import allowed_sizes
from hdp.packing.kernels.jit import int_array
from hdp.packing.kernels.sums import max_at
from hdp.packing.policies.hdp.kernels import costs as compiled
from hdp.packing.policies.hdp.columns import Columns
from hdp.packing.topology import Nodes

__all__ = ["Problem", "Meter", "POOLS"]

POOLS = ("construct", "search", "rivals")
"""The budget's pools (fields of `SearchBudget`)."""

_TOL = 1e-9  # relative: a step-time drop smaller than this is no drop


class Meter:
    """Work spent against a `SearchBudget`, per pool; shared by the passes of one ``plan()`` call.

    Counting, not timing, is what makes the planner deterministic: every rank charges the same
    units in the same order and so stops at the same point.
    """

    def __init__(self, budget: SearchBudget) -> None:
        self.budget = budget
        self.spent = dict.fromkeys(POOLS, 0)

    def left(self, pool: str) -> int:
        """Units of ``pool`` not spent yet (negative once overspent by a mandatory step)."""
        return int(getattr(self.budget, pool)) - self.spent[pool]

    def allows(self, pool: str, units: float) -> bool:
        """Whether ``units`` more still fit ``pool``."""
        return self.left(pool) >= units

    def charge(self, pool: str, units: float) -> None:
        """Count ``units`` of work against ``pool``."""
        self.spent[pool] += int(units)


@dataclass(eq=False)
class Problem:
    """The batch (lengths), the planner config, each sample's fewest ranks, the allowed group sizes
    and the work meter."""

    lengths: np.ndarray
    """[n] sample lengths (int64)."""
    config: PlannerConfig
    """Domain size, budget B, cost model, group shape, pipeline stages, search budget."""
    k_min: np.ndarray
    """[n] fewest ranks of every sample: zigzag-exact ceil(L/B), or the power of two above it."""
    sizes: np.ndarray
    """Allowed group sizes, ascending (every size up to N, or the powers of two)."""
    meter: Meter
    """Work spent so far (shared with sub-problems)."""
    memo: dict = field(default_factory=dict)
    """Plans of the rival policies, by name, once built (`rivals`; shared with hdp-pow2's run)."""
    nodes: Nodes | None = None
    """Where the domain's ranks sit (``None``: one node)."""
    cost: CostModel = None  # type: ignore[assignment]
    """The cost model plans are scored with: ``config.cost``, on several nodes as a `SizePricedCost`."""
    params: np.ndarray = None  # type: ignore[assignment]
    """`kernels.costs.cost_params` of `cost` (what the compiled passes price groups with)."""

    def __post_init__(self) -> None:
        if self.cost is None:
            self.cost = (self.config.cost if self.nodes is None else
                         SizePricedCost(**{n: getattr(self.config.cost, n) for n in PARAMETERS},
                                       node_ranks=self.nodes.largest))
        if self.params is None:
            self.params = compiled.cost_params(self.cost)

    @classmethod
    def of(
        cls, lengths: np.ndarray, config: PlannerConfig, meter: Meter | None = None, memo: dict | None = None,
    ) -> Problem:
        """The problem of planning ``lengths`` under ``config``; ValueError when a sample needs more
        ranks than the largest power-of-two block under ``group_shape=pow2``."""
        lengths = np.array(lengths, dtype=np.int64)  # a writable copy: one argument type for the kernels
        N, B = config.num_ranks, config.max_tokens_per_rank
        pow2 = config.group_shape is GroupShape.POW2
        k_min = min_group_size(lengths, B, N, pow2=pow2)
        sizes = allowed_sizes(N, config.group_shape)
        if pow2 and lengths.size and int(k_min.max()) > int(sizes[-1]):
            i = int(np.argmax(k_min))
            raise ValueError(
                f"lengths[{i}]={int(lengths[i])} needs {int(k_min[i])} ranks, more than the largest "
                f"power-of-two block of the domain ({int(sizes[-1])} of {N} ranks); use "
                "group_shape='any' or a larger max_tokens_per_rank"
            )
        return cls(lengths=lengths, config=config, k_min=k_min, sizes=sizes,
                   meter=meter if meter is not None else Meter(config.search_budget),
                   memo=memo if memo is not None else {}, nodes=Nodes.of(config.node_of, N))

    def sub(self, samples: np.ndarray) -> Problem:
        """The same problem for the given samples only (same config and meter)."""
        return replace(self, lengths=self.lengths[samples], k_min=self.k_min[samples], memo={})

    # ------------------------------------------------------------------------------ shorthands

    @property
    def n(self) -> int:
        """Samples."""
        return int(self.lengths.size)

    @property
    def num_ranks(self) -> int:
        """N."""
        return self.config.num_ranks

    @property
    def budget(self) -> int:
        """B: tokens per rank and round."""
        return self.config.max_tokens_per_rank

    @property
    def pow2(self) -> bool:
        """Groups must be aligned power-of-two blocks."""
        return self.config.group_shape is GroupShape.POW2

    @property
    def stages(self) -> int:
        """PP: pipeline stages."""
        return self.config.pipeline_stages

    # ------------------------------------------------------------------------------ scoring

    def sample_costs(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([n] per-rank cost, [n] busiest-rank tokens) of every sample alone on k[i] ranks."""
        k = int_array(np.broadcast_to(k, self.lengths.shape))
        cost, tokens = np.empty(self.n), np.empty(self.n, dtype=np.int64)
        compiled.sample_costs(self.params, self.lengths, k, cost, tokens)
        return cost, tokens

    def heights(self, cols: Columns) -> np.ndarray:
        """[C] exact per-rank time of every column (its samples share the ring steps,
        `CostModel.group_cost`; on several nodes priced by its size, `cost.SizePricedCost`); 0 for an
        empty column."""
        return compiled.column_heights(self.params, self.lengths, int_array(cols.col_of), int_array(cols.width))

    def tokens(self, cols: Columns) -> np.ndarray:
        """[C] busiest-rank tokens of every column."""
        return compiled.column_tokens(self.lengths, int_array(cols.col_of), int_array(cols.width))

    def tops(self, cols: Columns, heights: np.ndarray | None = None) -> np.ndarray:
        """[R] height of every round (its tallest column); rounds without samples count 0."""
        h = self.heights(cols) if heights is None else heights
        top = np.zeros(cols.num_rounds)
        used = cols.used()
        max_at(top, cols.round[used], h[used])
        return top

    def objective(self, tops: np.ndarray) -> float:
        """Step time of rounds of the given heights: sum + rounds * beta + (PP - 1) * max."""
        tops = np.asarray(tops, dtype=np.float64)
        if tops.size == 0:
            return 0.0
        return float(tops.sum()) + tops.size * self.cost.round_cost + (self.stages - 1) * float(tops.max())

    def step_time(self, cols: Columns, heights: np.ndarray | None = None) -> float:
        """T of a plan (empty rounds dropped), the simulator's step time; ``heights``: its columns'
        (`heights`) when already known.  On several nodes: of the plan as `placement.place` lays it
        out, every group priced where it sits (``heights`` unused)."""
        if self.nodes is not None:
            from hdp.packing.policies.hdp.placement import place  # it imports this module

            placed, h = place(self, cols)
            return self.step_time_at(placed, h)
        top = self.tops(cols, heights)
        return self.objective(top[top > 0] if np.any(top <= 0) else top)

    def step_time_at(self, cols: Columns, heights: np.ndarray) -> float:
        """T of a plan whose columns are ``heights`` tall (no placement)."""
        top = self.tops(cols, heights)
        return self.objective(top[top > 0] if np.any(top <= 0) else top)

    def placed(self, cols: Columns) -> Columns:
        """``cols`` as the plan runs: on several nodes laid out by `placement.place`, else as they are."""
        if self.nodes is None:
            return cols
        from hdp.packing.policies.hdp.placement import place

        return place(self, cols)[0]

    def better(self, new: Columns, old: Columns) -> Columns:
        """``new`` when its step time is lower than ``old``'s (beyond round-off), else ``old``."""
        return new if self.step_time(new) < self.step_time(old) * (1 - _TOL) else old

    def best(self, candidates: list[Columns]) -> Columns:
        """The candidate with the least step time (the first among equals)."""
        times = [self.step_time(c) for c in candidates]
        return candidates[int(np.argmin(times))]

    def fits(self, cols: Columns) -> bool:
        """Every sample planned on at least its fewest ranks, an allowed group size, and no rank over B."""
        if not cols.complete:
            return False
        w = cols.width[cols.col_of]
        if np.any(w < self.k_min) or not np.all(np.isin(cols.width[cols.used()], self.sizes)):
            return False
        return bool(self.tokens(cols).max(initial=0) <= self.budget) and cols.valid_layout(self.num_ranks, self.pow2)
