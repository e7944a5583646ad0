"""hdp.fused_logprobs: log-probs, entropies and Σp² from the hidden states and the output weight, exact against
the logits path, and never a [T, V]-sized tensor, forward or backward.

Reference: `hdp.logprobs.logprobs_entropy` / `sum_pi_squared` on the materialised logits ``hidden @ weight.T``
(themselves checked against ``torch.log_softmax`` in tests/unit/hdp/test_logprobs.py
tests/distributed/hdp/test_logprobs_dist.py), with the same upstream gradients.
Tolerances: float64 1e-12 absolute (values O(1..10); the paths differ in summation order only); float32 with
bf16 products 2e-2 (both paths round the products to bf16; the order of the bf16 partial sums differs).
The memory check counts every ATen op output of at least T·V elements in new storage (`BigOutputs`, as
tests/unit/hdp/test_logprobs.py tests/distributed/hdp/test_logprobs_dist.py): none in the forward and none in the
backward (the logits path builds d logits there).
TP 2 on gloo runs the compat head's TP mappings (`hdp.megatron_compat.head.HiddenHead`, Megatron's own
``copy_to_tensor_model_parallel_region`` / ``gather_from_sequence_parallel_region``) with and without sequence
parallelism: every rank's values, its input rows' gradient and its weight shard's gradient equal the
one-process full-vocabulary path's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hdp.fused_logprobs import (LastHidden, fused_logprobs_entropy, fused_sum_pi_squared, token_logprobs_entropy,
                                token_sum_pi_squared)
from hdp.logprobs import logprobs_entropy, sum_pi_squared

from helpers.fused_logprobs import H, T, TOL64, V, one_rank_group  # noqa: F401 - fixtures: pytest finds them by name
from helpers.logprobs import BigOutputs


def _inputs(dtype=torch.float64, seed=0, t_len=T, vocab=V):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(t_len, H, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, H, generator=g, dtype=torch.float64) * 0.7).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (t_len,), generator=g)
    temp = torch.rand(t_len, generator=g, dtype=torch.float64) + 0.5
    g_lp = torch.randn(t_len, generator=g, dtype=torch.float64)
    g_h = torch.randn(t_len, generator=g, dtype=torch.float64)
    return hidden, weight, targets, temp, g_lp, g_h


def _grads(fn, hidden, weight, g_lp, g_h):
    """(log-probs, entropies, d hidden, d weight) of ``fn(hidden, weight)`` under upstream (g_lp, g_h)."""
    lp, ent = fn(hidden, weight)
    loss = (lp.double() * g_lp).sum() if g_lp is not None else 0.0
    if ent is not None and g_h is not None:
        loss = loss + (ent.double() * g_h).sum()
    dh, dw = torch.autograd.grad(loss, [hidden, weight])
    return lp.detach(), (ent.detach() if ent is not None else None), dh, dw


@pytest.mark.parametrize(("chunk", "token_chunk"), [(V, T), (128, 8), (333, 36), (4096, 4096), (1, 37)])
@pytest.mark.parametrize("temperature", ["per-token", "scalar", "none"])
def test_values_and_every_gradient_equal_the_logits_path(chunk: int, token_chunk: int, temperature: str):
    hidden, weight, targets, temp, g_lp, g_h = _inputs()
    t = {"per-token": temp, "scalar": 0.7, "none": None}[temperature]
    tp = dist.group.WORLD
    got = _grads(lambda h, w: fused_logprobs_entropy(h, w, targets, tp, temperature=t, entropy=True, chunk=chunk,
                                                     token_chunk=token_chunk), hidden, weight, g_lp, g_h)
    want = _grads(lambda h, w: logprobs_entropy(h @ w.t(), targets, tp, temperature=t, entropy=True, chunk=128),
                  hidden, weight, g_lp, g_h)
    for name, a, b in zip(("log-probs", "entropies", "d hidden", "d weight"), got, want):
        torch.testing.assert_close(a, b, atol=TOL64, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("which", ["log-probs only", "entropy only"])
def test_one_output_alone_carries_its_own_gradient(which: str):
    """Only the log-probs asked for (no entropy computed), or only the entropy's gradient used."""
    hidden, weight, targets, temp, g_lp, g_h = _inputs(seed=1)
    tp = dist.group.WORLD
    entropy = which == "entropy only"
    up = (None, g_h) if entropy else (g_lp, None)
    got = _grads(lambda h, w: fused_logprobs_entropy(h, w, targets, tp, temperature=temp, entropy=entropy, chunk=100,
                                                     token_chunk=10), hidden, weight, *up)
    want = _grads(lambda h, w: logprobs_entropy(h @ w.t(), targets, tp, temperature=temp, entropy=entropy, chunk=100),
                  hidden, weight, *up)
    assert (got[1] is None) == (not entropy)
    for a, b in zip(got, want):
        if a is not None:
            torch.testing.assert_close(a, b, atol=TOL64, rtol=0)


