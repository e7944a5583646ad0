"""The hdp training engine: a Megatron-core GPT trained under HDP plans, for any trainer.

    engine = HdpEngine.build(EngineConfig(...), dist.group.WORLD)  # in every rank of the job
    metrics = engine.train_step(batch, loss_fn)             # plan, run all rounds, one optimizer step
    out = engine.forward(batch)                             # per-token log-probs/entropies, caller order
    engine.save_checkpoint(path); engine.load_checkpoint(path)
    engine.close()                                          # releases every group, thread and hold it made

Layout (``EngineConfig.parallel``): world = TP × PP × N.  The **domain** is the N ranks of one
(TP rank, PP stage) position; hdp plans over N.  Every TP rank and every pipeline stage of a
domain rank runs the same plan: under PP each round is one micro-batch of Megatron's pipeline
schedule (1F1B, or interleaved with virtual stages), under TP each domain rank's micro-batch is
split over its TP group by Megatron (sequence parallel), and hdp's CP rings / all-gathers connect
the domain ranks of the same TP rank and stage.

A step is the one step sequence both doors run (:mod:`hdp.core.step` on the round core,
:mod:`hdp.core.rounds`): agree on the call, validation, plan checksum and batch digest; every round
through Megatron's schedule; one all-reduce of the loss and its non-finite flags; the optimizer step or
an agreed skip; calibration records and auto-calibration (:mod:`hdp.core.planning`).  What is this
engine's own: the :class:`Batch` it takes, its validation, the per-token loss weights of the
configured aggregation (:mod:`hdp.loss`: Σ over the domain of Σ_t w_t ℓ_t is the exact
single-process loss), its loss adapter (``loss_fn`` on each round's local tokens), the outputs of
:meth:`HdpEngine.forward` and checkpoints (:mod:`hdp.core.checkpoint`).

Errors (docs/design.md, "Failure contract").  Whatever fails on one rank fails on every rank of the job,
before the next collective and with nothing applied: every public call that communicates starts with
one fixed-size agreement over the job carrying the call's name and arguments, its validation and
planning outcome (errors of any type, ``BaseException`` included), the plan checksum and the batch
digest — a rank that calls something else is named on every rank (:class:`CallMismatchError`); a
``loss_fn`` failure is recorded where it happens, the rounds go on with a zero loss so the collectives
line up, and the step guard raises it everywhere after the reduce; a NaN/inf loss, or a NaN/inf
gradient on any rank (checked on the device and carried by the step's one reduce), skips the update
everywhere and raises :class:`NonFiniteLossError` (:class:`NonFiniteGradientError`), and a run of
``PlanningConfig.max_consecutive_skips`` such skips raises :class:`SkippedUpdatesError`.  A phase that breaks
off inside its collectives (a peer died or hangs: ``PlanningConfig.collective_timeout_s``) raises
:class:`~hdp.guard.DomainUnreachableError` and leaves the engine refusing further calls.

The engine's own parts live beside it: the batch, its validation, target alignment and the loss adapter
(:mod:`hdp.trainer.batch`), Megatron's parallel state shared by the engines of a process
(:mod:`hdp.trainer.shared_megatron`), checkpoints (:mod:`hdp.trainer.checkpointer`), and how a call is
described to its agreement (:mod:`hdp.trainer.calls`).  The step stack is built by
:func:`hdp.core.stack.build_steps`, as verl's engine builds it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from hdp import device as _device
from hdp import megatron_compat as mc
from hdp.checksum import CallMismatchError
from hdp.core.agreement import agree_fields
from hdp.core.optim_state import CheckpointFormat
from hdp.core.planning import DomainPlanner, launcher_ranks_per_node, launcher_topology
from hdp.core.rounds import NonFiniteGradientError, NonFiniteLossError, RoundCore
from hdp.core.stack import StackParts, build_steps
from hdp.core.step import Pass, Prepared, SkippedUpdatesError
from hdp.digest import batch_digest
from hdp.dispatch import gather_outputs
from hdp.groups import DomainGroups, GroupLedger, LayoutGroups, copy_of_group
from hdp.moe.levels import ZeroMemoryLevel
from hdp.moe.zero_memory import apply_zero_memory
from hdp.packing import Plan, simulate
from hdp.trainer.batch import (Batch, ForwardOutput, LocalTensors, LossAdapter, LossFn, check_given_plan, nll_loss,
                               shifted_inputs, validate_batch)
from hdp.trainer.calls import BUILD_TOPICS, callable_name, compared_fields
from hdp.trainer.checkpointer import Checkpointer
from hdp.trainer.config import EngineConfig
from hdp.trainer.model import build_model_chunks, build_optimizer, global_param_name, init_parameters, wrap_ddp
from hdp.trainer.shared_megatron import SharedMegatron

__all__ = [
    "Batch",
    "LocalTensors",
    "LossFn",
    "ForwardOutput",
    "NonFiniteLossError",
    "NonFiniteGradientError",
    "SkippedUpdatesError",
    "CallMismatchError",
    "EngineClosedError",
    "CheckpointFormat",
    "HdpEngine",
    "nll_loss",
    "global_param_name",
]

logger = logging.getLogger(__name__)


class EngineClosedError(RuntimeError):
    """A call on an engine that was closed (:meth:`HdpEngine.close`, or released after a phase broke off)."""


class HdpEngine:
    """A Megatron GPT with DDP and the distributed optimizer, trained under HDP plans.

    Build it with :meth:`build` in every rank of the job (after ``init_process_group``).
    Attributes: ``groups`` (:class:`hdp.groups.LayoutGroups`, every process group by name),
    ``rank`` / ``num_ranks`` (this rank's domain rank and N), ``model_chunks`` (the DDP-wrapped
    model chunks of this rank: one, or ``virtual_pp``), ``optimizer`` (Megatron's distributed optimizer),
    ``planner`` (the :class:`~hdp.core.planning.DomainPlanner`: options, the cost model in use,
    calibration state), ``core`` (the :class:`~hdp.core.rounds.RoundCore`), ``round_seconds`` (this
    rank's measured seconds per round of the last training step).  After :meth:`close` every method and
    these attributes raise :class:`EngineClosedError`.

    Several engines in one process (an actor and a critic) share Megatron's parallel state, which
    megatron-core keeps once per process: they must have the same layout (``EngineConfig.parallel``; a
    build with another layout while one is open raises ``ValueError`` naming both and the fix), each holds
    its own model, optimizer, agreement group and CP groups (closing or losing one leaves the others
    working), and the last one closed destroys the parallel state.
    """

    def __init__(self, config: EngineConfig, groups: LayoutGroups, runtime: mc.MegatronRuntime,
                 model_chunks: Sequence[Any], optimizer: Any, device: torch.device,
                 ledger: GroupLedger | None = None, shared: SharedMegatron | None = None) -> None:
        self.config = config
        self._groups = groups
        self._runtime = runtime
        self._chunks = list(model_chunks)
        self._optimizer = optimizer
        self.device = device
        self.rank = groups.domain.domain_rank
        self.num_ranks = groups.domain.size
        self._closed = False
        self._ledger = ledger  # the groups close() destroys (build() makes it)
        self._shared = shared  # Megatron's parallel state, held while the engine is open
        self.memory_model, self.memory_limit = config.memory_setup(device, self.num_ranks)
        """The job's per-rank memory model and the bytes per device the plans stay within (``None``: the
        token budget only)."""
        self._steps = build_steps(config.planning, StackParts(
            groups=groups, megatron_groups=runtime.groups, chunks=self._chunks, optimizer=optimizer, device=device,
            shape=config.model.shape, pad_token_id=config.pad_token_id, memory_model=self.memory_model,
            memory_limit=self.memory_limit, abort_groups=self._groups_to_abort, on_broken=self.close,
            fused_logprobs=config.uses_fused_logprobs, records_role="engine"), loss_name="loss_fn")
        self._core, self._planner = self._steps.core, self._steps.planner
        self._checkpointer = Checkpointer(self)

    def _groups_to_abort(self) -> set[dist.ProcessGroup]:
        """The groups a failure inside a phase aborts: the engine's own, and Megatron's while no other engine
        of the process holds them."""
        own = self._ledger.created() if self._ledger is not None else set()
        shared = self._shared
        return own | (shared.ledger.created() if shared is not None and shared.holders == 1 else set())

    # -- public attributes (refused once closed) --

    @property
    def step(self) -> int:
        """Training steps that passed their agreement (non-finite ones included; a checkpoint restores it)."""
        return self._steps.step

    @step.setter
    def step(self, value: int) -> None:
        self._steps.step = int(value)

    @property
    def round_seconds(self) -> list[float]:
        """This rank's measured seconds per round of the last training step."""
        return self._steps.round_seconds

    @property
    def core(self) -> RoundCore:
        """The round core (:class:`~hdp.core.rounds.RoundCore`)."""
        self._open("core")
        return self._core

    @property
    def groups(self) -> LayoutGroups:
        """Every process group of the engine by name (:class:`hdp.groups.LayoutGroups`)."""
        self._open("groups")
        return self._groups

    @property
    def model_chunks(self) -> list[Any]:
        """The DDP-wrapped model chunks of this rank (one, or ``virtual_pp``)."""
        self._open("model_chunks")
        return self._chunks

    @property
    def optimizer(self) -> Any:
        """Megatron's distributed optimizer over the model chunks."""
        self._open("optimizer")
        return self._optimizer

    @property
    def planner(self) -> DomainPlanner:
        """The :class:`~hdp.core.planning.DomainPlanner` (options, cost model, calibration state)."""
        self._open("planner")
        return self._planner

    @property
    def runtime(self) -> mc.MegatronRuntime:
        """Megatron's runtime (explicit groups, CPU-shim hold), shared by the engines of this process."""
        self._open("runtime")
        return self._runtime

    @property
    def model(self) -> Any:
        """The DDP-wrapped model of this rank (one chunk; with virtual stages use ``model_chunks``)."""
        self._open("model")
        if len(self._chunks) != 1:
            raise ValueError(
                f"HdpEngine.model: this rank holds {len(self._chunks)} model chunks (virtual_pp); "
                "use engine.model_chunks"
            )
        return self._chunks[0]

    # -- construction --

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        world_group: dist.ProcessGroup,
        *,
        init_fn: Callable[[str, torch.Tensor], None] | None = None,
    ) -> "HdpEngine":
        """Initialise Megatron with the job's layout, build the model chunks, DDP and the optimizer.

        ``world_group``: the process group of the whole job (TP × PP × domain ranks), named
        explicitly — ``dist.group.WORLD`` (Megatron's parallel state spans the world).  The layout
        (``config.parallel``) is checked against the world and the model first, on every rank and
        before any collective; then one small all-reduce compares a digest of ``config`` and of the
        launcher's topology variables (``RAY_LOCAL_WORLD_SIZE``, ``LOCAL_WORLD_SIZE``:
        `hdp.core.planning.launcher_topology`) over the job (before Megatron is initialised): a config
        or a variable that differs between ranks raises ``ValueError`` on every rank naming the first field
        that differs and its value on each rank (the device is compared by its kind only), and a variable
        bad on every rank alike (not an integer in [1, 65536]) raises on every rank naming it.  ``init_fn(name, full)``, if given, fills each parameter before DDP
        wraps it: ``name`` is the parameter's name in a one-process model (global layer and expert
        indices) and ``full`` its whole, unsharded tensor (this rank keeps its TP shard), so a
        rank-independent function gives the same model for every TP / PP / EP layout.

        Another engine open in this process: this one shares its Megatron parallel state (see the class
        docstring); with another layout the build raises ``ValueError`` naming both and the fix (close the
        open engine first), before any collective.
        """
        if not dist.is_initialized():
            raise ValueError("HdpEngine.build: torch.distributed is not initialised; call init_process_group first")
        if not isinstance(config, EngineConfig):
            raise ValueError(f"config={config!r}: pass a hdp.trainer.config.EngineConfig")
        if not isinstance(world_group, dist.ProcessGroup):
            raise ValueError(
                f"world_group={world_group!r}: pass the job's process group explicitly (dist.group.WORLD)"
            )
        world = dist.get_world_size()
        if dist.get_world_size(world_group) != world:
            raise ValueError(
                f"world_group has {dist.get_world_size(world_group)} ranks but the world has {world}: Megatron's "
                "parallel state spans the whole world, so pass dist.group.WORLD"
            )
        par = config.parallel
        par.check_world(world)  # pure: the same ValueError on every rank, before any collective
        device = _device.select_device(config.device)
        config.memory_setup(device, world // (par.tp * par.pp))  # a limit below the static memory: ValueError
        layout = {"world": world, "tp": par.tp, "pp": par.pp, "virtual_pp": par.vpp, "ep": par.ep,
                  "expert_tp": par.expert_tp}
        SharedMegatron.check(layout)  # another open engine with another layout: ValueError, before any collective
        fields = {**compared_fields(config), **launcher_topology()}  # the config and the launcher's ranks per node
        timeout_s = float(config.planning.collective_timeout_s)
        ledger = GroupLedger()  # every group made from here on is this engine's: close() destroys them
        shared: SharedMegatron | None = None
        try:
            job = RoundCore.job_group(world, timeout_s)  # the engine's agreement group, bounded timeout
            agree_fields(fields, job, torch.device("cpu") if "gloo" in str(dist.get_backend(job)) else device,
                         where="HdpEngine.build", topics=BUILD_TOPICS)
            try:  # agreed above: a bad value raises on every rank alike, before Megatron
                launcher_ranks_per_node()
            except ValueError as exc:
                raise ValueError(f"HdpEngine.build: {exc} (nothing was built)") from None
            shared = SharedMegatron.acquire(layout, config.seed, lambda: mc.initialize_megatron(
                device=device,
                tensor_model_parallel_size=par.tp,
                pipeline_model_parallel_size=par.pp,
                virtual_pipeline_model_parallel_size=par.virtual_pp if par.vpp > 1 else None,
                expert_model_parallel_size=par.ep,
                expert_tensor_parallel_size=par.expert_tp,
                seed=config.seed,
                collective_timeout_s=timeout_s,
            ))
            runtime = shared.runtime
        except BaseException:
            if shared is not None:
                shared.release()
            ledger.release()
            raise
        try:
            pgc = runtime.groups
            torch.manual_seed(config.seed)  # identical initial weights on every rank of a domain
            chunks = build_model_chunks(config.model, device, groups=pgc, parallel=par)
            if init_fn is not None:
                per_rank = (config.model.num_moe_experts or 0) // par.ep
                for chunk in chunks:
                    init_parameters(chunk, init_fn, tp_rank=pgc.tp.rank(), tp_size=pgc.tp.size(),
                                    ep_rank=pgc.ep.rank(), experts_per_rank=per_rank)
            opts = config.planning
            if opts.zero_memory is not ZeroMemoryLevel.NONE:
                # MoE layers become ZeroMemoryMoELayer (same parameters and names) before DDP wraps them
                for chunk in chunks:
                    apply_zero_memory(chunk, opts.zero_memory, opts.zero_memory_num_layers)
            ddp = [wrap_ddp(c, config.optim, groups=pgc, chunk=i) for i, c in enumerate(chunks)]
            for d in ddp:
                d.broadcast_params()  # replicas start identical even if the init was rank-dependent
            optimizer = build_optimizer(ddp, config.optim, groups=pgc)
            # hdp's rings and CP collectives run on a domain group of the engine's own where an abort does not
            # end a blocked collective (gloo): a rank that fails frees it, releasing the peers blocked there,
            # without freeing Megatron's data-parallel group, which other engines of the process may hold
            own = pgc.dp if _device.abort_ends_collectives(pgc.dp) else copy_of_group(pgc.dp, job, timeout_s)
            groups = LayoutGroups(world=job, domain=DomainGroups.build(own, timeout_s=timeout_s), tp=pgc.tp,
                                  pp=pgc.pp, ep=pgc.ep)
            ledger.seal(exclude=shared.ledger.created())  # this engine's groups; Megatron's are the shared state's
            engine = cls(config, groups, runtime, ddp, optimizer, device, ledger, shared)  # the stack: one all-reduce
        except BaseException:
            shared.release()
            ledger.release()
            raise
        logger.info("hdp engine: world %d = TP %d x PP %d (x%d virtual) x domain %d, EP %d, device %s",
                    world, par.tp, par.pp, par.vpp, groups.domain.size, par.ep, device)
        return engine

    def close(self) -> None:
        """Release everything the engine made (idempotent): its process groups (with their transport
        threads), the plan-ahead thread, and its hold on Megatron's parallel state — the last engine of the
        process to close destroys that state, Megatron's groups, the CPU-shim hold and the helper process of
        Megatron's checkpoint writer.  Other engines of the process keep working.  Every later call on the
        engine, and its ``model`` / ``model_chunks`` / ``optimizer`` / ``groups`` / ``planner`` / ``core``,
        raise :class:`EngineClosedError`."""
        if self._closed:
            return
        self._closed = True
        self._steps.close()  # the plan-ahead thread, the core's watcher and hooks, every reference to the groups
        for chunk in self._chunks:
            mc.release_ddp(chunk)
        if self._shared is not None:
            self._shared.release()
        if self._ledger is not None:
            self._ledger.release()
        # the model, the optimizer and the group handles go now, not when the caller drops the
        # engine: a destroyed group's transport threads live as long as a reference to it does
        self._chunks = []
        for name in ("_optimizer", "_runtime", "_groups", "_planner", "_ledger", "_shared"):
            setattr(self, name, None)

    def _open(self, what: str) -> None:
        """Raise :class:`EngineClosedError` (no collective) once the engine is closed: after :meth:`close`,
        or after a phase broke off (its groups were released then; the message says where)."""
        if not self._closed:
            return
        broken = self._core.broken
        if broken is not None:
            raise EngineClosedError(
                f"HdpEngine.{what}: this engine is unusable since {broken}; its process groups were released. "
                "Restart the job (or rebuild the engine in a fresh process group) and load the last checkpoint")
        raise EngineClosedError(f"HdpEngine.{what}: the engine is closed (close() released its process groups); "
                                "build a new engine")

    def _usable(self, what: str) -> None:
        self._open(what)
        self._core.usable(f"HdpEngine.{what}")  # broke off in a phase (its groups were released then)


    # -- validation and planning --

    def _validate(self, batch: Batch) -> None:
        """Raise ``ValueError``/``TypeError`` naming the field, the value and the fix (pure;
        `hdp.trainer.batch.validate_batch`)."""
        validate_batch(batch, num_ranks=self.num_ranks, max_tokens_per_rank=self.config.planning.max_tokens_per_rank,
                       max_sequence_length=self.config.model.max_sequence_length,
                       vocab_size=self.config.model.vocab_size)

    def plan(self, batch: Batch) -> Plan:
        """The plan of ``batch`` on this domain (pure; the same on every rank of the job)."""
        self._usable("plan")
        self._validate(batch)
        return self.planner.plan(batch.lengths)


    def _prepare(self, batch: Batch, given: Plan | None, loss_fn: LossFn | None,
                 check: Callable[[], None] | None = None) -> Callable[[], Prepared]:
        """This door's part of a pass, run inside its agreement (every rank raises alike): ``check`` (the
        call's own arguments), validation, the plan (made ahead or in line, or ``given``, checked), the
        per-sample tensors shifted to target alignment and the loss adapter (``loss_fn``; ``None``: a
        forward pass that keeps the log-probs and entropies)."""

        def prepare() -> Prepared:
            if check is not None:
                check()
            self._validate(batch)
            t0 = time.perf_counter()
            if given is None:  # planned ahead (train_steps / plan_ahead) or in line
                taken = self.planner.take(batch.lengths)
                plan, ms, exposed = taken.plan, taken.planner_ms, taken.exposed_ms
            else:
                check_given_plan(given, batch, self.num_ranks)
                plan = given if given.stats is not None else given.with_stats(simulate(given, self.planner.cost, 0.0))
                exposed = (time.perf_counter() - t0) * 1e3
                ms = exposed if given.stats is None else given.stats.planner_ms
            inputs = shifted_inputs(batch, pad_token_id=self.config.pad_token_id,
                                    aggregation=self.config.loss_aggregation,
                                    loss_scale_factor=self.config.loss_scale_factor)
            return Prepared(plan, batch_digest(batch.tokens, batch.loss_mask, batch.extras), inputs.tokens,
                            LossAdapter(inputs, loss_fn, self.groups.tp, self.device), ms, exposed)

        return prepare

    # -- public steps --

    def train_step(self, batch: Batch, loss_fn: LossFn = nll_loss, *, plan: Plan | None = None) -> dict[str, Any]:
        """Plan ``batch`` (or use ``plan``), run every round with backward, and take one optimizer step.

        Returns metrics with stable names (``loss``, ``grad_norm``, ``perf/...``, ``hdp/...``).
        Raises on every rank of the job, with nothing applied: ``ValueError``/``TypeError`` for bad
        input (nothing run; the failed rank's own error, the others naming it; ``loss_fn`` not callable
        included), :class:`~hdp.checksum.CallMismatchError` when another rank made another call or passed
        other arguments, :class:`~hdp.guard.DomainStepError` for any other error of validation or of
        ``loss_fn`` (raising, returning ``None``, a non-scalar or a tensor without grad) on any rank, and
        :class:`NonFiniteLossError` when a loss is NaN/inf or — :class:`NonFiniteGradientError`, a
        subclass — when the loss is finite but a gradient is NaN/inf on any rank (detected in the step's one
        reduce, before the update); :class:`~hdp.core.step.SkippedUpdatesError` instead when that skip is
        the ``PlanningConfig.max_consecutive_skips``-th in a row (it names the first one's cause).  Ctrl-C during validation: every other rank raises naming this one,
        this one raises its ``KeyboardInterrupt``, and the engine stays usable on every rank (a trainer may
        then save a checkpoint on every rank).  A rank that dies or hangs mid-step makes
        the others raise :class:`~hdp.guard.DomainUnreachableError` within
        ``PlanningConfig.collective_timeout_s``.
        """
        return self._train_step(batch, loss_fn, plan, "train_step")

    def _train_step(self, batch: Batch, loss_fn: LossFn, plan: Plan | None, name: str) -> dict[str, Any]:
        t_start = time.perf_counter()

        def check_loss_fn() -> None:
            if not callable(loss_fn):
                raise TypeError(
                    f"{name}(loss_fn={loss_fn!r}): pass a callable loss_fn(local, logprobs, weights) -> scalar tensor "
                    "(hdp.trainer.engine.nll_loss for supervised fine-tuning); a forward pass without a loss is "
                    "engine.forward(batch)"
                )

        call = (f"{name}(step={self.step + 1}, loss_fn={callable_name(loss_fn)}, "
                f"plan={'given' if plan is not None else 'None'})")
        what = name.split("[", 1)[0]
        self._usable(what)
        done = self._steps.train_batch(what, call, self._prepare(batch, plan, loss_fn, check_loss_fn))
        assert done.outcome is not None
        if done.outcome.skipped is not None:  # skipped on every rank: nothing applied
            raise done.outcome.skipped
        return {**self._metrics(done, time.perf_counter() - t_start), **done.outcome.calibration}

    def plan_ahead(self, batches: Sequence[Batch]) -> None:
        """Announce the next mini-batches (in the order ``train_step`` will get them): each one's plan is
        made on a background thread while the one before it trains (`hdp.core.plan_ahead`; the
        same plans as in line).  ``hdp/planner_ms_exposed`` then reports what a step still waited.  Local
        (no collective): the plans are agreed by the steps that use them."""
        self._usable("plan_ahead")
        self.planner.announce([b.lengths for b in batches])

    def train_steps(self, batches: Sequence[Batch], loss_fn: LossFn = nll_loss) -> list[dict[str, Any]]:
        """One :meth:`train_step` (one optimizer step) per mini-batch, each planned while the one before
        it runs (:meth:`plan_ahead`); returns each step's metrics.  Errors as :meth:`train_step`; each
        step's agreement carries ``train_steps[i/n]``, so a rank that passed another number of batches (or
        called ``train_step`` instead) is named at the first step."""
        self._usable("train_steps")
        batches = list(batches)
        self.plan_ahead(batches)
        n = len(batches)
        return [self._train_step(b, loss_fn, None, f"train_steps[{i + 1}/{n}]") for i, b in enumerate(batches)]

    @torch.no_grad()
    def forward(self, batch: Batch, *, plan: Plan | None = None) -> ForwardOutput:
        """Per-token log-probs and entropies of ``batch`` (no grad), in the caller's sample order.

        Computed on the last pipeline stage and sent to every stage, so every rank of the job
        returns the same outputs.
        """
        self._usable("forward")
        call = f"forward(step={self.step}, plan={'given' if plan is not None else 'None'})"
        done = self._steps.infer_batch("forward", call, self._prepare(batch, plan, None), label="forward")
        with self.core.collectives("forward", self.step):
            return self._forward_outputs(done.plan, done.adapter.outputs)

    def _forward_outputs(self, plan: Plan, outputs: Mapping[int, torch.Tensor]) -> ForwardOutput:
        lengths = plan.lengths.tolist()
        flat = torch.empty((int(sum(lengths)), 2), dtype=torch.float32, device=self.core.collective_device)
        if self.groups.is_last_stage:
            none = torch.zeros((0, 2), dtype=torch.float32, device=self.device)
            outs = [outputs.get(r, none) for r in range(plan.num_rounds)]
            full = gather_outputs(plan, self.rank, outs, self.groups.domain.domain, dst="all")  # S x [L_i, 2]
            assert full is not None
            flat.copy_(torch.cat(full).to(flat.device))
        if self.groups.pp_size > 1:
            dist.broadcast(flat, src=self.groups.last_stage_global_rank, group=self.groups.pp)
        full = torch.split(flat.to(self.device), lengths)
        # input position p predicts token p+1: shift right to index by the predicted token
        lps = [torch.cat([x.new_zeros(1), x[:-1, 0]]) for x in full]
        ents = [torch.cat([x.new_zeros(1), x[:-1, 1]]) for x in full]
        return ForwardOutput(logprobs=lps, entropies=ents)

    def _metrics(self, done: Pass, step_s: float) -> dict[str, Any]:
        assert done.outcome is not None
        plan = done.plan
        stats = plan.stats
        tokens = int(plan.lengths.sum())
        return {
            "loss": done.loss,
            "grad_norm": done.outcome.grad_norm,
            "perf/step_time": step_s,
            "perf/throughput": tokens / max(step_s, 1e-12) / self.groups.world_size,
            "perf/tokens": tokens,
            "perf/round_time_max": max(done.round_seconds, default=0.0),
            **done.metrics(),
            "hdp/microbatches": done.state.num_microbatches,
            "hdp/idle_ratio_max": float(stats.max_idle_ratio) if stats else float("nan"),
            "hdp/step": self.step,
        }
    # -- state --

    def state_dict(self) -> dict[str, Any]:
        """This rank's model parameters (its chunks; local experts only under EP) and the step counter."""
        self._usable("state_dict")
        if len(self.model_chunks) == 1:
            return {"model": self.model_chunks[0].module.state_dict(), "step": self.step}
        return {**{f"model{i}": c.module.state_dict() for i, c in enumerate(self.model_chunks)}, "step": self.step}


    def save_checkpoint(self, path: str | os.PathLike[str], *, format: CheckpointFormat | str = "auto") -> None:
        """Save model, optimizer and step counter into the directory ``path`` (collective over the job):
        atomic and verified, ``dist`` / ``per-rank`` / ``auto`` (:meth:`hdp.trainer.checkpointer.Checkpointer.save`).
        Any error on any rank raises on every rank and leaves the previous checkpoint as it was."""
        self._usable("save_checkpoint")
        self._checkpointer.save(path, format=format)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load what :meth:`save_checkpoint` wrote (collective); the next step continues bit for bit.  Checked
        before anything is touched (manifest, hashes, fit from metadata), restored on every rank when loading
        fails on any (:meth:`hdp.trainer.checkpointer.Checkpointer.load`)."""
        self._usable("load_checkpoint")
        self._checkpointer.load(path)
