"""The hdp training engine: a Megatron-core GPT trained under HDP plans, for any trainer.

    engine = HdpEngine.build(EngineConfig(...), dist.group.WORLD)  # in every rank of the domain
    metrics = engine.train_step(batch, loss_fn)             # plan, run all rounds, one optimizer step
    out = engine.forward(batch)                             # per-token log-probs/entropies, caller order
    engine.save_checkpoint(path); engine.load_checkpoint(path)

A step, on every rank of the domain (DESIGN.md):

1. validate the batch and plan it (pure, identical on every rank); agree on input errors with one
   fixed-size all-gather, then :func:`hdp.checksum.verify_plan` — so a bad input or a plan mismatch
   raises on every rank instead of hanging;
2. per-token loss weights for the whole batch (:mod:`hdp.loss`): Σ over the domain of
   Σ_t w_t ℓ_t is the exact single-process loss of the configured aggregation;
3. every rank runs every round (lock-step, so EP all-to-alls and CP rings line up): its chunks of
   its group's samples with a :class:`~hdp.trainer.attention_spec.CPContext` for the group (ring,
   or all-gather on aligned power-of-two blocks when configured); a rank without tokens (idle, or
   holding none of its group's short samples) runs one pad token with loss 0 (Megatron's
   attention cannot run 0 tokens), inside its group's CP communication when it has a group;
4. one all-reduce of (loss, per-sample non-finite flags); a non-finite loss anywhere skips the
   update on every rank (grads zeroed, parameters unchanged) and raises
   :class:`NonFiniteLossError` naming the step and the samples;
5. Megatron DDP reduce-scatters the gradients with SUM (``calculate_per_token_loss=True``, no 1/N
   scaling: the weights already normalise globally) and the distributed optimizer steps.

Token alignment.  Per-token tensors of a :class:`Batch` (loss mask, advantages, old log-probs)
are indexed like the tokens: element t describes token t.  Token t is *predicted* from the
tokens before it, so log p(token t) comes from the logits at position t-1.  hdp shifts every
per-token tensor by one per sample *before* the zigzag split (``x'[p] = x[p+1]``, last = 0) so that
all local tensors of a round line up with the local logits; the loss function therefore receives,
at local position p, the target token (``local.targets[p]``) and the caller's values for that
target.  Token 0 of a sample is never predicted (its mask is ignored, its log-prob is 0).

Legend: S samples, L_i sample length, T local tokens of one round, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import logging
import math
import multiprocessing
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from hdp import device as _device
from hdp import megatron_compat as mc
from hdp.moe.levels import ZeroMemoryLevel
from hdp.moe.zero_memory import apply_zero_memory
from hdp.checksum import collective_device, verify_plan
from hdp.cp import CPAlgorithm
from hdp.dispatch import LocalMeta, gather_outputs, local_meta, pack
from hdp.groups import DomainGroups
from hdp.loss import sample_token_weights
from hdp.megatron_compat import dist_checkpointing
from hdp.packing import Plan, check_plan, simulate
from hdp.packing import plan as make_plan
from hdp.trainer.attention_spec import CPContext, HdpPackedSeqParams, packed_seq_params
from hdp.trainer.autocal import DomainAutoCalibrator  # [auto-calibration]
from hdp.trainer.config import EngineConfig
from hdp.trainer.model import build_gpt_model, build_optimizer, packed_logits, token_logprobs, wrap_ddp

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
    """[T, V] logits (with grad), e.g. for an entropy bonus."""


class LossFn(Protocol):
    """``loss_fn(local, logprobs [T], weights [T]) -> scalar``.

    Must return Σ_t weights[t] · ℓ_t for the per-token loss ℓ it wants (``weights`` already hold the
    mask and the global normaliser of the configured aggregation), so that the sum over the
    domain is the exact loss of the whole batch.
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


def global_param_name(name: str, ep_rank: int, experts_per_rank: int) -> str:
    """``name`` with a local expert index ``local_experts.{i}`` turned into the global expert index."""
    key = "local_experts."
    at = name.find(key)
    if at < 0:
        return name
    head, rest = name[: at + len(key)], name[at + len(key) :]
    idx, _, tail = rest.partition(".")
    return f"{head}{ep_rank * experts_per_rank + int(idx)}.{tail}" if tail else f"{head}{ep_rank * experts_per_rank + int(idx)}"


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


