"""The hdp training engine: a Megatron-core GPT trained under HDP plans, for any trainer.

    engine = HdpEngine.build(EngineConfig(...), dist.group.WORLD)  # in every rank of the job
    metrics = engine.train_step(batch, loss_fn)             # plan, run all rounds, one optimizer step
    out = engine.forward(batch)                             # per-token log-probs/entropies, caller order
    engine.save_checkpoint(path); engine.load_checkpoint(path)
    engine.close()                                          # releases Megatron's state and the CPU shim

Layout (``EngineConfig.parallel``): world = TP × PP × N.  The **domain** is the N ranks of one
(TP rank, PP stage) position; hdp plans over N.  Every TP rank and every pipeline stage of a
domain rank runs the same plan: under PP each round is one micro-batch of Megatron's pipeline
schedule (1F1B, or interleaved with virtual stages), under TP each domain rank's micro-batch is
split over its TP group by Megatron (sequence parallel), and hdp's CP rings / all-gathers connect
the domain ranks of the same TP rank and stage.

A step runs four phases, each a method of its own (so callers and later wrappers can see them):

1. **validate and plan** (:meth:`HdpEngine._prepare`): validate the batch and plan it (pure,
   identical on every rank); then one fixed-size all-reduce over the job
   (:func:`hdp.checksum.agree_step`) agrees on input errors and compares the plan checksum over
   the domain, the pipeline and the TP ranks at once — so a bad input or a plan mismatch raises on
   every rank instead of hanging;
   per-token loss weights for the whole batch (:mod:`hdp.loss`): Σ over the domain of
   Σ_t w_t ℓ_t is the exact single-process loss of the configured aggregation;
2. **rounds** (:meth:`HdpEngine._run_rounds`): every round is one micro-batch of Megatron's
   schedule (``forward_backward_no_pipelining`` at PP = 1, 1F1B
   ``forward_backward_pipelining_without_interleaving`` at PP > 1, the interleaved schedule with
   virtual stages; ``variable_seq_lengths``: each round has its own packed length).  Every rank
   runs every round (lock-step, so EP all-to-alls, CP rings and pipeline sends line up): its chunks
   of its group's samples with a :class:`~hdp.trainer.attention_spec.CPContext` for the group; a
   rank without tokens runs padding tokens with loss weight 0 (Megatron cannot run 0 tokens),
   inside its group's CP communication when it has a group.  The last stage computes the loss
   with hdp's per-token weights.  Losses and non-finite flags stay on the device; rounds are timed
   with device events (:class:`hdp.device.RoundTimer`);
3. **reduce** (:meth:`HdpEngine._reduce`): one all-reduce of (loss, loss_fn failed, per-sample
   non-finite flags) over the job — the one host synchronisation after the rounds (no round
   synchronises; phase 1's agreement reads one small vector before any device work); a non-finite loss
   anywhere skips the update on every rank (grads zeroed, parameters unchanged) and raises
   :class:`NonFiniteLossError` naming the step and the samples;
4. **optimizer step** (:meth:`HdpEngine._optimizer_step`): Megatron's ``finalize_model_grads``
   (DDP reduce-scatter with SUM over the domain — ``calculate_per_token_loss=True``, no 1/N
   scaling: the weights already normalise globally —, sequence-parallel norm gradients over TP)
   and the distributed optimizer's step.

Errors (README "Failure behaviour").  Whatever fails on one rank fails on every rank of the job,
before the next collective and with nothing applied: phase 1 catches every exception and agrees
on it with its fixed-size collective (and the batch digest, :mod:`hdp.digest`); a ``loss_fn``
failure is recorded where it happens, the rounds go on with a zero loss so the collectives line
up, and the step guard (:mod:`hdp.guard`) raises it everywhere after phase 3; checkpoints go
through :mod:`hdp.trainer.checkpoint` (verified before load, rolled back on failure).  A phase that
breaks off inside its collectives (a peer died or hangs: ``EngineConfig.collective_timeout_s``)
raises :class:`~hdp.guard.DomainUnreachableError` and leaves the engine refusing further calls.

Token alignment.  Per-token tensors of a :class:`Batch` (loss mask, advantages, old log-probs)
are indexed like the tokens: element t describes token t.  Token t is *predicted* from the
tokens before it, so log p(token t) comes from the logits at position t-1.  hdp shifts every
per-token tensor by one per sample *before* the zigzag split (``x'[p] = x[p+1]``, last = 0) so that
all local tensors of a round line up with the local logits; the loss function therefore receives,
at local position p, the target token (``local.targets[p]``) and the caller's values for that
target.  Token 0 of a sample is never predicted (its mask is ignored, its log-prob is 0).

Legend: S samples, L_i sample length, T local tokens of one round (Tr real, the rest padding),
V vocabulary, Vl = V/TP, R rounds (micro-batches).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import enum
import functools
import hashlib
import importlib.util
import json
import logging
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from hdp import device as _device
from hdp import megatron_compat as mc
from hdp.checksum import agree_step
from hdp.digest import batch_digest
from hdp.guard import DomainStepError, DomainUnreachableError, StepGuard, describe, is_input_error
from hdp.cp import CPAlgorithm
from hdp.dispatch import LocalMeta, gather_outputs, local_meta, pack
from hdp.groups import DomainGroups, GroupLedger, LayoutGroups
from hdp.loss import sample_token_weights
from hdp.megatron_compat import dist_checkpointing
from hdp.moe.levels import ZeroMemoryLevel
from hdp.moe.zero_memory import apply_zero_memory
from hdp.packing import Plan, check_plan, simulate
from hdp.packing import plan as make_plan
from hdp.trainer.attention_spec import CPContext, HdpPackedSeqParams, packed_seq_params
from hdp.trainer import checkpoint as ckpt
from hdp.trainer.autocal import DomainAutoCalibrator  # [auto-calibration]
from hdp.trainer.config import EngineConfig
from hdp.trainer.model import (
    build_model_chunks,
    build_optimizer,
    global_param_name,
    init_parameters,
    wrap_ddp,
)
from hdp.logprobs import logprobs_entropy

__all__ = [
    "Batch",
    "LocalTensors",
    "LossFn",
    "ForwardOutput",
    "NonFiniteLossError",
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
    logits: torch.Tensor
    """[T, V] logits (with grad).  Under tensor parallelism this is the TP rank's vocabulary shard
    [T, V/TP]: ``log_softmax(logits)`` is then only the shard's distribution.  For full-vocabulary
    quantities use :meth:`entropy` or :func:`hdp.logprobs.logprobs_entropy` with ``tp_group``."""
    tp_group: dist.ProcessGroup
    """The tensor-parallel group the logits are sharded over (a size-1 group without TP)."""
    _cache: dict = field(default_factory=dict, repr=False)

    def entropy(self) -> torch.Tensor:
        """[T] entropy of the full-vocabulary next-token distribution at each local position,
        differentiable (an entropy bonus gets its gradient) and TP-aware (collective over ``tp_group``:
        call it on every TP rank alike).  Computed once per round (vocabulary-chunked, no [T, V] copy)."""
        if "entropy" not in self._cache:
            _, ent = logprobs_entropy(self.logits, self.targets, self.tp_group, entropy=True)
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


class NonFiniteLossError(FloatingPointError):
    """A step's loss was NaN/inf on some rank; the update was skipped on every rank."""

    def __init__(self, step: int, samples: Sequence[int], ranks: Sequence[int]) -> None:
        self.step = step
        self.samples = tuple(samples)
        self.ranks = tuple(ranks)
        super().__init__(
            f"step {step}: the loss is not finite on domain ranks {list(ranks)} in rounds holding samples "
            f"{list(samples)}; the update was skipped on every rank (parameters unchanged, gradients zeroed). "
            "Check these samples' per-token inputs (advantages, old log-probs) and the loss function"
        )


