"""Loss aggregation across split samples: per-token weights that make the domain sum exact.

Dimension legend:
    S    samples of the global batch (caller order); L_i length of sample i
    T    tokens of this rank in one round (local zigzag chunks, packed)

verl's ``agg_loss`` (``verl/trainer/ppo/core_algos.py``, 0.7+ with ``global_batch_info``) reduces a
padded ``[S, Lmax]`` loss matrix ``ℓ`` with mask ``m`` over the *global* mini-batch.  With
n_i = Σ_t m_it the masked tokens of sample i and S' = #{i : n_i > 0} the samples that have any
(verl's ``global_batch_size``; fully masked samples are excluded from the seq-mean):

    token-mean               Σ_it m_it ℓ_it / Σ_it m_it
    seq-mean-token-mean      (1/S') Σ_{i: n_i>0} (Σ_t m_it ℓ_it / n_i)
    seq-mean-token-sum       (1/S') Σ_{i: n_i>0} Σ_t m_it ℓ_it
    seq-mean-token-sum-norm  (1/S') Σ_{i: n_i>0} Σ_t m_it ℓ_it / loss_scale_factor
                             (Dr. GRPO; verl's default factor is the padded width Lmax)

Each mode is linear in ℓ, so it equals Σ_it w_it ℓ_it with a weight per token that depends only on
the masks of the whole global batch:  w_it = m_it · c_i with
c_i = 1/Σm, 1/(S'·n_i), 1/S', 1/(S'·loss_scale_factor) respectively.  A rank computes its local
``Σ_t ℓ_t w_t`` over its chunks; the sum over all ranks and rounds is the single-process loss, even
though a sample's normaliser n_i counts tokens that other ranks hold.

Gradients: with these weights the step gradient is the **sum** of the ranks' gradients, so
gradients must be all-reduced with SUM over the domain.  hdp's Megatron model sets
``TransformerConfig.calculate_per_token_loss=True`` (:mod:`hdp.trainer.model`), which makes
Megatron's DDP sum over its data-parallel group (the whole domain: hdp runs Megatron with CP=1)
without the 1/N scaling, so the local loss is used as is: no factor N.  Only a DDP that
*averages* (Megatron's default, ``calculate_per_token_loss=False``) needs the local loss
multiplied by N before backward (verl's Megatron engine does that ``loss * dp_size`` for token-mean).

Where hdp differs from verl: seq-mean-token-mean divides by n_i exactly (verl by n_i + 1e-8, a
relative difference below 1e-8); the global batch is always the reference (no per-micro-batch
normalisation); a batch without any masked token gives weights 0 (verl returns a zero loss).
"""

from __future__ import annotations

import enum
from typing import Sequence

import torch


__all__ = ["LossAggregation", "sample_token_weights"]


class LossAggregation(str, enum.Enum):
    """How per-token losses reduce to one scalar (verl's ``loss_agg_mode`` names)."""

    TOKEN_MEAN = "token-mean"
    """Sum of masked token losses over the global batch / number of masked tokens."""
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    """Mean over samples of each sample's masked token mean."""
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    """Mean over samples of each sample's masked token sum."""
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"
    """seq-mean-token-sum / loss_scale_factor (Dr. GRPO; default factor: the longest sample)."""


def _mode(mode: LossAggregation | str) -> LossAggregation:
    try:
        return LossAggregation(mode)
    except ValueError as exc:
        raise ValueError(f"mode={mode!r}: choose one of {[m.value for m in LossAggregation]}") from exc


def _coefficients(
    masks: Sequence[torch.Tensor],
    mode: LossAggregation,
    loss_scale_factor: float | None,
    global_batch_size: int | None,
) -> list[float]:
    """Per-sample coefficient c_i (python floats, exact in float64)."""
    if not masks:
        raise ValueError("masks is empty: the global batch needs at least one sample")
    for i, m in enumerate(masks):
        if not isinstance(m, torch.Tensor) or m.dim() != 1:
            shape = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"masks[{i}] is {shape}; pass one 1-D mask [L_i] per sample")
    counts = [float(m.to(torch.float64).sum()) for m in masks]
    if mode is LossAggregation.TOKEN_MEAN:
        total = sum(counts)
        return [1.0 / total if total > 0 else 0.0] * len(masks)
    if global_batch_size is None:
        num = float(sum(1 for c in counts if c > 0))  # S': samples with any masked token
    elif isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size <= 0:
        raise ValueError(f"global_batch_size={global_batch_size!r}: must be a positive integer or None (count samples)")
    else:
        num = float(global_batch_size)
    if num == 0:
        return [0.0] * len(masks)
    if mode is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        return [1.0 / (num * c) if c > 0 else 0.0 for c in counts]
    if mode is LossAggregation.SEQ_MEAN_TOKEN_SUM:
        return [1.0 / num] * len(masks)
    norm = float(max(int(m.shape[0]) for m in masks)) if loss_scale_factor is None else float(loss_scale_factor)
    if norm <= 0:
        raise ValueError(f"loss_scale_factor={loss_scale_factor}: must be > 0 (e.g. the max response length)")
    return [1.0 / (num * norm)] * len(masks)


def sample_token_weights(
    masks: Sequence[torch.Tensor],
    mode: LossAggregation | str,
    *,
    loss_scale_factor: float | None = None,
    global_batch_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Per-sample token weights ``[L_i]`` with ``Σ_i Σ_t w_it ℓ_it == aggregate_loss(ℓ, masks, mode)``.

    ``masks[i]`` is sample i's loss mask ``[L_i]`` (bool or numeric) of the *global* batch.  Device
    follows each mask.  ``loss_scale_factor`` is used by seq-mean-token-sum-norm only (default:
    the longest sample, like verl's padded width; pass a constant for Dr. GRPO).
    ``global_batch_size`` overrides S' (the number of samples with a masked token), like verl's
    ``global_batch_info["global_batch_size"]``.
    """
    coef = _coefficients(masks, _mode(mode), loss_scale_factor, global_batch_size)
    return [mask.to(dtype) * c for mask, c in zip(masks, coef)]
