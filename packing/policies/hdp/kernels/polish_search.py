"""The polish pass's search, compiled: the loop of surveys and steps (`polish`, module docstring).

Each turn surveys the columns (`polish_survey.survey`), evaluates the moves of the source columns'
samples into the roomiest columns (`polish_steps.best_move`), when none is good the trades
(`polish_steps.best_trade`), when none is good the widenings (`polish_steps.widen`), and stops when
no step is good, the pool is spent, or a window of steps or units barely lowered the roofs.
"""

import numpy as np

from hdp.packing.kernels.jit import B1_1D, I64, I64_1D, helper, kernel
from hdp.packing.kernels.sums import pairwise_sum
from hdp.packing.policies.hdp.kernels.polish_state import BATCH, SETTINGS, ensure, grow, start
from hdp.packing.policies.hdp.kernels.polish_steps import best_move, best_trade, widen
from hdp.packing.policies.hdp.kernels.polish_survey import roomiest, survey

__all__ = ["polish_search"]


@kernel(BATCH, SETTINGS, I64_1D, I64_1D, I64_1D, B1_1D, I64, I64)
def polish_search(batch, settings, col_of, rnd0, width0, cross0, n_rounds, spent):
    """The search on a compact plan of ``batch`` (`polish_state.Batch`): ``col_of`` [n] column of every
    sample, ``rnd0`` / ``width0`` / ``cross0`` [C] round, width and crossing (`polish_state.Cols.cross`)
    of every column, ``n_rounds`` rounds; ``spent``
    units of the search pool spent so far, ``settings.stop_at`` the most it may reach.  Returns
    (col_of [n], round [cap], width [cap], alive [cap], columns opened, steps taken, spent): the
    searched plan's columns (``alive`` marks those left)."""
    n = batch.lengths.size
    R = n_rounds
    cols, surv, values = start(batch, col_of, rnd0, width0, cross0, n_rounds, settings.table_samples)
    opened = rnd0.size
    steps = 0
    stale = 0
    mark = -1.0
    mark_units = spent
    window = max(1, (settings.stop_at - spent) // settings.windows)
    order = np.empty(0, dtype=np.int64)  # the live columns at the last survey, sorted
    surveyed = 0  # columns opened at the last survey
    while True:
        units = n // 8 + opened  # the step's bookkeeping: roof samples, columns
        if spent + units > settings.stop_at:
            break
        spent += units
        if opened + R + 1 >= cols.rnd.size:
            cols, surv = grow(cols, surv)
        order = survey(cols, surv, order, surveyed, opened, settings.n_sources)
        surveyed = opened
        if mark < 0.0:
            mark = pairwise_sum(surv.roof, 0, R)
        movers = _samples_on(cols.col_of, surv.source)
        if movers.size == 0:
            break
        targets = roomiest(cols, surv, order, opened, settings.n_targets)
        # the table's rows the evaluation reads: the movers' and targets' widths, new groups' sizes
        for m in range(movers.size):
            values = ensure(values, cols.width[cols.col_of[movers[m]]])
            values = ensure(values, batch.k_min[movers[m]])
        for c in targets:
            values = ensure(values, cols.width[c])
        found, spent, ok, opened = best_move(batch, settings, cols, surv, values, movers, targets, spent, opened)
        if not ok:
            break
        if found == 0:
            roof_movers = _on(movers, cols.col_of, surv.at_roof)
            roomy = roomiest(cols, surv, order, opened, settings.trade_columns)
            for c in roomy:
                values = ensure(values, cols.width[c])
            found, spent, ok = best_trade(batch, settings, cols, surv, values, roof_movers, roomy, spent)
            if not ok:
                break
        if found == 0:
            found, spent = widen(batch, settings, cols, surv, values, opened, spent)
        if found == 0:
            break
        steps += found
        stale += found
        if stale > settings.patience or spent - mark_units > window:
            # a window of steps or of work: stop once the roofs barely came down over it
            order = survey(cols, surv, order, surveyed, opened, 1)
            surveyed = opened
            now = pairwise_sum(surv.roof, 0, R)
            if now > mark * (1 - settings.progress):
                break
            mark, stale, mark_units = now, 0, spent
    return cols.col_of, cols.rnd, cols.width, cols.alive, opened, steps, spent


@helper
def _on(items, col_of, flag):
    """The ``items`` (samples, in order) whose column is flagged."""
    n = 0
    for i in items:
        if flag[col_of[i]]:
            n += 1
    out = np.empty(n, dtype=np.int64)
    n = 0
    for i in items:
        if flag[col_of[i]]:
            out[n] = i
            n += 1
    return out


@helper
def _samples_on(col_of, flag):
    """The samples (ascending) whose column is flagged."""
    n = 0
    for i in range(col_of.size):
        if flag[col_of[i]]:
            n += 1
    out = np.empty(n, dtype=np.int64)
    n = 0
    for i in range(col_of.size):
        if flag[col_of[i]]:
            out[n] = i
            n += 1
    return out
