"""`hdp bench train` and `hdp demo`: the same training on the same data under several policies.

Every rank builds one `HdpEngine` per policy from the same weights (set by parameter name, so
every policy starts identically), then runs the same batches through each.  In the benchmark the
policies alternate step by step (and which goes first alternates too), so slow phases of a shared
machine hit both alike; the demo runs static CP first and HDP after it.  Before any step every
rank loads the compiled planner kernels of every policy (`warm_planner`; the parent compiles them
first when it spawns the ranks, so a cold numba cache is compiled once, not once per rank), so no
policy's first plan pays for a compile.  The first step of each policy is a warm-up and is not
timed (each engine's first forward and backward, its process groups' first messages); after it
every engine takes one more untimed step of the same batch under a mixed plan (single-rank and CP
groups), so the cost model fitted from the warm-up records has seen every group size.  With ``tp``/``pp`` every policy runs the same TP × PP
layout and plans over the domain of ``ranks / (tp · pp)`` ranks.

Output (`bench_train`): tokens/s per rank (all timed steps' tokens over their time) and the median
step time per policy, its median seconds per phase of the step (``phases``: the slowest rank's
``hdp/time/*``), the planned efficiency, the losses of every step (they must agree across policies:
the update is exact whatever the plan), ``plans_differ`` (the policies' first timed plans are not one
plan: otherwise the comparison compares nothing), the environment, — from the calibration records the
engines write — a cost model fitted to this machine with the ratio of simulated to measured step time
per policy (``calibration``: the fit's warnings are in ``calibration.warnings``, never logged, and the
model the timed steps were planned with in ``calibration.planned_with``), and
``plan_ahead``: the timed batches once more as one step of several mini-batches planned ahead
(`HdpEngine.train_steps`), each mini-batch's ``hdp/planner_ms`` and ``hdp/planner_ms_exposed``.

Works under ``torchrun`` (any device): every rank runs the worker directly; otherwise ranks are
spawned locally with gloo.
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hdp.packing.cost import CostModel
from hdp.core.phases import median_phases

__all__ = ["TrainBenchSpec", "TRAIN_WORKLOADS", "SMOKE", "bench_train", "compare_with_baseline", "domain_size",
           "train_batch_lengths", "warm_planner"]

logger = logging.getLogger(__name__)

SMOKE: dict[str, Any] = {"num_layers": 1, "hidden_size": 64, "num_attention_heads": 2, "vocab_size": 256,
                         "samples": 12, "max_tokens_per_rank": 256}
"""`TrainBenchSpec` fields of the smallest mode (``--smoke``): does the benchmark run and is its result
complete, in seconds; its figures are not throughput figures."""

TRAIN_WORKLOADS = ("short-tail", "long-response")
"""Synthetic batches: most samples on one rank with a few needing all ranks, or most needing 2-4."""


@dataclass(frozen=True, kw_only=True)
class TrainBenchSpec:
    """What one benchmark run trains (picklable: it travels to spawned ranks)."""

    ranks: int = 4
    """All ranks of the job, TP × PP × domain (local ranks when spawned)."""
    tp: int = 1
    """Tensor-parallel size (sequence parallel on), the same for every policy."""
    pp: int = 1
    """Pipeline stages, the same for every policy (each round one micro-batch of the 1F1B schedule)."""
    policies: tuple[str, ...] = ("static-cp", "hdp")
    """Policies compared side by side."""
    steps: int = 4
    """Steps per policy, the first one untimed."""
    workload: str = "short-tail"
    """One of TRAIN_WORKLOADS."""
    samples: int | None = None
    """Samples per global batch; None: 40 for short-tail, 12 for long-response (each ~1-4K tokens)."""
    max_tokens_per_rank: int = 1024
    """Planner token budget B."""
    num_layers: int = 4
    """Transformer layers of the GPT."""
    hidden_size: int = 256
    """Model width."""
    num_attention_heads: int = 4
    """Attention heads."""
    vocab_size: int = 1024
    """Vocabulary."""
    alternate: bool = True
    """Alternate policies step by step (benchmark) or run them one after another (demo)."""
    device: str = "cpu"
    """Device of every rank."""
    seed: int = 0
    """Batch seed."""
    records_dir: str | None = None
    """Where the engines write calibration records (one file per policy); None: a temp dir."""

    def __post_init__(self) -> None:
        if self.samples is None:
            object.__setattr__(self, "samples", 40 if self.workload == "short-tail" else 12)
        if self.workload not in TRAIN_WORKLOADS:
            raise ValueError(f"workload={self.workload!r} is unknown; choose one of: {', '.join(TRAIN_WORKLOADS)}")
        if self.ranks < 1:
            raise ValueError(f"ranks={self.ranks}: need at least 1 rank")
        for name in ("tp", "pp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: pass a positive integer")
        if self.ranks % (self.tp * self.pp):
            raise ValueError(
                f"ranks={self.ranks}: must be a multiple of tp x pp = {self.tp} x {self.pp} (the world is "
                "TP x PP x domain)"
            )
        if self.steps < 2:
            raise ValueError(f"steps={self.steps}: need at least 2 (the first step is a warm-up)")
        if not self.policies:
            raise ValueError("policies: name at least one policy")
        from hdp.packing import Policy

        known = [p.value for p in Policy]
        for name in self.policies:
            if name not in known:
                raise ValueError(f"policies: policy={name!r} is unknown; choose from: {', '.join(known)}")


def domain_size(spec: TrainBenchSpec) -> int:
    """N: the ranks hdp plans over (ranks / (TP · PP))."""
    return spec.ranks // (spec.tp * spec.pp)


def train_batch_lengths(spec: TrainBenchSpec, step: int) -> list[int]:
    """Sample lengths of the batch of ``step`` (deterministic in the spec's seed), sized for the domain."""
    rng = np.random.default_rng([spec.seed, step])
    budget, n = spec.max_tokens_per_rank, spec.samples
    ranks = domain_size(spec)
    full = ranks * budget - 2 * ranks  # longest that fits all domain ranks (zigzag rounding)
    if spec.workload == "short-tail":
        # most samples well under one rank's budget, a thin tail needing all ranks
        lengths = rng.lognormal(np.log(0.25 * budget), 0.6, n)
        n_long = max(1, n // 16)
        lengths[:n_long] = rng.uniform(0.75 * full, full, n_long)
    else:
        # long RL responses: most samples need 2..N ranks
        lengths = rng.uniform(1.1 * budget, full, n)
    lengths = np.clip(lengths.astype(np.int64), 16, full)
    return rng.permutation(lengths).tolist()


MIXED_POLICY = "verl-kk"
"""The policy of the warm-up's mixed plan (single-rank groups and CP groups)."""


def warm_planner(policies: tuple[str, ...]) -> None:
    """Import the planner module of every policy in ``policies`` and of the mixed plan's: importing a
    policy compiles its numba kernels, or loads them from numba's on-disk cache (docs/design.md, "Where
    the planner's code is").  Run before anything is timed, for every policy alike, so that no policy's
    first plan pays for a compile (a cold cache costs ~26 s of CPU for the hdp policy; a warm one
    ~0.5 s)."""
    import importlib

    from hdp.packing import Policy
    from hdp.packing.planner import POLICY_MODULES

    for name in dict.fromkeys((*policies, MIXED_POLICY)):
        importlib.import_module(POLICY_MODULES[Policy(name)])


def _init_param(name: str, p: torch.Tensor) -> None:
    """Weights keyed by the global parameter name: every policy and layout starts identically."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    val = torch.randn(p.shape, generator=g, dtype=torch.float32)
    p.copy_(1.0 + 0.02 * val if p.dim() == 1 else 0.02 * val)


def _batch(spec: TrainBenchSpec, step: int):
    from hdp.trainer.engine import Batch

    g = torch.Generator().manual_seed(1000 * spec.seed + step)
    lengths = train_batch_lengths(spec, step)
    tokens = [torch.randint(0, spec.vocab_size, (n,), generator=g) for n in lengths]
    # RL-style: the prompt (first quarter) carries no loss
    masks = [torch.cat([torch.zeros(n // 4), torch.ones(n - n // 4)]) for n in lengths]
    return Batch(tokens=tokens, loss_mask=masks)


def _engine_config(spec: TrainBenchSpec, policy: str, records: str | None):
    from hdp.trainer.config import EngineConfig, ParallelConfig, PlanningConfig
    from hdp.trainer.model import ModelConfig, OptimConfig

    longest = domain_size(spec) * spec.max_tokens_per_rank
    return EngineConfig(
        model=ModelConfig(
            num_layers=spec.num_layers, hidden_size=spec.hidden_size,
            num_attention_heads=spec.num_attention_heads, vocab_size=spec.vocab_size,
            max_sequence_length=max(4096, longest),
        ),
        optim=OptimConfig(lr=1e-4),
        planning=PlanningConfig(max_tokens_per_rank=spec.max_tokens_per_rank, policy=policy, calibration_path=records),
        parallel=ParallelConfig(tp=spec.tp, pp=spec.pp),
        device=spec.device,
    )


def _worker(rank: int, world: int, spec: TrainBenchSpec, records_dir: str) -> dict[str, Any]:
    from hdp.packing import PlannerConfig
    from hdp.packing import plan as make_plan
    from hdp.trainer.engine import HdpEngine, nll_loss

    torch.set_num_threads(1)
    warm_planner(spec.policies)  # every policy's kernels loaded before any step: no first plan compiles
    engines = {
        p: HdpEngine.build(_engine_config(spec, p, os.path.join(records_dir, f"{p}.jsonl")), dist.group.WORLD,
                            init_fn=_init_param)
        for p in spec.policies
    }
    batches = [_batch(spec, s) for s in range(spec.steps)]
    history: dict[str, list[dict[str, Any]]] = {p: [] for p in spec.policies}
    plans: dict[str, Any] = {}
    # warm-up, untimed, which also measures this machine for the cost model: per policy one step of
    # its own plan, then one of a mixed plan (verl-kk: single-rank groups and CP groups), so the
    # fit sees every group size even when the default cost model gives every policy the same CP
    # groups.  Every engine takes the same two updates, so the later losses still agree.
    mixed = make_plan(batches[0].lengths, PlannerConfig(
        num_ranks=domain_size(spec), max_tokens_per_rank=spec.max_tokens_per_rank, policy=MIXED_POLICY))
    for p in spec.policies:
        m = _timed_step(engines[p], batches[0])
        history[p].append({k: v for k, v in m.items() if isinstance(v, (int, float, dict, str))})
        engines[p].train_step(batches[0], nll_loss, plan=mixed)
    cost, source = _fitted_cost(spec, records_dir, rank, engines[spec.policies[0]].planner.cost)
    steps = range(1, spec.steps)
    if spec.alternate:
        order = [(s, p) for s in steps for p in (spec.policies if s % 2 else spec.policies[::-1])]
    else:
        order = [(s, p) for p in spec.policies for s in steps]
    for s, p in order:
        # planned as for PP = 1 (the engine's own default plans for the pipeline): local ranks share the
        # CPU cores, so a pipeline bubble costs no time here and PP-aware plans only add rounds (docs/results.md, "Speed")
        plan = make_plan(batches[s].lengths, PlannerConfig(
            num_ranks=domain_size(spec), max_tokens_per_rank=spec.max_tokens_per_rank, policy=p, cost=cost))
        if s == 1:
            plans[p] = plan.to_dict()
        m = _timed_step(engines[p], batches[s], plan)
        history[p].append({k: v for k, v in m.items() if isinstance(v, (int, float, dict, str))})
    ahead = _plan_ahead_steps(engines[spec.policies[-1]], batches[1:])
    for engine in engines.values():
        engine.close()
    if dist.is_initialized():
        dist.barrier(group=dist.group.WORLD)
    return ({"history": history, "plans": plans, "cost": asdict(cost), "cost_source": source, "plan_ahead": ahead}
            if rank == 0 else {})


def _plan_ahead_steps(engine: Any, batches: list[Any]) -> dict[str, Any]:
    """After the timed comparison: the timed batches once more as one step of several mini-batches
    (`HdpEngine.train_steps`, each planned while the one before it trains, the engine's own planner):
    each mini-batch's planning and exposed milliseconds."""
    from hdp.trainer.engine import nll_loss

    ms, exposed = [], []
    for m in engine.train_steps(batches, nll_loss):
        ms.append(float(m["hdp/planner_ms"]))
        exposed.append(float(m["hdp/planner_ms_exposed"]))
    later = sum(ms[1:])
    return {"mini_batches": len(batches), "planner_ms": ms, "planner_ms_exposed": exposed,
            "policy": engine.config.planning.policy,
            "exposed_share_after_first": sum(exposed[1:]) / later if later > 0 else 0.0,
            "exposed_share": sum(exposed) / sum(ms) if sum(ms) > 0 else 0.0}


def _timed_step(engine: Any, batch: Any, plan: Any = None) -> dict[str, Any]:
    """One ``train_step`` plus ``perf/cpu_time``: the CPU seconds of all ranks of the job on it.

    CPU time is what a loaded shared machine distorts least (a rank waiting for a peer sleeps);
    the wall-clock step time stays the headline figure.
    """
    from hdp.trainer.engine import nll_loss

    c0 = time.process_time()
    m = engine.train_step(batch, nll_loss, plan=plan)
    cpu = torch.tensor([time.process_time() - c0], dtype=torch.float64)
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM, group=dist.group.WORLD)
    return {**m, "perf/cpu_time": float(cpu)}


def _fitted_cost(spec: TrainBenchSpec, records_dir: str, rank: int, default: "CostModel"
                 ) -> tuple["CostModel", str]:
    """The cost model fitted on rank 0 to the warm-up records, broadcast over the world, and where it
    comes from.

    Falls back to ``default`` (the engines' own ``auto`` model) when the records cannot be fitted; the
    source says so and why (the result's ``calibration.planned_with``), and nothing is logged above INFO:
    the fit of every policy's records after the run (`_calibration`) is the one the result reports.
    """
    from hdp.packing.calibrate import calibrate, load_records

    fitted: list[Any] = [None, "the engines' auto model"]
    if rank == 0:
        records = []
        for p in spec.policies:
            path = Path(records_dir) / f"{p}.jsonl"
            if path.is_file():
                records.extend(load_records(path))
        try:
            # [cost model] what the warm-up cannot determine comes from the engine's default preset
            fitted[0] = asdict(calibrate(records, base=default, warn=False).cost)
            fitted[1] = "fitted to the warm-up records"
        except ValueError as exc:
            logger.info("bench train: cost model not fitted (%s); planning with the default", exc)
            fitted[1] = f"the engines' auto model; the warm-up fit was refused: {exc}"
    if dist.is_initialized():
        dist.broadcast_object_list(fitted, src=0, group=dist.group.WORLD)
    return (CostModel(**fitted[0]) if fitted[0] else default), str(fitted[1])


def _environment(spec: TrainBenchSpec) -> dict[str, Any]:
    from importlib import metadata

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "megatron-core": version("megatron-core"),
        "hdp-engine": version("hdp-engine"), "device": spec.device, "ranks": spec.ranks,
        "tp": spec.tp, "pp": spec.pp, "domain": domain_size(spec),
        "threads_per_rank": 1, "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()),
    }


def _summarise(spec: TrainBenchSpec, out: dict[str, Any], records_dir: str) -> dict[str, Any]:
    hist = out["history"]
    results: dict[str, Any] = {}
    for p, steps in hist.items():
        timed = steps[1:]
        results[p] = {
            # throughput of the timed steps together: their tokens over their time, per rank
            "tokens_per_s": sum(m["perf/tokens"] for m in timed) / sum(m["perf/step_time"] for m in timed) / spec.ranks,
            "step_time_s": statistics.median(m["perf/step_time"] for m in timed),
            # tokens per CPU-second of all ranks (robust to other jobs on a shared machine)
            "cpu_tokens_per_s": sum(m["perf/tokens"] for m in timed) / sum(m["perf/cpu_time"] for m in timed),
            "cpu_time_s": statistics.median(m["perf/cpu_time"] for m in timed),
            "step_times_s": [m["perf/step_time"] for m in steps],
            "losses": [m["loss"] for m in steps],
            "rounds": [m["hdp/rounds"] for m in steps],
            "efficiency_planned": statistics.mean(m["hdp/efficiency_planned"] for m in steps),
            "cp_degree_hist": steps[0]["hdp/cp_degree_hist"],
            "phases": median_phases(timed),  # the slowest rank's seconds per phase (hdp.core.phases)
        }
    pols = list(hist)
    speedup = {
        f"{p}_vs_{q}": results[p]["tokens_per_s"] / results[q]["tokens_per_s"]
        for p in pols for q in pols if p != q and p == "hdp"
    }
    speedup_cpu = {
        f"{p}_vs_{q}": results[p]["cpu_tokens_per_s"] / results[q]["cpu_tokens_per_s"]
        for p in pols for q in pols if p != q and p == "hdp"
    }
    ref = np.asarray(results[pols[0]]["losses"])
    loss_diff = max(float(np.max(np.abs(np.asarray(results[p]["losses"]) - ref) / np.maximum(np.abs(ref), 1e-12))) for p in pols)
    result = {
        "spec": asdict(spec), "results": results, "speedup": speedup, "speedup_cpu_time": speedup_cpu,
        "loss_match": loss_diff <= 1e-4, "loss_max_rel_diff": loss_diff,
        # the comparison means something only when the policies ran different plans (first timed step's)
        "plans_differ": len({p["checksum"] for p in out["plans"].values()}) == len(out["plans"]),
        "environment": _environment(spec), "plans": out["plans"],
    }
    result["calibration"] = _calibration(spec, hist, records_dir, out["cost"], out["cost_source"])
    result["plan_ahead"] = out["plan_ahead"]
    return result


def _calibration(spec: TrainBenchSpec, hist: dict[str, list[dict[str, Any]]], records_dir: str,
                 planned_cost: dict[str, Any], cost_source: str) -> dict[str, Any]:
    """Fit the cost model to all policies' records; simulated / measured step time per policy, with
    the fitted model, or when the fit is refused with ``planned_cost`` (the model the timed steps were
    planned with); ``model`` says which."""
    from hdp.packing import PlannerConfig, plan, simulate
    from hdp.packing.calibrate import calibrate, load_records
    records: list[Any] = []
    for p in spec.policies:
        path = Path(records_dir) / f"{p}.jsonl"
        if path.is_file():
            records.extend(load_records(path))
    if not records:
        return {"error": "no calibration records were written"}
    planned_with = CostModel(**planned_cost)
    try:
        # what the records cannot determine: the model the bench planned with; the fit's warnings go into
        # the result (``warnings``), not the log: the command prints them once, beside the figures they qualify
        fit = calibrate(records, base=planned_with, warn=False)
        cost = fit.cost
        out = fit.to_dict() if hasattr(fit, "to_dict") else {"r2": fit.r2}
        out["model"] = "fitted to every policy's records"
    except ValueError as exc:
        # a refused fit (too few or too noisy records) is reported; the ratios then say how well the
        # model the bench planned with predicted the steps
        cost = planned_with
        out = {"fit_error": f"calibrate: {exc}", "model": f"the model the bench planned with ({cost_source})"}
    ratios = {}
    for p, steps in hist.items():
        predicted = []
        for s in range(1, len(steps)):
            lengths = train_batch_lengths(spec, s)
            cfg = PlannerConfig(num_ranks=domain_size(spec), max_tokens_per_rank=spec.max_tokens_per_rank,
                                policy=p, cost=cost)
            predicted.append(simulate(plan(lengths, cfg), cost).step_time_s)
        measured = statistics.median(m["perf/step_time"] for m in steps[1:])
        ratios[p] = statistics.median(predicted) / measured
    out["predicted_over_measured"] = ratios
    out["planned_with"] = cost_source
    return out


def bench_train(spec: TrainBenchSpec) -> dict[str, Any]:
    """Run the comparison (spawning ``spec.ranks`` gloo ranks, or in place under torchrun)."""
    from hdp.trainer.launch import init_from_env, spawn

    records_dir = spec.records_dir or tempfile.mkdtemp(prefix="hdp-bench-train-")
    for p in spec.policies:
        (Path(records_dir) / f"{p}.jsonl").unlink(missing_ok=True)
    if init_from_env(spec.device):
        world = dist.get_world_size()
        if world != spec.ranks:
            spec = TrainBenchSpec(**{**asdict(spec), "ranks": world, "policies": tuple(spec.policies)})
        out = _worker(dist.get_rank(), world, spec, records_dir)
        if dist.get_rank() != 0:
            return {}
    else:
        warm_planner(spec.policies)  # a cold cache compiled once here, then loaded by every rank
        out = spawn(_worker, spec.ranks, spec, records_dir, timeout=1800.0)[0]
    return _summarise(spec, out, records_dir)


def compare_with_baseline(result: dict[str, Any], baseline: dict[str, Any], tolerance: float) -> list[str]:
    """Regressions of ``result`` against a stored ``baseline`` beyond ``tolerance`` (empty: none).

    Compares tokens/s of every policy both ran and every speedup ratio.
    """
    problems = []
    for p, r in result.get("results", {}).items():
        b = baseline.get("results", {}).get(p)
        if b and r["tokens_per_s"] < b["tokens_per_s"] * (1 - tolerance):
            problems.append(f"{p}: {r['tokens_per_s']:.1f} tokens/s < baseline {b['tokens_per_s']:.1f} - {tolerance:.0%}")
    for k, v in result.get("speedup", {}).items():
        b = baseline.get("speedup", {}).get(k)
        if b and v < b * (1 - tolerance):
            problems.append(f"speedup {k}: {v:.3f} < baseline {b:.3f} - {tolerance:.0%}")
    if not result.get("loss_match", False):
        problems.append("losses differ between policies (the update must not depend on the plan)")
    return problems
