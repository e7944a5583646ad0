"""What the library door takes and gives per step: the :class:`Batch`, its validation, the per-token tensors
shifted to target alignment, the loss function's view of one round (:class:`LocalTensors`, :class:`LossFn`) and
the loss adapter the round core calls, and :meth:`~hdp.trainer.engine.HdpEngine.forward`'s outputs.

Token alignment.  Per-token tensors of a :class:`Batch` (loss mask, advantages, old log-probs) are indexed
like the tokens: element t describes token t.  Token t is *predicted* from the tokens before it, so
log p(token t) comes from the logits at position t-1.  hdp shifts every per-token tensor by one per sample
*before* the zigzag split (``x'[p] = x[p+1]``, last = 0: `shift_to_targets`) so that all local tensors of a
round line up with the local logits; the loss function therefore receives, at local position p, the target
token (``local.targets[p]``) and the caller's values for that target.  Token 0 of a sample is never
predicted (its mask is ignored, its log-prob is 0).

Legend: S samples, L_i sample length, T local tokens of one round (Tr real), V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from hdp.dispatch import pack
from hdp.fused_logprobs import LastHidden, token_logprobs_entropy
from hdp.loss import LossAggregation, sample_token_weights
from hdp.packing import Plan, check_plan
from hdp.core.rounds import RoundInput, next_token_targets

__all__ = ["Batch", "LocalTensors", "LossFn", "nll_loss", "ForwardOutput", "ShiftedInputs", "LossAdapter",
           "shift_to_targets", "shifted_inputs", "validate_batch", "check_given_plan"]


# ---- what the caller passes and gets ---------------------------------------------------------------


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



# ---- validation ------------------------------------------------------------------------------------


def validate_batch(batch: Batch, *, num_ranks: int, max_tokens_per_rank: int | None, max_sequence_length: int,
                   vocab_size: int) -> None:
    """Raise ``ValueError``/``TypeError`` naming the field, the value and the fix (pure: alike on every rank).
    ``num_ranks`` × ``max_tokens_per_rank`` bounds one sample (``None``: the planner's memory check does)."""
    """Raise ``ValueError``/``TypeError`` naming the field, the value and the fix (pure)."""
    if not isinstance(batch, Batch):
        raise TypeError(f"batch is {type(batch).__name__}; pass a hdp.trainer.engine.Batch")
    toks = batch.tokens
    if len(toks) == 0:
        raise ValueError("Batch.tokens is empty: a step needs at least one sample; skip empty batches")
    vocab = vocab_size
    budget = max_tokens_per_rank
    cap = num_ranks * budget if budget is not None else None  # else the planner's memory check
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
                f"Batch.tokens[{i}] has {n} tokens but the domain holds at most {num_ranks} ranks x "
                f"PlanningConfig.max_tokens_per_rank={max_tokens_per_rank} = {cap} tokens "
                "per sample; raise max_tokens_per_rank (memory permitting) or truncate the sample"
            )
        if n > max_sequence_length:
            raise ValueError(
                f"Batch.tokens[{i}] has {n} tokens > ModelConfig.max_sequence_length="
                f"{max_sequence_length}; raise it or truncate the sample"
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


def check_given_plan(plan: Plan, batch: Batch, num_ranks: int) -> None:
    """A caller's ``plan=`` fits ``batch`` on a domain of ``num_ranks`` (pure; names the field and the fix)."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan is {type(plan).__name__}; pass a hdp.packing.Plan (engine.plan(batch)) or None")
    if plan.num_ranks != num_ranks:
        raise ValueError(f"plan.num_ranks={plan.num_ranks}: the domain has {num_ranks} ranks; re-plan for it")
    if plan.lengths.tolist() != batch.lengths:
        raise ValueError(
            f"plan.lengths={plan.lengths.tolist()} differ from the batch lengths {batch.lengths}; "
            "plan this batch (engine.plan(batch))"
        )
    check_plan(plan)  # PlanError (a ValueError) naming the column, the sample or round, and the fix


# ---- per-step state --------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ShiftedInputs:
    """A validated batch's per-sample tensors, shifted to target alignment (what the loss adapter reads)."""

    tokens: list[torch.Tensor]  # S x [L_i] int64
    targets: list[torch.Tensor]  # S x [L_i] int64 (token p+1; pad at the end)
    mask: list[torch.Tensor]  # S x [L_i] float32 (mask of token p+1)
    weights: list[torch.Tensor]  # S x [L_i] float32 loss weights (target aligned)
    extras: dict[str, list[torch.Tensor]]  # name -> S x [L_i, ...] (target aligned)


def shift_to_targets(x: torch.Tensor) -> torch.Tensor:
    """[L, ...] -> [L, ...] with out[p] = x[p+1] and a zero last row (per-sample next-token alignment)."""
    return torch.cat([x[1:], torch.zeros_like(x[:1])])


class LossAdapter:
    """The library engine's round loss: ``loss_fn`` on this rank's local tokens with hdp's weights; in a
    forward pass, the round's (log-prob, entropy) kept for :meth:`HdpEngine.forward`."""

    def __init__(self, prep: ShiftedInputs, loss_fn: LossFn | None, tp_group: dist.ProcessGroup, device: torch.device):
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



def shifted_inputs(batch: Batch, *, pad_token_id: int, aggregation: LossAggregation,
                   loss_scale_factor: float | None) -> ShiftedInputs:
    """A validated batch's per-sample tensors in target alignment, with the loss weights of ``aggregation``
    (`hdp.loss.sample_token_weights`: Σ over the domain of Σ_t w_t ℓ_t is the whole batch's loss)."""
    tokens = [t.to(torch.int64) for t in batch.tokens]
    targets = next_token_targets(tokens, pad_token_id)
    masks = [
        torch.ones(t.shape[0], dtype=torch.float32) if batch.loss_mask is None else batch.loss_mask[i].to(torch.float32)
        for i, t in enumerate(tokens)
    ]
    mask = [shift_to_targets(m) for m in masks]
    weights = sample_token_weights(mask, aggregation, loss_scale_factor=loss_scale_factor, dtype=torch.float32)
    extras = {name: [shift_to_targets(x) for x in xs] for name, xs in batch.extras.items()}
    return ShiftedInputs(tokens, targets, mask, weights, extras)
