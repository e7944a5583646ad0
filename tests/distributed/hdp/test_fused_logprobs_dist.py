"""The distributed tier (other processes) of the tests tests/unit/hdp/test_fused_logprobs.py describes: its docstring says what they check and how."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hdp.fused_logprobs import fused_logprobs_entropy, fused_sum_pi_squared
from hdp.logprobs import logprobs_entropy, sum_pi_squared

from helpers.fused_logprobs import H, TOL64, one_rank_group  # noqa: F401 - fixtures: pytest finds them by name


# ---- TP 2 through the compat head's TP mappings ----

def _tp_worker(rank: int, world: int, sequence_parallel: bool) -> None:
    """TP 2: each rank holds half of the weight's rows; the head's mapping gathers the sequence-parallel rows
    (or copies the whole input) and sums the input gradient over TP in its backward."""
    from types import SimpleNamespace

    from hdp import megatron_compat as mc

    t_len, vocab = 24, 64
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(t_len, 1, H, generator=g, dtype=torch.float64)  # [T, 1, H] Megatron's [s, b, h]
    weight = torch.randn(vocab, H, generator=g, dtype=torch.float64) * 0.7  # [V, H]
    targets = torch.randint(0, vocab, (t_len,), generator=g)
    temp = torch.rand(t_len, generator=g, dtype=torch.float64) + 0.5
    g_lp, g_h = torch.randn(t_len, generator=g, dtype=torch.float64), torch.randn(t_len, generator=g, dtype=torch.float64)

    # one process, the whole vocabulary
    h_ref, w_ref = hidden[:, 0].clone().requires_grad_(), weight.clone().requires_grad_()
    lp_ref, ent_ref = logprobs_entropy(h_ref @ w_ref.t(), targets, dist.new_group([rank]), temperature=temp, entropy=True)
    ((lp_ref * g_lp).sum() + (ent_ref * g_h).sum()).backward()

    tp = dist.new_group([0, 1])
    rows = vocab // world
    w_mine = weight[rank * rows:(rank + 1) * rows].clone().requires_grad_()  # [V/2, H]
    s_len = t_len // world if sequence_parallel else t_len
    x = hidden[rank * s_len:(rank + 1) * s_len].clone() if sequence_parallel else hidden.clone()
    x.requires_grad_()  # [S, 1, H] this rank's input of the output layer
    layer = SimpleNamespace(weight=w_mine, tp_group=tp, sequence_parallel=sequence_parallel)
    with mc.apply_cpu_shim(torch.device("cpu")):
        out, bias = mc.HiddenHead(layer).forward(x)
        assert bias is None and out.shape == (t_len, 1, H)
        lp, ent = fused_logprobs_entropy(out[:, 0], w_mine, targets, tp, temperature=temp, entropy=True, chunk=5,
                                         token_chunk=7)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    torch.testing.assert_close(lp, lp_ref.detach(), atol=TOL64, rtol=0)
    torch.testing.assert_close(ent, ent_ref.detach(), atol=TOL64, rtol=0)
    want_dx = h_ref.grad[rank * s_len:(rank + 1) * s_len] if sequence_parallel else h_ref.grad
    torch.testing.assert_close(x.grad[:, 0], want_dx, atol=TOL64, rtol=0)
    torch.testing.assert_close(w_mine.grad, w_ref.grad[rank * rows:(rank + 1) * rows], atol=TOL64, rtol=0)
    spq = fused_sum_pi_squared(out[:, 0].detach(), w_mine.detach(), tp, temperature=temp, chunk=9)
    torch.testing.assert_close(spq, sum_pi_squared((h_ref @ w_ref.t()).detach(), dist.new_group([rank]),
                                                   temperature=temp), atol=TOL64, rtol=0)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_through_the_heads_mappings(sequence_parallel: bool):
    from helpers.dist_helper import run_distributed

    run_distributed(_tp_worker, 2, sequence_parallel, timeout=180)
