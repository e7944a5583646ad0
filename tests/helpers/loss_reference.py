"""Single-process references of the loss aggregation (:mod:`hdp.loss`), for the tests: the formulas written out
(`aggregate_loss`), and the weights of one rank's tokens in one round (`local_loss_weights`).  The engines use
:func:`hdp.loss.sample_token_weights` and pack them per round."""

from __future__ import annotations

from typing import Sequence

import torch

from hdp.dispatch import local_meta, pack
from hdp.loss import LossAggregation, _coefficients, _mode, sample_token_weights
from hdp.packing.plan import Plan

__all__ = ["aggregate_loss", "local_loss_weights", "ddp_average_scale"]


def aggregate_loss(
    losses: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    mode: LossAggregation | str,
    *,
    loss_scale_factor: float | None = None,
    global_batch_size: int | None = None,
) -> torch.Tensor:
    """Single-process reference: aggregate per-sample token losses ``[L_i]`` like verl's ``agg_loss``.

    Written as the formulas of the module docstring (sums and divisions), not through the weights.
    """
    m = _mode(mode)
    if len(losses) != len(masks):
        raise ValueError(f"len(losses)={len(losses)} != len(masks)={len(masks)}; pass one of each per sample")
    _coefficients(masks, m, loss_scale_factor, global_batch_size)  # validation only
    sums = [(loss * mask.to(loss.dtype)).sum() for loss, mask in zip(losses, masks)]  # [S] masked token sums
    counts = [float(mask.to(torch.float64).sum()) for mask in masks]  # [S] n_i
    zero = torch.stack(sums).sum() * 0.0
    if m is LossAggregation.TOKEN_MEAN:
        total = sum(counts)
        return torch.stack(sums).sum() / total if total > 0 else zero
    valid = [i for i, c in enumerate(counts) if c > 0]
    num = float(len(valid)) if global_batch_size is None else float(global_batch_size)
    if not valid or num == 0:
        return zero
    if m is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        return torch.stack([sums[i] / counts[i] for i in valid]).sum() / num
    seq_sum = torch.stack([sums[i] for i in valid]).sum() / num
    if m is LossAggregation.SEQ_MEAN_TOKEN_SUM:
        return seq_sum
    norm = float(max(int(mask.shape[0]) for mask in masks)) if loss_scale_factor is None else float(loss_scale_factor)
    return seq_sum / norm


def local_loss_weights(
    plan: Plan,
    rank: int,
    round_index: int,
    masks: Sequence[torch.Tensor],
    mode: LossAggregation | str,
    *,
    loss_scale_factor: float | None = None,
    global_batch_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[T] weights of ``rank``'s local tokens in round ``round_index`` (canonical local order).

    ``Σ_ranks Σ_rounds Σ_t local_loss[t] · weight[t]`` equals :func:`aggregate_loss` of the whole
    global batch; pure (masks of the global batch are known on every rank).  For many rounds,
    compute :func:`sample_token_weights` once and :func:`hdp.dispatch.pack` it per round instead.
    """
    if len(masks) != plan.num_samples:
        raise ValueError(f"len(masks)={len(masks)}: the plan has {plan.num_samples} samples; pass one mask per sample")
    weights = sample_token_weights(
        masks, mode, loss_scale_factor=loss_scale_factor, global_batch_size=global_batch_size, dtype=dtype
    )
    return pack(local_meta(plan, rank, round_index), weights)


def ddp_average_scale(plan: Plan) -> float:
    """N: the factor for the local loss when a DDP *averages* gradients over the domain.

    Not needed with hdp's Megatron model, whose ``calculate_per_token_loss=True`` makes DDP sum.
    """
    return float(plan.num_ranks)
