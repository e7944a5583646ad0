"""The one round core both engines run: the phases of a step — agree → rounds through Megatron's
schedule → reduce → optimizer step or an agreed skip.  The only place in hdp that calls Megatron's
forward/backward schedules; the sequence of the phases, with the non-finite rules, calibration and the
release, is written once in :mod:`hdp.trainer.step`, which both doors call.

A step's phases are

1. **agree** (:meth:`RoundCore.agree_call`, the first collective of every engine call): the engine's own
   validation and planning run inside it and may raise anything, ``BaseException`` included; one
   fixed-size all-reduce over the job (:func:`hdp.checksum.agree_step`) compares the call (its name and
   arguments: another call on some rank is named on every rank), agrees on failures and compares the
   plan checksum and the batch digest over the domain, the pipeline and the TP ranks at once; when any
   rank failed, the step guard
   (:mod:`hdp.guard`) shares the messages and every rank raises, naming the failed world ranks;
2. **rounds** (:meth:`RoundCore.run`): every round is one micro-batch of Megatron's schedule
   (``forward_backward_no_pipelining`` at PP = 1, 1F1B, or interleaved with virtual stages; every
   stage knows each round's shape from the plan, so no shape message is ever sent).  One padding
   rule: under the interleaved schedule the rounds are padded with idle micro-batches to a multiple
   of Megatron's ``microbatch_group_size_per_vp_stage`` (PP by default); a rank without tokens runs
   padding tokens (Megatron cannot run 0 tokens), inside its group's CP communication when it has a
   group.  On the last stage the round's output goes to the engine's **loss adapter**
   (:class:`RoundLoss`): hdp's per-token weights for the library, verl's loss function on whole
   samples for verl.  That output is the logits [T, Vl] (the logits path), or on the fused log-prob
   path (``fused_logprobs``: the output layer returns its TP-gathered input,
   `hdp.megatron_compat.head`) a `hdp.fused_logprobs.LastHidden` — the final hidden states [T, H] and
   the output layer's weight shard [Vl, H] — from which the adapter computes log-probs without
   [T, Vl].  The adapter returns the round's share of the step loss (the sum over the domain of the
   shares is the exact loss); the core undoes Megatron's scaling (``÷ micro-batches`` and DDP's
   ``÷ N`` when ``calculate_per_token_loss`` is off).  A failing adapter is recorded and
   the rounds go on with a zero loss, so every collective lines up;
3. **reduce** (:meth:`RoundCore.reduce`): one all-reduce over the job of (loss, adapter failed, ranks
   whose gradient buffers hold a NaN/inf — each rank's own device-side check —, per-sample non-finite
   flags) — the step's one host synchronisation;
4. **optimizer** (:meth:`RoundCore.optimizer_step`) or :meth:`RoundCore.skip_update` (gradients
   zeroed, parameters unchanged) — decided from the reduced flags, alike on every rank
   (`hdp.trainer.step.Steps.finish`).

A phase that breaks off inside its collectives marks the core unusable
(:meth:`RoundCore.collectives`): every later call raises at once, without touching the network.

Legend: S samples, T local tokens of a round (Tr real, the rest padding), Vl vocabulary shard,
R rounds, m micro-batches (R, padded under interleaving), N domain size.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import logging
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist

from hdp import device as _device
from hdp import megatron_compat as mc
from hdp.checksum import agree_step
from hdp.cp import CPAlgorithm
from hdp.dispatch import LocalMeta, local_meta, pack
from hdp.fused_logprobs import LastHidden
from hdp.groups import LayoutGroups
from hdp.alarm import Alarm, is_transport_error
from hdp.guard import DomainStepError, DomainUnreachableError, RankFailedError, StepGuard, describe, is_input_error
from hdp.memory_meter import MemoryMeter
from hdp.packing import Plan
from hdp.trainer.attention_spec import CPContext, HdpPackedSeqParams, packed_seq_params
from hdp.trainer.phases import PhaseTimer

__all__ = ["check_round_loss", "RoundCore", "RoundInput", "RoundLoss", "RoundHooks", "StepState", "NonFiniteLossError",
           "NonFiniteGradientError", "next_token_targets"]

PEER_REPORT_WAIT_S = 1.0
"""How long a rank whose collective broke waits for a peer's published error before it reports a lost peer.  A
rank that fails on its own publishes before it frees its groups (the break its peers see), so its report is
normally there already; a killed rank publishes nothing, and its peers raise after this wait."""


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


class NonFiniteGradientError(NonFiniteLossError):
    """A step's loss was finite but a gradient was NaN/inf on some rank (any parameter); the update was
    skipped on every rank, exactly as for a non-finite loss (a :class:`NonFiniteLossError`)."""

    def __init__(self, step: int, world_ranks: Sequence[int], loss: float) -> None:
        self.step = step
        self.samples = ()
        self.ranks = tuple(world_ranks)
        FloatingPointError.__init__(
            self,
            f"step {step}: the gradient is not finite on world ranks {list(world_ranks)} (the loss {loss:.6g} is "
            "finite); the update was skipped on every rank (parameters and optimizer state unchanged, gradients "
            "zeroed). Check the loss function's backward (a sqrt or log at 0, a division by a zero count) and the "
            "per-token inputs"
        )


def check_round_loss(loss: Any, who: str, inputs: str) -> None:
    """TypeError unless ``loss`` is a scalar tensor that requires grad: what a training round's loss must be.
    ``who`` names the function that returned it, ``inputs`` what it should be built from."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"{who} returned {type(loss).__name__}"
                        f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; return a scalar tensor")
    if not loss.requires_grad:
        raise TypeError(f"{who} returned a tensor that does not require grad (detached, or computed under "
                        f"torch.no_grad / from .item()); build the loss from {inputs}")


