"""`plan(lengths, config) -> Plan`: validate, run the configured policy, attach its figures."""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Sequence

import numpy as np

from hdp.packing.config import PlannerConfig, Policy
from hdp.packing.plan import Plan
from hdp.packing.simulate import simulate
from hdp.packing.single_rank import pack_rounds
from hdp.packing.memory import memory_stats
from hdp.packing.validate import MAX_LENGTH, validate_lengths

__all__ = ["plan", "POLICY_MODULES"]

POLICY_MODULES: dict[Policy, str] = {
    Policy.HDP: "hdp.packing.policies.hdp",
    Policy.STATIC_CP: "hdp.packing.policies.static_cp",
    Policy.MEGATRON_DCP: "hdp.packing.policies.megatron_dcp",
    Policy.ASCEND_HDP: "hdp.packing.policies.ascend_hdp",
    Policy.VERL_KK: "hdp.packing.policies.verl_kk",
}


def plan(lengths: Sequence[int] | np.ndarray, config: PlannerConfig) -> Plan:
    """Plan one step: which samples run on which ranks in which round.

    Pure and deterministic: the same (lengths, config) give an identical plan on every rank.  With
    ``config.node_of`` the plan carries the topology (its checksum covers it) and its figures price a
    ring across nodes on the inter-node link.  A
    domain of one rank is plain packing at the fewest rounds, whatever the policy
    (`hdp.packing.single_rank`).
    With ``config.memory_limit`` the token budget B is derived from the memory model (the plan's
    ``max_tokens_per_rank`` and ``stats.memory["token_budget"]``) and every round's predicted per-rank
    peak stays within the limit (``stats.memory``).
    Raises ValueError for bad input (empty batch, non-positive or non-integer lengths, a sample
    that does not fit N x B, a memory limit below the layout's static memory), and `hdp.packing.policies.common.TooLarge` (a ValueError) when a
    baseline policy would take too long on a batch this large.
    """
    if config.memory_limit is not None:  # B derived from the memory model (errors name the limit)
        budget = config.budget(validate_lengths(lengths, config.num_ranks, MAX_LENGTH))
        if budget != config.max_tokens_per_rank:
            config = dataclasses.replace(config, max_tokens_per_rank=budget)
    arr = validate_lengths(lengths, config.num_ranks, config.max_tokens_per_rank)
    if config.num_ranks == 1:  # no groups to choose: plain packing at the fewest rounds (every policy)
        t0 = time.perf_counter()
        a = pack_rounds(arr, config.max_tokens_per_rank)
        planner_ms = (time.perf_counter() - t0) * 1e3
    else:
        module = importlib.import_module(POLICY_MODULES[config.policy])
        check_scale = getattr(module, "check_scale", None)
        if check_scale is not None:  # a policy that cannot plan this batch in reasonable time says so now
            check_scale(arr, config)
        t0 = time.perf_counter()
        a = module.assign(arr, config)
        planner_ms = (time.perf_counter() - t0) * 1e3
    p = Plan.from_columns(
        num_ranks=config.num_ranks,
        max_tokens_per_rank=config.max_tokens_per_rank,
        policy=config.policy.value,
        lengths=arr,
        round_of=a.round_of,
        group_start=a.group_start,
        group_size=a.group_size,
        node_of=config.node_of,
    )
    stats = simulate(p, config.cost, planner_ms, config.pipeline_stages)
    if config.memory_model is not None:
        stats = dataclasses.replace(stats, memory=memory_stats(p, stats.tokens_per_rank, config.memory_model,
                                                               config.memory_limit))
    return p.with_stats(stats)
