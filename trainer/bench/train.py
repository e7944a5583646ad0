"""`hdp bench train` and `hdp demo`: the user's training job under several policies side by side.

**The job** (`TrainBenchSpec`): the model (`hdp.trainer.bench.job`: ``tiny``, a shape preset or a
Megatron / Hugging Face ``config.json``; random weights), the layout (TP, PP, virtual PP, EP, expert TP,
MoE zero-memory, recompute, the CP attention algorithm), the device (``cpu``, ``cuda``, ``npu``) and the
batches (`hdp.trainer.bench.lengths`: a built-in workload, a lengths file, or the lengths a run of either
door recorded beside its calibration records).  It is launched like training: under ``torchrun`` (any
number of devices and nodes) every rank runs the worker in place; otherwise the ranks are spawned on this
machine -- gloo ranks on CPU, one rank per local GPU / NPU (NCCL / HCCL) with ``--device cuda|npu``.

Every rank builds one `HdpEngine` per policy from the same weights (set by parameter name, so every policy
starts identically), then runs the same batches through each.  In the benchmark the policies alternate
step by step and which goes first alternates too (**paired alternation**): step s of one policy and step s
of the other meet nearly the same load, so the ratio of the two steps -- the **paired** figure,
`hdp.trainer.bench.stats.paired`: the median over the timed steps with a 95% bootstrap interval -- is what a
shared machine moves least; the demo runs static CP first and HDP after it.  Each step is timed from a
barrier: its wall seconds (the slowest rank) and the CPU seconds of all ranks (what other work on a
shared machine distorts least).  Before any step every rank loads the compiled planner kernels of every
policy (`warm_planner`; the parent compiles them first when it spawns the ranks, so a cold numba cache is
compiled once, not once per rank), so no policy's first plan pays for a compile.  The first step of each
policy is a warm-up and is not timed (each engine's first forward and backward, its process groups' first
messages); after it every engine takes one more untimed step of the same batch under a mixed plan
(single-rank and CP groups), so the cost model fitted from the warm-up records has seen every group size.
Every policy runs the same layout and plans over the domain of ``ranks / (tp · pp)`` ranks, each timed
step's plan made with the engine's own planner settings (its pipeline stages, its nodes) and the bench's
cost model (`TrainBenchSpec.cost_model`: fitted to the warm-up, or the job's own).

Output (`bench_train`), per policy (``results``): ``tokens_per_s`` (all timed steps' tokens over their wall
seconds, per device: the recipe's TPS/card), ``tokens_per_s_job`` (the whole job's), the median step time,
``cpu_tokens_per_s`` (tokens per CPU-second of all ranks), ``model_tflops_per_device`` and ``mfu`` (the model
FLOPs of the shape, `hdp.trainer.bench.job.train_flops`, against the device's peak; None where no peak is
known), ``peak_memory_gb`` (the largest per-rank peak of its timed steps: the allocator's on a GPU / NPU, the
engine's meter on CPU), ``phases`` (the median seconds per phase of the step: the slowest rank's
``hdp/time/*``), the planned efficiency and the losses of every step (they must agree across policies: the
update is exact whatever the plan).  Across policies: ``speedup`` / ``speedup_cpu_time`` (hdp over each other
policy, whole-run tokens/s), ``paired`` (hdp over each other policy: the paired median of wall and of
CPU-second ratios with their 95% intervals), ``loss_match``, ``plans_differ`` (the policies' first timed plans
are not one plan: otherwise the comparison compares nothing), ``replay`` (recorded lengths only: each timed
step's plan checksum against the one the recording run wrote, for the policies it ran), the environment, a
cost model fitted to this machine from the engines' records with the ratio of simulated to measured step time
per policy (``calibration``: the fit's warnings are in ``calibration.warnings``, never logged, and the model
the timed steps were planned with in ``calibration.planned_with``), and ``plan_ahead``: the timed batches once
more as one step of several mini-batches planned ahead (`HdpEngine.train_steps`), each mini-batch's
``hdp/planner_ms`` and ``hdp/planner_ms_exposed``.

NOT RUN ON HARDWARE: the ``cuda`` / ``npu`` paths (device placement, NCCL / HCCL, allocator peaks, MFU against
a datasheet peak) ran on CPU only, through ``hdp bench device --dry-run``'s ``train_job`` row.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import statistics
import subprocess
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hdp.device import DEVICE_KINDS
from hdp.packing.cost import CostModel
from hdp.trainer.bench.lengths import RecordedBatch, read_batches
from hdp.core.phases import median_phases

__all__ = ["TrainBenchSpec", "TRAIN_WORKLOADS", "SMOKE", "DEVICES", "COST_FIT", "bench_train", "compare_with_baseline",
           "domain_size", "batch_lengths", "train_batch_lengths", "warm_planner", "job_config"]

logger = logging.getLogger(__name__)

SMOKE: dict[str, Any] = {"num_layers": 1, "hidden_size": 64, "num_attention_heads": 2, "vocab_size": 256,
                         "samples": 12, "max_tokens_per_rank": 256}
"""`TrainBenchSpec` fields of the smallest mode (``--smoke``): does the benchmark run and is its result
complete, in seconds; its figures are not throughput figures."""

TRAIN_WORKLOADS = ("short-tail", "long-response")
"""Synthetic batches: most samples on one rank with a few needing all ranks, or most needing 2-4."""

DEVICES = DEVICE_KINDS
"""Devices a job runs on (`hdp.device.DEVICE_KINDS`; one rank per device on an accelerator)."""

COST_FIT = "fit"
"""`TrainBenchSpec.cost_model` value: plan the timed steps with a cost model fitted to the warm-up's records."""