def next_token_targets(tokens: Sequence[torch.Tensor], pad_token_id: int) -> list[torch.Tensor]:
    """S x [L_i]: the token each position predicts (token p+1 of its sample; ``pad_token_id`` after the last)."""
    return [torch.cat([t[1:], t.new_full((1,), pad_token_id)]) for t in tokens]


@dataclass(frozen=True, eq=False)
class RoundInput:
    """This rank's micro-batch of one round: packed tokens (real, then padding) and their context."""

    index: int
    """Micro-batch index (plan round; rounds beyond the plan are interleaving padding)."""
    meta: LocalMeta | None
    """Where the real tokens come from; ``None`` for a padding round beyond the plan."""
    tokens: torch.Tensor
    """[T] int64 token ids on the device (Tr real ones, then padding)."""
    psp: HdpPackedSeqParams
    """THD packed-sequence parameters with the CP context."""

    @property
    def real(self) -> int:
        """Tr: the real tokens."""
        return 0 if self.meta is None else self.meta.num_tokens


class RoundLoss(Protocol):
    """An engine's loss adapter: called on the last stage for every round where this rank holds tokens.

    ``adapter(rnd, out) -> scalar or None``, ``out`` the round's output on this rank's Tr real tokens:
    logits [Tr, Vl], or on the fused path a `hdp.fused_logprobs.LastHidden` (hidden states [Tr, H] and
    the output layer's weight shard; `hdp.fused_logprobs.token_logprobs_entropy` takes either).  In a
    training step, the round's share of the step loss (its gradient summed over the domain is the exact
    gradient), or ``None`` when this rank adds nothing; in a forward-only pass the return value is ignored
    (the adapter keeps its outputs).
    May raise: the core records the first error, runs the remaining rounds with a zero loss (still
    calling the adapter, whose collectives must line up) and reports it in :meth:`RoundCore.reduce`.
    """

    def __call__(self, rnd: RoundInput, out: torch.Tensor | LastHidden) -> torch.Tensor | None: ...


class RoundHooks(Protocol):
    """What a door runs around each model chunk's forward of a round (verl's MoE router replay sets each
    router's experts for the round's tokens before it, and switches them to their backward replay after it).

    ``before_forward(rnd, chunk, model)`` / ``after_forward(rnd, chunk, model)``: ``chunk`` is the virtual-stage
    index of ``model`` on this rank; ``finish()``: once after every round (also when one failed)."""

    def before_forward(self, rnd: RoundInput, chunk: int, model: Any) -> None: ...

    def after_forward(self, rnd: RoundInput, chunk: int, model: Any) -> None: ...

    def finish(self) -> None: ...


@dataclass(eq=False)
class StepState:
    """What one step's rounds produce on this rank, kept on the device until the step's one sync."""

    plan: Plan
    train: bool
    adapter: RoundLoss | None
    num_microbatches: int
    loss_sum: torch.Tensor
    """[] float64: Σ of this rank's round losses (last stage), as the adapter returned them."""
    bad: torch.Tensor
    """[S] float64: > 0 where a round holding the sample had a non-finite loss."""
    timer: _device.RoundTimer
    error: BaseException | None = None
    """The first error the adapter raised on this rank."""
    timer_round: int = -1
    inputs: dict[int, RoundInput] = field(default_factory=dict)
    marked: set[tuple[int, int]] = field(default_factory=set)
    """(round, chunk) whose first layer's input carries the backward span's stop mark."""
    meter: MemoryMeter | None = None
    """Measures each round's peak memory (`hdp.memory_meter`), when the engine asked for it."""
    grad_bad: torch.Tensor | None = None
    """[] float64: 1 when this rank's gradient buffers held a NaN/inf after the rounds (:meth:`RoundCore.reduce`)."""
    hooks: RoundHooks | None = None
    """The door's hooks around each chunk's forward (`RoundHooks`)."""


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


def _gloo(group: dist.ProcessGroup) -> bool:
    return "gloo" in str(dist.get_backend(group))


