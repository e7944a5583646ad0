"""`DomainPlanner`: an engine's one planner — options, cost model, calibration state — built once.

Both engines (`hdp.trainer.engine.HdpEngine`, the verl engine) hold one, built at construction from
their resolved settings; nothing is re-read or rebuilt per step.  It

* plans a batch (`plan`; verl's log-prob passes with their own token budget, resolved once at build);
* after every training step, `observe` takes every rank's measured seconds of every round
  (**one all-gather over the whole job**), and from the same ``[W, R]`` table on every rank:
  a round's time is its slowest rank over all TP ranks and pipeline stages, a group's the slowest
  of its domain ranks;
  - writes calibration records (`hdp.packing.calibrate` schema) on world rank 0 when a path is set,
    and beside them (`lengths_path`: ``actor.jsonl`` -> ``actor.lengths.jsonl``) the step's sample
    lengths in the order planned, with the plan's checksum, which ``hdp bench train --lengths`` replays
    (a failed write never fails the step: it is reported as ``hdp/records_write_failed`` on every
    rank);
  - feeds the auto-calibration window (`hdp.packing.autocal`) and, every ``every_steps`` steps,
    refits on world rank 0; the decision travels in **one fixed-size broadcast over the job**, so
    every rank of every domain, stage and TP rank plans with bit-identical parameters;
  - returns the metrics ``hdp/predicted_over_measured``, ``hdp/idle_fraction_measured``,
    ``hdp/cost_model_version``, ``hdp/cost_fit_r2``;
  - carries each rank's seconds per phase of the step (`hdp.core.phases`) in the same gather and
    returns the slowest rank's as ``hdp/time/<phase>`` (no collective of their own).

The topology (`job_node_map`): a job launched over several nodes -- ``RAY_LOCAL_WORLD_SIZE`` ranks per node
(verl's Ray workers: its ``trainer.n_gpus_per_node``), or ``LOCAL_WORLD_SIZE`` (torchrun) -- plans
with the node of every domain rank (`hdp.packing.PlannerConfig.node_of`), derived from Megatron's rank
order and that count.  Both engines agree on those variables over the job before they read them
(`launcher_topology` through `hdp.core.agreement.agree_fields`): a value that differs between ranks is
named with each rank's value, one bad on every rank is refused alike (`launcher_ranks_per_node`).

Default cost model (``cost_model="auto"`` in both engines): the engine's own model shape
(`hdp.packing.model_shape.ModelShape`) on its device kind's profile — ``cpu-gloo`` on CPU,
``h100-nvlink`` on CUDA, ``ascend-910b-hccs`` on NPU — then refined by auto-calibration.  The
planner alone (``hdp plan``, `hdp.packing.PlannerConfig`) has no model or device and defaults to
`hdp.packing.profiles.DEFAULT_PRESET` (``deepseek-v3@h100-nvlink``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hdp.checksum import text_digest
from hdp.device import cost_profile
from hdp.groups import LayoutGroups
from hdp.packing import CostModel, Plan, PlannerConfig, simulate
from hdp.packing import plan as make_plan
from hdp.packing.autocal import AutoCalibrate, CostWindow, Refit, explore_model, refit
from hdp.packing.cost import PARAMETERS
from hdp.packing.model_shape import ModelShape
from hdp.packing.memory import GB
from hdp.packing.profiles import cost_model as preset_cost
from hdp.packing.topology import Nodes, domain_node_map
from hdp.core.memory import COEF_NAMES, MemoryCalibration
from hdp.core.phases import PHASES, PhaseTimer
from hdp.core.plan_ahead import PlanAhead, Taken

__all__ = ["DomainPlanner", "auto_cost_model", "lengths_path", "plan_id", "job_node_map", "launcher_ranks_per_node", "launcher_topology",
           "MEGATRON_ORDER", "RANKS_PER_NODE_KEYS", "MAX_RANKS_PER_NODE", "TOPOLOGY_FIX"]

logger = logging.getLogger(__name__)

LENGTHS_SUFFIX = ".lengths"
"""Inserted before the records file's suffix to name the file of each step's sample lengths (`lengths_path`)."""


def lengths_path(records_path: str | os.PathLike[str]) -> Path:
    """The file beside calibration records ``records_path`` where world rank 0 appends one JSON line per training
    step: ``{"step", "policy", "num_ranks", "max_tokens_per_rank", "lengths": [...], "checksum"}`` -- the samples'
    lengths in the order planned and the plan's checksum (``actor.jsonl`` -> ``actor.lengths.jsonl``)."""
    p = Path(records_path)
    return p.with_name(f"{p.stem}{LENGTHS_SUFFIX}{p.suffix}")