DEFAULT_BUDGET = 1024
"""Token budget B when neither the spec nor the recorded lengths give one."""

_LAYOUT_CHOICES = {"zero_memory": ("none", "level0", "level1"), "recompute": ("none", "selective", "full"),
                   "cp_algorithm": ("ring", "allgather")}


@dataclass(frozen=True, kw_only=True)
class TrainBenchSpec:
    """What one benchmark run trains (picklable: it travels to spawned ranks)."""

    ranks: int = 4
    """All ranks of the job, TP × PP × domain (local ranks when spawned; the world under torchrun)."""
    tp: int = 1
    """Tensor-parallel size (sequence parallel on), the same for every policy."""
    pp: int = 1
    """Pipeline stages, the same for every policy (each round one micro-batch of the 1F1B schedule)."""
    virtual_pp: int | None = None
    """Virtual stages per pipeline rank (interleaved 1F1B); None: plain 1F1B."""
    ep: int = 1
    """Expert-parallel size (a MoE model)."""
    etp: int = 1
    """Expert tensor-parallel size (hdp runs 1)."""
    zero_memory: str = "none"
    """MoE zero-memory level: none, level0, level1."""
    recompute: str = "none"
    """Activation recompute: none, selective, full."""
    cp_algorithm: str = "ring"
    """CP attention: ring, or allgather (on aligned power-of-two groups)."""
    policies: tuple[str, ...] = ("static-cp", "hdp")
    """Policies compared side by side (``verl-kk``: verl's stock scheduling)."""
    steps: int | None = None
    """Steps per policy, the first one untimed; None: 4, or with recorded lengths one per recorded batch + 1."""
    workload: str = "short-tail"
    """One of TRAIN_WORKLOADS (unused with ``lengths``)."""
    lengths: str | None = None
    """A lengths file or a run's recorded lengths (`hdp.trainer.bench.lengths`); None: the workload."""
    samples: int | None = None
    """Samples per global batch of a workload; None: 40 for short-tail, 12 for long-response (each ~1-4K tokens)."""
    max_tokens_per_rank: int | None = None
    """Planner token budget B; None: the recorded one (recorded lengths), else `DEFAULT_BUDGET`."""
    model: str | None = None
    """``tiny`` (None), a shape preset or a config.json (`hdp.trainer.bench.job`)."""
    layers: int | None = None
    """Override of the model's layer count."""
    num_layers: int = 4
    """``tiny``: transformer layers."""
    hidden_size: int = 256
    """``tiny``: model width."""
    num_attention_heads: int = 4
    """``tiny``: attention heads."""
    vocab_size: int = 1024
    """``tiny``: vocabulary."""
    dtype: str | None = None
    """Parameter dtype, float32 or bfloat16; None: float32 on CPU, bfloat16 on an accelerator."""
    cost_model: str = COST_FIT
    """The timed steps' cost model: ``fit`` (fitted to the warm-up's records), or what ``cost_model`` takes
    everywhere (``auto``: the engines' own model of this shape and device; ``MODEL@PROFILE``; a cost-model
    file) -- the job's, to replay its plans."""
    peak_tflops: float | None = None
    """Peak TFLOP/s per device MFU is taken against; None: `hdp.trainer.bench.job.PEAK_TFLOPS` by name."""
    alternate: bool = True
    """Alternate policies step by step (benchmark) or run them one after another (demo)."""
    device: str = "cpu"
    """Device kind of every rank (`DEVICES`)."""
    seed: int = 0
    """Batch seed."""
    records_dir: str | None = None
    """Where the engines write calibration records (one file per policy); None: a temp dir."""
    batches: tuple[RecordedBatch, ...] | None = None
    """The batches of ``lengths``, read at construction (not a user field)."""

    def __post_init__(self) -> None:
        if self.workload not in TRAIN_WORKLOADS:
            raise ValueError(f"workload={self.workload!r} is unknown; choose one of: {', '.join(TRAIN_WORKLOADS)}")
        if self.samples is None:
            object.__setattr__(self, "samples", 40 if self.workload == "short-tail" else 12)
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r}: choose one of {', '.join(DEVICES)}")
        if self.ranks < 1:
            raise ValueError(f"ranks={self.ranks}: need at least 1 rank")
        for name in ("tp", "pp", "ep", "etp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: pass a positive integer")
        for name, choices in _LAYOUT_CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {', '.join(choices)}")
        if self.dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r}: choose float32 or bfloat16")
        if self.ranks % (self.tp * self.pp):
            raise ValueError(
                f"ranks={self.ranks}: must be a multiple of tp x pp = {self.tp} x {self.pp} (the world is "
                "TP x PP x domain)"
            )
        if self.peak_tflops is not None and not (isinstance(self.peak_tflops, (int, float))
                                                 and 0 < self.peak_tflops < 1e6):
            raise ValueError(f"peak_tflops={self.peak_tflops!r}: pass the device's peak TFLOP/s, a number > 0")
        if self.lengths is not None and self.batches is None:
            object.__setattr__(self, "batches", tuple(read_batches(self.lengths)))
        if self.max_tokens_per_rank is None:
            recorded = {b.max_tokens_per_rank for b in self.batches or () if b.max_tokens_per_rank}
            object.__setattr__(self, "max_tokens_per_rank", recorded.pop() if len(recorded) == 1 else DEFAULT_BUDGET)
        if self.steps is None:
            object.__setattr__(self, "steps", len(self.batches) + 1 if self.batches else 4)
        if self.steps < 2:
            raise ValueError(f"steps={self.steps}: need at least 2 (the first step is a warm-up)")
        if not self.policies:
            raise ValueError("policies: name at least one policy")
        from hdp.packing import Policy

        known = [p.value for p in Policy]
        for name in self.policies:
            if name not in known:
                raise ValueError(f"policies: policy={name!r} is unknown; choose from: {', '.join(known)}")
        if self.batches:
            longest, fits = max(max(b.lengths) for b in self.batches), domain_size(self) * self.max_tokens_per_rank
            if longest > fits:
                raise ValueError(f"lengths: a sample of {longest} tokens does not fit the domain of {domain_size(self)} "
                                 f"ranks x max_tokens_per_rank={self.max_tokens_per_rank} = {fits} tokens; raise "
                                 "max_tokens_per_rank or the ranks")

    def config(self) -> dict[str, Any]:
        """The job as plain data (the result's ``spec``; the recorded batches summarised)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "batches"}
        out["policies"] = list(self.policies)
        if self.batches:
            out["recorded_batches"] = len(self.batches)
        return out


def domain_size(spec: TrainBenchSpec) -> int:
    """N: the ranks hdp plans over (ranks / (TP · PP))."""
    return spec.ranks // (spec.tp * spec.pp)


def train_batch_lengths(spec: TrainBenchSpec, step: int) -> list[int]:
    """Sample lengths of the workload's batch of ``step`` (deterministic in the spec's seed), sized for the domain."""
    rng = np.random.default_rng([spec.seed, step])
    budget, n = spec.max_tokens_per_rank, spec.samples
    assert budget is not None and n is not None
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


def _recorded_index(spec: TrainBenchSpec, step: int) -> int:
    """The recorded batch of ``step``: step 0 (the warm-up) and step 1 train batch 0, step s batch s - 1 (cycled)."""
    assert spec.batches
    return max(step - 1, 0) % len(spec.batches)


def batch_lengths(spec: TrainBenchSpec, step: int) -> list[int]:
    """Sample lengths of ``step``'s batch: the recorded batch (`_recorded_index`) or the workload's."""
    if spec.batches:
        return list(spec.batches[_recorded_index(spec, step)].lengths)
    return train_batch_lengths(spec, step)


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
    g = torch.Generator(device=p.device).manual_seed(zlib.crc32(name.encode()))
    val = torch.randn(p.shape, generator=g, dtype=torch.float32, device=p.device)
    p.copy_(1.0 + 0.02 * val if p.dim() == 1 else 0.02 * val)


def _batch(spec: TrainBenchSpec, step: int, vocab: int):
    from hdp.trainer.engine import Batch

    g = torch.Generator().manual_seed(1000 * spec.seed + step)
    lengths = batch_lengths(spec, step)
    tokens = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    # RL-style: the prompt (first quarter) carries no loss
    masks = [torch.cat([torch.zeros(n // 4), torch.ones(n - n // 4)]) for n in lengths]
    return Batch(tokens=tokens, loss_mask=masks)


def _dtype(spec: TrainBenchSpec) -> str:
    return spec.dtype or ("float32" if spec.device == "cpu" else "bfloat16")


def job_config(spec: TrainBenchSpec, policy: str, records: str | None, device: str | None = None):
    """The `EngineConfig` of the job under ``policy`` (calibration records to ``records``); pure: ValueError
    naming the field for a layout the model cannot take, before any rank starts."""
    from hdp.trainer.bench.job import model_config
    from hdp.trainer.config import EngineConfig, ParallelConfig, PlanningConfig
    from hdp.trainer.model import OptimConfig

    longest = max([domain_size(spec) * (spec.max_tokens_per_rank or DEFAULT_BUDGET)]
                  + [max(b.lengths) for b in spec.batches or ()])
    model = model_config(spec, _dtype(spec), max(4096, longest))
    parallel = ParallelConfig(tp=spec.tp, pp=spec.pp, virtual_pp=spec.virtual_pp, ep=spec.ep, expert_tp=spec.etp)
    parallel.check_model(model, "bench train")
    parallel.check_world(spec.ranks, "bench train")
    fixed = spec.cost_model != COST_FIT
    planning = PlanningConfig(
        max_tokens_per_rank=spec.max_tokens_per_rank, policy=policy, calibration_path=records,
        cost_model=spec.cost_model if fixed else "auto", auto_calibrate=not fixed, cp_algorithm=spec.cp_algorithm,
        group_shape="pow2" if spec.cp_algorithm == "allgather" else "any", zero_memory=spec.zero_memory)
    return EngineConfig(model=model, optim=OptimConfig(lr=1e-4), planning=planning, parallel=parallel,
                        device=device or spec.device)


def _engine_config(spec: TrainBenchSpec, policy: str, records: str | None):
    """`job_config` (the demo's name for it)."""
    return job_config(spec, policy, records)


def _rank_device(spec: TrainBenchSpec, rank: int) -> str:
    """This rank's device: ``cpu``, or ``cuda:i`` / ``npu:i`` with i the local rank (``LOCAL_RANK`` under torchrun)."""
    if spec.device == "cpu":
        return "cpu"
    from hdp import device as _dev

    _dev.select_device(spec.device)  # imports torch_npu on an NPU; ValueError when the device is missing
    mod = getattr(torch, spec.device)
    local = int(os.environ.get("LOCAL_RANK", rank % max(1, mod.device_count())))
    mod.set_device(local)
    return f"{spec.device}:{local}"


def _worker(rank: int, world: int, spec: TrainBenchSpec, records_dir: str) -> dict[str, Any]:
    from hdp.packing import PlannerConfig
    from hdp.packing import plan as make_plan
    from hdp.trainer.engine import HdpEngine, nll_loss

    if spec.device == "cpu":
        torch.set_num_threads(1)
    device = _rank_device(spec, rank)
    warm_planner(spec.policies)  # every policy's kernels loaded before any step: no first plan compiles
    engines = {
        p: HdpEngine.build(job_config(spec, p, os.path.join(records_dir, f"{p}.jsonl"), device), dist.group.WORLD,
                            init_fn=_init_param)
        for p in spec.policies
    }
    vocab = engines[spec.policies[0]].config.model.vocab_size
    batches = [_batch(spec, s, vocab) for s in range(spec.steps)]
    history: dict[str, list[dict[str, Any]]] = {p: [] for p in spec.policies}
    plans: dict[str, Any] = {}
    # warm-up, untimed, which also measures this machine for the cost model: per policy one step of
    # its own plan, then one of a mixed plan (verl-kk: single-rank groups and CP groups), so the
    # fit sees every group size even when the default cost model gives every policy the same CP
    # groups.  Every engine takes the same two updates, so the later losses still agree.
    first = engines[spec.policies[0]].planner.planner_config()
    mixed = make_plan(batches[0].lengths, dataclasses.replace(first, policy=MIXED_POLICY, cost=first.cost))
    for p in spec.policies:
        history[p].append(_timed_step(engines[p], batches[0], device=device))
        engines[p].train_step(batches[0], nll_loss, plan=mixed)
    if spec.cost_model == COST_FIT:
        cost, source = _fitted_cost(spec, records_dir, rank, engines[spec.policies[0]].planner.cost)
    else:
        cost, source = engines[spec.policies[0]].planner.cost, f"the job's cost model ({spec.cost_model})"
    steps = range(1, spec.steps)
    if spec.alternate:
        order = [(s, p) for s in steps for p in (spec.policies if s % 2 else spec.policies[::-1])]
    else:
        order = [(s, p) for p in spec.policies for s in steps]
    for s, p in order:
        # the engine's own planner settings (pipeline stages, nodes, options) with the bench's cost model
        cfg: PlannerConfig = dataclasses.replace(engines[p].planner.planner_config(), cost=cost)
        plan = make_plan(batches[s].lengths, cfg)
        if s == 1:
            plans[p] = plan.to_dict()
        history[p].append(_timed_step(engines[p], batches[s], plan, device=device))
    ahead = _plan_ahead_steps(engines[spec.policies[-1]], batches[1:])
    for engine in engines.values():
        engine.close()
    if dist.is_initialized():
        dist.barrier(group=dist.group.WORLD)
    return ({"history": history, "plans": plans, "cost": asdict(cost), "cost_source": source, "plan_ahead": ahead,
             "device_name": _device_name(device)} if rank == 0 else {})


def _device_name(device: str) -> str:
    from hdp import device as _dev

    if device == "cpu":
        return _cpu_model() or platform.processor() or "cpu"
    return _dev.device_name(torch.device(device))


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


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


def _timed_step(engine: Any, batch: Any, plan: Any = None, *, device: str = "cpu") -> dict[str, Any]:
    """One ``train_step`` started from a barrier: its metrics (numbers, dicts, strings) with ``perf/wall`` (the
    slowest rank's wall seconds), ``perf/cpu_time`` (the CPU seconds of all ranks of the job), ``perf/peak_gb``
    (the largest rank's allocator peak on an accelerator, the engine's meter on CPU) and ``checksum`` (the plan).

    CPU time is what a loaded shared machine distorts least (a rank waiting for a peer sleeps).
    """
    from hdp import device as _dev
    from hdp.trainer.engine import nll_loss

    dev = torch.device(device)
    coll = dev if dev.type != "cpu" and "gloo" not in str(dist.get_backend(dist.group.WORLD)) else torch.device("cpu")
    _dev.reset_peak_memory(dev)
    dist.barrier(group=dist.group.WORLD)
    t0, c0 = time.perf_counter(), time.process_time()
    m = engine.train_step(batch, nll_loss, plan=plan)
    _dev.synchronize(dev)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = _dev.memory_stats(dev)["peak_bytes"] / 1e9 if dev.type != "cpu" else float(m.get("hdp/memory_peak_gb", 0.0))
    top = torch.tensor([wall, peak], dtype=torch.float64, device=coll)
    total = torch.tensor([cpu], dtype=torch.float64, device=coll)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=dist.group.WORLD)
    out = {k: v for k, v in m.items() if isinstance(v, (int, float, dict, str))}
    out.update({"perf/wall": float(top[0]), "perf/peak_gb": float(top[1]), "perf/cpu_time": float(total[0])})
    out["checksum"] = plan.checksum() if plan is not None else None
    return out


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


