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

A step is the one step sequence both doors run (:mod:`hdp.trainer.step` on the round core,
:mod:`hdp.trainer.rounds`): agree on the call, validation, plan checksum and batch digest; every round
through Megatron's schedule; one all-reduce of the loss and its non-finite flags; the optimizer step or
an agreed skip; calibration records and auto-calibration (:mod:`hdp.trainer.planning`).  What is this
engine's own: the :class:`Batch` it takes, its validation, the per-token loss weights of the
configured aggregation (:mod:`hdp.loss`: Σ over the domain of Σ_t w_t ℓ_t is the exact
single-process loss), its loss adapter (``loss_fn`` on each round's local tokens), the outputs of
:meth:`HdpEngine.forward` and checkpoints (:mod:`hdp.trainer.checkpoint`).

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

Token alignment.  Per-token tensors of a :class:`Batch` (loss mask, advantages, old log-probs)
are indexed like the tokens: element t describes token t.  Token t is *predicted* from the
tokens before it, so log p(token t) comes from the logits at position t-1.  hdp shifts every
per-token tensor by one per sample *before* the zigzag split (``x'[p] = x[p+1]``, last = 0) so that
all local tensors of a round line up with the local logits; the loss function therefore receives,
at local position p, the target token (``local.targets[p]``) and the caller's values for that
target.  Token 0 of a sample is never predicted (its mask is ignored, its log-prob is 0).

Legend: S samples, L_i sample length, T local tokens of one round (Tr real), V vocabulary,
Vl = V/TP, R rounds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from hdp import device as _device
from hdp import megatron_compat as mc
from hdp.checksum import CallMismatchError
from hdp.digest import batch_digest
from hdp.dispatch import gather_outputs, pack
from hdp.groups import DomainGroups, GroupLedger, LayoutGroups, copy_of_group
from hdp.fused_logprobs import FusedLogprobs, LastHidden, token_logprobs_entropy
from hdp.loss import sample_token_weights
from hdp.megatron_compat import dist_checkpointing
from hdp.moe.levels import ZeroMemoryLevel
from hdp.moe.zero_memory import apply_zero_memory
from hdp.packing import Plan, check_plan, simulate
from hdp.trainer import checkpoint as ckpt
from hdp.trainer.config import EngineConfig
from hdp.trainer.model import build_model_chunks, build_optimizer, global_param_name, init_parameters, wrap_ddp
from hdp.trainer.optim_state import (
    CheckpointFormat,
    checkpoint_format,
    dist_checkpoint_problem,
    ensure_optimizer_state,
    load_shard_state,
    optimizers,
    restore_adam_steps,
    shard_state,
    to_device,
    to_host,
)
from hdp.trainer.memory import MemoryCalibration, check_static_fits, engine_memory_model, resolve_memory_limit, static_bytes
from hdp.trainer.agreement import Topic, agree_fields
from hdp.trainer.planning import (RANKS_PER_NODE_KEYS, TOPOLOGY_FIX, DomainPlanner, launcher_ranks_per_node,
                                  launcher_topology)
from hdp.trainer.rounds import NonFiniteGradientError, NonFiniteLossError, RoundCore, RoundInput, next_token_targets
from hdp.trainer.step import Pass, Prepared, SkippedUpdatesError, Steps

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


# ---- data ------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Batch:
    """The global batch of one step, the same on every rank of the domain.

    ``tokens[i]`` is sample i ([L_i] integer ids).  ``loss_mask[i]`` ([L_i], bool or float) marks
    the tokens that count in the loss (``None``: all).  ``extras[name][i]`` ([L_i, ...]) are further
    per-token tensors (advantages, old log-probs, ...) that the loss function receives chunked like
    the tokens.  All per-token tensors are indexed like the tokens (see the module docstring).
    """

    tokens: Sequence[torch.Tensor]
    """One 1-D integer tensor [L_i] per sample."""
    loss_mask: Sequence[torch.Tensor] | None = None
    """One [L_i] mask per sample; ``None``: every token counts."""
    extras: Mapping[str, Sequence[torch.Tensor]] = field(default_factory=dict)
    """name -> one [L_i, ...] tensor per sample."""

    @property
    def lengths(self) -> list[int]:
        """L_i of every sample."""
        return [int(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() >= 1 else 0 for t in self.tokens]


@dataclass(frozen=True, eq=False)
class LocalTensors:
    """This rank's tokens of one round, as the loss function receives them (aligned to the *targets*)."""

    round_index: int
    """Round of the plan."""
    samples: tuple[int, ...]
    """Caller indices of the group's samples."""
    targets: torch.Tensor
    """[T] the token each local position predicts."""
    mask: torch.Tensor
    """[T] float loss mask of the targets."""
    extras: Mapping[str, torch.Tensor]
    """name -> [T, ...] the caller's per-token tensors of the targets."""
    sample_index: torch.Tensor
    """[T] caller index of each local token's sample."""
    target_position: torch.Tensor
    """[T] position of each target token inside its sample (1 .. L_i; L_i marks the padded last slot)."""
    output: torch.Tensor | LastHidden
    """The round's last-stage output (with grad): the logits [T, V/TP] (``EngineConfig.fused_logprobs=off``),
    or the final hidden states and the output layer's weight shard (`hdp.fused_logprobs.LastHidden`)."""
    tp_group: dist.ProcessGroup
    """The tensor-parallel group the logits are sharded over (a size-1 group without TP)."""
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def logits(self) -> torch.Tensor:
        """[T, V] logits (with grad).  Under tensor parallelism this is the TP rank's vocabulary shard
        [T, V/TP]: ``log_softmax(logits)`` is then only the shard's distribution.  For full-vocabulary
        quantities use :meth:`entropy` or :func:`hdp.fused_logprobs.token_logprobs_entropy` of ``output``
        with ``tp_group``.  On the fused path they are built here, once per round, when first read: [T, V/TP]
        and, in backward, their gradient — the memory that path saves otherwise."""
        if isinstance(self.output, torch.Tensor):
            return self.output
        if "logits" not in self._cache:
            self._cache["logits"] = self.output.logits()
        return self._cache["logits"]

    def entropy(self) -> torch.Tensor:
        """[T] entropy of the full-vocabulary next-token distribution at each local position,
        differentiable (an entropy bonus gets its gradient) and TP-aware (collective over ``tp_group``:
        call it on every TP rank alike).  Computed once per round (chunked, no [T, V] copy)."""
        if "entropy" not in self._cache:
            _, ent = token_logprobs_entropy(self.output, self.targets, self.tp_group, entropy=True)
            self._cache["entropy"] = ent
        return self._cache["entropy"]


class LossFn(Protocol):
    """``loss_fn(local, logprobs [T], weights [T]) -> scalar``.

    Must return Σ_t weights[t] · ℓ_t for the per-token loss ℓ it wants (``weights`` already hold the
    mask and the global normaliser of the configured aggregation), so that the sum over the
    domain is the exact loss of the whole batch.  ``logprobs`` [T] are full-vocabulary log-probs of
    the targets (with grad, TP-aware); an entropy bonus is ``-c * (weights * local.entropy()).sum()``.
    """

    def __call__(self, local: LocalTensors, logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...


def nll_loss(local: LocalTensors, logprobs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Supervised fine-tuning loss: Σ_t w_t · (−log p(target_t))."""
    del local
    return -(weights * logprobs).sum()


@dataclass(frozen=True, eq=False)
class ForwardOutput:
    """Per-token outputs of :meth:`HdpEngine.forward`, in the caller's sample order."""

    logprobs: list[torch.Tensor]
    """[L_i] float32: log p(token t | tokens before t); 0 at t = 0."""
    entropies: list[torch.Tensor]
    """[L_i] float32: entropy of the distribution that predicts token t; 0 at t = 0."""


# ---- per-step state --------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Inputs:
    """A validated batch's per-sample tensors, shifted to target alignment (what the loss adapter reads)."""

    tokens: list[torch.Tensor]  # S x [L_i] int64
    targets: list[torch.Tensor]  # S x [L_i] int64 (token p+1; pad at the end)
    mask: list[torch.Tensor]  # S x [L_i] float32 (mask of token p+1)
    weights: list[torch.Tensor]  # S x [L_i] float32 loss weights (target aligned)
    extras: dict[str, list[torch.Tensor]]  # name -> S x [L_i, ...] (target aligned)


def _shift(x: torch.Tensor) -> torch.Tensor:
    """[L, ...] -> [L, ...] with out[p] = x[p+1] and a zero last row (per-sample next-token alignment)."""
    return torch.cat([x[1:], torch.zeros_like(x[:1])])


class _LossAdapter:
    """The library engine's round loss: ``loss_fn`` on this rank's local tokens with hdp's weights; in a
    forward pass, the round's (log-prob, entropy) kept for :meth:`HdpEngine.forward`."""

    def __init__(self, prep: _Inputs, loss_fn: LossFn | None, tp_group: dist.ProcessGroup, device: torch.device):
        self.prep, self.loss_fn, self.tp, self.device = prep, loss_fn, tp_group, device
        self.outputs: dict[int, torch.Tensor] = {}  # forward: round -> [Tr, 2] (log-prob, entropy)

    def __call__(self, rnd: RoundInput, out: torch.Tensor | LastHidden) -> torch.Tensor | None:
        meta, prep, dev = rnd.meta, self.prep, self.device
        assert meta is not None
        targets = pack(meta, prep.targets).to(dev)  # [Tr]
        if self.loss_fn is None:  # forward
            lp, ent = token_logprobs_entropy(out, targets, self.tp, entropy=True)  # [Tr], [Tr]
            self.outputs[rnd.index] = torch.stack([lp.float(), ent.float()], dim=-1).detach()  # [Tr, 2]
            return None
        local = LocalTensors(
            round_index=meta.round_index, samples=meta.samples, targets=targets, mask=pack(meta, prep.mask).to(dev),
            extras={name: pack(meta, xs).to(dev) for name, xs in prep.extras.items()},
            sample_index=meta.sample_index.to(dev), target_position=(meta.position_ids + 1).to(dev),
            output=out, tp_group=self.tp,
        )
        # on the fused path the entropy comes with the log-probs (one pass over the products; its backward runs
        # only if the loss reads local.entropy()); on the logits path it is computed when asked for
        fused = isinstance(out, LastHidden)
        logprobs, ent = token_logprobs_entropy(out, targets, self.tp, entropy=fused)  # [Tr], [Tr] or None
        if ent is not None:
            local._cache["entropy"] = ent
        loss = self.loss_fn(local, logprobs, pack(meta, prep.weights).to(dev))
        if loss is None:  # would train on a zero loss (Adam's momentum still moves the parameters)
            raise TypeError(
                f"loss_fn returned None in round {meta.round_index} (samples {list(meta.samples)}); return a scalar "
                "tensor: Σ_t weights[t] · ℓ_t of the per-token loss ℓ (hdp.trainer.engine.nll_loss: "
                "-(weights * logprobs).sum())")
        return loss


# ---- the engine ------------------------------------------------------------------------------------


def _fused(config: EngineConfig) -> bool:
    """Whether the engine runs the fused log-prob path: ``auto`` and ``on`` (its Megatron GPT's output layer
    always allows it exactly: `hdp.megatron_compat.fused_head_problem`)."""
    return config.fused_logprobs is not FusedLogprobs.OFF


def _memory_setup(config: EngineConfig, device: torch.device, domain: int) -> tuple[Any, float | None]:
    """The job's memory model (`hdp.trainer.memory.engine_memory_model`) and the resolved limit in bytes;
    ValueError naming ``PlanningConfig.max_memory_gb`` when the limit is below the layout's static memory
    (pure: raised alike on every rank before any collective)."""
    par = config.parallel
    model = engine_memory_model(
        config.model.shape(), tp=par.tp, pp=par.pp, vpp=par.vpp, ep=par.ep, etp=par.expert_tp, domain=domain,
        recompute=config.model.recompute, zero_memory=config.planning.zero_memory.value,
        cp_algorithm=config.planning.cp_algorithm.value, param_bytes=4 if config.model.params_dtype == "float32" else 2,
        coef=config.planning.memory_coefficients, fused_logprobs=_fused(config))
    limit = resolve_memory_limit(config.planning.max_memory_gb, device)
    if limit is not None:
        check_static_fits(model, limit, "PlanningConfig.max_memory_gb")
    return model, limit



class EngineClosedError(RuntimeError):
    """A call on an engine that was closed (:meth:`HdpEngine.close`, or released after a phase broke off)."""


def _config_fields(obj: Any, prefix: str) -> dict[str, str]:
    """Dotted field -> ``repr`` of every leaf of a (nested) config dataclass, in declaration order."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, str] = {}
        for f in dataclasses.fields(obj):
            out.update(_config_fields(getattr(obj, f.name), f"{prefix}.{f.name}"))
        return out
    return {prefix: repr(obj)}


def _compared_fields(config: EngineConfig) -> dict[str, str]:
    """The fields of ``config`` every rank of a job must share: all of them, the device by its kind only
    (``cuda:0`` on one rank and ``cuda:1`` on another is one job)."""
    fields = _config_fields(config, "EngineConfig")
    fields["EngineConfig.device"] = repr(str(config.device).split(":", 1)[0])
    return fields


BUILD_TOPICS: dict[str, Topic] = {
    "EngineConfig": ("the EngineConfig", "every rank must build the engine with the same config (nothing was built)"),
    **{key: ("the launcher's topology", f"{TOPOLOGY_FIX} (nothing was built)") for key in RANKS_PER_NODE_KEYS},
}
"""What differs and how to mend it, for the fields `HdpEngine.build` agrees on (`hdp.trainer.agreement`)."""


class _SharedMegatron:
    """Megatron's parallel state, shared by the engines of this process.

    megatron-core keeps one parallel state per process (``parallel_state``'s module globals: one TP × PP ×
    EP layout, one RNG tracker), and parts of Megatron read it instead of the groups they are given.  So
    the engines of one process share it: the first build initialises it (its groups in a ledger of their
    own), later builds with the same layout reuse it, and the last engine to close destroys it.  A build
    with another layout while an engine holds it is refused (:meth:`check`).  ``current`` is that one
    process-wide state (it mirrors Megatron's own global)."""

    current: ClassVar["_SharedMegatron | None"] = None

    def __init__(self, layout: dict[str, Any], runtime: mc.MegatronRuntime, ledger: GroupLedger) -> None:
        self.layout, self.runtime, self.ledger, self.holders = layout, runtime, ledger, 1

    @classmethod
    def _live(cls) -> "_SharedMegatron | None":
        cur = cls.current
        return cur if cur is not None and cur.holders > 0 and cur.runtime.current else None

    @classmethod
    def check(cls, layout: dict[str, Any]) -> None:
        """Raise ``ValueError`` (pure: before any collective) when an open engine holds Megatron's state with
        another layout."""
        cur = cls._live()
        if cur is not None and cur.layout != layout:
            held = ", ".join(f"{k}={v}" for k, v in cur.layout.items())
            want = ", ".join(f"{k}={v}" for k, v in layout.items())
            raise ValueError(
                f"HdpEngine.build: {cur.holders} open engine(s) of this process hold Megatron's parallel state with "
                f"layout {held}; this engine asks for {want}. Megatron keeps one parallel state per process, so the "
                "engines of one process share one layout: build this one with the same EngineConfig.parallel, or "
                "close() the open engine(s) first"
            )

    @classmethod
    def acquire(cls, layout: dict[str, Any], seed: int, make: Callable[[], mc.MegatronRuntime]) -> "_SharedMegatron":
        """The live state of this layout, held once more (Megatron's RNG tracker reseeded with ``seed``, as a
        fresh initialisation would), or a new one from ``make`` (collective over the world)."""
        cls.check(layout)
        cur = cls._live()
        if cur is not None:
            mc.manual_seed(seed)
            cur.holders += 1
            return cur
        ledger = GroupLedger()
        try:
            runtime = make()
        except BaseException:
            ledger.release()
            raise
        ledger.seal()
        cls.current = shared = cls(layout, runtime, ledger)
        return shared

    def release(self) -> None:
        """One holder less; the last one destroys the parallel state, its groups and the checkpoint writer."""
        self.holders -= 1
        if self.holders > 0:
            return
        self.runtime.close()
        self.ledger.release()
        mc.stop_checkpoint_writer()
        if _SharedMegatron.current is self:
            _SharedMegatron.current = None


def _callable_name(fn: Any) -> str:
    """A loss function's name as every rank of a job spells it (module and qualified name)."""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{name}"


def _check_path(path: Any, what: str) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what}(path={path!r}): pass the checkpoint directory as a str or os.PathLike")


def _call(name: str, step: int, **args: Any) -> str:
    """The description of a public call that its agreement compares across the job (``path`` as given)."""
    parts = [f"step={step}"]
    for key, value in args.items():
        if key == "path" and isinstance(value, (str, os.PathLike)):
            value = os.fspath(value)
        elif isinstance(value, CheckpointFormat):
            value = value.value
        parts.append(f"{key}={value!r}")
    return f"{name}({', '.join(parts)})"


class HdpEngine:
    """A Megatron GPT with DDP and the distributed optimizer, trained under HDP plans.

    Build it with :meth:`build` in every rank of the job (after ``init_process_group``).
    Attributes: ``groups`` (:class:`hdp.groups.LayoutGroups`, every process group by name),
    ``rank`` / ``num_ranks`` (this rank's domain rank and N), ``model_chunks`` (the DDP-wrapped
    model chunks of this rank: one, or ``virtual_pp``), ``optimizer`` (Megatron's distributed optimizer),
    ``planner`` (the :class:`~hdp.trainer.planning.DomainPlanner`: options, the cost model in use,
    calibration state), ``core`` (the :class:`~hdp.trainer.rounds.RoundCore`), ``round_seconds`` (this
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
                 ledger: GroupLedger | None = None, shared: _SharedMegatron | None = None) -> None:
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
        self._core = RoundCore(groups=groups, megatron_groups=runtime.groups, chunks=self._chunks, device=device,
                               pad_token_id=config.pad_token_id, cp_algorithm=config.planning.cp_algorithm,
                               timeout_s=config.planning.collective_timeout_s, optimizer=optimizer,
                               abort_groups=self._groups_to_abort, on_broken=self.close,
                               fused_logprobs=_fused(config))
        par = config.parallel
        self.memory_model, self.memory_limit = _memory_setup(config, device, self.num_ranks)
        """The job's per-rank memory model and the bytes per device the plans stay within (``None``: the
        token budget only)."""
        self._planner = DomainPlanner(
            config.planning.planner_config(self.num_ranks, pipeline_stages=par.pp, memory_model=self.memory_model,
                                           memory_limit=self.memory_limit),
            config.planning.auto_calibrate, groups, collective_device=self._core.collective_device,
            records_path=config.planning.records_path("engine"), memory=MemoryCalibration())
        self._steps = Steps(self._core, self._planner, measure_memory=config.planning.measure_memory, loss_name="loss_fn",
                            max_consecutive_skips=config.planning.max_consecutive_skips,
                            skips_option=config.planning.field_name("max_consecutive_skips"))

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
        """The round core (:class:`~hdp.trainer.rounds.RoundCore`)."""
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
        """The :class:`~hdp.trainer.planning.DomainPlanner` (options, cost model, calibration state)."""
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
        `hdp.trainer.planning.launcher_topology`) over the job (before Megatron is initialised): a config
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
        _memory_setup(config, device, world // (par.tp * par.pp))  # a limit below the static memory: ValueError
        layout = {"world": world, "tp": par.tp, "pp": par.pp, "virtual_pp": par.vpp, "ep": par.ep,
                  "expert_tp": par.expert_tp}
        _SharedMegatron.check(layout)  # another open engine with another layout: ValueError, before any collective
        fields = {**_compared_fields(config), **launcher_topology()}  # the config and the launcher's ranks per node
        timeout_s = float(config.planning.collective_timeout_s)
        ledger = GroupLedger()  # every group made from here on is this engine's: close() destroys them
        shared: _SharedMegatron | None = None
        try:
            job = RoundCore.job_group(world, timeout_s)  # the engine's agreement group, bounded timeout
            agree_fields(fields, job, torch.device("cpu") if "gloo" in str(dist.get_backend(job)) else device,
                         where="HdpEngine.build", topics=BUILD_TOPICS)
            try:  # agreed above: a bad value raises on every rank alike, before Megatron
                launcher_ranks_per_node()
            except ValueError as exc:
                raise ValueError(f"HdpEngine.build: {exc} (nothing was built)") from None
            shared = _SharedMegatron.acquire(layout, config.seed, lambda: mc.initialize_megatron(
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
            engine = cls(config, groups, runtime, ddp, optimizer, device, ledger, shared)
            engine._planner.measure_static(static_bytes(ddp, optimizers(optimizer)))  # the job's most, one all-reduce
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
        """Raise ``ValueError``/``TypeError`` naming the field, the value and the fix (pure)."""
        if not isinstance(batch, Batch):
            raise TypeError(f"batch is {type(batch).__name__}; pass a hdp.trainer.engine.Batch")
        toks = batch.tokens
        if len(toks) == 0:
            raise ValueError("Batch.tokens is empty: a step needs at least one sample; skip empty batches")
        vocab = self.config.model.vocab_size
        budget = self.config.planning.max_tokens_per_rank
        cap = self.num_ranks * budget if budget is not None else None  # else the planner's memory check
        for i, t in enumerate(toks):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"Batch.tokens[{i}] is {type(t).__name__}; pass a 1-D integer torch.Tensor")
            if t.dtype.is_complex:
                raise TypeError(
                    f"Batch.tokens[{i}] has dtype {t.dtype}: token ids are integers; pass a 1-D integer tensor [L_i] "
                    "(e.g. torch.int64)"
                )
            if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError(
                    f"Batch.tokens[{i}] has shape {tuple(t.shape)}, dtype {t.dtype}; pass a 1-D integer tensor [L_i]"
                )
            n = int(t.shape[0])
            if n == 0:
                raise ValueError(f"Batch.tokens[{i}] is empty (0 tokens); drop empty samples from the batch")
            if cap is not None and n > cap:
                raise ValueError(
                    f"Batch.tokens[{i}] has {n} tokens but the domain holds at most {self.num_ranks} ranks x "
                    f"PlanningConfig.max_tokens_per_rank={self.config.planning.max_tokens_per_rank} = {cap} tokens "
                    "per sample; raise max_tokens_per_rank (memory permitting) or truncate the sample"
                )
            if n > self.config.model.max_sequence_length:
                raise ValueError(
                    f"Batch.tokens[{i}] has {n} tokens > ModelConfig.max_sequence_length="
                    f"{self.config.model.max_sequence_length}; raise it or truncate the sample"
                )
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= vocab:
                raise ValueError(
                    f"Batch.tokens[{i}] holds ids in [{lo}, {hi}] outside the vocabulary [0, {vocab}); "
                    "fix the tokenizer or ModelConfig.vocab_size"
                )
        lengths = [int(t.shape[0]) for t in toks]

        def check(name: str, tensors: Sequence[torch.Tensor] | None) -> None:
            if tensors is None:
                return
            if len(tensors) != len(lengths):
                raise ValueError(
                    f"Batch.{name} has {len(tensors)} tensors for {len(lengths)} samples; pass one per sample"
                )
            for i, (x, n) in enumerate(zip(tensors, lengths)):
                if not isinstance(x, torch.Tensor):
                    raise TypeError(f"Batch.{name}[{i}] is {type(x).__name__}; pass a torch.Tensor [L_i, ...]")
                if x.dim() < 1 or int(x.shape[0]) != n:
                    raise ValueError(
                        f"Batch.{name}[{i}] has shape {tuple(x.shape)} but sample {i} has {n} tokens; "
                        f"pass one value per token ([{n}, ...])"
                    )

        check("loss_mask", batch.loss_mask)
        for i, m in enumerate(batch.loss_mask or ()):
            # a mask selects tokens (hdp.loss counts them: n_i = Σ_t m_it); it is not a per-token weight
            if m.dtype.is_complex:
                raise TypeError(f"Batch.loss_mask[{i}] has dtype {m.dtype}; pass a bool or 0/1 mask [L_i]")
            if m.dtype != torch.bool:
                odd = (m != 0) & (m != 1)
                if bool(odd.any()):
                    bad = m[odd].flatten()[0].item()
                    raise ValueError(
                        f"Batch.loss_mask[{i}] holds {bad!r} at token {int(torch.nonzero(odd.flatten())[0])}: a loss "
                        "mask is 0 or 1 (it selects the tokens that count; hdp's loss aggregation counts them); pass a "
                        "bool or 0/1 mask, and per-token weights (advantages) through Batch.extras"
                    )
        if not isinstance(batch.extras, Mapping):
            raise TypeError(f"Batch.extras is {type(batch.extras).__name__}; pass a dict name -> per-sample tensors")
        for name, tensors in batch.extras.items():
            if not isinstance(name, str):
                raise TypeError(
                    f"Batch.extras has the key {name!r} ({type(name).__name__}); extras are named by strings "
                    "(the loss function reads local.extras[name]): use str keys"
                )
            check(f"extras[{name!r}]", tensors)

    def plan(self, batch: Batch) -> Plan:
        """The plan of ``batch`` on this domain (pure; the same on every rank of the job)."""
        self._usable("plan")
        self._validate(batch)
        return self.planner.plan(batch.lengths)

    def _check_given_plan(self, plan: Plan, batch: Batch) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan is {type(plan).__name__}; pass a hdp.packing.Plan (engine.plan(batch)) or None")
        if plan.num_ranks != self.num_ranks:
            raise ValueError(f"plan.num_ranks={plan.num_ranks}: the domain has {self.num_ranks} ranks; re-plan for it")
        if plan.lengths.tolist() != batch.lengths:
            raise ValueError(
                f"plan.lengths={plan.lengths.tolist()} differ from the batch lengths {batch.lengths}; "
                "plan this batch (engine.plan(batch))"
            )
        check_plan(plan)  # PlanError (a ValueError) naming the column, the sample or round, and the fix

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
                self._check_given_plan(given, batch)
                plan = given if given.stats is not None else given.with_stats(simulate(given, self.planner.cost, 0.0))
                exposed = (time.perf_counter() - t0) * 1e3
                ms = exposed if given.stats is None else given.stats.planner_ms
            inputs = self._shifted(batch)
            return Prepared(plan, batch_digest(batch.tokens, batch.loss_mask, batch.extras), inputs.tokens,
                            _LossAdapter(inputs, loss_fn, self.groups.tp, self.device), ms, exposed)

        return prepare

    def _shifted(self, batch: Batch) -> _Inputs:
        tokens = [t.to(torch.int64) for t in batch.tokens]
        targets = next_token_targets(tokens, self.config.pad_token_id)
        masks = [
            torch.ones(t.shape[0], dtype=torch.float32) if batch.loss_mask is None else batch.loss_mask[i].to(torch.float32)
            for i, t in enumerate(tokens)
        ]
        mask = [_shift(m) for m in masks]
        weights = sample_token_weights(mask, self.config.loss_aggregation,
                                       loss_scale_factor=self.config.loss_scale_factor, dtype=torch.float32)
        extras = {name: [_shift(x) for x in xs] for name, xs in batch.extras.items()}
        return _Inputs(tokens, targets, mask, weights, extras)

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
        reduce, before the update); :class:`~hdp.trainer.step.SkippedUpdatesError` instead when that skip is
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

        call = (f"{name}(step={self.step + 1}, loss_fn={_callable_name(loss_fn)}, "
                f"plan={'given' if plan is not None else 'None'})")
        what = name.split("[", 1)[0]
        self._usable(what)
        done = self._steps.train(what, call, self._prepare(batch, plan, loss_fn, check_loss_fn))
        assert done.outcome is not None
        if done.outcome.skipped is not None:  # skipped on every rank: nothing applied
            raise done.outcome.skipped
        return {**self._metrics(done, time.perf_counter() - t_start), **done.outcome.calibration}

    def plan_ahead(self, batches: Sequence[Batch]) -> None:
        """Announce the next mini-batches (in the order ``train_step`` will get them): each one's plan is
        made on a background thread while the one before it trains (`hdp.trainer.plan_ahead`; the
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
        done = self._steps.forward("forward", call, self._prepare(batch, plan, None), label="forward")
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

    def _model_sharded_state_dict(self) -> dict[str, Any]:
        if len(self.model_chunks) == 1:
            return self.model_chunks[0].module.sharded_state_dict()
        return {f"model{i}": c.module.sharded_state_dict() for i, c in enumerate(self.model_chunks)}

    def _sharded_state_dict(self, is_loading: bool) -> dict[str, Any]:
        ensure_optimizer_state(self.optimizer)
        model_sd = self._model_sharded_state_dict()
        # megatron-core 0.16.1: the default 'fully_sharded_model_space' relies on flattened_range,
        # which dist_checkpointing rejects, and 'fully_reshardable' gathers through a hard-coded
        # ``.cuda()``; 'dp_reshardable' saves each rank's optimizer shard without communication
        # (load with the same layout).
        meta = {"distrib_optim_sharding_type": "dp_reshardable"}
        return {
            "model": model_sd,
            "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=meta),
            "hdp_step": self.step,
        }

    def _load_model_state(self, model_state: Mapping[str, Any]) -> None:
        if len(self.model_chunks) == 1:
            self.model_chunks[0].module.load_state_dict(model_state)
        else:
            for i, c in enumerate(self.model_chunks):
                c.module.load_state_dict(model_state[f"model{i}"])

    def _layout(self) -> dict[str, int]:
        par = self.config.parallel
        return {"world_size": self.groups.world_size, "domain_size": self.num_ranks, "tp": par.tp, "pp": par.pp,
                "virtual_pp": par.vpp, "ep": par.ep}

    def _model_digest(self) -> str:
        """sha256 (16 hex digits) of the model configuration: a checkpoint loads only into the same model."""
        cfg = json.dumps(dataclasses.asdict(self.config.model), sort_keys=True, default=str)
        return hashlib.sha256(cfg.encode()).hexdigest()[:16]

    def _checkpoint_meta(self, fmt: CheckpointFormat) -> dict[str, Any]:
        return {"model_config": self._model_digest(), "hdp_format": fmt.value, **self._layout()}

    def _saved_view(self, manifest: ckpt.Manifest, slot: Path) -> ckpt.StateView:
        """What the checkpoint's slot holds, from metadata (`hdp.trainer.checkpoint.check_fit`): a ``dist`` slot's
        Megatron metadata (the whole job), or this rank's ``per-rank`` file, memory-mapped."""
        if manifest.format == CheckpointFormat.DIST.value:
            entries = ckpt.dist_checkpoint_tensors(slot)
        else:
            entries = ckpt.torch_file_tensors(slot / f"rank_{self.groups.world_rank}.pt")
        layout = {k: manifest.meta.get(k) for k in self._layout()}
        return ckpt.StateView(parts={"state": entries}, meta={"model_config": manifest.meta.get("model_config")},
                              layout=layout)

    def _loaded_view(self, fmt: str) -> ckpt.StateView:
        """What this rank would load in format ``fmt``: the Megatron sharded state dict a ``dist`` save writes, or the
        state a ``per-rank`` save writes (no copy of the tensors: shapes and dtypes only)."""
        if fmt == CheckpointFormat.DIST.value:
            entries = ckpt.sharded_state_tensors(self._sharded_state_dict(is_loading=False))
        else:
            entries = ckpt.state_tensors(self._payload())
        return ckpt.StateView(parts={"state": entries}, meta={"model_config": self._model_digest()},
                              layout=self._layout())

    def _check_layout(self, manifest: ckpt.Manifest) -> None:
        """A per-rank checkpoint loads only on the layout that wrote it; a ``dist`` one on another domain size,
        but with the TP and PP sizes that wrote it (the optimizer state is saved ``dp_reshardable``)."""
        if manifest.format != CheckpointFormat.PER_RANK.value:
            mine = self._layout()
            changed = {k: (manifest.meta.get(k), mine[k]) for k in ("tp", "pp") if k in manifest.meta
                       and manifest.meta.get(k) != mine[k]}
            if changed:
                what = ", ".join(f"{k.upper()} {old} -> {new}" for k, (old, new) in changed.items())
                raise ckpt.CheckpointError(
                    f"checkpoint (step {manifest.step}, format 'dist') was saved with TP {manifest.meta.get('tp')} x "
                    f"PP {manifest.meta.get('pp')}; this engine has TP {mine['tp']} x PP {mine['pp']} (the layout "
                    f"changed: {what}). A dist checkpoint reshards over the domain size only (megatron-core 0.16.1 "
                    "saves the distributed optimizer's state as dp_reshardable): load it with the TP and PP that "
                    "saved it"
                )
            return
        saved = {k: manifest.meta.get(k) for k in self._layout()}
        if saved != self._layout():
            raise ckpt.CheckpointError(
                f"checkpoint (step {manifest.step}, format 'per-rank') was saved with layout {saved}; this engine has "
                f"{self._layout()}. A per-rank checkpoint loads only on the same layout (save with format='dist')"
            )

    def _payload(self) -> dict[str, Any]:
        """This rank's whole training state (what a per-rank checkpoint holds; tensors are live references)."""
        ensure_optimizer_state(self.optimizer)  # a fresh optimizer: Adam's zero state, as its first step makes
        return {
            "format": CheckpointFormat.PER_RANK.value,
            "layout": self._layout(),
            "model": self.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "optimizer_shards": [shard_state(o) for o in optimizers(self.optimizer)],
            "hdp_step": self.step,
        }

    def _apply_payload(self, state: Mapping[str, Any]) -> None:
        """Put :meth:`_payload`'s state (on this engine's device) into the model and the optimizer."""
        model = state["model"]
        self._load_model_state(model["model"] if len(self.model_chunks) == 1 else model)
        self.optimizer.load_state_dict(state["optimizer"])
        for opt, shard in zip(optimizers(self.optimizer), state["optimizer_shards"]):
            load_shard_state(opt, shard)
        self.step = int(state["hdp_step"])

    def save_checkpoint(self, path: str | os.PathLike[str], *, format: CheckpointFormat | str = "auto") -> None:
        """Save model, optimizer and step counter into the directory ``path`` (collective over the job).

        Atomic and verified (:mod:`hdp.trainer.checkpoint`): every rank writes into the free data
        slot of ``path``, flushes and hashes its files, and one manifest (format version, world and
        domain size, layout, model-config digest, step, sha256 of every file) is renamed into place
        once every rank has written — a process killed during the save leaves the previous
        checkpoint loadable.  Any error on any rank raises on every rank and leaves the previous
        checkpoint as it was.

        ``dist``: Megatron distributed checkpointing (model + distributed-optimizer sharded state
        dicts, torch_dist backend, optimizer as ``dp_reshardable``); its forked writer processes
        die with their rank.  megatron-core 0.16.1's writer needs ``psutil`` and starts worker
        processes, so the rank must not run in a daemonic process.  ``per-rank``: every rank writes
        ``rank_{global rank}.pt`` with its model chunks, the optimizer's common state and its own
        optimizer shard (load with the same layout).  ``auto``: ``dist`` when every rank of the job
        can write it, else ``per-rank``.  Raises ``ValueError`` on every rank when ``dist`` is asked
        for and some rank cannot write it.
        """
        self._usable("save_checkpoint")
        box: list[tuple[CheckpointFormat, str | None]] = []

        def work() -> tuple[None, int, int]:
            _check_path(path, "save_checkpoint")
            fmt = checkpoint_format(format)
            problem = dist_checkpoint_problem() if fmt is not CheckpointFormat.PER_RANK else None
            box.append((fmt, problem))
            return None, 0, 0 if problem is None else 1  # the vote: some rank cannot write 'dist'

        # the call's one agreement: the same call and arguments everywhere, and one format decision for all
        _, cannot = self.core.agree_call("save_checkpoint", self.step, _call("save_checkpoint", self.step, path=path,
                                                                              format=format), work)
        fmt, problem = box[0]
        if fmt is not CheckpointFormat.PER_RANK:
            if not cannot:
                fmt = CheckpointFormat.DIST
            elif fmt is CheckpointFormat.AUTO:
                logger.info("save_checkpoint: per-rank format (%s)", problem or "another rank cannot write 'dist'")
                fmt = CheckpointFormat.PER_RANK
            else:
                raise ValueError(
                    f"save_checkpoint(format='dist'): {problem or 'another rank cannot write it (see its error)'}; "
                    "use format='per-rank' or 'auto'"
                )
        with self.core.collectives("save", self.step):

            def write(slot: Path) -> None:
                if fmt is CheckpointFormat.DIST:
                    mc.checkpoint_writers_die_with_parent()  # its spawned helper dies with this rank
                    with self.core.checkpoint_collectives():  # Megatron's collectives: the engine's timeout, released on failure
                        dist_checkpointing.save(self._sharded_state_dict(is_loading=False), str(slot))
                else:
                    torch.save(self._payload(), slot / f"rank_{self.groups.world_rank}.pt")

            ckpt.save_slots(path, guard=self.core.guard, group=self.groups.world, rank=self.groups.world_rank,
                            size=self.groups.world_size, step=self.step, format=fmt.value,
                            meta=self._checkpoint_meta(fmt), write=write)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load what :meth:`save_checkpoint` wrote (collective); the next step continues bit for bit.

        Verified before anything is touched, on every rank: the manifest (format version, the layout)
        and the sha256 of every file, then whether the checkpoint fits this engine
        (:func:`~hdp.trainer.checkpoint.check_fit`, from metadata: every key, shape and dtype against
        what this engine loads, and the model-config digest); any problem on any rank raises
        :class:`~hdp.trainer.checkpoint.CheckpointError` (a ``ValueError``, through the step guard) on
        every rank, naming the first differing tensor and both sides, and the engine stays usable.
        Then every rank loads; if loading fails on any rank
        — whatever the exception type, Megatron's ``CheckpointException`` included — every rank puts
        back the state it had before the call (model, optimizer, step) and raises.  A ``dist``
        checkpoint also loads on another domain size.
        """
        self._usable("load_checkpoint")
        step = self.step

        def work() -> tuple[None, int, int]:
            _check_path(path, "load_checkpoint")
            return None, 0, 0

        self.core.agree_call("load_checkpoint", step, _call("load_checkpoint", step, path=path), work)
        with self.core.collectives("load", self.step):
            manifest = ckpt.verify_checkpoint(
                path, guard=self.core.guard, rank=self.groups.world_rank, size=self.groups.world_size, step=step,
                expect={}, check=self._check_layout)
            slot = Path(path) / manifest.slot
            ckpt.check_fit(path, guard=self.core.guard, step=step, checkpoint=lambda: self._saved_view(manifest, slot),
                           engine=lambda: self._loaded_view(manifest.format),
                           gather=manifest.format == CheckpointFormat.DIST.value)
            before: dict[str, Any] | None = None
            try:
                with self.core.guard.phase("load: apply", step):
                    before = to_host(self._payload())  # the state to restore if any rank fails to load
                    if manifest.format == CheckpointFormat.DIST.value:
                        with self.core.checkpoint_collectives():  # Megatron's collectives: released when this rank fails
                            self._load_dist(slot)
                    else:
                        state = torch.load(slot / f"rank_{self.groups.world_rank}.pt", map_location=self.device,
                                           weights_only=False)
                        self._apply_payload(state)
            except BaseException:
                if before is not None:
                    with torch.no_grad():
                        self._apply_payload(to_device(before, self.device))
                raise

    def _load_dist(self, slot: Path) -> None:
        state = dist_checkpointing.load(self._sharded_state_dict(is_loading=True), str(slot))
        self._load_model_state(state["model"])
        # no_grad: for fp32 models the optimizer's main parameters are views of the model's
        # leaf parameters, which Megatron's loader copies into in place
        with torch.no_grad():
            self.optimizer.load_state_dict(state["optimizer"])
        restore_adam_steps(self.optimizer, state["optimizer"])
        self.step = int(state["hdp_step"])