STATIC_SLACK = 0.01
"""Growth of the measured static bytes (a fraction) below which the memory model keeps its figure."""


def plan_id(plan: Plan) -> float:
    """The metric ``hdp/plan_id``: the first 48 bits of ``plan.checksum()`` as a float (exact; equal plans,
    equal ids), so a run's metrics say which plan ran."""
    return float(int(plan.checksum()[:12], 16))


MEGATRON_ORDER = "tp-cp-ep-dp-pp"
"""The rank order the engines initialise Megatron with (megatron-core 0.16.1's default of
``initialize_model_parallel``); with CP = 1 the domain is its DP dimension."""
RANKS_PER_NODE_KEYS = ("RAY_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE")
"""Where launchers say how many consecutive global ranks share a node: verl's Ray worker group
(``RAY_LOCAL_WORLD_SIZE``, from its resource pool: ``trainer.n_gpus_per_node``), then torchrun.  Ray's
first: verl's ``Worker.__init__`` writes ``LOCAL_WORLD_SIZE`` itself, as ``1`` when no launcher set it
(``os.getenv("LOCAL_WORLD_SIZE", "1")``), which would put every rank of a Ray job on a node of its own."""


MAX_RANKS_PER_NODE = 1 << 16
"""Largest ranks per node a launcher variable may say (no machine holds more; beyond, a typo)."""

TOPOLOGY_FIX = (f"launch every rank with the same {' / '.join(RANKS_PER_NODE_KEYS)} (the ranks per node: verl's "
                "trainer.n_gpus_per_node, torchrun's --nproc-per-node), or unset it on every rank for one node")
"""How to mend the launcher's topology variables when they are bad or differ between ranks."""


def launcher_ranks_per_node(env: Mapping[str, str] | None = None) -> int | None:
    """The ranks per node the launcher set (`RANKS_PER_NODE_KEYS`, the first set and non-empty), None when it says
    nothing (one node is assumed, as without a topology); ValueError naming the variable and its value when it is
    not an integer in [1, `MAX_RANKS_PER_NODE`].  The engines call it after `launcher_topology` was agreed over the
    job, so a bad value raises on every rank alike."""
    env = os.environ if env is None else env
    for key in RANKS_PER_NODE_KEYS:
        text = env.get(key)
        if text is None or text == "":
            continue
        try:
            value = int(text.strip())
        except ValueError:  # not an integer (or one of more digits than Python converts)
            value = 0
        if not 1 <= value <= MAX_RANKS_PER_NODE:
            shown = text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"
            raise ValueError(f"{key}={shown!r}: the launcher's ranks per node must be an integer in "
                             f"[1, {MAX_RANKS_PER_NODE}]; set it to the ranks each node runs (verl's "
                             "trainer.n_gpus_per_node, torchrun's --nproc-per-node), or unset it for one node")
        return value
    return None


