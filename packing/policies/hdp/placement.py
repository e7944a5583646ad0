"""Placement: where every round's groups sit on a domain over several nodes.

The passes choose groups -- their sizes, samples and rounds -- and price a group across nodes
exactly when it is wider than the largest node (`kernels.costs.group_cost`); a narrower group
crosses a boundary only where the round puts it across one.  `place` lays every round out again
so that groups stay inside nodes where the round's ranks allow (`kernels.placement`: node by
node, widest first, a group crossing into the next node only when the round has no idle ranks to
leave instead, the one whose height across nodes raises the round's top least), and keeps, round
by round, whichever of that layout and the given one has the lower top (rounds are independent:
the step time is a sum of round tops and the pipeline's term grows with each), the new one on
ties (it crosses no more).  Its result is never slower than its input, so `Problem.step_time`
scores every plan as placed, and the pipeline hands out placed columns.

A round's groups may not fit its nodes without one crossing (widths 5, 5 and 6 on two nodes of 8),
and the passes, pricing by size, do not see it.  The last pass, `repair`, places the plan and
searches it once more with every group priced where it sits (`polish` with ``placed``: the
polish pass's search keeps each group's crossing, `kernels.polish_state.Cols.cross`), so samples
leave groups that crossing made tall; it may spend a sixteenth of the search pool beyond what the
earlier passes left (counted like the rest, so every rank stops at the same point).

A contiguous group spanning m nodes crosses each boundary once and back once on the ring's
closing edge (`hdp.packing.topology`): m crossing edges, the fewest a ring over m nodes has.
"""

from __future__ import annotations

import numpy as np

from hdp.packing.kernels.jit import int_array
from hdp.packing.policies.hdp.columns import Columns
from hdp.packing.policies.hdp.kernels import costs as compiled
from hdp.packing.policies.hdp.kernels.placement import place_any, place_pow2
from hdp.packing.policies.hdp.polish import polish
from hdp.packing.topology import Nodes

__all__ = ["place", "exact_heights", "repair"]


def exact_heights(problem, cols: Columns) -> tuple[np.ndarray, np.ndarray]:
    """([C] every column's height inside one node, [C] its height across nodes) of compact ``cols``."""
    args = (problem.params, problem.lengths, int_array(cols.col_of), int_array(cols.width))
    inside = compiled.column_heights_at(*args, np.zeros(cols.n_columns, dtype=np.bool_))
    across = compiled.column_heights_at(*args, np.ones(cols.n_columns, dtype=np.bool_))
    return inside, across


def _tops(rounds: np.ndarray, h: np.ndarray, R: int) -> np.ndarray:
    top = np.zeros(R)
    np.maximum.at(top, rounds, h)
    return top


def place(problem, cols: Columns) -> tuple[Columns, np.ndarray]:
    """(``cols`` compacted and laid out round by round as the module docstring says, [C] every
    column's exact height where it sits); the nodes are ``problem.nodes`` (not None)."""
    nodes: Nodes = problem.nodes
    c = cols.compact()
    inside, across = exact_heights(problem, c)
    cross = nodes.crosses(c.start, c.width) if c.n_columns else np.zeros(0, dtype=bool)
    h = np.where(cross, across, inside)
    avoidable = cross & (c.width <= nodes.largest)
    if not avoidable.any():
        return c, h
    R = c.num_rounds
    redo = np.zeros(R, dtype=bool)
    redo[c.round[avoidable]] = True
    sel = np.flatnonzero(redo[c.round])
    order = sel[np.lexsort((sel, -across[sel], -c.width[sel], c.round[sel]))]
    bounds = np.searchsorted(c.round[order], np.arange(R + 1), side="left").astype(np.int64)
    start = int_array(c.start)
    if problem.pow2:
        place_pow2(int_array(order), bounds, int_array(c.width), int_array(nodes.first), int_array(nodes.node_of),
                   int(nodes.largest), start)
        failed = np.zeros(R, dtype=bool)
        failed[c.round[sel][start[sel] < 0]] = True
        start = np.where(failed[c.round], c.start, start)  # a round whose blocks found no slot keeps its layout
    else:
        place_any(int_array(order), bounds, int_array(c.width), inside, across, int_array(nodes.first),
                  int_array(nodes.node_of), int(nodes.largest), start)
    new_cross = nodes.crosses(start, c.width)
    h_new = np.where(new_cross, across, inside)
    take = _tops(c.round, h_new, R) <= _tops(c.round, h, R)  # per round: the lower top (the new on ties)
    use = take[c.round]
    out = Columns(col_of=c.col_of, round=c.round, start=np.where(use, start, c.start), width=c.width)
    return out, np.where(use, h_new, h)


def repair(cols: Columns, problem) -> Columns:
    """The last pass (module docstring): on a domain over nodes the plan placed and searched with every
    group priced where it sits; ``cols`` unchanged on one node."""
    if problem.nodes is None or not cols.complete:
        return cols
    return polish(problem.placed(cols), problem, placed=True)