class RoundCore:
    """Runs an engine's steps over the job (see the module docstring).

    ``groups``: the job's groups (``world`` is the core's own agreement group, built with the
    engine's timeout: :meth:`job_group`); ``megatron_groups``: Megatron's ``ProcessGroupCollection``
    (passed to the pipeline schedules); ``chunks``: this rank's DDP model chunks (one, or one per
    virtual stage); ``pad_token_id``: the token padding runs; ``cp_algorithm``: ring everywhere, or
    all-gather on aligned power-of-two groups; ``timeout_s``: quoted in errors; ``optimizer``: Megatron's
    optimizer over ``chunks`` (``None`` for a forward-only engine); ``abort_groups``: every process group
    the engine communicates on (aborted when a rank fails inside a phase, :mod:`hdp.alarm`);
    ``on_broken``: called when a phase breaks off inside its collectives, to free every group the engine
    holds (see :meth:`collectives`); ``fused_logprobs``: the fused log-prob path — during :meth:`run` the
    output layer of the chunk holding it returns its input (`hdp.megatron_compat.head`) and the adapter
    receives a `hdp.fused_logprobs.LastHidden` (ValueError naming the reason when the model's output layer
    cannot be replaced exactly: `hdp.megatron_compat.fused_head_problem`).
    """

    def __init__(self, *, groups: LayoutGroups, megatron_groups: Any, chunks: Sequence[Any], device: torch.device,
                 pad_token_id: int, cp_algorithm: CPAlgorithm, timeout_s: float, optimizer: Any = None,
                 abort_groups: Callable[[], Iterable[dist.ProcessGroup]] | None = None,
                 on_broken: Callable[[], None] | None = None, fused_logprobs: bool = False) -> None:
        self.groups = groups
        self.optimizer = optimizer
        self.megatron_groups = megatron_groups
        self.chunks = list(chunks)
        if fused_logprobs:  # first: a model it cannot replace raises before the core starts anything
            for m in self.chunks:
                problem = mc.fused_head_problem(m)
                if problem is not None:
                    raise ValueError(f"the fused log-prob path cannot replace this model's output layer: {problem}")
        self.fused_logprobs = bool(fused_logprobs)
        """Whether the last stage hands the adapter a `hdp.fused_logprobs.LastHidden` (else logits)."""
        self._heads: dict[int, mc.HiddenHead] = {}  # id(chunk) -> its hidden-state output layer, during `run`
        self.device = torch.device(device)
        self.pad_token_id = int(pad_token_id)
        self.cp_algorithm = CPAlgorithm(cp_algorithm)
        self.timeout_s = float(timeout_s)
        cfg = self.chunks[0].config
        self.per_token_loss = bool(getattr(cfg, "calculate_per_token_loss", False))
        tp = groups.tp_size
        self.token_multiple = tp if tp > 1 and bool(getattr(cfg, "sequence_parallel", False)) else 1
        self.collective_device = torch.device("cpu") if _gloo(groups.world) else self.device
        self.guard = StepGuard(group=groups.world, rank=groups.world_rank, size=groups.world_size,
                               device=self.collective_device, timeout_s=self.timeout_s, label="world rank")
        self.broken: str | None = None
        self._on_broken = on_broken
        self._failed_contexts: list[HdpPackedSeqParams] = []
        """The CP contexts of a failed `run`: `_release` detaches their groups."""
        self.alarm = Alarm.for_job(groups.world, groups.world_rank, abort_groups or (lambda: ()))
        self.alarm.start()
        self.phases = PhaseTimer()
        """Host seconds per phase of the current step (`hdp.trainer.phases`; read by the calibration gather)."""
        self._p2p = mc.HdpP2PCommunicator(groups.pp, cfg, self.device) if groups.pp_size > 1 else None
        self._chunk_index = {id(m): i for i, m in enumerate(self.chunks)}
        self._holds_loss = any(_post_process(m) for m in self.chunks)
        self._state: StepState | None = None
        self._hooks = [
            _decoder(chunk).layers[0].register_forward_pre_hook(
                functools.partial(self._mark_stage_input, i), with_kwargs=True)
            for i, chunk in enumerate(self.chunks)
        ]

    @staticmethod
    def job_group(world: int, timeout_s: float) -> dist.ProcessGroup:
        """A new group over the whole job with ``timeout_s`` (collective: every rank calls it once)."""
        return dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=float(timeout_s)))

    def close(self) -> None:
        """Stop the alarm's watcher, remove the core's hooks and drop every reference it holds: the model
        chunks, the optimizer, the job's groups and the guard on them (the engine destroys the groups)."""
        self.alarm.close()
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.chunks, self._chunk_index, self._p2p, self._state = [], [], {}, None, None
        self.optimizer = None
        self.groups = self.guard = self.megatron_groups = None  # type: ignore[assignment]

    # -- failure bookkeeping --

    def usable(self, what: str) -> None:
        """Raise (no collective) when an earlier call broke off in the middle of its collectives."""
        if self.broken is not None:
            raise RuntimeError(
                f"{what}: this engine is unusable since {self.broken}; its process groups may be out "
                "of step. Restart the job (or rebuild the engine in a fresh process group) and load the last checkpoint"
            )

    @contextlib.contextmanager
    def collectives(self, phase: str, step: int) -> Iterator[None]:
        """Run a phase whose collectives cannot be abandoned on one rank alone (rounds, optimizer, save).

        An exception here leaves the job's groups out of step, and the core marks itself unusable.
        When it is this rank's own error (not a broken collective), the rank tells every rank at once
        (:mod:`hdp.alarm`: the store, then an abort of its groups) and frees every group it holds
        (``on_broken``: on gloo only closing its connections ends a peer's blocked collective), and every
        rank raises :class:`~hdp.guard.RankFailedError` naming it and its error within seconds; each
        rank freed the same way releases those blocked on it in turn.  When a
        collective broke and no rank published a failure (a peer died or hangs: the group's timeout
        expired), this rank raises :class:`~hdp.guard.DomainUnreachableError` naming the step, the
        phase and the timeout, and releases the others the same way.  Errors the step guard already
        agreed on pass through.
        """
        try:
            yield
        except (DomainStepError, NonFiniteLossError):
            raise
        except BaseException as exc:
            where = f"step {step}, phase {phase!r}"
            self.broken = f"{where} ({describe(exc)})"
            me, world = self.groups.world_rank, self.groups.world_size
            own = not (is_transport_error(exc) or isinstance(exc, DomainUnreachableError) or self.alarm.tripped.is_set())
            if own:
                self.alarm.raise_alarm(f"error|{where}: {describe(exc)}")
                self._release(exc)
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                raise RankFailedError(
                    f"{where}: world rank {me} failed: {describe(exc)}; every rank was told and stops this step "
                    "(nothing was applied). The engine is no longer usable: restart the job and load the last checkpoint",
                    step=step, phase=phase, failures={me: f"{where}: {describe(exc)}"},
                ) from exc
            dom = self.groups.domain.domain_rank
            failures = {r: m.split("|", 1)[1] for r, m in self.alarm.failures(world, wait_s=PEER_REPORT_WAIT_S).items()
                        if m.startswith("error|")}
            if failures:
                self.alarm.trip()
                self._release(exc)  # a rank still blocked on this one is released in turn
                detail = "; ".join(f"world rank {r}: {m}" for r, m in sorted(failures.items()))
                raise RankFailedError(
                    f"{where}: world rank {me} stopped because {detail}. Nothing was applied this step; the engine is "
                    "no longer usable: restart the job and load the last checkpoint",
                    step=step, phase=phase, failures=failures,
                ) from exc
            self.alarm.raise_alarm(f"lost|{where}: world rank {me} saw {describe(exc)}")  # release the others
            self._release(exc)
            if isinstance(exc, (KeyboardInterrupt, SystemExit, DomainUnreachableError)):
                raise
            raise DomainUnreachableError(
                f"{where}: world rank {me} (domain rank {dom}) stopped "
                f"in the middle of the phase's collectives: {describe(exc)}. Either a peer died or hangs (each rank "
                f"gives up after the collective timeout, {self.timeout_s:g} s) or this rank failed there, and then "
                "the other ranks fail within that timeout. The engine is no longer usable: restart the job and load "
                "the last checkpoint",
                step=step, phase=phase,
            ) from exc

    def _release(self, exc: BaseException) -> None:
        """Free every group this rank holds (``on_broken``, once): on gloo an abort does not end a
        collective a peer is blocked in, but closing this rank's connections does — the peer's call
        then fails at once and it releases its own groups in turn.  The finished frames of the tracebacks of
        ``exc`` and of the errors it was raised from are cleared first, and the CP contexts of a failed
        `run` drop their rings: they hold the groups the failed collectives were called with."""
        release, self._on_broken = self._on_broken, None
        if release is None:
            self._failed_contexts = []
            return
        seen: set[int] = set()
        chain: list[BaseException | None] = [exc]
        while chain:  # the error and those it was raised from or during (their frames hold groups too)
            err = chain.pop()
            if err is None or id(err) in seen:
                continue
            seen.add(id(err))
            traceback.clear_frames(err.__traceback__)
            chain += [err.__cause__, err.__context__]
        for psp in self._failed_contexts:  # a cleared frame still holds its function, and a closure its cells
            psp.cp = None
        self._failed_contexts = []
        try:
            release()
        except Exception as err:  # noqa: BLE001 - the original error is the one to report
            logging.getLogger(__name__).warning("releasing the engine's groups after %s failed: %s", self.broken, err)
        gc.collect()

    @contextlib.contextmanager
    def checkpoint_collectives(self) -> Iterator[None]:
        """Make ``group=None`` collectives (Megatron's and verl's checkpoint code) run on a group of the
        whole job made for this one save or load (`hdp.megatron_compat.default_group`): they get the
        engine's timeout and are released by its alarm; when this rank fails inside them it aborts
        the group, so the peers leave them at once and reach the step guard's agreement instead of
        waiting.  The group is destroyed afterwards, on every rank alike."""
        group = self.job_group(self.groups.world_size, self.timeout_s)
        try:
            with mc.default_group(group):
                yield
        except BaseException:
            group.abort()
            raise
        finally:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - already aborted: nothing left to release
                pass

    # -- phase 1: agree --

    def agree(self, what: str, step: int, work: Callable[[], tuple[Plan, int]], *, call: str | None = None) -> Plan:
        """Run ``work`` (the engine's validation and planning: returns the plan and the batch digest)
        and agree on its outcome, and on the call, over the job; every rank raises alike when any rank
        failed (see :meth:`agree_call`).  ``call`` describes the call and its arguments (default ``what``)."""
        plan, _ = self.agree_call(what, step, call if call is not None else what, lambda: (*work(), 0))
        assert plan is not None
        return plan

    def agree_call(self, what: str, step: int, call: str,
                   work: Callable[[], tuple[Plan | None, int, int]]) -> tuple[Plan | None, int]:
        """The first collective of every engine call: run ``work`` (the call's validation and planning;
        returns the plan or ``None``, the data digest and a 0/1 vote) and agree over the job, in one
        fixed-size all-reduce (:func:`hdp.checksum.agree_step`), on the call (``call``: its name and
        arguments), on failures and on the plan and the data.  A rank that made another call, or the same
        with other arguments, is named on every rank (:class:`~hdp.checksum.CallMismatchError`, a
        ``ValueError``; nothing ran).  ``work`` may raise anything, ``BaseException`` included (Ctrl-C): the
        rank still takes part, every other rank raises naming it, and the rank re-raises its own exception
        (its original one for an interrupt, or a ``ValueError``/``TypeError`` naming it for bad input).  The
        job's groups stay in step through all of this (the engine stays usable); only a collective that
        breaks off here (a peer died or hangs) makes it unusable.  Returns the plan and the largest vote."""
        self.usable(what)
        self.phases.begin()
        error: BaseException | None = None
        plan: Plan | None = None
        digest = vote = 0
        try:
            with self.phases.phase("plan"):
                plan, digest, vote = work()
        except BaseException as exc:  # every type, interrupts included: one rank's failure must reach every rank
            error, plan = exc, None
        mismatch: ValueError | None = None  # a call, plan or data mismatch: raised alike on every rank
        agreed: DomainStepError | None = None
        with self.collectives("validate", step), self.phases.phase("agree"):  # a peer lost here: DomainUnreachableError
            try:
                result = agree_step(plan, self.groups.world, failed=error is not None, data_digest=digest, call=call,
                                    vote=vote, device=self.collective_device, domain_size=self.groups.domain.size,
                                    label="world rank")
            except ValueError as exc:
                result, mismatch = None, exc
            if result is not None and result.failed:
                try:
                    self.guard.agree(f"{what}: validate", step, error)
                except DomainStepError as exc:
                    agreed = exc
                except BaseException as exc:  # the guard re-raises this rank's own interrupt once it told the others
                    if exc is not error:
                        raise
        if mismatch is not None:
            if error is not None and not isinstance(error, Exception):
                raise error from mismatch  # this rank was interrupted too: it stops as it was asked to
            raise mismatch
        assert result is not None
        if result.failed:
            if error is not None and not isinstance(error, Exception):
                raise error  # Ctrl-C / SystemExit: the other ranks were told and raise naming this one
            if agreed is not None:
                if error is not None and is_input_error(error):
                    me = self.groups.world_rank
                    others = [r for r in agreed.ranks if r != me]
                    also = f" (invalid input on world ranks {others} too)" if others else ""
                    raise type(error)(f"{what} (step {step}, world rank {me} = domain rank "
                                      f"{self.groups.domain.domain_rank}): {error}{also}") from error
                raise agreed
            raise RuntimeError(f"{what} (step {step}): world ranks {result.failed} reported a failure the agreement "
                               "did not carry")
        return plan, result.vote

    # -- phase 2: the rounds --

    def num_microbatches(self, plan: Plan) -> int:
        """Rounds, padded under the interleaved schedule to a multiple of Megatron's micro-batch group."""
        r = plan.num_rounds
        if len(self.chunks) > 1:
            g = self._vp_group()
            r = -(-r // g) * g
        return r

    def _vp_group(self) -> int:
        pp = self.groups.pp_size
        return max(int(getattr(self.chunks[0].config, "microbatch_group_size_per_vp_stage", None) or pp), pp)

    def _context(self, meta: LocalMeta) -> HdpPackedSeqParams:
        m = self.token_multiple
        if meta.k == 1:
            return packed_seq_params(meta.group_lengths, self.device, token_multiple=m)
        algo = CPAlgorithm.RING
        aligned = meta.k & (meta.k - 1) == 0 and meta.group_start % meta.k == 0
        if self.cp_algorithm is CPAlgorithm.ALLGATHER and aligned:
            algo = CPAlgorithm.ALLGATHER
        dom = self.groups.domain
        cp = CPContext(group_lengths=meta.group_lengths, k_group=meta.k, ring=dom.ring(meta.group_start, meta.k),
                       groups=dom, algo=algo)
        return packed_seq_params(meta.group_lengths, self.device, cp=cp, token_multiple=m)

    def _round_input(self, state: StepState, tokens: Sequence[torch.Tensor], r: int) -> RoundInput:
        """This rank's micro-batch of round ``r`` (a rank without tokens runs padding only, inside its
        group's CP context when it has a group, so the group's ring or all-gather lines up)."""
        plan = state.plan
        meta = local_meta(plan, self.groups.domain.domain_rank, r) if r < plan.num_rounds else None
        if meta is None:
            psp = packed_seq_params((), self.device, token_multiple=self.token_multiple)
            real = torch.empty(0, dtype=torch.int64)
        else:
            psp = self._context(meta)
            real = pack(meta, tokens).to(torch.int64) if meta.num_tokens else torch.empty(0, dtype=torch.int64)
        pad = torch.full((psp.pad_tokens,), self.pad_token_id, dtype=torch.int64)
        return RoundInput(index=r, meta=meta, tokens=torch.cat([real, pad]).to(self.device), psp=psp)  # [T]

    def _mark_stage_input(self, chunk: int, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Forward pre-hook of a chunk's first layer: its input's backward closes the round's backward span.
        Once per round and chunk, where autograd records it: full recompute runs the first forward
        without grad and the layer's forward again inside the backward."""
        state = self._state
        hidden = kwargs.get("hidden_states")
        if (state is None or not state.train or hidden is None or not hidden.requires_grad
                or not torch.is_grad_enabled()):
            return None
        # inside a backward (full recompute) the round is the one whose backward span of this chunk is
        # open (a rank runs one backward at a time); in a forward none is open
        running = [k[1] for k in state.timer.open_keys() if k[0] == "b" and k[2] == chunk]
        r = running[0] if running else state.timer_round
        if (r, chunk) in state.marked:
            return None
        state.marked.add((r, chunk))
        kwargs["hidden_states"] = _SpanMark.apply(hidden, state.timer, ("b", r, chunk), "stop")
        return args, kwargs

    def _forward_step(self, state: StepState, data_iterator: Iterator[int], model: Any) -> tuple[torch.Tensor, Callable]:
        """Megatron's ``forward_step_func``: run this chunk on round ``next(data_iterator)``."""
        r = next(data_iterator)
        chunk = self._chunk_index[id(model)]
        inp = state.inputs[r]
        key = ("f", r, chunk)
        state.timer.start(key)
        state.timer_round = r
        if state.meter is not None:
            state.meter.begin_round(r)
        if state.hooks is not None:
            state.hooks.before_forward(inp, chunk, model)
        out = model(input_ids=inp.tokens[None, :], position_ids=None, attention_mask=None,
                    packed_seq_params=inp.psp)  # [1, T, Vl] (last stage; fused path: [1, T, H]) or [T/TP?, 1, H]
        head = self._heads.get(id(model))
        weight = head.weight if head is not None else None  # [Vl, H] the weight this forward's output layer got
        if state.hooks is not None:
            state.hooks.after_forward(inp, chunk, model)
        if state.train:
            out = _SpanMark.apply(out, state.timer, ("b", r, chunk), "start")
        if not _post_process(model):
            state.timer.stop(key)
        return out, functools.partial(self._round_loss, state, key, inp, weight)

    def _round_loss(self, state: StepState, key: Any, inp: RoundInput, weight: torch.Tensor | None,
                    output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Megatron's loss function on the last stage: the adapter's round loss, Megatron's scaling undone.
        ``weight``: the output layer's weight on the fused path (``output`` holds hidden states), else None."""
        logits: torch.Tensor | LastHidden = output[0]  # [T, Vl] logits, or on the fused path:
        if weight is not None:
            logits = LastHidden(output[0], weight)  # hidden states [T, H] and the weight shard [Vl, H]
        loss = None
        # the adapter runs in every round even after it failed once: it may hold collectives among the
        # group's ranks (verl's whole-sample exchange), which must line up; only the first error is kept
        if inp.real and state.adapter is not None:
            try:
                with self.phases.phase("loss"):
                    loss = state.adapter(inp, logits[: inp.real])
                if state.train and loss is not None:
                    check_round_loss(loss, "the loss function", "the logprobs it is given")
            except Exception as exc:  # a caller bug on one rank must not hang the others
                state.error, loss = state.error or exc, None
        if not state.train or loss is None:
            loss = _zero_loss(logits, state.train)  # backward still runs (EP all-to-alls, CP rings line up)
        loss = loss.reshape(())
        value = loss.detach().to(torch.float64)
        state.loss_sum += value
        if inp.meta is not None and inp.meta.samples:
            flag = (~torch.isfinite(value)).to(torch.float64)
            idx = torch.tensor(inp.meta.samples, dtype=torch.int64, device=state.bad.device)
            state.bad.index_add_(0, idx, flag.expand(idx.shape[0]))
        if not self.per_token_loss:  # Megatron divides by the micro-batches and DDP averages over the domain
            loss = loss * (state.num_microbatches * self.groups.domain.size)
        state.timer.stop(key)
        # (loss, tokens, reduced): per-token mode adds no count (the engine finalises with num_tokens=None);
        # otherwise a count of 1 makes Megatron's ÷ count a no-op
        count = torch.zeros if self.per_token_loss else torch.ones
        return loss, count((), dtype=torch.int, device=loss.device), {}

    def run(self, plan: Plan, tokens: Sequence[torch.Tensor], adapter: RoundLoss | None, *, train: bool,
            meter: MemoryMeter | None = None, hooks: RoundHooks | None = None) -> StepState:
        """Phase 2: every round through Megatron's schedule (one micro-batch per round); ``meter``
        measures each round's peak memory (read it with ``meter.finish()`` afterwards); ``hooks`` run around
        each chunk's forward (`RoundHooks`)."""
        with self.phases.phase("rounds"):
            return self._run(plan, tokens, adapter, train=train, meter=meter, hooks=hooks)

    def _run(self, plan: Plan, tokens: Sequence[torch.Tensor], adapter: RoundLoss | None, *, train: bool,
             meter: MemoryMeter | None, hooks: RoundHooks | None) -> StepState:
        dev = self.device
        m = self.num_microbatches(plan)
        self._failed_contexts = []
        state = StepState(plan=plan, train=train, adapter=adapter if self._holds_loss else None,
                          num_microbatches=m, loss_sum=torch.zeros((), dtype=torch.float64, device=dev),
                          bad=torch.zeros(plan.num_samples, dtype=torch.float64, device=dev),
                          timer=_device.RoundTimer(dev), meter=meter, hooks=hooks)
        # every round's inputs go to the device before the first round (no host-device copy, so no
        # synchronisation, between rounds)
        for r in range(m):
            state.inputs[r] = self._round_input(state, tokens, r)
        longest = max(inp.tokens.shape[0] for inp in state.inputs.values())
        chunks = self.chunks
        kwargs: dict[str, Any] = dict(forward_step_func=functools.partial(self._forward_step, state),
                                      num_microbatches=m, seq_length=longest, micro_batch_size=1,
                                      forward_only=not train)
        p2p = self._p2p
        if p2p is not None:
            # every stage knows each round's length from the plan: no shape messages (a stage waiting
            # for a shape its peer sends only later is what hung the interleaved schedule on <= PP rounds)
            cfg = chunks[0].config
            shapes = [(state.inputs[r].tokens.shape[0] // self.token_multiple, 1, cfg.hidden_size) for r in range(m)]
            if len(chunks) == 1:
                p2p.expect_shapes(shapes, forward_only=not train)
            else:
                p2p.expect_interleaved_shapes(shapes, len(chunks), self._vp_group(), forward_only=not train)
        self._state = state
        try:
            with contextlib.ExitStack() as scope:
                if meter is not None:
                    scope.enter_context(meter.activate())
                if dev.type == "cpu":  # Megatron's recompute (ModelConfig.recompute) saves a CUDA RNG state
                    scope.enter_context(mc.cpu_checkpoint_rng())
                if self.fused_logprobs:
                    scope.enter_context(self._hidden_heads())
                self._schedule(chunks, m, p2p, kwargs)
        except BaseException:
            # the failed call's frames keep these (closures of module hooks hold the forward's kwargs)
            self._failed_contexts = [inp.psp for inp in state.inputs.values() if inp.psp.cp is not None]
            raise
        finally:
            self._state = None
            if hooks is not None:
                hooks.finish()
            left = p2p.unused_shapes() if p2p is not None else 0
            if p2p is not None:
                p2p.expect_shapes(None)
        if left:
            raise RuntimeError(f"pipeline schedule of {m} micro-batches ended with {left} expected messages not received")
        return state

    @contextlib.contextmanager
    def _hidden_heads(self) -> Iterator[None]:
        """The fused path's output layers (`hdp.megatron_compat.install_hidden_head`) for this run's rounds
        only: another engine on the same model (verl's engine around the library's chunks, a reference
        forward) meets Megatron's own."""
        try:
            for m in self.chunks:
                head = mc.install_hidden_head(m)
                if head is not None:
                    self._heads[id(m)] = head
            yield
        finally:
            for head in reversed(list(self._heads.values())):
                head.remove()
            self._heads = {}

    def _schedule(self, chunks: Sequence[Any], m: int, p2p: Any, kwargs: dict[str, Any]) -> None:
        """Megatron's schedule for this layout: no pipelining, 1F1B, or interleaved."""
        if self.groups.pp_size == 1:
            mc.forward_backward_no_pipelining(data_iterator=iter(range(m)), model=chunks[0], **kwargs)
        elif len(chunks) == 1:
            mc.forward_backward_pipelining_without_interleaving(
                data_iterator=iter(range(m)), model=chunks[0], p2p_communicator=p2p,
                pg_collection=self.megatron_groups, **kwargs)
        else:
            mc.forward_backward_pipelining_with_interleaving(
                data_iterator=[iter(range(m)) for _ in chunks], model=chunks, p2p_communicator=p2p,
                pg_collection=self.megatron_groups, **kwargs)

    # -- phase 3: reduce --

    def reduce(self, state: StepState) -> torch.Tensor:
        """One all-reduce over the job of [loss, adapter failed, ranks with a non-finite gradient, per-sample
        non-finite flags]; the step's one host synchronisation.  Returns the reduced vector on the host
        (float64).  In a training step every rank first checks its own gradient buffers on the device
        (:meth:`_local_grad_nonfinite`: no host read), so a NaN/inf gradient of any parameter on any rank
        is known on every rank before the optimizer runs."""
        counts = self.groups.is_last_stage and self.groups.tp_rank == 0  # each domain rank's loss once
        dev = state.bad.device
        with self.phases.phase("reduce"):  # the gradient check's read of the buffers counts here
            grad_bad = self._local_grad_nonfinite(dev) if state.train else torch.zeros((), dtype=torch.float64, device=dev)
            state.grad_bad = grad_bad
            head = torch.stack([
                state.loss_sum if counts else torch.zeros_like(state.loss_sum),
                torch.tensor(1.0 if state.error is not None else 0.0, dtype=torch.float64, device=dev),
                grad_bad,
            ])
            red = torch.cat([head, state.bad]).to(self.collective_device)
            dist.all_reduce(red, op=dist.ReduceOp.SUM, group=self.groups.world)
            return red.cpu()  # the one synchronisation of the step

    def _local_grad_nonfinite(self, dev: torch.device) -> torch.Tensor:
        """[] float64 on the device: 1 when any element of this rank's DDP gradient buffers (every chunk,
        dense and expert) is NaN/inf, else 0.  One read of the buffers (``aminmax`` propagates NaN and keeps
        ±inf; no overflow, unlike a sum), no host synchronisation.  The buffers hold this rank's local
        gradients (or, where the reduce-scatter already ran, its reduced shard and local values elsewhere:
        a NaN survives either)."""
        flag = torch.zeros((), dtype=torch.bool, device=dev)
        for chunk in self.chunks:
            for buf in list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", [])):
                grad = getattr(buf, "grad_data", None)
                if grad is None or grad.numel() == 0:
                    continue
                lo, hi = torch.aminmax(grad)
                flag = flag | ~torch.isfinite(lo).to(dev) | ~torch.isfinite(hi).to(dev)
        return flag.to(torch.float64)

    def round_seconds(self, state: StepState) -> list[float]:
        """Seconds per plan round on this rank (forward + backward over its chunks); call after :meth:`reduce`."""
        spans = state.timer.seconds(sync=False)
        out = [0.0] * state.plan.num_rounds
        for (_kind, r, _chunk), secs in spans.items():
            if r < len(out):
                out[r] += secs
        return out

    def raise_adapter_error(self, state: StepState, red: torch.Tensor, step: int, what: str) -> None:
        """When an adapter failed on any rank (``red[1] > 0``): skip the update and raise on every rank,
        naming the failed ranks and their errors (one fixed-size collective)."""
        if state.error is not None or red[1] > 0:
            self.skip_update()
            self.guard.agree(what, step, state.error)
            raise RuntimeError(f"step {step}: {what} failed on some rank; the update was skipped")

    def nonfinite(self, state: StepState, red: torch.Tensor) -> list[int]:
        """Samples whose round loss was NaN/inf on some rank ([] when the step's loss is finite)."""
        flags = red[3:] > 0
        if flags.any() or not torch.isfinite(red[0]):
            return torch.nonzero(flags).flatten().tolist()
        return []

    def nonfinite_grad_ranks(self, state: StepState, red: torch.Tensor, step: int) -> list[int]:
        """World ranks whose gradient held a NaN/inf (``[]`` when none did: no collective).  When some did,
        every rank knows it from ``red`` and takes part in one diagnostic all-gather of the flags (fixed
        size, on every rank alike) that names them."""
        if not red[2] > 0:
            return []
        mine = (state.grad_bad if state.grad_bad is not None else torch.zeros((), dtype=torch.float64)).reshape(1)
        mine = mine.to(self.collective_device)
        table = [torch.empty_like(mine) for _ in range(self.groups.world_size)]
        with self.collectives("optimizer", step):
            dist.all_gather(table, mine, group=self.groups.world)
        return [r for r, f in enumerate(table) if float(f.item()) > 0]

    def ranks_of(self, plan: Plan, samples: Sequence[int]) -> list[int]:
        """Domain ranks of the groups holding ``samples``."""
        ranks: set[int] = set()
        for s in samples:
            start, k = int(plan.group_start[s]), int(plan.group_size[s])
            ranks.update(range(start, start + k))
        return sorted(ranks)

    # -- phase 4: optimizer step or skip --

    def skip_update(self) -> None:
        """Zero the DDP grad buffers and the optimizer's grads (nothing applied)."""
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    def optimizer_step(self) -> tuple[bool, Any]:
        """Finalize the gradients (DDP reduce-scatter over the domain, sequence-parallel norm gradients
        over TP; skipped when the schedule already did it through ``finalize_model_grads_func``) and step
        the distributed optimizer; returns (applied, grad norm), alike on every rank."""
        with self.phases.phase("optimizer"):
            if getattr(self.chunks[0].config, "finalize_model_grads_func", None) is None:
                mc.finalize_model_grads(self.chunks, num_tokens=None, pg_collection=self.megatron_groups)
            ok, grad_norm, _ = self.optimizer.step()
        return bool(ok), grad_norm


def _zero_loss(out: torch.Tensor | LastHidden, train: bool) -> torch.Tensor:
    """A zero loss through the round's output: its backward runs the model's (the logits path's reaches the
    output layer's weight; on the fused path the weight is added, in training, so its gradient is a zero too)."""
    if isinstance(out, LastHidden):
        zero = out.hidden.sum() * 0.0
        return zero + out.weight.sum() * 0.0 if train else zero
    return out.sum() * 0.0


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model


def _post_process(model: Any) -> bool:
    return bool(_unwrap(model).post_process)


def _decoder(model: Any) -> Any:
    return _unwrap(model).decoder