def launcher_topology(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The launcher's topology inputs as every rank of a job must share them (`hdp.core.agreement.agree_fields`):
    each variable of `RANKS_PER_NODE_KEYS` with its text (``repr``), ``unset``, or -- after the one in effect --
    ``not read (KEY is set)`` (verl's worker writes ``LOCAL_WORLD_SIZE=1`` under Ray, which the planner never reads
    and which may then differ)."""
    env = os.environ if env is None else env
    out: dict[str, str] = {}
    used = None
    for key in RANKS_PER_NODE_KEYS:
        text = env.get(key)
        if used is not None:
            out[key] = f"not read ({used} is set)"
        elif text is None or text == "":
            out[key] = "unset"
        else:
            out[key] = repr(text) if len(text) <= 40 else \
                f"{text[:20]!r}... ({len(text)} characters, digest {text_digest(text) & (2**64 - 1):016x})"
            used = key
    return out


def job_node_map(tp: int, pp: int, domain: int, ranks_per_node: int | None, order: str = MEGATRON_ORDER
                 ) -> tuple[int, ...] | None:
    """The node of every domain rank of a TP x PP x ``domain`` job whose launcher puts ``ranks_per_node``
    consecutive global ranks on a node (None: one node): the domains' global ranks from Megatron's
    ``RankGenerator`` in ``order`` (one domain per TP rank and stage), then
    `hdp.packing.topology.domain_node_map`.  ValueError when the world is no whole number of nodes."""
    if ranks_per_node is None:
        return None
    world = tp * pp * domain
    if world % ranks_per_node and world > ranks_per_node:
        raise ValueError(f"{' / '.join(RANKS_PER_NODE_KEYS)} = {ranks_per_node} ranks per node: the job's {world} ranks (TP {tp} x PP {pp} x "
                         f"domain {domain}) are no whole number of nodes of {ranks_per_node}; launch the same number "
                         "of ranks on every node")
    from megatron.core.parallel_state import RankGenerator

    domains = RankGenerator(tp=tp, ep=1, dp=domain, pp=pp, cp=1, order=order).get_ranks("dp")
    return domain_node_map(domains, ranks_per_node)


def auto_cost_model(shape: ModelShape, device: torch.device | str) -> CostModel:
    """The ``auto`` cost model: ``shape``'s preset (`ModelShape.cost_preset`) on the device kind's profile."""
    kind = torch.device(device).type
    return preset_cost(shape.cost_preset(), cost_profile(kind))


class DomainPlanner:
    """Plans every step of one engine and learns its cost model from the timed rounds (see the module docstring).

    ``config``: the planner config (domain size, the training passes' token budget, cost model, PP stages,
    options); ``settings``: auto-calibration; ``groups``: the job's groups (``world`` carries the two
    collectives of `observe`); ``records_path``: where calibration records go (``None``: nowhere);
    ``infer_budget``: the token budget of forward-only passes where it differs (verl's log-prob passes).
    """

    def __init__(self, config: PlannerConfig, settings: AutoCalibrate, groups: LayoutGroups, *,
                 collective_device: torch.device, records_path: str | None = None,
                 memory: MemoryCalibration | None = None, infer_budget: int | None = None) -> None:
        if not isinstance(settings, AutoCalibrate):
            raise TypeError(f"settings is {type(settings).__name__}; pass a hdp.packing.autocal.AutoCalibrate")
        if config.node_of is None:  # the job's topology, alike on every rank (module docstring)
            config = dataclasses.replace(config, node_of=job_node_map(
                groups.tp_size, groups.pp_size, groups.domain.size, launcher_ranks_per_node()))
        self.config = config
        self.settings = settings
        self.infer_budget = config.max_tokens_per_rank if infer_budget is None else int(infer_budget)
        """The token budget of forward-only passes (the training passes' unless the door has its own)."""
        self.groups = groups
        self.device = collective_device
        self.records_path = None if records_path is None else Path(records_path)
        self.window = CostWindow(settings.window_groups)
        self.version = 0
        self.steps = 0
        self.r2 = math.nan
        self.last: Refit | None = None
        self._exploring = False
        self._plan_cost = config.cost  # the model the next plans use (an exploration variant for one step)
        self.ahead = PlanAhead(make_plan)
        """Plans announced mini-batches on a background thread, one ahead."""
        self._memory_vec: np.ndarray | None = None
        self.memory = memory if config.memory_model is not None else None
        """Memory records, tightening and refits (`hdp.core.memory`), when the config has a memory model."""

    @property
    def cost(self) -> CostModel:
        """The cost model in use (the adopted one; not an exploration variant)."""
        return self.config.cost

    def planner_config(self, *, infer: bool = False) -> PlannerConfig:
        """The planner config of the next plan (``infer``: of a forward-only pass, with its budget)."""
        cfg = self.config if self._plan_cost is self.config.cost else dataclasses.replace(self.config, cost=self._plan_cost)
        if infer and self.infer_budget != cfg.max_tokens_per_rank:
            cfg = dataclasses.replace(cfg, max_tokens_per_rank=self.infer_budget)
        return cfg

    def plan(self, lengths: Sequence[int], *, infer: bool = False) -> Plan:
        """The plan of ``lengths`` (pure; identical on every rank); its stats carry ``planner_ms``."""
        return make_plan(lengths, self.planner_config(infer=infer))

    def announce(self, batches: Sequence[Sequence[int]], *, extend: bool = False) -> None:
        """The lengths of the next training mini-batches: planned one ahead on a background thread
        (`hdp.core.plan_ahead.PlanAhead`); ``extend``: after those announced before."""
        (self.ahead.extend if extend else self.ahead.announce)(batches, lambda i: self.planner_config())

    def take(self, lengths: Sequence[int], *, infer: bool = False) -> Taken:
        """The plan of the mini-batch about to run: made ahead when it was announced and the config is
        unchanged, else in line (the same plan either way); with the planning and the exposed time."""
        return self.ahead.take(lengths, self.planner_config(infer=infer))

    def close(self) -> None:
        """Stop the plan-ahead thread (idempotent)."""
        self.ahead.close()

    def measure_static(self, local_bytes: float) -> None:
        """Set the memory model's static bytes to the most any rank of the job holds (one all-reduce over
        the job; the engines call it once built, with `hdp.core.memory.static_bytes`).  Later steps
        re-measure them and replace the figure only when it grows by more than `STATIC_SLACK`, so plans
        made ahead stay valid (`hdp.core.plan_ahead`)."""
        mm = self.config.memory_model
        if mm is None:
            return
        buf = torch.tensor([float(local_bytes)], dtype=torch.float64, device=self.device)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.groups.world)
        self.config = dataclasses.replace(self.config, memory_model=dataclasses.replace(
            mm, measured_static=float(buf.item())))

    # -- after a training step: records, calibration, metrics ---------------------------------------

    def observe(self, plan: Plan, round_seconds: Sequence[float], *, step: int,
                memory_row: Sequence[float] | None = None, phases: PhaseTimer | None = None) -> dict[str, Any]:
        """Feed one training step's round times and, when measured, this rank's peak memory per round
        (``memory_row``: `MemoryCalibration.row`) — one collective over the job (see the module docstring).
        ``phases``: the core's phase timer; this call is its ``calibrate`` phase, and the gather carries
        its row (``hdp/time/*`` in the metrics)."""
        t0 = time.perf_counter()
        try:
            return self._observe(plan, round_seconds, step, memory_row, phases)
        finally:
            if phases is not None:
                phases.add("calibrate", time.perf_counter() - t0)

    def _observe(self, plan: Plan, round_seconds: Sequence[float], step: int, memory_row: Sequence[float] | None,
                 phases: PhaseTimer | None) -> dict[str, Any]:
        r_ = plan.num_rounds
        self._memory_vec = None
        mem = list(memory_row) if memory_row is not None and len(memory_row) == r_ + 1 else [math.nan] * (r_ + 1)
        timing = phases.row() if phases is not None else [math.nan] * len(PHASES)
        table = self._gather(plan, list(round_seconds), mem + timing)  # [W, R + (R + 1) + P + 2]
        times, dom, stage = table[:, :r_], table[:, -2].astype(int), table[:, -1].astype(int)
        mem_peaks, mem_static = table[:, r_:2 * r_], table[:, 2 * r_]
        slowest = table[:, 2 * r_ + 1:2 * r_ + 1 + len(PHASES)].max(axis=0)  # [P]: the job's slowest rank per phase
        n = plan.num_ranks
        per_rank = np.full((n, plan.num_rounds), 0.0)  # [N, R]: slowest TP rank / stage of each domain rank
        for d in range(n):
            rows = times[dom == d]
            if rows.size:
                per_rank[d] = rows.max(axis=0)
        measured = float(per_rank.max(axis=0).sum()) if per_rank.size else math.nan
        predicted = simulate(plan, self._plan_cost).step_time_s  # the model this step was planned with
        busy = float(per_rank.sum())
        idle = 1.0 - busy / (n * measured) if measured > 0 else math.nan
        mem_out, mem_records = self._observe_memory(plan, mem_peaks, mem_static, dom, stage, step)
        write_failed = 0.0
        if self.records_path is not None and self.groups.world_rank == 0:
            write_failed = 0.0 if self._write(plan, times, dom, stage, step, mem_records) else 1.0
        if self.settings.enabled and self.steps >= self.settings.warmup_steps:
            self.window.add_step(plan, per_rank, step=self.steps)
        self.steps += 1
        due = (self.settings.enabled and self.steps % self.settings.every_steps == 0
               and len(self.window) >= self.settings.min_rounds)
        exploring_done = self._exploring
        if self.settings.enabled or self.records_path is not None:
            decision, write_failed = self._decide(due, write_failed)
        else:
            decision = None
        if exploring_done:  # back to the model in use after one exploration step
            self._exploring, self._plan_cost = False, self.config.cost
        if decision is not None and self.memory is not None and self._memory_vec is not None:
            fitted = self.memory.adopt(self.config.memory_model, self._memory_vec)
            if fitted is not None:
                self.config = dataclasses.replace(self.config, memory_model=fitted)
                logger.info("memory calibration: model v%d adopted (%s)", self.memory.version, fitted.coef.to_dict())
        if decision is not None:
            self.window.mark()  # every rank alike: the next refit is judged on the rounds after this one
            self.last, self.r2 = decision, decision.r2
            if decision.adopt and decision.candidate is not None and decision.candidate != self.config.cost:
                self.config = dataclasses.replace(self.config, cost=decision.candidate)
                self._plan_cost = decision.candidate
                self.version += 1
                logger.info("auto-calibration: cost model v%d adopted (held-out error %.3g -> %.3g, R2 %.3f)",
                            self.version, decision.error_old, decision.error_new, decision.r2)
            else:
                logger.info("auto-calibration: kept cost model v%d (%s; held-out error %.3g, candidate's %.3g)",
                            self.version, decision.reason, decision.error_old, decision.error_new)
            if decision.explore:
                self._exploring, self._plan_cost = True, explore_model(self.config.cost, self.window)
                logger.info("auto-calibration: no single-rank group in the window; the next step explores")
        stats = plan.stats
        out = {
            "hdp/predicted_over_measured": predicted / measured if measured > 0 else math.nan,
            "hdp/idle_fraction_measured": idle,
            "hdp/round_time_max": float(per_rank.max()) if per_rank.size else 0.0,
            "hdp/max_tokens_per_rank": float(stats.max_tokens_per_rank) if stats else math.nan,
            "hdp/mean_tokens_per_rank": float(stats.tokens_per_rank.mean()) if stats and stats.tokens_per_rank.size
            else math.nan,
        }
        if self.settings.enabled:
            out.update({"hdp/cost_model_version": self.version, "hdp/cost_fit_r2": self.r2})
        if self.records_path is not None:
            out["hdp/records_write_failed"] = write_failed
        out.update(mem_out)
        if phases is not None:
            out.update(PhaseTimer.metrics(slowest.tolist()))
        return out

    def _observe_memory(self, plan: Plan, peaks: np.ndarray, static: np.ndarray, dom: np.ndarray, stage: np.ndarray,
                        step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Memory records of the step, the prediction they are judged against, tightening at once, metrics."""
        mm = self.config.memory_model
        out: dict[str, Any] = {}
        if mm is None:
            return out, []
        limit = self.config.memory_limit
        out["hdp/token_budget"] = float(plan.max_tokens_per_rank)
        if limit is not None:
            out["hdp/memory_limit_gb"] = limit / GB
        mem = plan.stats.memory if plan.stats is not None and plan.stats.memory else None
        if mem is not None:
            out["hdp/memory_predicted_gb"] = mem["peak_bytes"] / GB
        if self.memory is None or not np.isfinite(peaks).any():
            return out, []
        held = float(np.nanmax(static)) if np.isfinite(static).any() else math.nan
        if math.isfinite(held) and (mm.measured_static is None or held > mm.measured_static * (1 + STATIC_SLACK)):
            # the static bytes as measured (the most any rank holds) replace the formula's, alike on every rank
            mm = dataclasses.replace(mm, measured_static=held)
            self.config = dataclasses.replace(self.config, memory_model=mm)
        recs = self.memory.records_of(plan, mm, peaks, static, dom, stage, step)
        measured = float(np.nanmax(peaks))
        out["hdp/memory_peak_gb"] = measured / GB
        if recs:
            pred = [self.memory.predicted(mm, r) for r in recs]
            out["hdp/memory_over_predicted"] = max(r["peak_bytes"] / p for r, p in zip(recs, pred))
            self.memory.records.extend(recs)
            # planning to a limit: tightened at once, alike on every rank (the same gathered table); without
            # one the model only predicts, and is refit with the cost model
            tighter = self.memory.tighten(mm, recs) if limit is not None else None
            if tighter is not None:
                self.config = dataclasses.replace(self.config, memory_model=tighter)
                logger.info("memory: a measured peak exceeded the prediction by x%.3f; model v%d tightened",
                            self.memory.last_ratio, self.memory.version)
        out["hdp/memory_model_version"] = float(self.memory.version)
        return out, recs

    def _gather(self, plan: Plan, round_seconds: Sequence[float], extra: Sequence[float]) -> np.ndarray:
        """[W, R + E + 2]: every rank's seconds per round, ``extra`` (its peak bytes per round and static
        bytes, NaN where not measured, then its seconds per phase), its domain rank and stage (one all-gather
        over the job)."""
        mine = np.asarray(list(round_seconds), dtype=np.float64)
        if mine.shape != (plan.num_rounds,):
            mine = np.full(plan.num_rounds, math.nan)  # a caller bug must not change the collective's size
        row = np.concatenate([mine, np.asarray(extra, dtype=np.float64),
                              [float(self.groups.domain.domain_rank), float(self.groups.pp_rank)]])
        local = torch.from_numpy(row).to(self.device)  # [R + E + 2]
        table = [torch.empty_like(local) for _ in range(self.groups.world_size)]  # W x [R + E + 2]
        dist.all_gather(table, local, group=self.groups.world)
        return torch.stack(table).cpu().numpy()

    def _decide(self, due: bool, write_failed: float) -> tuple[Refit | None, float]:
        """World rank 0 refits (when due) and broadcasts [write failed, decided, decision...] (fixed size)."""
        base = 2 + Refit.VECTOR_SIZE + len(PARAMETERS)
        vec = np.zeros(base + 1 + len(COEF_NAMES), dtype=np.float64)  # + the memory refit
        if self.groups.world_rank == 0:
            vec[0] = write_failed
            if due:
                vec[1] = 1.0
                if self.memory is not None and self.config.memory_model is not None:
                    vec[base:] = self.memory.refit(self.config.memory_model)
                try:
                    vec[2:base] = refit(self.window, self.config.cost, self.settings).to_vector(self.config.cost)
                except Exception as exc:  # noqa: BLE001 - rank 0 must still broadcast, or the job hangs
                    logger.warning("auto-calibration: refit raised %s: %s; keeping the current cost model",
                                   type(exc).__name__, exc)
                    vec[2:base] = Refit(candidate=None, adopt=False, error_new=math.nan, error_old=math.nan,
                                    r2=math.nan, reason=f"refit raised {type(exc).__name__}").to_vector(self.config.cost)
        buf = torch.from_numpy(vec).to(self.device)
        src = dist.get_global_rank(self.groups.world, 0)
        dist.broadcast(buf, src=src, group=self.groups.world)
        got = buf.cpu().numpy()
        self._memory_vec = got[base:] if got[1] > 0 else None
        return (Refit.from_vector(got[2:base]) if got[1] > 0 else None), float(got[0])

    def _write(self, plan: Plan, times: np.ndarray, dom: np.ndarray, stage: np.ndarray, step: int,
               memory_records: Sequence[dict[str, Any]] = ()) -> bool:
        """Append this step's timing and memory records and its sample lengths (`lengths_path`) (world rank 0); False
        (logged) when a write failed."""
        pp = self.groups.pp_size
        nodes = Nodes.of(plan.node_of, plan.num_ranks)
        lines = []
        for rnd in plan.rounds:
            groups = []
            for g in rnd.groups:
                sel = (dom >= g.start) & (dom < g.start + g.size)
                per_stage = [float(times[sel & (stage == s), rnd.index].max()) for s in range(pp)]
                span = {} if nodes is None else {"nodes": int(nodes.spans(g.start, g.size))}
                rec = {"kind": "group", "lengths": list(g.lengths), "group_size": g.size, "seconds": max(per_stage), **span}
                lines.append({**rec, "step": step, "round": rnd.index, "policy": plan.policy,
                              "pp": pp, "tp": self.groups.tp_size, "stage_seconds": per_stage})
                groups.append({"lengths": list(g.lengths), "group_size": g.size, **span})
            per_stage = [float(times[stage == s, rnd.index].max()) for s in range(pp)]
            lines.append({"kind": "round", "seconds": max(per_stage), "groups": groups, "step": step,
                          "round": rnd.index, "policy": plan.policy, "pp": pp, "tp": self.groups.tp_size,
                          "stage_seconds": per_stage})
        lines.extend(memory_records)
        text = "".join(json.dumps(rec) + "\n" for rec in lines)
        batch = {"step": int(step), "policy": str(plan.policy), "num_ranks": int(plan.num_ranks),
                 "max_tokens_per_rank": int(plan.max_tokens_per_rank), "lengths": plan.lengths.tolist(),
                 "checksum": plan.checksum()}
        try:
            assert self.records_path is not None
            self.records_path.parent.mkdir(parents=True, exist_ok=True)
            with self.records_path.open("a") as fh:
                fh.write(text)
            with lengths_path(self.records_path).open("a") as fh:
                fh.write(json.dumps(batch) + "\n")
            return True
        except (OSError, ValueError) as exc:  # a full disk, a read-only path: never fail the step
            logger.warning("calibration records: writing %s failed at step %d (%s); the step itself is fine",
                           self.records_path, step, exc)
            return False
