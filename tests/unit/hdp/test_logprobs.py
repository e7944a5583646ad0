"""hdp.logprobs: chunked, TP-aware token log-probs / entropy of both engines: exact, and no extra [T, V] tensors.

The verl engine used to build ``logits.float() / t``, its ``log_softmax``, ``exp`` of that and the
entropy product — four [T, V] fp32 tensors per round, entropy or not.  The memory check counts,
with a ``TorchDispatchMode``, every tensor an ATen op produces: the forward may produce nothing of
T·V elements or more, the backward exactly one (d logits, which Megatron's output layer needs).
Numerics: float64 against ``torch.log_softmax`` with per-token temperatures, tolerance 1e-10
(float32 logits accumulate in float32: 2e-5).
"""

from __future__ import annotations

import pytest
import torch

import torch.distributed as dist

from hdp.logprobs import logprobs_entropy

from helpers.logprobs import T, V, one_rank_group  # noqa: F401 - fixtures: pytest finds them by name
from helpers.logprobs import BigOutputs


def token_logprobs_entropy(logits, targets, temp, *, chunk, entropy=False):
    return logprobs_entropy(logits, targets, dist.group.WORLD, temperature=temp, chunk=chunk, entropy=entropy)


def _inputs(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=g, dtype=torch.float64) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    temp = torch.rand(T, generator=g, dtype=torch.float64) + 0.5
    return logits, targets, temp


def _reference(logits, targets, temp):
    lp_all = torch.log_softmax(logits.double() / temp[:, None], dim=-1)  # [T, V]
    return lp_all.gather(-1, targets[:, None])[:, 0], -(lp_all.exp() * lp_all).sum(-1)


@pytest.mark.parametrize("chunk", [1000, 128, 333, 4096])
def test_matches_log_softmax_forward_and_backward(chunk: int):
    logits, targets, temp = _inputs()
    g_lp, g_h = torch.randn(T, dtype=torch.float64), torch.randn(T, dtype=torch.float64)
    lp, h = token_logprobs_entropy(logits, targets, temp, chunk=chunk, entropy=True)
    (lp.double() * g_lp + h.double() * g_h).sum().backward()
    got = logits.grad.clone()
    logits.grad = None
    rlp, rh = _reference(logits, targets, temp)
    (rlp * g_lp + rh * g_h).sum().backward()
    torch.testing.assert_close(lp, rlp, atol=1e-10, rtol=0)
    torch.testing.assert_close(h, rh, atol=1e-10, rtol=0)
    torch.testing.assert_close(got, logits.grad, atol=1e-10, rtol=0)


def test_entropy_is_not_computed_unless_asked():
    logits, targets, temp = _inputs(torch.float32)
    lp, h = token_logprobs_entropy(logits, targets, temp, chunk=128, entropy=False)
    assert h is None
    lp.sum().backward()
    rlp, _ = _reference(logits.detach(), targets, temp)
    torch.testing.assert_close(lp.double(), rlp, atol=2e-5, rtol=0)  # float32 accumulation


@pytest.mark.parametrize("entropy", [False, True])
def test_no_extra_full_vocab_tensors(entropy: bool):
    logits, targets, temp = _inputs(torch.float32)
    with BigOutputs(T * V) as fwd:
        lp, h = token_logprobs_entropy(logits, targets, temp, chunk=128, entropy=entropy)
        loss = lp.sum() + (h.sum() if h is not None else 0.0)
    assert fwd.big == [], f"forward built [T, V]-sized tensors: {fwd.big}"
    with BigOutputs(T * V) as bwd:
        loss.backward()
    assert len(bwd.big) == 1, f"backward must build only d logits, got {bwd.big}"


def test_bad_chunk_names_the_value():
    logits, targets, temp = _inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk=0"):
        token_logprobs_entropy(logits, targets, temp, chunk=0)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_sum_pi_squared_matches_the_naive_softmax(dtype, tol):
    """Σ_v p_v² (verl's optimal-token-baseline input) in vocabulary chunks, with per-token temperatures, against
    ``softmax(logits / t)²`` summed in float64; relative ``tol``."""
    from hdp.logprobs import sum_pi_squared

    logits, _, temp = _inputs(dtype)
    want = torch.softmax(logits.detach().double() / temp[:, None], dim=-1).pow(2).sum(-1)
    for chunk in (V, 128, 7):
        got = sum_pi_squared(logits.detach(), dist.group.WORLD, temperature=temp, chunk=chunk)
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=0)
