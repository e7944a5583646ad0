"""The ``hdp`` policy: sequence-length-aware hybrid data/context parallel packing.

A plan is built as `Columns` -- groups of ranks (k = 1: a plain data-parallel rank) running a
packed set of samples for one round -- by a pipeline of passes; every pass takes the columns and
the `Problem` (batch, config, objective, work meter) and returns new columns:

1. **construct** (`construct.py`): a group size per sample and a round count, the samples of each
   size balanced over that size's bins, bins shelved into rounds; many candidates (variants x
   round counts) scored by the step time, the best kept;
2. **level** (`level.py`): work re-spread between columns and rounds of that plan (singles up to
   each round's roof, gaps filled, a round's roof traded with another round's work, rounds
   re-planned on their own, uneven groups merged);
3. **tall round** (`tall_round.py`): when some sample is far taller than a balanced round, another
   starting plan whose first round holds the tallest samples, widened where the idle time and
   the ring overhead balance, the rest spread over the other rounds; it and the input each get
   half of the search budget, the better goes on;
4. **polish** (`polish.py`): local search -- samples move or trade places off each round's roof,
   a round's only roof group widens onto free ranks;
5. **reshelve** (`reshelve.py`): the finished columns laid out into rounds again, tallest first,
   and searched once more, when that is faster (the search cannot move a round's roof column into
   another round step by step when every round has one);
6. **rivals** (`rivals.py`): the plans the other policies (and hdp with power-of-two groups) build
   for the batch, so hdp is never worse than any of them under its own cost model;
7. **repair** (`placement.py`, a domain over nodes only): the plan placed and searched once more with
   every group priced where it sits.

The objective of every pass is the simulator's step time (`problem.py`): the sum of round maxima,
plus rounds * beta, plus (PP - 1) times the tallest round with a pipeline of PP stages.  Every
pass after the first returns a plan at least as good as its input.  Work is counted against the
config's `SearchBudget` (construction candidates, search moves, rivals), never timed: every rank
stops at the same point and gets the same plan.  The cost model, not the group shape, decides:
CP3/CP5/CP6 groups appear whenever they are cheaper.  All steps are deterministic (ties broken
by index).  On a domain over several nodes (``config.node_of``) the passes price a group wider than
a node across nodes, and every plan is scored -- and handed out -- as `placement.place` lays its
rounds out, groups inside nodes where that is cheaper.  The inner loops run compiled (`kernels`, numba; the cost arithmetic is `CostModel`'s
own, in its order); their machine code is loaded from numba's on-disk cache -- or compiled, once per
machine, when it is cold -- when this package is imported.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from hdp.packing.config import PlannerConfig
from hdp.packing.policies.common import Assignment
from hdp.packing.policies.hdp import construct, kernels, level, placement, polish, reshelve, rivals, tall_round
from hdp.packing.policies.hdp.columns import Columns
from hdp.packing.policies.hdp.problem import Meter, Problem

__all__ = ["assign", "plan_columns", "PIPELINE", "Pass", "Columns", "Problem", "Meter"]

kernels.warm_up()  # the compiled kernels loaded (or compiled) at import, not inside the first plan


class Pass(Protocol):
    """One pass of the pipeline: columns in, columns out (the input is never changed)."""

    def __call__(self, cols: Columns, problem: Problem) -> Columns: ...


PIPELINE: tuple[Pass, ...] = (
    construct.construct, level.level, tall_round.tall_round, polish.polish, reshelve.reshelve, rivals.rivals,
    placement.repair,
)
"""The passes, in order."""


def plan_columns(lengths: np.ndarray, config: PlannerConfig, *, memo: dict | None = None) -> Columns:
    """Run the pipeline on ``lengths``: the plan as columns (``memo``: rival plans already built)."""
    problem = Problem.of(lengths, config, memo=memo)
    cols = Columns.empty(problem.n)
    for step in PIPELINE:
        cols = step(cols, problem)
    return problem.placed(cols)


def assign(lengths: np.ndarray, config: PlannerConfig) -> Assignment:
    """Plan ``lengths`` with the hdp policy (module docstring)."""
    return plan_columns(lengths, config).assignment()