def _commit() -> str | None:
    """The git commit of the checkout hdp runs from (``+dirty`` when it has uncommitted changes); None outside one."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) if head else None


def environment(device: str = "cpu", device_name: str | None = None) -> dict[str, Any]:
    """The machine and software a figure was measured on: hardware, versions, the commit, the load."""
    from importlib import metadata

    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch.__version__, "megatron-core": version("megatron-core"), "verl": version("verl"),
        "hdp-engine": version("hdp-engine"), "commit": _commit(), "device": device,
        "device_name": device_name or (_cpu_model() if device == "cpu" else None),
        "cpu_model": _cpu_model(), "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def _environment(spec: TrainBenchSpec, device_name: str | None) -> dict[str, Any]:
    return {**environment(spec.device, device_name), "ranks": spec.ranks, "tp": spec.tp, "pp": spec.pp,
            "domain": domain_size(spec), "threads_per_rank": 1 if spec.device == "cpu" else None}


def _summarise(spec: TrainBenchSpec, out: dict[str, Any], records_dir: str) -> dict[str, Any]:
    from hdp.trainer.bench.job import model_shape, peak_tflops, train_flops
    from hdp.trainer.bench.stats import paired

    hist = out["history"]
    shape = model_shape(spec)
    peak, peak_source = peak_tflops(out.get("device_name") or spec.device, spec.peak_tflops)
    flops = {s: train_flops(shape, batch_lengths(spec, s)) for s in range(spec.steps)}
    results: dict[str, Any] = {}
    for p, steps in hist.items():
        timed = steps[1:]
        wall = sum(m["perf/wall"] for m in timed)
        tokens = sum(m["perf/tokens"] for m in timed)
        tflops = sum(flops[s] for s in range(1, spec.steps)) / wall / spec.ranks / 1e12
        results[p] = {
            # throughput of the timed steps together: their tokens over their wall time
            "tokens_per_s": tokens / wall / spec.ranks,
            "tokens_per_s_job": tokens / wall,
            "step_time_s": statistics.median(m["perf/wall"] for m in timed),
            # tokens per CPU-second of all ranks (robust to other jobs on a shared machine)
            "cpu_tokens_per_s": tokens / sum(m["perf/cpu_time"] for m in timed),
            "cpu_time_s": statistics.median(m["perf/cpu_time"] for m in timed),
            "model_tflops_per_device": tflops,
            "mfu": tflops / peak if peak else None,
            "peak_memory_gb": max(m["perf/peak_gb"] for m in timed),
            "step_times_s": [m["perf/wall"] for m in steps],
            "cpu_times_s": [m["perf/cpu_time"] for m in steps],
            "losses": [m["loss"] for m in steps],
            "rounds": [m["hdp/rounds"] for m in steps],
            "checksums": [m["checksum"] for m in steps],
            "efficiency_planned": statistics.mean(m["hdp/efficiency_planned"] for m in steps),
            "cp_degree_hist": steps[0]["hdp/cp_degree_hist"],
            "phases": median_phases(timed),  # the slowest rank's seconds per phase (hdp.core.phases)
        }
    pols = list(hist)
    others = [q for q in pols if q != "hdp"] if "hdp" in pols else []
    speedup = {f"hdp_vs_{q}": results["hdp"]["tokens_per_s"] / results[q]["tokens_per_s"] for q in others}
    speedup_cpu = {f"hdp_vs_{q}": results["hdp"]["cpu_tokens_per_s"] / results[q]["cpu_tokens_per_s"] for q in others}
    # the paired figures: step s of q over step s of hdp (the same batch, one right after the other)
    pair = {f"hdp_vs_{q}": {"wall": paired(results[q]["step_times_s"][1:], results["hdp"]["step_times_s"][1:]),
                            "cpu": paired(results[q]["cpu_times_s"][1:], results["hdp"]["cpu_times_s"][1:])}
            for q in others}
    ref = np.asarray(results[pols[0]]["losses"])
    loss_diff = max(float(np.max(np.abs(np.asarray(results[p]["losses"]) - ref) / np.maximum(np.abs(ref), 1e-12))) for p in pols)
    result = {
        "spec": spec.config(), "results": results, "speedup": speedup, "speedup_cpu_time": speedup_cpu,
        "paired": pair, "loss_match": loss_diff <= 1e-4, "loss_max_rel_diff": loss_diff,
        # the comparison means something only when the policies ran different plans (first timed step's)
        "plans_differ": len({p["checksum"] for p in out["plans"].values()}) == len(out["plans"]),
        "model": {**asdict(shape), "train_flops_per_step": statistics.median(flops.values()),
                  "peak_tflops": peak, "peak_source": peak_source},
        "environment": _environment(spec, out.get("device_name")), "plans": out["plans"],
    }
    if spec.batches:
        result["replay"] = _replay(spec, results)
    result["calibration"] = _calibration(spec, hist, records_dir, out["cost"], out["cost_source"])
    result["plan_ahead"] = out["plan_ahead"]
    return result


def _replay(spec: TrainBenchSpec, results: dict[str, Any]) -> dict[str, Any]:
    """Per policy the recording run planned with: its timed steps' plan checksums against the recorded ones
    (``equal`` of ``compared``), and the recorded steps' indices."""
    assert spec.batches
    out: dict[str, Any] = {}
    for p, r in results.items():
        compared = equal = 0
        for s in range(1, spec.steps):
            rec = spec.batches[_recorded_index(spec, s)]
            if rec.checksum is None or rec.policy != p:
                continue
            compared += 1
            equal += int(r["checksums"][s] == rec.checksum)
        if compared:
            out[p] = {"compared": compared, "equal": equal}
    return out


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
            cfg = PlannerConfig(num_ranks=domain_size(spec), max_tokens_per_rank=spec.max_tokens_per_rank,
                                policy=p, cost=cost, pipeline_stages=spec.pp)
            predicted.append(simulate(plan(batch_lengths(spec, s), cfg), cost).step_time_s)
        measured = statistics.median(m["perf/wall"] for m in steps[1:])
        ratios[p] = statistics.median(predicted) / measured
    out["predicted_over_measured"] = ratios
    out["planned_with"] = cost_source
    return out


