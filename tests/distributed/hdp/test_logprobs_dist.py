"""The distributed tier (other processes) of the tests tests/unit/hdp/test_logprobs.py describes: its docstring says what they check and how."""

from __future__ import annotations

import torch

import torch.distributed as dist

from hdp.logprobs import logprobs_entropy

from helpers.logprobs import T, one_rank_group  # noqa: F401 - fixtures: pytest finds them by name


def _tp_worker(rank: int, world: int) -> None:
    """TP 2: each rank holds half of the vocabulary; values and d logits equal the one-process path."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(T, 64, generator=g) * 3  # [T, V] float32, V = 64
    targets = torch.randint(0, 64, (T,), generator=g)
    temp = torch.rand(T, generator=g) + 0.5
    w_lp, w_h = torch.randn(T, generator=g), torch.randn(T, generator=g)  # upstream gradients

    full = logits.clone().requires_grad_(True)
    lp_all = torch.log_softmax(full / temp[:, None], dim=-1)  # [T, V] the naive one-process path
    lp_ref, h_ref = lp_all.gather(-1, targets[:, None])[:, 0], -(lp_all.exp() * lp_all).sum(-1)
    ((lp_ref * w_lp).sum() + (h_ref * w_h).sum()).backward()

    shard = logits[:, rank * 32 : (rank + 1) * 32].clone().requires_grad_(True)  # [T, V/2]
    lp, h = logprobs_entropy(shard, targets, dist.group.WORLD, temperature=temp, chunk=8, entropy=True)
    ((lp * w_lp).sum() + (h * w_h).sum()).backward()
    torch.testing.assert_close(lp, lp_ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(h, h_ref, atol=2e-5, rtol=0)
    torch.testing.assert_close(shard.grad, full.grad[:, rank * 32 : (rank + 1) * 32], atol=2e-5, rtol=0)
    lp_only, none = logprobs_entropy(shard.detach(), targets, dist.group.WORLD, temperature=temp, entropy=False)
    assert none is None
    torch.testing.assert_close(lp_only, lp_ref.detach(), atol=2e-5, rtol=0)


def test_tensor_parallel_logprobs_and_entropy_match_the_full_vocabulary():
    """TP 2: chunked over each shard's columns, combined over the TP group; d logits of each shard equal the
    full-vocabulary gradient's columns (the backward needs no communication)."""
    from helpers.dist_helper import run_distributed

    run_distributed(_tp_worker, 2, timeout=120)
