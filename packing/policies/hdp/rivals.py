"""The rivals pass: hdp is never worse than any other plan the package builds for the batch.

The other policies -- ``static-cp``, ``verl-kk``, ``megatron-dcp``, ``ascend-hdp`` -- hdp itself
with power-of-two groups (under ``group_shape=any``), with PP stages hdp planned as if there
were no pipeline, and on a domain over several nodes hdp planned as if it were one node (the
node-blind plan, which placement then lays out on the nodes) plan the same batch; each plan that is
valid under the problem's group shape (power-of-two plans are laid out again as aligned blocks,
which costs nothing) and fits the token budget is scored with the problem's own objective, and
the best of them and the pass's input is kept (then polished with what is left of the search
pool, when a rival won).  So under the cost model it plans with, hdp's step time is at most every
rival's.

Rivals cost time, so they are taken cheapest first while their estimated work fits the
``rivals`` pool of the search budget (`estimate`: samples x (ranks + 32), four times that for
hdp-pow2, hdp-no-pp and hdp-one-node).  The rival plans are cached
on the problem, so hdp-pow2's own rivals reuse them.
"""

from __future__ import annotations

import importlib
from dataclasses import replace

from hdp.packing.config import GroupShape, Policy
from hdp.packing.policies.hdp.columns import Columns
from hdp.packing.policies.hdp.polish import polish

__all__ = ["rivals", "estimate", "RIVALS"]

HDP_POW2 = "hdp-pow2"
HDP_NO_PP = "hdp-no-pp"
HDP_ONE_NODE = "hdp-one-node"
_HDP_RIVALS = (HDP_POW2, HDP_NO_PP, HDP_ONE_NODE)
RIVALS: tuple[str, ...] = (
    Policy.STATIC_CP.value, Policy.VERL_KK.value, Policy.MEGATRON_DCP.value, Policy.ASCEND_HDP.value, HDP_POW2,
    HDP_NO_PP, HDP_ONE_NODE,
)
"""Plans hdp competes with (policy names; ``hdp-pow2`` is hdp under ``group_shape=pow2``,
``hdp-no-pp`` hdp planned as if there were no pipeline, a rival only with PP stages,
``hdp-one-node`` hdp planned without the topology, a rival only on several nodes)."""

_PER_SAMPLE = 32  # fixed work per sample of every rival (Python-level placement), in ranks


def estimate(name: str, problem) -> int:
    """Estimated work of rival ``name`` on the problem's batch, in units of the ``rivals`` pool:
    samples x (ranks + 32) -- the baselines place samples one by one over the domain's groups --
    and four times that for hdp-pow2 (a whole hdp run)."""
    units = problem.n * (problem.num_ranks + _PER_SAMPLE)
    return 4 * units if name in _HDP_RIVALS else units


def _rival_columns(name: str, problem) -> Columns | None:
    """Rival ``name``'s plan as columns (cached on the problem), or None when it cannot plan the batch."""
    config = problem.config
    key = name if name not in _HDP_RIVALS else f"{name}/{config.group_shape.value}/{config.pipeline_stages}/{config.node_of}"
    if key in problem.memo:
        return problem.memo[key]
    cols = None
    try:
        if name in _HDP_RIVALS:
            from hdp.packing.policies.hdp import plan_columns

            cfg = (replace(config, policy=Policy.HDP, group_shape=GroupShape.POW2) if name == HDP_POW2
                   else replace(config, policy=Policy.HDP, pipeline_stages=1) if name == HDP_NO_PP
                   else replace(config, policy=Policy.HDP, node_of=None))
            cols = plan_columns(problem.lengths, cfg, memo=problem.memo)
        else:
            module = importlib.import_module(f"hdp.packing.policies.{name.replace('-', '_')}")
            a = module.assign(problem.lengths, replace(config, policy=Policy(name)))
            cols = Columns.from_assignment(a, problem.num_ranks)
    except ValueError:  # the rival cannot plan this batch (a sample fits no block of its shape)
        cols = None
    problem.memo[key] = cols
    return cols


def rivals(cols: Columns, problem) -> Columns:
    """The rivals pass (module docstring): the best of ``cols`` and the rival plans that fit the budget."""
    assert cols.complete, "rivals needs every sample planned"
    meter = problem.meter
    names = [r for r in RIVALS if not (r == HDP_POW2 and problem.pow2) and not (r == HDP_NO_PP and problem.stages == 1)
             and not (r == HDP_ONE_NODE and problem.nodes is None)]
    est = {r: estimate(r, problem) for r in names}
    best = cols
    for name in sorted(names, key=lambda r: (est[r], names.index(r))):
        if not meter.allows("rivals", est[name]):
            break
        meter.charge("rivals", est[name])
        cand = _rival_columns(name, problem)
        if cand is None:
            continue
        if problem.pow2:
            cand = cand.relaid()  # power-of-two groups laid out wider first are aligned blocks
        if not problem.fits(cand):
            continue
        best = problem.better(cand, best)
    if best is cols:
        return cols
    return polish(best, problem)
