"""The fixed built-in benchmark suite: length distributions x domain sizes, run for every policy.

Each `Case` fixes a workload (generator name + parameters + seed), the domain size N, the token
budget B, the model preset and the hardware profile, so every run of the suite plans exactly the
same batches.  Batches hold ~16 samples per rank on average (N = 512 -> 8,192 samples).  B is
chosen so that in most cases the longest sample needs at most N/4 ranks (the regime where hdp
should reach >= 95% efficiency); the cases marked ``tight`` need more.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hdp.packing.config import PlannerConfig, Policy
from hdp.packing.cost import min_group_size
from hdp.packing.planner import plan
from hdp.packing.profiles import DEFAULT_MODEL, DEFAULT_PROFILE, cost_model
from hdp.packing.simulate import simulate
from hdp.packing.workloads import get_workload

__all__ = ["Case", "SUITE", "run_case", "ClusterCase", "cluster_cases", "run_cluster_case", "CLUSTER_POLICIES", "plan_entry", "policy_options", "RESULT_FIELDS", "SAMPLES_PER_RANK", "HDP_POW2"]

HDP_POW2 = "hdp-pow2"
"""The hdp policy with aligned power-of-two groups (``group_shape=pow2``), compared like a policy."""


def policy_options(name: str) -> dict[str, Any]:
    """`PlannerConfig` fields for a policy name; ``hdp-pow2`` is hdp with ``group_shape=pow2``."""
    if name == HDP_POW2:
        return {"policy": Policy.HDP, "group_shape": "pow2"}
    return {"policy": name}

logger = logging.getLogger(__name__)

SAMPLES_PER_RANK = 16
"""Average samples per rank in every suite batch."""

RESULT_FIELDS = (
    "case", "policy", "ranks", "rounds", "step_time", "lower_bound", "efficiency",
    "lower_bound_tight", "efficiency_tight", "max_idle_ratio", "cp_degree_hist", "planner_ms",
    "longest_needs_ranks",
)
"""Keys of every successful `run_case` entry (times in seconds)."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """One benchmark case: a seeded batch, a domain and a cost model."""

    name: str
    """Unique case name (``<distribution>-N<ranks>``)."""
    workload: str
    """Generator name in `hdp.packing.workloads.WORKLOADS`."""
    params: tuple[tuple[str, Any], ...] = ()
    """Extra generator keyword arguments, as sorted (name, value) pairs (hashable)."""
    num_samples: int
    """Samples in the batch."""
    num_ranks: int
    """N: ranks in the domain."""
    max_tokens_per_rank: int
    """B: per-rank token budget of one round."""
    model: str = DEFAULT_MODEL
    """Model preset name (`hdp.packing.MODELS`)."""
    profile: str = DEFAULT_PROFILE
    """Hardware profile name (`hdp.packing.PROFILES`)."""
    static_cp_size: int | None = None
    """CP size for static-cp style baselines; None = smallest power of two fitting the longest."""
    seed: int = 0
    """Seed of the generator."""
    tags: tuple[str, ...] = field(default=())
    """Free-form labels (``ascend`` marks the Ascend short-tail comparison case)."""

    def lengths(self) -> np.ndarray:
        """The case's batch (deterministic)."""
        return get_workload(self.workload)(n=self.num_samples, seed=self.seed, **dict(self.params))

    def config(self, policy: Policy | str) -> PlannerConfig:
        """The planner configuration of this case for ``policy`` (or ``hdp-pow2``)."""
        return PlannerConfig(
            num_ranks=self.num_ranks,
            max_tokens_per_rank=self.max_tokens_per_rank,
            **policy_options(str(policy.value if isinstance(policy, Policy) else policy)),
            cost=cost_model(self.model, self.profile),
            static_cp_size=self.static_cp_size,
        )


