"""``hdp bench planner``: how long ``plan()`` takes, per batch family, beside megatron-core's scheduler.

Every family is planned at two sizes, 1,024 samples on 64 ranks (target: 100 ms median) and 8,192
on 512 (target: 50 ms), with the suite's model, hardware profile and token budget where the family is
a suite distribution (`hdp.packing.suite.SUITE`) and deepseek-v3 on h100-nvlink with B = 4,096
otherwise.  Per batch: the median wall and CPU milliseconds of whole ``plan()`` calls and the plan's
efficiency (T* / T), and the same figures for

* megatron-core's own ``BalancedCPScheduler`` (`hdp.trainer.bench.peers.megatron_core_plan`), when
  the installed megatron-core has it -- its plan scored under hdp's cost model; it may put more than
  B tokens on a rank in a round (``budget_ok``), its memory model being per sample;
* hdp's re-implementation of that scheduler, the ``megatron-dcp`` policy (a port, not megatron-core).

Speed targets live here, never in unit tests.  The CPU time is `time.process_time` (a shared
machine's other load inflates wall time, not CPU time).  ``first_plan`` reports what the process's
first ``plan()`` costs: the planner's compiled kernels loaded from numba's on-disk cache, or compiled
when it is cold.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from hdp.packing.config import PlannerConfig, SearchBudget
from hdp.packing.planner import plan
from hdp.packing.profiles import cost_model
from hdp.packing.suite import SAMPLES_PER_RANK, SUITE
from hdp.packing.workloads import get_workload

__all__ = ["Family", "FAMILIES", "SIZES", "bench_planner", "megatron_core_status"]

SIZES: tuple[tuple[int, float], ...] = ((64, 100.0), (512, 50.0))
"""(ranks, target median ms of ``plan()``) of every family; samples = 16 x ranks."""


@dataclass(frozen=True, kw_only=True)
class Family:
    """A batch family: a workload with its parameters, the cost model it is planned under and B per N."""

    name: str
    """Family name (``hdp bench planner --families``)."""
    workload: str
    """Generator name in `hdp.packing.workloads.WORKLOADS`."""
    params: tuple[tuple[str, Any], ...] = ()
    """Extra generator keyword arguments, as (name, value) pairs."""
    model: str = "deepseek-v3"
    """Model preset of the cost model."""
    profile: str = "h100-nvlink"
    """Hardware profile of the cost model."""
    budgets: tuple[tuple[int, int], ...] = ((64, 4_096), (512, 4_096))
    """(ranks, B) pairs."""
    static_cp_size: int | None = None
    """CP size of the static baselines (the suite's Ascend case fixes CP8)."""
    in_suite: bool = False
    """A distribution of the benchmark suite (``hdp simulate --suite``)."""

    def lengths(self, samples: int, seed: int) -> np.ndarray:
        """The family's batch of ``samples`` lengths (deterministic in ``seed``)."""
        return get_workload(self.workload)(n=samples, seed=seed, **dict(self.params))

    def config(self, ranks: int, **options: Any) -> PlannerConfig:
        """The planner configuration of this family on ``ranks`` ranks (``options``: more fields)."""
        return PlannerConfig(num_ranks=ranks, max_tokens_per_rank=dict(self.budgets)[ranks],
                             cost=cost_model(self.model, self.profile), static_cp_size=self.static_cp_size, **options)


def _suite_families() -> tuple[Family, ...]:
    """The suite's distributions at N = 64 and 512 (its B per N; a distribution the suite has at
    N = 64 only keeps that B)."""
    out: dict[str, Family] = {}
    for case in SUITE:
        if "tight" in case.tags or case.num_ranks not in (64, 512):
            continue
        name = case.name.rsplit("-N", 1)[0]
        fam = out.get(name) or Family(name=name, workload=case.workload, params=case.params, model=case.model,
                                      profile=case.profile, budgets=(), static_cp_size=case.static_cp_size,
                                      in_suite=True)
        out[name] = replace(fam, budgets=fam.budgets + ((case.num_ranks, case.max_tokens_per_rank),))
    return tuple(replace(f, budgets=f.budgets + ((512, dict(f.budgets)[64]),)) if 512 not in dict(f.budgets) else f
                 for f in out.values())


FAMILIES: tuple[Family, ...] = _suite_families() + (
    Family(name="short-reasoning", workload="short-reasoning"),
    Family(name="pareto", workload="pareto"),
    Family(name="rl-grouped-16", workload="rl-grouped", params=(("group", 16),)),
)
"""The suite's distributions, then short reasoning with a long tail, Pareto and RL rollouts with 16
responses per prompt (``bimodal`` and ``wikipedia`` -- the real lengths bundled under
``packing/data`` -- are suite distributions)."""


def megatron_core_status() -> dict[str, Any]:
    """Whether megatron-core's ``BalancedCPScheduler`` can be run here: ``available``, the installed
    ``version`` (None when missing) and a one-line ``note``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("megatron-core")
    except PackageNotFoundError:
        return {"available": False, "version": None, "note": "megatron-core is not installed: no peer figures"}
    try:
        from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler  # noqa: F401
    except ImportError as exc:
        return {"available": False, "version": ver,
                "note": f"megatron-core {ver} has no BalancedCPScheduler (hybrid_cp_schedule): {exc}"}
    return {"available": True, "version": ver,
            "note": f"megatron-core {ver}'s own BalancedCPScheduler (megatron.core.pipeline_parallel.hybrid_cp_schedule)"}


def _first_plan(fam: Family, ranks: int, policy: str, budget: SearchBudget, seed: int) -> dict[str, Any]:
    """Wall and CPU ms of this process's first ``plan()`` (256 samples of ``fam``): what a rank pays
    once at start -- loading the planner's compiled kernels from numba's on-disk cache, or compiling
    them when the cache is cold (`hdp.packing.kernels.jit`) -- beside a second call."""
    lengths = fam.lengths(256, seed)
    config = fam.config(ranks, policy=policy, search_budget=budget)
    out: dict[str, Any] = {}
    for key in ("first", "second"):
        t0, c0 = time.perf_counter(), time.process_time()
        plan(lengths, config)
        out[f"{key}_ms"] = (time.perf_counter() - t0) * 1e3
        out[f"{key}_cpu_ms"] = (time.process_time() - c0) * 1e3
    out["note"] = ("first: kernels loaded from numba's cache or compiled (cold cache: seconds, once per machine "
                   "and user); second: the same plan again")
    return out


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[dict[str, float], Any]:
    """({median_ms, median_cpu_ms, repeats}, the last result) of ``repeats`` calls of ``fn``."""
    walls, cpus, out = [], [], None
    for _ in range(max(1, repeats)):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        walls.append((time.perf_counter() - t0) * 1e3)
        cpus.append((time.process_time() - c0) * 1e3)
    return {"median_ms": statistics.median(walls), "median_cpu_ms": statistics.median(cpus), "repeats": len(walls)}, out


def _peer(fn: Callable[[], Any], repeats: int) -> dict[str, Any]:
    """Timed figures of a peer plan, or ``{"error": reason}`` when it cannot plan the batch."""
    from hdp.trainer.bench.peers import budget_ok

    try:
        figures, p = _timed(fn, repeats)
    except (ImportError, ValueError) as exc:
        return {"error": (str(exc).splitlines() or [type(exc).__name__])[0]}
    return {**figures, "efficiency": p.stats.efficiency, "budget_ok": budget_ok(p)}


def bench_planner(
    families: Sequence[Family] = FAMILIES, sizes: Sequence[tuple[int, float]] = SIZES, *, repeats: int = 7,
    peer_repeats: int = 3, seed: int = 0, policy: str = "hdp", search_budget: SearchBudget | None = None,
    peers: bool = True, ranks_per_node: int | None = None,
) -> dict[str, Any]:
    """Time ``plan()`` on every family at every size (module docstring); the peers with
    ``peer_repeats`` calls each (one on 512 ranks, where megatron-core takes seconds).  With
    ``ranks_per_node`` every domain is on nodes of that many ranks (`PlannerConfig.node_of`): the
    planner prices rings across nodes and places groups (the topology on)."""
    from hdp.packing.topology import node_map

    from hdp.trainer.bench.peers import megatron_core_plan

    budget = search_budget or SearchBudget()
    status = megatron_core_status() if peers else {"available": False, "version": None, "note": "peers not run"}
    first = _first_plan(families[0], sizes[0][0], policy, budget, seed) if families and sizes else {}
    rows: list[dict[str, Any]] = []
    for fam in families:
        for ranks, target in sizes:
            lengths = fam.lengths(SAMPLES_PER_RANK * ranks, seed)
            config = fam.config(ranks, policy=policy, search_budget=budget,
                                node_of=None if ranks_per_node is None else node_map(ranks, ranks_per_node))
            plan(lengths[:256], config)  # warm-up: imports, caches
            figures, p = _timed(lambda: plan(lengths, config), repeats)
            row: dict[str, Any] = {
                "family": fam.name, "in_suite": fam.in_suite, "samples": int(lengths.size), "ranks": ranks,
                "max_tokens_per_rank": config.max_tokens_per_rank, "cost_model": f"{fam.model}@{fam.profile}",
                "policy": policy, "ranks_per_node": ranks_per_node, "cross_node_fraction": p.stats.cross_node_fraction,
                **figures, "policy_ms": p.stats.planner_ms, "efficiency": p.stats.efficiency,
                "target_ms": target, "passed": figures["median_ms"] <= target,
            }
            if peers:
                n_peer = peer_repeats if ranks <= 64 else 1
                if status["available"]:
                    row["megatron_core"] = _peer(lambda: megatron_core_plan(lengths, config), n_peer)
                else:
                    row["megatron_core"] = {"error": status["note"]}
                row["megatron_dcp_port"] = _peer(lambda: plan(lengths, replace(config, policy="megatron-dcp")), n_peer)
            rows.append(row)
    return {
        "planner": rows, "passed": all(r["passed"] for r in rows), "search_budget": budget.__dict__.copy(),
        "megatron_core": status, "first_plan": first,
        "notes": ["megatron_dcp_port is hdp's re-implementation of megatron-core's BalancedCPScheduler "
                  "(policy megatron-dcp), not megatron-core itself",
                  "times are whole plan() calls (validation, the policy and the simulator's figures); CPU ms "
                  "by time.process_time"],
    }