# ---- the engine ------------------------------------------------------------------------------------


class HdpEngine:
    """A Megatron GPT with DDP and the distributed optimizer, trained under HDP plans.

    Build it with :meth:`build` in every rank of the domain (after ``init_process_group``).
    """

    def __init__(
        self,
        config: EngineConfig,
        domain_group: dist.ProcessGroup,
        groups: DomainGroups,
        model: Any,
        optimizer: Any,
        device: torch.device,
    ) -> None:
        self.config = config
        self.domain_group = domain_group
        self.groups = groups
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.rank = groups.domain_rank
        self.num_ranks = groups.size
        self.step = 0
        self._planner = config.planning.planner_config(self.num_ranks)
        # [auto-calibration] refits the cost model from the timed rounds (trainer/autocal.py)
        self._autocal = DomainAutoCalibrator(config.planning.auto_calibrate, self._planner.cost, domain_group,
                                             rank=self.rank, size=self.num_ranks)

    # -- construction --

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        domain_group: dist.ProcessGroup,
        *,
        init_fn: Callable[[str, torch.Tensor], None] | None = None,
    ) -> "HdpEngine":
        """Initialise Megatron over the domain, build model, DDP and distributed optimizer.

        ``domain_group``: the process group of the domain, named explicitly; it must span the whole
        world (``dist.group.WORLD``) while Megatron runs with TP = PP = 1 (its data-parallel group is
        the world).  ``init_fn(name, param)``, if
        given, fills each parameter in place before DDP wraps it; ``name`` is the global parameter
        name (expert indices global, see :func:`global_param_name`), so a rank-independent
        function gives the same model whatever the expert-parallel layout.
        """
        if not dist.is_initialized():
            raise ValueError("HdpEngine.build: torch.distributed is not initialised; call init_process_group first")
        if not isinstance(config, EngineConfig):
            raise ValueError(f"config={config!r}: pass a hdp.trainer.config.EngineConfig")
        if not isinstance(domain_group, dist.ProcessGroup):
            raise ValueError(
                f"domain_group={domain_group!r}: pass the domain's process group (dist.group.WORLD)"
            )
        group = domain_group
        if dist.get_world_size(group) != dist.get_world_size():
            raise ValueError(
                f"domain_group has {dist.get_world_size(group)} ranks but the world has {dist.get_world_size()}: "
                "hdp runs Megatron with TP = PP = 1, so the domain must be the whole world (pass dist.group.WORLD)"
            )
        n = dist.get_world_size(group)
        ep = config.model.expert_model_parallel_size
        if n % ep:
            raise ValueError(
                f"EngineConfig.model.expert_model_parallel_size={ep}: must divide the domain size {n}"
            )
        device = _device.select_device(config.device)
        mc.initialize_megatron(expert_model_parallel_size=ep, seed=config.seed, device=device)
        torch.manual_seed(config.seed)  # identical initial weights on every rank
        model = build_gpt_model(config.model, device)
        if init_fn is not None:
            ep_rank = mc.parallel_state.get_expert_model_parallel_rank()
            per_rank = (config.model.num_moe_experts or 0) // ep
            with torch.no_grad():
                for name, p in model.named_parameters():
                    init_fn(global_param_name(name, ep_rank, per_rank), p)
        if config.moe_zero_memory is not ZeroMemoryLevel.NONE:
            # MoE layers become ZeroMemoryMoELayer (same parameters and names) before DDP wraps them
            apply_zero_memory(model, config.moe_zero_memory, config.moe_zero_memory_num_layers)
        ddp = wrap_ddp(model, config.optim)
        ddp.broadcast_params()  # replicas start identical even if the init was rank-dependent
        optimizer = build_optimizer(ddp, config.optim)
        groups = DomainGroups.build(group)
        logger.info("hdp engine: %d ranks, EP=%d, device %s", n, ep, device)
        return cls(config, group, groups, ddp, optimizer, device)

    # -- validation and planning --

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

    def _agree(self, what: str, error: BaseException | None) -> None:
        """One fixed-size all-gather of error flags: a bad input on any rank raises on every rank."""
        dev = collective_device(self.domain_group)
        flag = torch.tensor([1 if error is not None else 0], dtype=torch.int64, device=dev)
        flags = [torch.empty_like(flag) for _ in range(self.num_ranks)]
        dist.all_gather(flags, flag, group=self.domain_group)
        bad = [r for r, f in enumerate(flags) if int(f.item())]
        if error is not None:
            raise type(error)(f"{what} (step {self.step + 1}, domain rank {self.rank}): {error}") from error
        if bad:
            raise ValueError(
                f"{what} (step {self.step + 1}): invalid input on domain ranks {bad} (see their errors); "
                "nothing was run; every rank must pass the same valid batch"
            )

    def plan(self, batch: Batch) -> Plan:
        """The plan of ``batch`` on this domain (pure; the same on every rank)."""
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
        try:
            check_plan(plan)
        except AssertionError as exc:
            raise ValueError(f"plan is invalid: {exc}; build it with hdp.packing.plan or Plan.from_columns") from exc

    def _prepare(self, batch: Batch, what: str, given: Plan | None = None) -> _Prepared:
        error: BaseException | None = None
        prepared: _Prepared | None = None
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
        except (ValueError, TypeError) as exc:
            error = exc
        self._agree(what, error)  # fixed size: never hangs, whatever the inputs
        assert prepared is not None
        verify_plan(prepared.plan, self.domain_group, device=collective_device(self.domain_group))
        return prepared

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

    # -- one round --

    def _context(self, meta: LocalMeta) -> HdpPackedSeqParams:
        if meta.k == 1:
            return packed_seq_params(meta.group_lengths, self.device)
        algo = CPAlgorithm.RING
        aligned = meta.k & (meta.k - 1) == 0 and meta.group_start % meta.k == 0
        if self.config.planning.cp_algorithm is CPAlgorithm.ALLGATHER and aligned:
            algo = CPAlgorithm.ALLGATHER
        cp = CPContext(
            group_lengths=meta.group_lengths,
            k_group=meta.k,
            ring=self.groups.ring(meta.group_start, meta.k),
            groups=self.groups,
            algo=algo,
        )
        return packed_seq_params(meta.group_lengths, self.device, cp=cp)

    def _round_logits(self, prep: _Prepared, meta: LocalMeta) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [T, V] of this rank's round and the packed tokens (``None`` for a pad-token round).

        A rank without tokens runs one pad token (Megatron's attention cannot run 0 tokens; its
        loss weight is 0): alone when idle, else with its group's CP context, whose layout holds
        0 tokens here (samples shorter than 2k on k ranks), so that the group's ring or
        all-gather still lines up (:class:`~hdp.trainer.attention_spec.HdpCoreAttention`).
        """
        if meta.num_tokens == 0:
            pad = torch.full((1,), self.config.pad_token_id, dtype=torch.int64, device=self.device)
            psp = packed_seq_params([1], self.device) if meta.idle else self._context(meta)
            return packed_logits(self.model, pad, psp), None
        tokens = pack(meta, prep.tokens).to(self.device)  # [T]
        return packed_logits(self.model, tokens, self._context(meta)), tokens

    def _local(self, prep: _Prepared, meta: LocalMeta, logits: torch.Tensor) -> LocalTensors:
        dev = self.device
        return LocalTensors(
            round_index=meta.round_index,
            samples=meta.samples,
            targets=pack(meta, prep.targets).to(dev),
            mask=pack(meta, prep.mask).to(dev),
            extras={name: pack(meta, xs).to(dev) for name, xs in prep.extras.items()},
            sample_index=meta.sample_index.to(dev),
            target_position=(meta.position_ids + 1).to(dev),
            logits=logits,
        )

    def _sync_time(self) -> float:
        _device.synchronize(self.device)
        return time.perf_counter()

    # -- public steps --

    def train_step(self, batch: Batch, loss_fn: LossFn = nll_loss, *, plan: Plan | None = None) -> dict[str, Any]:
        """Plan ``batch`` (or use ``plan``), run every round with backward, and take one optimizer step.

        Returns metrics with stable names (``loss``, ``grad_norm``, ``perf/...``, ``hdp/...``).
        Raises ``ValueError`` on every rank for bad input (nothing run), and
        :class:`NonFiniteLossError` on every rank when the loss is NaN/inf (no update).
        """
        t_start = self._sync_time()
        prep = self._prepare(batch, "train_step", plan)
        self.step += 1  # counts steps that passed validation (NaN-skipped ones included)
        plan = prep.plan
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        local_loss = 0.0
        bad = torch.zeros(plan.num_samples, dtype=torch.float64)  # [S] non-finite flags
        fn_error: BaseException | None = None
        round_s: list[float] = []
        for r in range(plan.num_rounds):
            t0 = self._sync_time()
            meta = local_meta(plan, self.rank, r)
            logits, tokens = self._round_logits(prep, meta)  # [T, V]
            loss = None
            if tokens is not None and fn_error is None:
                local = self._local(prep, meta, logits)
                weights = pack(meta, prep.weights).to(self.device)  # [T]
                try:
                    loss = loss_fn(local, token_logprobs(logits, local.targets), weights)
                    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                        raise TypeError(
                            f"loss_fn returned {type(loss).__name__}"
                            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; return a scalar tensor"
                        )
                except Exception as exc:  # a caller bug on one rank must not hang the others
                    fn_error, loss = exc, None
            if loss is None:
                loss = logits.sum() * 0.0  # idle round: backward still runs (EP all-to-alls line up)
            loss = loss.reshape(())
            loss.backward()
            value = float(loss.detach())
            if not math.isfinite(value):
                bad[list(meta.samples)] = 1.0
            local_loss += value
            round_s.append(self._sync_time() - t0)

        # one all-reduce: [loss, loss_fn failed?, non-finite flag per sample]
        red = torch.cat([torch.tensor([local_loss, 1.0 if fn_error else 0.0], dtype=torch.float64), bad])
        red = red.to(collective_device(self.domain_group))
        dist.all_reduce(red, op=dist.ReduceOp.SUM, group=self.domain_group)
        red = red.cpu()
        if fn_error is not None or red[1] > 0:
            self._skip_update()
            if fn_error is not None:
                raise RuntimeError(f"step {self.step}: loss_fn failed on domain rank {self.rank}: {fn_error}") from fn_error
            raise RuntimeError(
                f"step {self.step}: loss_fn failed on another domain rank (see its error); the update was skipped"
            )
        nonfinite = red[2:] > 0
        if nonfinite.any() or not math.isfinite(float(red[0])):
            self._skip_update()
            samples = torch.nonzero(nonfinite).flatten().tolist()
            ranks = self._ranks_of(plan, samples)
            raise NonFiniteLossError(self.step, samples, ranks)

        self.model.finish_grad_sync()  # SUM over the domain (per-token loss: no 1/N scaling)
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError(f"step {self.step}: Megatron's optimizer skipped the update (inf/NaN gradients)")
        if self.config.calibration_path:
            self._write_records(plan, round_s)
        # [auto-calibration] one all-gather of the round times; every n steps a refit, adopted alike on every rank
        cal = self._autocal.observe(plan, round_s)
        if cal.cost is not None:
            self._planner = dataclasses.replace(self._planner, cost=cal.cost)
        step_s = self._sync_time() - t_start
        return {**self._metrics(plan, prep.planner_ms, float(red[0]), grad_norm, step_s), **cal.metrics}

    @torch.no_grad()
    def forward(self, batch: Batch, *, plan: Plan | None = None) -> ForwardOutput:
        """Per-token log-probs and entropies of ``batch`` (no grad), in the caller's sample order."""
        prep = self._prepare(batch, "forward", plan)
        plan = prep.plan
        outs: list[torch.Tensor] = []
        for r in range(plan.num_rounds):
            meta = local_meta(plan, self.rank, r)
            logits, tokens = self._round_logits(prep, meta)  # [T, V]
            if tokens is None:
                outs.append(torch.zeros((0, 2), dtype=torch.float32, device=self.device))
                continue
            targets = pack(meta, prep.targets).to(self.device)
            logp_all = torch.log_softmax(logits.float(), dim=-1)  # [T, V]
            lp = logp_all.gather(-1, targets[:, None])[:, 0]  # [T]
            ent = -(logp_all.exp() * logp_all).sum(-1)  # [T]
            outs.append(torch.stack([lp, ent], dim=-1))  # [T, 2]
        full = gather_outputs(plan, self.rank, outs, self.domain_group, dst="all")  # S x [L_i, 2] (input aligned)
        assert full is not None
        # input position p predicts token p+1: shift right to index by the predicted token
        lps = [torch.cat([x.new_zeros(1), x[:-1, 0]]) for x in full]
        ents = [torch.cat([x.new_zeros(1), x[:-1, 1]]) for x in full]
        return ForwardOutput(logprobs=lps, entropies=ents)

    # -- failure handling, metrics, records --

    def _skip_update(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _ranks_of(self, plan: Plan, samples: Sequence[int]) -> list[int]:
        ranks: set[int] = set()
        for s in samples:
            start, k = int(plan.group_start[s]), int(plan.group_size[s])
            ranks.update(range(start, start + k))
        return sorted(ranks)

    def _metrics(self, plan: Plan, planner_ms: float, loss: float, grad_norm: Any, step_s: float) -> dict[str, Any]:
        stats = plan.stats
        tokens = int(plan.lengths.sum())
        return {
            "loss": loss,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "perf/step_time": step_s,
            "perf/throughput": tokens / max(step_s, 1e-12) / self.num_ranks,
            "perf/tokens": tokens,
            "hdp/rounds": plan.num_rounds,
            "hdp/efficiency_planned": float(stats.efficiency) if stats else float("nan"),
            "hdp/idle_ratio_max": float(stats.max_idle_ratio) if stats else float("nan"),
            "hdp/cp_degree_hist": {int(k): int(v) for k, v in sorted(stats.cp_degree_hist.items())} if stats else {},
            "hdp/planner_ms": planner_ms,
            "hdp/step": self.step,
        }

    def _write_records(self, plan: Plan, round_s: Sequence[float]) -> None:
        """Append calibration records (``hdp.packing.calibrate`` schema) from domain rank 0."""
        mine = torch.tensor(list(round_s), dtype=torch.float64, device=collective_device(self.domain_group))  # [R]
        table = [torch.empty_like(mine) for _ in range(self.num_ranks)]  # N x [R]
        dist.all_gather(table, mine, group=self.domain_group)
        if self.rank != 0:
            return
        times = torch.stack(table).cpu().numpy()  # [N, R]
        lines = []
        for rnd in plan.rounds:
            groups = []
            for g in rnd.groups:
                secs = float(times[g.start : g.start + g.size, rnd.index].max())
                rec = {"kind": "group", "lengths": list(g.lengths), "group_size": g.size, "seconds": secs}
                lines.append({**rec, "step": self.step, "round": rnd.index, "policy": plan.policy})
                groups.append({"lengths": list(g.lengths), "group_size": g.size})
            lines.append({"kind": "round", "seconds": float(times[:, rnd.index].max()), "groups": groups,
                          "step": self.step, "round": rnd.index, "policy": plan.policy})
        path = Path(self.config.calibration_path)  # type: ignore[arg-type]
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as fh:
            for rec in lines:
                fh.write(json.dumps(rec) + "\n")

    # -- state --

    def state_dict(self) -> dict[str, Any]:
        """This rank's model parameters (local experts only under EP) and the step counter."""
        return {"model": self.model.module.state_dict(), "step": self.step}

    def _sharded_state_dict(self, is_loading: bool) -> dict[str, Any]:
        _ensure_optimizer_state(self.optimizer)
        model_sd = self.model.module.sharded_state_dict()
        # megatron-core 0.16.1: the default 'fully_sharded_model_space' relies on flattened_range,
        # which dist_checkpointing rejects, and 'fully_reshardable' gathers through a hard-coded
        # ``.cuda()``; 'dp_reshardable' saves each rank's optimizer shard without communication
        # (load with the same domain size).
        meta = {"distrib_optim_sharding_type": "dp_reshardable"}
        return {
            "model": model_sd,
            "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=meta),
            "hdp_step": self.step,
        }

    def save_checkpoint(self, path: str | os.PathLike[str], *, format: CheckpointFormat | str = "auto") -> None:
        """Save model, optimizer and step counter into the directory ``path`` (collective).

        ``dist``: Megatron distributed checkpointing (model + distributed-optimizer sharded state
        dicts, torch_dist backend, optimizer as ``dp_reshardable``: load with the same domain
        size).  megatron-core 0.16.1's writer needs ``psutil`` and starts worker processes, so the
        rank must not run in a daemonic process.  ``per-rank``: every rank writes ``rank_{r}.pt``
        with its model state, the optimizer's common state and its own optimizer shard (no
        communication; load with the same domain and EP size).  ``auto``: ``dist`` when every rank
        of the domain can write it, else ``per-rank``.  Raises ``ValueError`` on every rank when
        ``dist`` is asked for and some rank cannot write it.
        """
        fmt = _checkpoint_format(format)
        if fmt is not CheckpointFormat.PER_RANK:
            problem = _dist_checkpoint_problem()
            flag = torch.tensor([0 if problem is None else 1], dtype=torch.int64,
                                device=collective_device(self.domain_group))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.domain_group)  # one decision for all
            if int(flag.item()) == 0:
                fmt = CheckpointFormat.DIST
            elif fmt is CheckpointFormat.AUTO:
                logger.info("save_checkpoint: per-rank format (%s)", problem or "another rank cannot write 'dist'")
                fmt = CheckpointFormat.PER_RANK
            else:
                raise ValueError(
                    f"save_checkpoint(format='dist'): {problem or 'another domain rank cannot write it (see its error)'}; "
                    "use format='per-rank' or 'auto'"
                )
        path = Path(path)
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier(group=self.domain_group)
        if fmt is CheckpointFormat.DIST:
            dist_checkpointing.save(self._sharded_state_dict(is_loading=False), str(path))
        else:
            torch.save(
                {
                    "format": CheckpointFormat.PER_RANK.value,
                    "domain_size": self.num_ranks,
                    "expert_model_parallel_size": self.config.model.expert_model_parallel_size,
                    "model": self.model.module.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "optimizer_shards": [_shard_state(o) for o in _optimizers(self.optimizer)],
                    "hdp_step": self.step,
                },
                path / f"rank_{self.rank}.pt",
            )
        dist.barrier(group=self.domain_group)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Load what :meth:`save_checkpoint` wrote (collective); the next step continues bit for bit."""
        path = Path(path)
        if (path / "metadata.json").exists():
            state = dist_checkpointing.load(self._sharded_state_dict(is_loading=True), str(path))
            self.model.module.load_state_dict(state["model"])
            # no_grad: for fp32 models the optimizer's main parameters are views of the model's
            # leaf parameters, which Megatron's loader copies into in place
            with torch.no_grad():
                self.optimizer.load_state_dict(state["optimizer"])
            _restore_adam_steps(self.optimizer, state["optimizer"])
            self.step = int(state["hdp_step"])
            return
        mine = path / f"rank_{self.rank}.pt"
        if not mine.exists():
            raise ValueError(
                f"load_checkpoint: {str(path)!r} holds neither a Megatron distributed checkpoint (metadata.json) "
                f"nor {mine.name}; pass a directory written by HdpEngine.save_checkpoint"
            )
        state = torch.load(mine, map_location=self.device, weights_only=False)
        ep = self.config.model.expert_model_parallel_size
        if state["domain_size"] != self.num_ranks or state["expert_model_parallel_size"] != ep:
            raise ValueError(
                f"load_checkpoint: {str(path)!r} was saved on {state['domain_size']} ranks with EP="
                f"{state['expert_model_parallel_size']}; this engine has {self.num_ranks} ranks and EP={ep}. "
                "A per-rank checkpoint loads only on the same layout (use format='dist' to reshard)"
            )
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for opt, shard in zip(_optimizers(self.optimizer), state["optimizer_shards"]):
            _load_shard_state(opt, shard)
        self.step = int(state["hdp_step"])


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