def _cases() -> tuple[Case, ...]:
    # (distribution name, workload, params, model, profile, {N: B}); B per N keeps the longest
    # sample at <= N/4 ranks (N=8: 2 ranks, N=64: 16, N=512: 128) unless tagged tight.
    dists: list[tuple[str, str, dict[str, Any], str, str, dict[int, int]]] = [
        ("lognormal", "lognormal", {"mean": 2048.0, "sigma": 1.2, "max_len": 32_768},
         "deepseek-v3", "h100-nvlink", {8: 16_384, 64: 8_192, 512: 4_096}),
        ("rl-16k", "rl", {"prompt_mean": 1024.0, "response_mean": 6144.0, "response_cap": 16_384},
         "qwen3-235b-a22b", "h100-nvlink", {8: 16_384, 64: 8_192, 512: 4_096}),
        ("rl-32k", "rl", {"prompt_mean": 1024.0, "response_mean": 12_288.0, "response_cap": 32_768},
         "qwen3-235b-a22b", "ascend-910b-hccs", {8: 24_576, 64: 16_384, 512: 8_192}),
        ("bimodal", "bimodal", {"short_mean": 1024.0, "long_mean": 16_384.0, "long_frac": 0.05,
                                "max_len": 32_768},
         "dense-8b", "h100-nvlink", {8: 16_384, 64: 8_192, 512: 4_096}),
        ("wikipedia", "wikipedia", {"max_len": 32_768},
         "deepseek-v3", "h100-nvlink", {8: 16_384, 64: 4_096, 512: 4_096}),
    ]
    cases: list[Case] = []
    for name, workload, params, model, profile, budgets in dists:
        for n, b in budgets.items():
            cases.append(Case(
                name=f"{name}-N{n}", workload=workload, params=tuple(sorted(params.items())),
                num_samples=SAMPLES_PER_RANK * n, num_ranks=n, max_tokens_per_rank=b,
                model=model, profile=profile,
            ))
    # longest sample needs more than N/4 ranks
    cases.append(Case(
        name="lognormal-tight-N8", workload="lognormal",
        params=(("max_len", 32_768), ("mean", 2048.0), ("sigma", 1.2)),
        num_samples=SAMPLES_PER_RANK * 8, num_ranks=8, max_tokens_per_rank=4_096, tags=("tight",),
    ))
    cases.append(Case(
        name="rl-32k-tight-N64", workload="rl",
        params=(("prompt_mean", 1024.0), ("response_cap", 32_768), ("response_mean", 12_288.0)),
        num_samples=SAMPLES_PER_RANK * 64, num_ranks=64, max_tokens_per_rank=2_048,
        model="qwen3-235b-a22b", tags=("tight",),
    ))
    # Ascend's short-tail comparison: mean ~1.5K, thin tail to 32K, B=4K so the longest needs CP8
    cases.append(Case(
        name="ascend-short-tail-N64", workload="ascend-short-tail",
        params=(("max_len", 32_768), ("mean", 1536.0), ("tail_frac", 0.01)),
        num_samples=SAMPLES_PER_RANK * 64, num_ranks=64, max_tokens_per_rank=4_096,
        model="deepseek-v3", profile="ascend-910b-hccs", static_cp_size=8, tags=("ascend",),
    ))
    return tuple(cases)


SUITE: tuple[Case, ...] = _cases()
"""The built-in suite (fixed seeds)."""


def longest_needs_ranks(lengths: np.ndarray, case: Case) -> int:
    """Fewest ranks the longest sample of the batch needs under the case's budget."""
    longest = np.asarray([int(np.max(lengths))], dtype=np.int64)
    return int(min_group_size(longest, case.max_tokens_per_rank, case.num_ranks)[0])


def plan_entry(plan: Any, cost: Any = None) -> dict[str, Any]:
    """The figures of one planned batch, as ``hdp simulate --json`` and the suite report them
    (with ``cost``, the tight lower bound is added when the stats lack it)."""
    assert plan.stats is not None
    if plan.stats.lower_bound_tight is None and cost is not None:
        st = plan.stats
        plan = plan.with_stats(simulate(plan, cost, st.planner_ms, st.pipeline_stages, tight=True))
    s = plan.stats.to_dict()
    return {
        "policy": plan.policy,
        "ranks": plan.num_ranks,
        **{k: s[k] for k in ("rounds", "step_time", "lower_bound", "efficiency", "lower_bound_tight",
                             "efficiency_tight", "max_idle_ratio", "cp_degree_hist", "planner_ms", "nodes",
                             "cross_node_fraction", "cross_node_groups")},
    }


def run_case(case: Case, policies: list[str] | tuple[str, ...]) -> list[dict[str, Any]]:
    """Plan the case's batch with every policy; one result dict per policy (times in seconds).

    A policy that is not available yet (ImportError / NotImplementedError), rejects the case
    (ValueError, e.g. a batch too large for a baseline) or runs out of memory gives
    ``{"case", "policy", "error"}`` (a one-line reason) instead of the figures.
    """
    lengths = case.lengths()
    needs = longest_needs_ranks(lengths, case)
    out: list[dict[str, Any]] = []
    for name in policies:
        try:
            p = plan(lengths, case.config(name))
        except (ImportError, NotImplementedError, ValueError, MemoryError) as exc:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            logger.warning("case %s policy %s skipped: %s", case.name, name, reason)
            out.append({"case": case.name, "policy": str(name), "longest_needs_ranks": needs, "error": reason})
            continue
        out.append({"case": case.name, **plan_entry(p, case.config(name).cost), "policy": str(name),
                    "longest_needs_ranks": needs})
    return out


# ----------------------------------------------------------------------------------- cluster cases