def test_bf16_weight_with_float32_hidden_states_matches_bf16_logits():
    """Megatron's Float16Module hands the last stage's output over in float32: the hidden states are cast to
    the weight's dtype and the products run in bf16, as the output layer's do."""
    hidden, weight, targets, temp, g_lp, g_h = _inputs(seed=2)
    h32 = hidden.detach().float().requires_grad_()
    w16 = weight.detach().bfloat16().requires_grad_()
    tp = dist.group.WORLD
    got = _grads(lambda h, w: fused_logprobs_entropy(h, w, targets, tp, temperature=temp, entropy=True, chunk=256,
                                                     token_chunk=16), h32, w16, g_lp, g_h)
    want = _grads(lambda h, w: logprobs_entropy(h.bfloat16() @ w.t(), targets, tp, temperature=temp, entropy=True),
                  h32, w16, g_lp, g_h)
    assert got[2].dtype == torch.float32 and got[3].dtype == torch.bfloat16
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("entropy", [False, True])
def test_no_full_vocabulary_tensor_forward_or_backward(entropy: bool):
    """Forward and backward build nothing of T·V elements (the logits path builds d logits [T, V] in backward)."""
    hidden, weight, targets, temp, g_lp, g_h = _inputs(torch.float32, seed=3, t_len=64)
    limit = 64 * V
    with BigOutputs(limit) as fwd:
        lp, ent = fused_logprobs_entropy(hidden, weight, targets, dist.group.WORLD, temperature=temp, entropy=entropy,
                                         chunk=128, token_chunk=16)
        loss = lp.sum() + (ent.sum() if ent is not None else 0.0)
    assert fwd.big == [], f"forward built [T, V]-sized tensors: {fwd.big}"
    with BigOutputs(limit) as bwd:
        loss.backward()
    assert bwd.big == [], f"backward built [T, V]-sized tensors: {bwd.big}"
    with BigOutputs(limit) as ref:  # the check sees the logits path's d logits
        lp2, _ = logprobs_entropy(hidden.detach() @ weight.detach().t().requires_grad_(), targets, dist.group.WORLD)
        lp2.sum().backward()
    assert ref.big, "the counter must see the logits path's [T, V] tensors"


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_sum_pi_squared_equals_the_logits_path(dtype, tol):
    hidden, weight, _, temp, _, _ = _inputs(dtype, seed=4)
    want = sum_pi_squared((hidden @ weight.t()).detach(), dist.group.WORLD, temperature=temp)
    for chunk, token_chunk in ((V, T), (77, 5), (1, 37)):
        got = fused_sum_pi_squared(hidden.detach(), weight.detach(), dist.group.WORLD, temperature=temp, chunk=chunk,
                                   token_chunk=token_chunk)
        torch.testing.assert_close(got, want, rtol=tol, atol=0)


def test_one_call_for_either_path():
    """The adapters' entry points take logits or a `LastHidden` (with ``[: rows]`` and ``logits()``) alike."""
    hidden, weight, targets, temp, _, _ = _inputs(seed=5)
    head = LastHidden(hidden.detach(), weight.detach())
    assert head.shape == (T, V) and head[:10].shape == (10, V)
    tp = dist.group.WORLD
    a = token_logprobs_entropy(head[:10], targets[:10], tp, temperature=temp[:10], entropy=True, chunk=64)
    b = token_logprobs_entropy(head.logits()[:10], targets[:10], tp, temperature=temp[:10], entropy=True, chunk=64)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=TOL64, rtol=0)
    torch.testing.assert_close(token_sum_pi_squared(head, tp, chunk=64), token_sum_pi_squared(head.logits(), tp),
                               atol=TOL64, rtol=0)


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"chunk": 0}, "chunk=0"), ({"token_chunk": -1}, "token_chunk=-1"), ({"chunk": True}, "chunk=True"),
])
def test_bad_chunks_name_the_argument(kwargs, needle):
    hidden, weight, targets, *_ = _inputs(seed=6)
    with pytest.raises(ValueError, match=needle):
        fused_logprobs_entropy(hidden, weight, targets, dist.group.WORLD, **kwargs)


def test_mismatched_shapes_and_a_missing_group_are_refused():
    hidden, weight, targets, *_ = _inputs(seed=7)
    with pytest.raises(ValueError, match=r"weight.shape=\(1000, 8\)"):
        fused_logprobs_entropy(hidden, weight[:, :8], targets, dist.group.WORLD)
    with pytest.raises(ValueError, match="tp_group=None"):
        fused_sum_pi_squared(hidden, weight, None)