# ---- per-step state --------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Prepared:
    """A validated, planned batch with the per-sample tensors shifted to target alignment."""

    plan: Plan
    tokens: list[torch.Tensor]  # S x [L_i] int64
    targets: list[torch.Tensor]  # S x [L_i] int64 (token p+1; pad at the end)
    mask: list[torch.Tensor]  # S x [L_i] float32 (mask of token p+1)
    weights: list[torch.Tensor]  # S x [L_i] float32 loss weights (target aligned)
    extras: dict[str, list[torch.Tensor]]  # name -> S x [L_i, ...] (target aligned)
    planner_ms: float


def _shift(x: torch.Tensor) -> torch.Tensor:
    """[L, ...] -> [L, ...] with out[p] = x[p+1] and a zero last row (per-sample next-token alignment)."""
    return torch.cat([x[1:], torch.zeros_like(x[:1])])


@dataclass(frozen=True, eq=False)
class _RoundInput:
    """This rank's micro-batch of one round: packed tokens (real, then padding) and their context."""

    meta: LocalMeta | None
    """Where the real tokens come from; ``None`` for a padding round beyond the plan (interleaved PP)."""
    tokens: torch.Tensor
    """[T] int64 token ids on the device (Tr real ones, then padding)."""
    psp: HdpPackedSeqParams
    """THD packed-sequence parameters with the CP context."""
    loss: "_LossInputs | None" = None
    """What the last stage's loss needs (``None`` elsewhere, and for rounds without tokens)."""

    @property
    def real(self) -> int:
        """Tr: the real tokens."""
        return 0 if self.meta is None else self.meta.num_tokens


@dataclass(frozen=True, eq=False)
class _LossInputs:
    """The per-token loss inputs of one round on the device (target aligned, [Tr, ...])."""

    targets: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor
    extras: Mapping[str, torch.Tensor]
    sample_index: torch.Tensor
    target_position: torch.Tensor
    samples: torch.Tensor
    """[Sg] caller indices of the group's samples (for the non-finite flags)."""


@dataclass(eq=False)
class _StepState:
    """What one step's rounds produce on this rank, kept on the device until the step's one sync.

    Passed explicitly to the schedule's callbacks (never module or engine state between steps).
    """

    prep: _Prepared
    train: bool
    loss_fn: "LossFn | None"
    num_microbatches: int
    """Rounds of the plan, plus padding rounds where the interleaved schedule needs a multiple of PP."""
    loss_sum: torch.Tensor
    """[] float64: Σ of this rank's round losses (last stage)."""
    bad: torch.Tensor
    """[S] float64: > 0 where a round holding the sample had a non-finite loss."""
    timer: _device.RoundTimer
    fn_error: BaseException | None = None
    timer_round: int = -1
    """The round whose forward runs now (read by the first layer's pre-hook)."""
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    """forward: round -> [Tr, 2] (log-prob, entropy) on the last stage."""
    inputs: dict[int, _RoundInput] = field(default_factory=dict)