CLUSTER_RANKS = (16, 64, 256, 1024)
"""Domain sizes of the cluster cases (8 ranks per node: 2 to 128 nodes)."""
CLUSTER_BUDGETS = (4_608, 12_288)
"""B of the cluster cases: the longest RL sample (4,096 + 32,768 tokens) fits CP8 at the first (the Ascend
Qwen3-235B recipe's regime without MoE zero-memory) and CP4 at the second (with level1: docs/memory.md, "The
Ascend Qwen3-235B recipe's 32K sample"; the recipe: docs/design.md, "The workload we were built from")."""
CLUSTER_FAMILIES: tuple[tuple[str, str, tuple[tuple[str, Any], ...]], ...] = (
    ("rl-32k", "rl", (("prompt_mean", 1024.0), ("response_cap", 32_768), ("response_mean", 12_288.0))),
    ("short-reasoning", "short-reasoning", ()),
    ("wikipedia", "wikipedia", (("max_len", 32_768),)),
    ("bimodal", "bimodal", (("long_frac", 0.05), ("long_mean", 16_384.0), ("max_len", 32_768), ("short_mean", 1024.0))),
)
"""(name, workload, params): RL rollouts with 32K responses, short reasoning with a long tail, real Wikipedia
lengths (``packing/data``) and a bimodal mix -- held-out families (the planner was not tuned on them at
these sizes)."""
CLUSTER_POLICIES = ("hdp", "hdp-node-blind", "static-cp-8", "static-cp-4", "megatron-dcp", "ascend-hdp", "verl-kk")
"""Every cluster case's plans: hdp with the topology, hdp without it (its plan priced on the nodes), static
CP8 and CP4 (node-local: aligned blocks inside a node), and the peers."""


@dataclass(frozen=True, kw_only=True)
class ClusterCase:
    """A domain over nodes of ``ranks_per_node`` ranks, under the two-level cost model of the Ascend
    Qwen3-235B recipe's model and layout (Qwen3-235B-A22B, PP 8; docs/design.md)."""

    name: str
    workload: str
    params: tuple[tuple[str, Any], ...] = ()
    num_ranks: int
    max_tokens_per_rank: int
    ranks_per_node: int = 8
    model: str = "qwen3-235b-a22b"
    profile: str = "h100-nvlink"
    pipeline_stages: int = 8
    seed: int = 0

    def lengths(self) -> np.ndarray:
        """The case's batch: 16 samples per rank (deterministic)."""
        return get_workload(self.workload)(n=SAMPLES_PER_RANK * self.num_ranks, seed=self.seed, **dict(self.params))

    def config(self, policy: str) -> PlannerConfig:
        """The planner configuration of one of `CLUSTER_POLICIES` (every one on the case's nodes)."""
        from hdp.packing.topology import node_map

        opts: dict[str, Any] = {"policy": "hdp" if policy.startswith("hdp") else policy}
        if policy.startswith("static-cp-"):
            opts = {"policy": "static-cp", "static_cp_size": int(policy.rsplit("-", 1)[1])}
        return PlannerConfig(num_ranks=self.num_ranks, max_tokens_per_rank=self.max_tokens_per_rank,
                             cost=cost_model(self.model, self.profile), pipeline_stages=self.pipeline_stages,
                             node_of=node_map(self.num_ranks, self.ranks_per_node), **opts)


def cluster_cases(model: str = "qwen3-235b-a22b", ranks: tuple[int, ...] = CLUSTER_RANKS) -> tuple[ClusterCase, ...]:
    """Every family x domain size x budget of the cluster cases, under ``model`` on h100-nvlink."""
    return tuple(ClusterCase(name=f"{fam}-N{n}-B{b}", workload=wl, params=params, num_ranks=n, max_tokens_per_rank=b,
                             model=model)
                 for fam, wl, params in CLUSTER_FAMILIES for n in ranks for b in CLUSTER_BUDGETS)


def run_cluster_case(case: ClusterCase, policies: tuple[str, ...] = CLUSTER_POLICIES) -> list[dict[str, Any]]:
    """Plan the case's batch with every policy, each priced on the case's nodes (``hdp-node-blind``: the
    hdp plan made without the topology); one entry per policy, like `run_case`'s, with ``nodes``,
    ``cross_node_fraction`` (of the ring traffic) and ``cross_node_groups``, or ``error``."""
    lengths = case.lengths()
    out: list[dict[str, Any]] = []
    for name in policies:
        cfg = case.config(name)
        try:
            if name == "hdp-node-blind":
                import dataclasses

                p = plan(lengths, dataclasses.replace(cfg, node_of=None))
                p = p.on_nodes(cfg.node_of).with_stats(simulate(p.on_nodes(cfg.node_of), cfg.cost, p.stats.planner_ms,
                                                                cfg.pipeline_stages))
            else:
                p = plan(lengths, cfg)
        except (ImportError, NotImplementedError, ValueError, MemoryError) as exc:
            out.append({"case": case.name, "policy": name, "error": (str(exc).splitlines() or [type(exc).__name__])[0]})
            continue
        out.append({"case": case.name, **plan_entry(p, cfg.cost), "policy": name, "ranks_per_node": case.ranks_per_node,
                    "max_tokens_per_rank": case.max_tokens_per_rank, "cost_model": f"{case.model}@{case.profile}"})
    return out
