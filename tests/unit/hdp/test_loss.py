"""Per-token loss weights: the sum over simulated ranks and rounds equals the single-process loss.

Tolerance: float64, 1e-12 absolute.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.dispatch_reference import local_metas
from hdp.dispatch import pack
from hdp.loss import LossAggregation, sample_token_weights
from helpers.loss_reference import aggregate_loss, ddp_average_scale, local_loss_weights
from helpers.plan_factory import plan_with_k, random_plan


def _verl_agg_loss(loss_mat, loss_mask, mode, norm=None):
    """verl's agg_loss (0.7+, dp_size=1) on a padded [S, Lmax] matrix, without its 1e-8 in seq-mean-token-mean."""
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    seq_mask = (loss_mask.sum(-1) > 0).double()  # fully masked sequences are excluded
    if mode == "seq-mean-token-mean":
        seq = (loss_mat * loss_mask).sum(-1) / loss_mask.sum(-1).clamp(min=1)
        return (seq * seq_mask).sum() / seq_mask.sum()
    loss = ((loss_mat * loss_mask).sum(-1) * seq_mask).sum() / seq_mask.sum()
    if mode == "seq-mean-token-sum-norm":
        loss = loss / (loss_mask.shape[-1] if norm is None else norm)
    return loss


def _batch(plan, seed):
    gen = torch.Generator().manual_seed(seed)
    losses = [torch.rand(int(n), generator=gen, dtype=torch.float64) for n in plan.lengths]
    masks = [torch.rand(int(n), generator=gen) < 0.7 for n in plan.lengths]
    masks[0][:] = False  # one fully masked sample: excluded from the seq-mean
    masks[-1][0] = True  # and at least one masked token
    return losses, masks


@pytest.mark.parametrize("mode", list(LossAggregation))
def test_weights_sum_to_single_process_loss(mode):
    rng = np.random.default_rng(3)
    plans = [random_plan(rng, n, s, max_k=4) for n, s in ((4, 9), (5, 13), (3, 2), (4, 1))]
    plans += [plan_with_k(rng, 4, k, 6) for k in (1, 2, 4)]
    for idx, plan in enumerate(plans):
        losses, masks = _batch(plan, idx)
        for lsf in (None, 37.0):
            ref = aggregate_loss(losses, masks, mode, loss_scale_factor=lsf)
            # the reference agrees with verl's padded-matrix formula
            lmax = int(plan.lengths.max())
            mat = torch.zeros(plan.num_samples, lmax, dtype=torch.float64)
            msk = torch.zeros(plan.num_samples, lmax, dtype=torch.float64)
            for i, (lo, m) in enumerate(zip(losses, masks)):
                mat[i, : lo.numel()], msk[i, : m.numel()] = lo, m.double()
            torch.testing.assert_close(ref, _verl_agg_loss(mat, msk, mode.value, lsf), rtol=0, atol=1e-12)

            total = torch.zeros((), dtype=torch.float64)
            weights = sample_token_weights(masks, mode, loss_scale_factor=lsf, dtype=torch.float64)
            for rank in range(plan.num_ranks):
                for meta in local_metas(plan, rank):
                    w = local_loss_weights(plan, rank, meta.round_index, masks, mode,
                                           loss_scale_factor=lsf, dtype=torch.float64)
                    assert torch.equal(w, pack(meta, weights))
                    total = total + (pack(meta, losses) * w).sum()
            torch.testing.assert_close(total, ref, rtol=0, atol=1e-12)


def test_edge_cases_and_bad_input():
    masks = [torch.tensor([True, False]), torch.tensor([False, False, False])]
    losses = [torch.tensor([2.0, 5.0], dtype=torch.float64), torch.tensor([1.0, 1.0, 1.0], dtype=torch.float64)]
    # the fully masked sample is excluded from the sample mean (S' = 1)
    for mode, want in (("seq-mean-token-mean", 2.0), ("seq-mean-token-sum", 2.0), ("seq-mean-token-sum-norm", 2.0 / 3)):
        assert float(aggregate_loss(losses, masks, mode)) == pytest.approx(want)
        w = sample_token_weights(masks, mode, dtype=torch.float64)
        assert float(sum((lo * wi).sum() for lo, wi in zip(losses, w))) == pytest.approx(want)
    # an explicit global batch size (verl's global_batch_info) replaces S'
    assert float(aggregate_loss(losses, masks, "seq-mean-token-sum", global_batch_size=4)) == pytest.approx(0.5)
    w = sample_token_weights(masks, "seq-mean-token-sum", global_batch_size=4, dtype=torch.float64)
    assert float(w[0][0]) == pytest.approx(0.25)
    # no masked token at all: zero loss, zero weights
    empty = [torch.zeros(2, dtype=torch.bool)]
    for mode in LossAggregation:
        assert float(aggregate_loss(losses[:1], empty, mode)) == 0.0
        assert float(sample_token_weights(empty, mode)[0].abs().sum()) == 0.0
    with pytest.raises(ValueError, match="mode='mean'"):
        sample_token_weights(masks, "mean")
    with pytest.raises(ValueError, match="loss_scale_factor=0"):
        sample_token_weights(masks, "seq-mean-token-sum-norm", loss_scale_factor=0)
    with pytest.raises(ValueError, match="global_batch_size=0"):
        sample_token_weights(masks, "seq-mean-token-sum", global_batch_size=0)
    with pytest.raises(ValueError, match="masks\\[0\\]"):
        sample_token_weights([torch.zeros(2, 2)], "token-mean")
    assert LossAggregation("token-mean") is LossAggregation.TOKEN_MEAN
    plan = plan_with_k(np.random.default_rng(0), 4, 2, 3)
    assert ddp_average_scale(plan) == 4.0