class _SpanMark(torch.autograd.Function):
    """Identity whose backward starts or stops a span of a :class:`~hdp.device.RoundTimer`.

    Put on a stage's output (its backward starts there) and on its first layer's input (its
    backward ends there), it times a micro-batch's backward inside Megatron's schedule without a
    host synchronisation.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, timer: _device.RoundTimer, key: Any, action: str) -> torch.Tensor:  # type: ignore[override]
        ctx.timer, ctx.key, ctx.action = timer, key, action
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        getattr(ctx.timer, ctx.action)(ctx.key)
        return grad, None, None, None


# ---- the engine ------------------------------------------------------------------------------------


class HdpEngine:
    """A Megatron GPT with DDP and the distributed optimizer, trained under HDP plans.

    Build it with :meth:`build` in every rank of the job (after ``init_process_group``).
    Attributes: ``groups`` (:class:`hdp.groups.LayoutGroups`, every process group by name),
    ``rank`` / ``num_ranks`` (this rank's domain rank and N), ``model_chunks`` (the DDP-wrapped
    model chunks of this rank: one, or ``virtual_pp``), ``round_seconds`` (this rank's measured
    seconds per round of the last step: forward + backward of the round's micro-batch on this
    stage).
    """

    def __init__(
        self,
        config: EngineConfig,
        groups: LayoutGroups,
        runtime: mc.MegatronRuntime,
        model_chunks: Sequence[Any],
        optimizer: Any,
        device: torch.device,
    ) -> None:
        self.config = config
        self.groups = groups
        self.world_group = groups.world
        self.domain_group = groups.domain.domain
        self.runtime = runtime
        self.model_chunks = list(model_chunks)
        self.optimizer = optimizer
        self.device = device
        self.rank = groups.domain.domain_rank
        self.num_ranks = groups.domain.size
        self.step = 0
        self.round_seconds: list[float] = []
        self._planner = config.planning.planner_config(self.num_ranks, pipeline_stages=config.parallel.pp)
        # [auto-calibration] refits the cost model from the timed rounds (trainer/autocal.py)
        self._autocal = DomainAutoCalibrator(config.planning.auto_calibrate, self._planner.cost, self.domain_group,
                                             rank=self.rank, size=self.num_ranks)
        self._token_multiple = config.parallel.token_multiple
        self._state: _StepState | None = None
        self._chunk_index = {id(m): i for i, m in enumerate(self.model_chunks)}
        self._holds_loss = any(m.module.post_process for m in self.model_chunks)
        self._p2p = (
            mc.HdpP2PCommunicator(groups.pp, self.model_chunks[0].config, device) if groups.pp_size > 1 else None
        )
        self._hooks = [
            chunk.module.decoder.layers[0].register_forward_pre_hook(
                functools.partial(self._mark_stage_input, i), with_kwargs=True)
            for i, chunk in enumerate(self.model_chunks)
        ]
        self._closed = False
        self._ledger: GroupLedger | None = None  # set by build(): the groups close() destroys
        # control tensors of the job's collectives: CPU for gloo, else the device
        self._collective_device = torch.device("cpu") if _gloo(self.world_group) else device
        # every error inside a step raises on every rank of the job (hdp/guard.py)
        self._guard = StepGuard(group=self.world_group, rank=groups.world_rank, size=groups.world_size,
                                device=self._collective_device, timeout_s=config.collective_timeout_s, label="world rank")
        self._broken: str | None = None

    @property
    def model(self) -> Any:
        """The DDP-wrapped model of this rank (one chunk; with virtual stages use ``model_chunks``)."""
        if len(self.model_chunks) != 1:
            raise ValueError(
                f"HdpEngine.model: this rank holds {len(self.model_chunks)} model chunks (virtual_pp); "
                "use engine.model_chunks"
            )
        return self.model_chunks[0]

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
        before any collective.  ``init_fn(name, full)``, if given, fills each parameter before DDP
        wraps it: ``name`` is the parameter's name in a one-process model (global layer and expert
        indices) and ``full`` its whole, unsharded tensor (this rank keeps its TP shard), so a
        rank-independent function gives the same model for every TP / PP / EP layout.
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
        timeout_s = float(config.collective_timeout_s)
        ledger = GroupLedger()  # every group made from here on is this engine's: close() destroys them
        try:
            # the engine's own agreement group over the whole job, with the bounded timeout
            job = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=timeout_s))
            runtime = mc.initialize_megatron(
                device=device,
                tensor_model_parallel_size=par.tp,
                pipeline_model_parallel_size=par.pp,
                virtual_pipeline_model_parallel_size=par.virtual_pp if par.vpp > 1 else None,
                expert_model_parallel_size=par.ep,
                expert_tensor_parallel_size=par.expert_tp,
                seed=config.seed,
                collective_timeout_s=timeout_s,
            )
        except BaseException:
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
            if config.moe_zero_memory is not ZeroMemoryLevel.NONE:
                # MoE layers become ZeroMemoryMoELayer (same parameters and names) before DDP wraps them
                for chunk in chunks:
                    apply_zero_memory(chunk, config.moe_zero_memory, config.moe_zero_memory_num_layers)
            ddp = [wrap_ddp(c, config.optim, groups=pgc, chunk=i) for i, c in enumerate(chunks)]
            for d in ddp:
                d.broadcast_params()  # replicas start identical even if the init was rank-dependent
            optimizer = build_optimizer(ddp, config.optim, groups=pgc)
            groups = LayoutGroups(world=job, domain=DomainGroups.build(pgc.dp, timeout_s=timeout_s), tp=pgc.tp,
                                  pp=pgc.pp, ep=pgc.ep)
        except BaseException:
            runtime.close()
            ledger.release()
            raise
        logger.info("hdp engine: world %d = TP %d x PP %d (x%d virtual) x domain %d, EP %d, device %s",
                    world, par.tp, par.pp, par.vpp, groups.domain.size, par.ep, device)
        engine = cls(config, groups, runtime, ddp, optimizer, device)
        engine._ledger = ledger
        return engine

    def close(self) -> None:
        """Release everything the engine made (idempotent): Megatron's parallel state, every process
        group it created (with their transport threads), the CPU-shim hold and the helper process of
        Megatron's checkpoint writer.  Later calls on the engine raise."""
        if not self._closed:
            self._closed = True
            self._state = None
            for hook in self._hooks:
                hook.remove()
            for chunk in self.model_chunks:
                mc.release_ddp(chunk)
            self.runtime.close()
            if self._ledger is not None:
                self._ledger.release()
            mc.stop_checkpoint_writer()
            # the model, the optimizer and the group handles go now, not when the caller drops the
            # engine: a destroyed group's transport threads live as long as a reference to it does
            self.model_chunks, self._chunk_index, self._hooks = [], {}, []
            for name in ("optimizer", "runtime", "groups", "world_group", "domain_group", "_p2p", "_guard",
                         "_autocal", "_ledger"):
                setattr(self, name, None)

    # -- phase 1: validation and planning --

    def _validate(self, batch: Batch) -> None:
        """Raise ``ValueError``/``TypeError`` naming the field, the value and the fix (pure)."""
        if not isinstance(batch, Batch):
            raise TypeError(f"batch is {type(batch).__name__}; pass a hdp.trainer.engine.Batch")
        toks = batch.tokens
        if len(toks) == 0:
            raise ValueError("Batch.tokens is empty: a step needs at least one sample; skip empty batches")
        vocab = self.config.model.vocab_size
        cap = self.num_ranks * self.config.planning.max_tokens_per_rank
        for i, t in enumerate(toks):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"Batch.tokens[{i}] is {type(t).__name__}; pass a 1-D integer torch.Tensor")
            if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError(
                    f"Batch.tokens[{i}] has shape {tuple(t.shape)}, dtype {t.dtype}; pass a 1-D integer tensor [L_i]"
                )
            n = int(t.shape[0])
            if n == 0:
                raise ValueError(f"Batch.tokens[{i}] is empty (0 tokens); drop empty samples from the batch")
            if n > cap:
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
        for name, tensors in batch.extras.items():
            check(f"extras[{name!r}]", tensors)

    def plan(self, batch: Batch) -> Plan:
        """The plan of ``batch`` on this domain (pure; the same on every rank of the job)."""
        self._validate(batch)
        return make_plan(batch.lengths, self._planner)

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

    def _prepare(self, batch: Batch, what: str, given: Plan | None = None) -> _Prepared:
        """Phase 1: validate, plan and digest the batch; agree on errors, the plan and the data over the job.

        Any exception here (not only bad input) is caught; one fixed-size all-reduce
        (:func:`hdp.checksum.agree_step`) then tells every rank whether some rank failed and
        compares the plan checksum and the batch digest over the domain, the pipeline and the TP
        ranks.  When a rank failed, a second fixed-size collective (the step guard) shares the
        messages, so every rank raises naming the failed ranks and their errors — the failed rank
        its own error type for bad input (``ValueError``/``TypeError``), else
        :class:`~hdp.guard.DomainStepError` everywhere.  Nothing has run yet.
        """
        self._usable(what)
        error: BaseException | None = None
        prepared: _Prepared | None = None
        digest = 0
        try:
            self._validate(batch)
            t0 = time.perf_counter()
            if given is None:
                plan = make_plan(batch.lengths, self._planner)
            else:
                self._check_given_plan(given, batch)
                plan = given if given.stats is not None else given.with_stats(simulate(given, self._planner.cost, 0.0))
            planner_ms = (time.perf_counter() - t0) * 1e3 if given is None or given.stats is None else given.stats.planner_ms
            prepared = self._shifted(batch, plan, planner_ms)
            digest = batch_digest(batch.tokens, batch.loss_mask, batch.extras)
        except Exception as exc:  # every type: one rank's failure must reach every rank
            error, prepared = exc, None
        step = self.step + 1
        # one fixed-size collective over the job (never hangs, whatever the inputs): errors anywhere,
        # the plan checksum and the batch digest over the domain, the pipeline and the TP ranks at once
        bad = agree_step(None if prepared is None else prepared.plan, self.world_group, failed=error is not None,
                         data_digest=digest, device=self._collective_device, domain_size=self.num_ranks,
                         label="world rank")
        if bad:
            try:
                self._guard.agree(f"{what}: validate", step, error)
            except DomainStepError as agreed:
                if error is not None and is_input_error(error):
                    me = self.groups.world_rank
                    others = [r for r in agreed.ranks if r != me]
                    also = f" (invalid input on world ranks {others} too)" if others else ""
                    raise type(error)(f"{what} (step {step}, world rank {me} = domain rank {self.rank}): {error}{also}") from error
                raise
            raise RuntimeError(f"{what} (step {step}): world ranks {bad} reported a failure the agreement did not carry")
        assert prepared is not None
        return prepared

    def _usable(self, what: str) -> None:
        """Raise (no collective) when the engine is closed or an earlier call broke off in the middle of
        its collectives."""
        if self._closed:
            raise RuntimeError(f"HdpEngine.{what}: the engine is closed (close() released its process groups); "
                               "build a new engine")
        if self._broken is not None:
            raise RuntimeError(
                f"HdpEngine.{what}: this engine is unusable since {self._broken}; its process groups may be out "
                "of step. Restart the job (or rebuild the engine in a fresh process group) and load the last checkpoint"
            )

    @contextlib.contextmanager
    def _collectives(self, phase: str) -> Iterator[None]:
        """Run a phase whose collectives cannot be abandoned on one rank alone (rounds, optimizer, save).

        An exception here (a peer died or hangs and the group's timeout expired, or this rank
        failed in the middle of the phase's collectives) leaves the job's groups out of step: the
        engine marks itself unusable and raises :class:`~hdp.guard.DomainUnreachableError` naming
        the step, the phase and the timeout.  Errors the step guard already agreed on pass through.
        """
        try:
            yield
        except (DomainStepError, NonFiniteLossError):
            raise
        except BaseException as exc:
            where = f"step {self.step}, phase {phase!r}"
            self._broken = f"{where} ({describe(exc)})"
            if isinstance(exc, (KeyboardInterrupt, SystemExit, DomainUnreachableError)):
                raise
            raise DomainUnreachableError(
                f"{where}: world rank {self.groups.world_rank} (domain rank {self.rank}) stopped in the middle of the "
                f"phase's collectives: {describe(exc)}. Either a peer died or hangs (each rank gives up after "
                f"EngineConfig.collective_timeout_s={self.config.collective_timeout_s:g} s) or this rank failed "
                "there, and then the other ranks fail within that timeout. The engine is no longer usable: "
                "restart the job and load the last checkpoint",
                step=self.step, phase=phase,
            ) from exc

    def _shifted(self, batch: Batch, plan: Plan, planner_ms: float) -> _Prepared:
        tokens = [t.to(torch.int64) for t in batch.tokens]
        pad = self.config.pad_token_id
        targets = [torch.cat([t[1:], t.new_full((1,), pad)]) for t in tokens]
        masks = [
            torch.ones(t.shape[0], dtype=torch.float32) if batch.loss_mask is None else batch.loss_mask[i].to(torch.float32)
            for i, t in enumerate(tokens)
        ]
        mask = [_shift(m) for m in masks]
        weights = sample_token_weights(
            mask,
            self.config.loss_aggregation,
            loss_scale_factor=self.config.loss_scale_factor,
            dtype=torch.float32,
        )
        extras = {name: [_shift(x) for x in xs] for name, xs in batch.extras.items()}
        return _Prepared(plan, tokens, targets, mask, weights, extras, planner_ms)

    # -- phase 2: the rounds --

    def _context(self, meta: LocalMeta) -> HdpPackedSeqParams:
        m = self._token_multiple
        if meta.k == 1:
            return packed_seq_params(meta.group_lengths, self.device, token_multiple=m)
        algo = CPAlgorithm.RING
        aligned = meta.k & (meta.k - 1) == 0 and meta.group_start % meta.k == 0
        if self.config.planning.cp_algorithm is CPAlgorithm.ALLGATHER and aligned:
            algo = CPAlgorithm.ALLGATHER
        cp = CPContext(
            group_lengths=meta.group_lengths,
            k_group=meta.k,
            ring=self.groups.domain.ring(meta.group_start, meta.k),
            groups=self.groups.domain,
            algo=algo,
        )
        return packed_seq_params(meta.group_lengths, self.device, cp=cp, token_multiple=m)

    def _round_input(self, state: _StepState, r: int) -> _RoundInput:
        """This rank's micro-batch of round ``r`` (built once per step, shared by the model chunks).

        A rank without tokens runs only padding (loss weight 0): alone when idle, else with its
        group's CP context, whose layout holds 0 tokens here (samples shorter than 2k on k ranks),
        so that the group's ring or all-gather still lines up.
        """
        hit = state.inputs.get(r)
        if hit is not None:
            return hit
        plan = state.prep.plan
        meta = local_meta(plan, self.rank, r) if r < plan.num_rounds else None
        if meta is None:
            psp = packed_seq_params((), self.device, token_multiple=self._token_multiple)
            real = torch.empty(0, dtype=torch.int64)
        else:
            psp = self._context(meta)
            real = pack(meta, state.prep.tokens) if meta.num_tokens else torch.empty(0, dtype=torch.int64)
        pad = torch.full((psp.pad_tokens,), self.config.pad_token_id, dtype=torch.int64)
        tokens = torch.cat([real, pad]).to(self.device)  # [T]
        loss = None
        if self._holds_loss and meta is not None and meta.num_tokens:
            loss = self._loss_inputs(state.prep, meta)
        inp = _RoundInput(meta=meta, tokens=tokens, psp=psp, loss=loss)
        state.inputs[r] = inp
        return inp

    def _loss_inputs(self, prep: _Prepared, meta: LocalMeta) -> _LossInputs:
        dev = self.device
        return _LossInputs(
            targets=pack(meta, prep.targets).to(dev),
            mask=pack(meta, prep.mask).to(dev),
            weights=pack(meta, prep.weights).to(dev),
            extras={name: pack(meta, xs).to(dev) for name, xs in prep.extras.items()},
            sample_index=meta.sample_index.to(dev),
            target_position=(meta.position_ids + 1).to(dev),
            samples=torch.tensor(meta.samples, dtype=torch.int64, device=dev),
        )

    def _mark_stage_input(self, chunk: int, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Forward pre-hook of a chunk's first layer: its input's backward closes the round's backward span."""
        state = self._state
        hidden = kwargs.get("hidden_states")
        if state is None or not state.train or hidden is None or not hidden.requires_grad:
            return None
        r = state.timer_round
        kwargs["hidden_states"] = _SpanMark.apply(hidden, state.timer, ("b", r, chunk), "stop")
        return args, kwargs

    def _forward_step(self, state: _StepState, data_iterator: Iterator[int], model: Any) -> tuple[torch.Tensor, Callable]:
        """Megatron's ``forward_step_func``: run this chunk on round ``next(data_iterator)``."""
        r = next(data_iterator)
        chunk = self._chunk_index[id(model)]
        inp = self._round_input(state, r)
        key = ("f", r, chunk)
        state.timer.start(key)
        state.timer_round = r
        out = model(input_ids=inp.tokens[None, :], position_ids=None, attention_mask=None,
                    packed_seq_params=inp.psp)  # [1, T, Vl] (last stage) or [T/TP?, 1, H]
        if state.train:
            out = _SpanMark.apply(out, state.timer, ("b", r, chunk), "start")
        last = model.module.post_process
        if not last:
            state.timer.stop(key)
        return out, functools.partial(self._round_loss, state, r, key, inp)

    def _round_loss(self, state: _StepState, r: int, key: Any, inp: _RoundInput,
                    output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Megatron's loss function on the last stage: Σ_t w_t ℓ_t of round ``r`` (device-side bookkeeping)."""
        logits = output[0]  # [T, Vl]
        meta = inp.meta
        real = inp.real
        li = inp.loss
        tp = self.groups.tp
        count = torch.zeros((), dtype=torch.int, device=logits.device)
        if not state.train:
            if real:
                assert li is not None
                lp, ent = logprobs_entropy(logits[:real], li.targets, tp, entropy=True)  # [Tr], [Tr]
                state.outputs[r] = torch.stack([lp.float(), ent.float()], dim=-1)  # [Tr, 2]
            state.timer.stop(key)
            return logits.sum() * 0.0, count, {}
        loss = None
        if real and state.fn_error is None:
            assert meta is not None and li is not None
            local = LocalTensors(
                round_index=meta.round_index, samples=meta.samples, targets=li.targets, mask=li.mask,
                extras=li.extras, sample_index=li.sample_index, target_position=li.target_position,
                logits=logits[:real], tp_group=tp,
            )
            try:
                logprobs, _ = logprobs_entropy(local.logits, local.targets, tp)  # [Tr]
                loss = state.loss_fn(local, logprobs, li.weights)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise TypeError(
                        f"loss_fn returned {type(loss).__name__}"
                        f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; return a scalar tensor"
                    )
                if not loss.requires_grad:
                    raise TypeError(
                        "loss_fn returned a tensor that does not require grad (detached, or computed under "
                        "torch.no_grad / from .item()); build the loss from the logprobs it is given"
                    )
            except Exception as exc:  # a caller bug on one rank must not hang the others
                state.fn_error, loss = exc, None
        if loss is None:
            loss = logits.sum() * 0.0  # padding round: backward still runs (EP all-to-alls, CP rings line up)
        loss = loss.reshape(())
        value = loss.detach().to(torch.float64)
        state.loss_sum += value
        if li is not None:
            flag = (~torch.isfinite(value)).to(torch.float64)
            state.bad.index_add_(0, li.samples, flag.expand(li.samples.shape[0]))
        state.timer.stop(key)
        return loss, count, {}

    def _num_microbatches(self, plan: Plan) -> int:
        """Rounds, padded to a multiple of PP for the interleaved schedule (padding rounds are idle)."""
        r = plan.num_rounds
        pp = self.groups.pp_size
        if len(self.model_chunks) > 1:
            r = -(-r // pp) * pp
        return r

    def _run_rounds(self, prep: _Prepared, loss_fn: "LossFn | None", *, train: bool) -> _StepState:
        """Phase 2: every round through Megatron's schedule (one micro-batch per round)."""
        plan = prep.plan
        dev = self.device
        state = _StepState(
            prep=prep,
            train=train,
            loss_fn=loss_fn,
            num_microbatches=self._num_microbatches(plan),
            loss_sum=torch.zeros((), dtype=torch.float64, device=dev),
            bad=torch.zeros(plan.num_samples, dtype=torch.float64, device=dev),
            timer=_device.RoundTimer(dev),
        )
        m = state.num_microbatches
        chunks = self.model_chunks
        # every round's inputs go to the device before the first round (no host-device copy, so no
        # synchronisation, between rounds)
        longest = max(self._round_input(state, r).tokens.shape[0] for r in range(m))
        iters = [iter(range(m)) for _ in chunks]
        kwargs: dict[str, Any] = dict(
            forward_step_func=functools.partial(self._forward_step, state),
            num_microbatches=m,
            seq_length=longest,
            micro_batch_size=1,
            forward_only=not train,
        )
        self._state = state
        known = self._p2p is not None
        if known:
            # every stage knows each round's length from the plan: no shape messages (a stage receiving
            # a shape its peer sends only later is what hangs the interleaved schedule on <= PP rounds)
            split = self._token_multiple  # sequence parallelism: a stage sends its [T/TP, 1, H] shard
            cfg = chunks[0].config
            shapes = [(self._round_input(state, r).tokens.shape[0] // split, 1, cfg.hidden_size) for r in range(m)]
            if len(chunks) == 1:
                self._p2p.expect_shapes(shapes, forward_only=not train)  # 1F1B: micro-batch order
            else:
                group = int(getattr(cfg, "microbatch_group_size_per_vp_stage", None) or self.groups.pp_size)
                self._p2p.expect_interleaved_shapes(shapes, len(chunks), group, forward_only=not train)
        try:
            if self.groups.pp_size == 1:
                mc.forward_backward_no_pipelining(data_iterator=iters[0], model=chunks[0], **kwargs)
            elif len(chunks) == 1:
                mc.forward_backward_pipelining_without_interleaving(
                    data_iterator=iters[0], model=chunks[0], p2p_communicator=self._p2p,
                    pg_collection=self.runtime.groups, **kwargs)
            else:
                mc.forward_backward_pipelining_with_interleaving(
                    data_iterator=iters, model=chunks, p2p_communicator=self._p2p,
                    pg_collection=self.runtime.groups, **kwargs)
        finally:
            self._state = None
            if known:
                left = self._p2p.unused_shapes()
                self._p2p.expect_shapes(None)
        if known and left:
            raise RuntimeError(f"pipeline schedule of {m} micro-batches ended with {left} expected messages not received")
        return state

    # -- phase 3: reduce --

    def _reduce(self, state: _StepState) -> torch.Tensor:
        """One all-reduce over the job of [loss, loss_fn failed, per-sample non-finite flags]; the
        step's one host synchronisation.  Returns the reduced vector on the host (float64)."""
        counts = self.groups.is_last_stage and self.groups.tp_rank == 0  # each domain rank's loss once
        head = torch.stack([
            state.loss_sum if counts else torch.zeros_like(state.loss_sum),
            torch.tensor(1.0 if state.fn_error is not None else 0.0, dtype=torch.float64, device=state.bad.device),
        ])
        red = torch.cat([head, state.bad]).to(self._collective_device)
        dist.all_reduce(red, op=dist.ReduceOp.SUM, group=self.world_group)
        host = red.cpu()  # the one synchronisation of the step
        self.round_seconds = self._round_times(state)
        return host

    def _round_times(self, state: _StepState) -> list[float]:
        """Seconds per plan round on this rank (forward + backward over this rank's chunks); the
        events are complete after the step's synchronisation."""
        spans = state.timer.seconds(sync=False)
        out = [0.0] * state.prep.plan.num_rounds
        for (kind, r, _chunk), secs in spans.items():
            del kind
            if r < len(out):
                out[r] += secs
        return out

    def _check_reduced(self, state: _StepState, red: torch.Tensor) -> None:
        """Raise on every rank (after skipping the update) when a loss_fn failed or a loss is not finite."""
        if state.fn_error is not None or red[1] > 0:
            self._skip_update()  # nothing applied: grads zeroed, no optimizer step
            # every rank knows (red[1]): one fixed-size collective shares who failed and why
            self._guard.agree("loss_fn", self.step, state.fn_error)
            raise RuntimeError(f"step {self.step}: loss_fn failed on some rank; the update was skipped")
        nonfinite = red[2:] > 0
        if nonfinite.any() or not torch.isfinite(red[0]):
            self._skip_update()
            samples = torch.nonzero(nonfinite).flatten().tolist()
            raise NonFiniteLossError(self.step, samples, self._ranks_of(state.prep.plan, samples))

    # -- phase 4: optimizer step --

    def _optimizer_step(self) -> tuple[bool, Any]:
        """Finalize the gradients (DDP reduce-scatter over the domain with SUM, sequence-parallel
        norm gradients over TP) and step the distributed optimizer; returns (applied, grad norm), alike on every rank."""
        mc.finalize_model_grads(self.model_chunks, num_tokens=None, pg_collection=self.runtime.groups)
        ok, grad_norm, _ = self.optimizer.step()
        return ok, grad_norm

    # -- public steps --

    def train_step(self, batch: Batch, loss_fn: LossFn = nll_loss, *, plan: Plan | None = None) -> dict[str, Any]:
        """Plan ``batch`` (or use ``plan``), run every round with backward, and take one optimizer step.

        Returns metrics with stable names (``loss``, ``grad_norm``, ``perf/...``, ``hdp/...``).
        Raises on every rank of the job, with nothing applied: ``ValueError``/``TypeError`` for bad
        input (nothing run; the failed rank's own error, the others naming it),
        :class:`~hdp.guard.DomainStepError` for any other error of validation or of ``loss_fn``
        (raising, returning a non-scalar or a tensor without grad) on any rank, and
        :class:`NonFiniteLossError` when a loss is NaN/inf.  A rank that dies or hangs mid-step makes
        the others raise :class:`~hdp.guard.DomainUnreachableError` within
        ``EngineConfig.collective_timeout_s``.
        """
        t_start = time.perf_counter()
        prep = self._prepare(batch, "train_step", plan)
        self.step += 1  # counts steps that passed validation (NaN-skipped ones included)
        with self._collectives("rounds"):
            self._skip_update()  # zero the grad buffers and the optimizer's grads
            state = self._run_rounds(prep, loss_fn, train=True)
            red = self._reduce(state)
        self._check_reduced(state, red)
        with self._collectives("optimizer"):
            ok, grad_norm = self._optimizer_step()
        if not ok:
            raise RuntimeError(f"step {self.step}: Megatron's optimizer skipped the update (inf/NaN gradients)")
        with self._collectives("calibrate"):
            if self.config.calibration_path:
                self._write_records(prep.plan, self.round_seconds)
            # [auto-calibration] one all-gather of the round times; every n steps a refit, adopted alike on every rank
            cal = self._autocal.observe(prep.plan, self.round_seconds)
        if cal.cost is not None:
            self._planner = dataclasses.replace(self._planner, cost=cal.cost)
        step_s = time.perf_counter() - t_start
        return {**self._metrics(prep, float(red[0]), grad_norm, step_s, state.num_microbatches), **cal.metrics}

    @torch.no_grad()
    def forward(self, batch: Batch, *, plan: Plan | None = None) -> ForwardOutput:
        """Per-token log-probs and entropies of ``batch`` (no grad), in the caller's sample order.

        Computed on the last pipeline stage and sent to every stage, so every rank of the job
        returns the same outputs.
        """
        prep = self._prepare(batch, "forward", plan)
        with self._collectives("forward"):
            return self._forward_rounds(prep)

    def _forward_rounds(self, prep: _Prepared) -> ForwardOutput:
        plan = prep.plan
        state = self._run_rounds(prep, None, train=False)
        lengths = plan.lengths.tolist()
        total = int(sum(lengths))
        flat = torch.empty((total, 2), dtype=torch.float32, device=self._collective_device)
        if self.groups.is_last_stage:
            outs = []
            for r in range(plan.num_rounds):
                got = state.outputs.get(r)
                outs.append(got if got is not None else torch.zeros((0, 2), dtype=torch.float32, device=self.device))
            full = gather_outputs(plan, self.rank, outs, self.domain_group, dst="all")  # S x [L_i, 2] (input aligned)
            assert full is not None
            flat.copy_(torch.cat(full).to(flat.device))
        if self.groups.pp_size > 1:
            dist.broadcast(flat, src=self.groups.last_stage_global_rank, group=self.groups.pp)
        full = torch.split(flat.to(self.device), lengths)
        # input position p predicts token p+1: shift right to index by the predicted token
        lps = [torch.cat([x.new_zeros(1), x[:-1, 0]]) for x in full]
        ents = [torch.cat([x.new_zeros(1), x[:-1, 1]]) for x in full]
        return ForwardOutput(logprobs=lps, entropies=ents)

    # -- failure handling, metrics, records --

    def _skip_update(self) -> None:
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _ranks_of(self, plan: Plan, samples: Sequence[int]) -> list[int]:
        ranks: set[int] = set()
        for s in samples:
            start, k = int(plan.group_start[s]), int(plan.group_size[s])
            ranks.update(range(start, start + k))
        return sorted(ranks)

    def _metrics(self, prep: _Prepared, loss: float, grad_norm: Any, step_s: float, microbatches: int) -> dict[str, Any]:
        plan = prep.plan
        stats = plan.stats
        tokens = int(plan.lengths.sum())
        return {
            "loss": loss,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "perf/step_time": step_s,
            "perf/throughput": tokens / max(step_s, 1e-12) / self.groups.world_size,
            "perf/tokens": tokens,
            "perf/round_time_max": max(self.round_seconds, default=0.0),
            "hdp/rounds": plan.num_rounds,
            "hdp/microbatches": microbatches,
            "hdp/efficiency_planned": float(stats.efficiency) if stats else float("nan"),
            "hdp/idle_ratio_max": float(stats.max_idle_ratio) if stats else float("nan"),
            "hdp/cp_degree_hist": {int(k): int(v) for k, v in sorted(stats.cp_degree_hist.items())} if stats else {},
            "hdp/planner_ms": prep.planner_ms,
            "hdp/step": self.step,
        }

    def _write_records(self, plan: Plan, round_s: Sequence[float]) -> None:
        """Append calibration records (``hdp.packing.calibrate`` schema) from global rank 0.

        One all-gather over the job of every rank's per-round seconds and its (domain rank, stage);
        a group's seconds are the slowest of its domain ranks over all TP ranks and stages (the
        bottleneck stage of the pipeline), ``stage_seconds`` the same per stage.
        """
        pp = self.groups.pp_size
        row = list(round_s) + [float(self.rank), float(self.groups.pp_rank)]
        mine = torch.tensor(row, dtype=torch.float64, device=self._collective_device)  # [R+2]
        table = [torch.empty_like(mine) for _ in range(self.groups.world_size)]  # W x [R+2]
        dist.all_gather(table, mine, group=self.world_group)
        if self.groups.world_rank != 0:
            return
        rows = torch.stack(table).cpu().numpy()  # [W, R+2]
        times, dom, stage = rows[:, :-2], rows[:, -2].astype(int), rows[:, -1].astype(int)
        lines = []
        for rnd in plan.rounds:
            groups = []
            for g in rnd.groups:
                sel = (dom >= g.start) & (dom < g.start + g.size)
                per_stage = [float(times[sel & (stage == s), rnd.index].max()) for s in range(pp)]
                rec = {"kind": "group", "lengths": list(g.lengths), "group_size": g.size, "seconds": max(per_stage)}
                lines.append({**rec, "step": self.step, "round": rnd.index, "policy": plan.policy,
                              "pp": pp, "tp": self.groups.tp_size, "stage_seconds": per_stage})
                groups.append({"lengths": list(g.lengths), "group_size": g.size})
            per_stage = [float(times[stage == s, rnd.index].max()) for s in range(pp)]
            lines.append({"kind": "round", "seconds": max(per_stage), "groups": groups, "step": self.step,
                          "round": rnd.index, "policy": plan.policy, "pp": pp, "tp": self.groups.tp_size,
                          "stage_seconds": per_stage})
        path = Path(self.config.calibration_path)  # type: ignore[arg-type]
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:
            for rec in lines:
                fh.write(json.dumps(rec) + "\n")

    # -- state --

    def state_dict(self) -> dict[str, Any]:
        """This rank's model parameters (its chunks; local experts only under EP) and the step counter."""
        if len(self.model_chunks) == 1:
            return {"model": self.model_chunks[0].module.state_dict(), "step": self.step}
        return {**{f"model{i}": c.module.state_dict() for i, c in enumerate(self.model_chunks)}, "step": self.step}

    def _model_sharded_state_dict(self) -> dict[str, Any]:
        if len(self.model_chunks) == 1:
            return self.model_chunks[0].module.sharded_state_dict()
        return {f"model{i}": c.module.sharded_state_dict() for i, c in enumerate(self.model_chunks)}

    def _sharded_state_dict(self, is_loading: bool) -> dict[str, Any]:
        _ensure_optimizer_state(self.optimizer)
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

    def _check_layout(self, manifest: ckpt.Manifest) -> None:
        """A per-rank checkpoint loads only on the layout that wrote it (``dist`` reshards)."""
        if manifest.format != CheckpointFormat.PER_RANK.value:
            return
        saved = {k: manifest.meta.get(k) for k in self._layout()}
        if saved != self._layout():
            raise ckpt.CheckpointError(
                f"checkpoint (step {manifest.step}, format 'per-rank') was saved with layout {saved}; this engine has "
                f"{self._layout()}. A per-rank checkpoint loads only on the same layout (save with format='dist')"
            )

    def _payload(self) -> dict[str, Any]:
        """This rank's whole training state (what a per-rank checkpoint holds; tensors are live references)."""
        _ensure_optimizer_state(self.optimizer)  # a fresh optimizer: Adam's zero state, as its first step makes
        return {
            "format": CheckpointFormat.PER_RANK.value,
            "layout": self._layout(),
            "model": self.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "optimizer_shards": [_shard_state(o) for o in _optimizers(self.optimizer)],
            "hdp_step": self.step,
        }

    def _apply_payload(self, state: Mapping[str, Any]) -> None:
        """Put :meth:`_payload`'s state (on this engine's device) into the model and the optimizer."""
        model = state["model"]
        self._load_model_state(model["model"] if len(self.model_chunks) == 1 else model)
        self.optimizer.load_state_dict(state["optimizer"])
        for opt, shard in zip(_optimizers(self.optimizer), state["optimizer_shards"]):
            _load_shard_state(opt, shard)
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
        fmt = _checkpoint_format(format)
        with self._collectives("save"):
            if fmt is not CheckpointFormat.PER_RANK:
                problem = _dist_checkpoint_problem()
                flag = torch.tensor([0 if problem is None else 1], dtype=torch.int64,
                                    device=self._collective_device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.world_group)  # one decision for all
                if int(flag.item()) == 0:
                    fmt = CheckpointFormat.DIST
                elif fmt is CheckpointFormat.AUTO:
                    logger.info("save_checkpoint: per-rank format (%s)", problem or "another rank cannot write 'dist'")
                    fmt = CheckpointFormat.PER_RANK
                else:
                    raise ValueError(
                        f"save_checkpoint(format='dist'): {problem or 'another rank cannot write it (see its error)'}; "
                        "use format='per-rank' or 'auto'"
                    )

            def write(slot: Path) -> None:
                if fmt is CheckpointFormat.DIST:
                    mc.checkpoint_writers_die_with_parent()  # its spawned helper dies with this rank
                    dist_checkpointing.save(self._sharded_state_dict(is_loading=False), str(slot))
                else:
                    torch.save(self._payload(), slot / f"rank_{self.groups.world_rank}.pt")

            ckpt.save_slots(path, guard=self._guard, group=self.world_group, rank=self.groups.world_rank,
                            size=self.groups.world_size, step=self.step, format=fmt.value,
                            meta=self._checkpoint_meta(fmt), write=write)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load what :meth:`save_checkpoint` wrote (collective); the next step continues bit for bit.

        Verified before anything is touched, on every rank: the manifest (format version, the
        model-config digest, the layout for ``per-rank``) and the sha256 of every file; any problem
        on any rank raises :class:`~hdp.trainer.checkpoint.CheckpointError` (a ``ValueError``,
        through the step guard) on every rank.  Then every rank loads; if loading fails on any rank
        — whatever the exception type, Megatron's ``CheckpointException`` included — every rank puts
        back the state it had before the call (model, optimizer, step) and raises.  A ``dist``
        checkpoint also loads on another domain size.
        """
        self._usable("load_checkpoint")
        step = self.step
        with self._collectives("load"):
            manifest = ckpt.verify_checkpoint(
                path, guard=self._guard, rank=self.groups.world_rank, size=self.groups.world_size, step=step,
                expect={"model_config": self._model_digest()}, check=self._check_layout)
            slot = Path(path) / manifest.slot
            before: dict[str, Any] | None = None
            try:
                with self._guard.phase("load: apply", step):
                    before = _to_host(self._payload())  # the state to restore if any rank fails to load
                    if manifest.format == CheckpointFormat.DIST.value:
                        self._load_dist(slot)
                    else:
                        state = torch.load(slot / f"rank_{self.groups.world_rank}.pt", map_location=self.device,
                                           weights_only=False)
                        self._apply_payload(state)
            except BaseException:
                if before is not None:
                    with torch.no_grad():
                        self._apply_payload(_to_device(before, self.device))
                raise

    def _load_dist(self, slot: Path) -> None:
        state = dist_checkpointing.load(self._sharded_state_dict(is_loading=True), str(slot))
        self._load_model_state(state["model"])
        # no_grad: for fp32 models the optimizer's main parameters are views of the model's
        # leaf parameters, which Megatron's loader copies into in place
        with torch.no_grad():
            self.optimizer.load_state_dict(state["optimizer"])
        _restore_adam_steps(self.optimizer, state["optimizer"])
        self.step = int(state["hdp_step"])


def _to_host(obj: Any) -> Any:
    """A deep copy of ``obj`` with every tensor copied to host memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, _to_host(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return obj


def _to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def _gloo(group: dist.ProcessGroup) -> bool:
    return "gloo" in str(dist.get_backend(group))


class CheckpointFormat(str, enum.Enum):
    """On-disk format of :meth:`HdpEngine.save_checkpoint`."""

    AUTO = "auto"
    """``dist`` when every rank can write it (psutil installed, non-daemonic process), else ``per-rank``."""
    DIST = "dist"
    """Megatron distributed checkpointing (``megatron.core.dist_checkpointing``, torch_dist)."""
    PER_RANK = "per-rank"
    """One ``rank_{r}.pt`` per rank (model, optimizer common state and shard); same layout to load."""


def _checkpoint_format(value: CheckpointFormat | str) -> CheckpointFormat:
    try:
        fmt = CheckpointFormat(value)
    except ValueError as exc:
        raise ValueError(f"format={value!r}: choose one of {[f.value for f in CheckpointFormat]}") from exc
    return fmt


def _dist_checkpoint_problem() -> str | None:
    """Why this process cannot write a Megatron distributed checkpoint, or ``None``."""
    if importlib.util.find_spec("psutil") is None:
        return "megatron-core's checkpoint writer imports psutil, which is not installed (pip install psutil)"
    if multiprocessing.current_process().daemon:
        return (
            "megatron-core's checkpoint writer starts worker processes, which a daemonic process "
            "(this rank) may not do; start the ranks as non-daemonic processes"
        )
    return None


def _optimizers(optimizer: Any) -> list[Any]:
    """The distributed optimizers inside Megatron's (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _ensure_optimizer_state(optimizer: Any) -> None:
    """Allocate the inner torch optimizer's state where no step has created it yet.

    megatron-core 0.16.1 ``DistributedOptimizer.state_dict`` (called by ``sharded_state_dict``,
    also when loading) reads the ``step`` of every state entry when neither Apex nor
    TransformerEngine is installed (the CPU case) and asserts that there is exactly one, so it
    fails on an optimizer that has not stepped yet (a fresh engine about to load).  Zero moments
    and ``step = 0`` are what torch Adam/AdamW start from anyway, and loading overwrites them.
    """
    for opt in _optimizers(optimizer):
        inner = opt.optimizer
        params = [p for group in inner.param_groups for p in group["params"]]
        if all(len(inner.state[p]) for p in params):
            continue
        opt.init_state_fn(inner, opt.config)  # Megatron's own allocation of exp_avg / exp_avg_sq
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for p in params:
                inner.state[p].setdefault("step", torch.tensor(0.0, dtype=torch.float32))


def _restore_adam_steps(optimizer: Any, loaded: Mapping[Any, Any]) -> None:
    """Set the torch Adam ``step`` of every state entry to the loaded step, one tensor per entry.

    megatron-core 0.16.1, no Apex/TE (the CPU case), ``dp_reshardable``: ``load_state_dict``
    first sets every entry's ``step`` to the step saved in the param groups (one tensor shared by
    all entries), then ``load_parameter_state_from_dp_reshardable`` copies into it the *local
    placeholder* ``step`` captured when the loading state dict was built (``LocalNonpersistentObject``,
    the fresh optimizer's 0).  torch's AdamW also increments ``step`` in place, so a shared tensor
    would advance once per parameter.  ``loaded`` is the optimizer part of the loaded state dict.
    """
    subs = _optimizers(optimizer)
    states = [loaded] if len(subs) == 1 else [v for _, v in sorted(loaded.items())]
    for opt, st in zip(subs, states):
        steps = {g["step"] for g in st["optimizer"]["param_groups"] if g.get("step") is not None}
        if len(steps) != 1:
            continue  # Apex/TE optimizers keep the step in their param groups
        step = float(steps.pop())
        for entry in opt.optimizer.state.values():
            if "step" in entry:
                entry["step"] = torch.tensor(step, dtype=entry["step"].dtype, device=entry["step"].device)


def _shard_state(opt: Any) -> dict[str, Any]:
    """This rank's optimizer shard: the inner torch optimizer state (exp_avg, exp_avg_sq, step) and,
    for low-precision models, the fp32 main parameters (for fp32 models they are views of the
    model parameters, saved with the model)."""
    return {
        "inner": opt.optimizer.state_dict(),
        "main_params": [[t.detach().clone() for t in g] for g in getattr(opt, "shard_fp32_from_float16_groups", [])],
    }


def _load_shard_state(opt: Any, shard: Mapping[str, Any]) -> None:
    opt.optimizer.load_state_dict(shard["inner"])
    with torch.no_grad():
        for group, saved in zip(getattr(opt, "shard_fp32_from_float16_groups", []), shard["main_params"]):
            for t, v in zip(group, saved):
                t.copy_(v)