def check_job(spec: TrainBenchSpec) -> None:
    """Every check of the job that needs no rank (the model, its layout, the device), ValueError naming the field:
    run before any rank starts."""
    if spec.device != "cpu":
        from hdp import device as _dev

        _dev.select_device(spec.device)  # ValueError when the accelerator is not there
    job_config(spec, spec.policies[0], None)


def bench_train(spec: TrainBenchSpec) -> dict[str, Any]:
    """Run the comparison (in place under torchrun; else spawning ``spec.ranks`` local ranks: gloo on CPU, one
    per device with NCCL / HCCL on an accelerator)."""
    from hdp import device as _dev
    from hdp.trainer.launch import init_from_env, spawn

    check_job(spec)
    records_dir = spec.records_dir or tempfile.mkdtemp(prefix="hdp-bench-train-")
    for p in spec.policies:
        for name in (f"{p}.jsonl", f"{p}.lengths.jsonl"):
            (Path(records_dir) / name).unlink(missing_ok=True)
    if init_from_env(spec.device):
        world = dist.get_world_size()
        if world != spec.ranks:
            spec = dataclasses.replace(spec, ranks=world)
        out = _worker(dist.get_rank(), world, spec, records_dir)
        if dist.get_rank() != 0:
            return {}
    else:
        if spec.device != "cpu":
            _dev.select_device(spec.device)
            count = getattr(torch, spec.device).device_count()
            if spec.ranks > count:
                raise ValueError(f"ranks={spec.ranks}: this machine has {count} {spec.device} device(s); spawned ranks "
                                 "take one device each -- ask for fewer, or launch with torchrun over several nodes")
        warm_planner(spec.policies)  # a cold cache compiled once here, then loaded by every rank
        backend = _dev.backend_for(torch.device(spec.device))
        out = spawn(_worker, spec.ranks, spec, records_dir, timeout=1800.0, backend=backend)[0]
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
