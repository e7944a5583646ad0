"""The grouped-GEMM seam (hdp.kernels.grouped_gemm) against per-group torch.mm, and which backend serves.

Tolerance: 0 (bit for bit) where torch's grouped_mm serves (torch 2.13's CPU kernel runs one
``at::mm`` per group, as the reference does, on the same operand layout) and for the loop fallback
(it *is* the reference); fp32 round-off (``atol``/``rtol`` 1e-6 on O(1) values) where the reference
reads an operand in another layout (``F.linear``'s transposed weight against a stacked row-major
one) or autograd adds differently.
"""

from __future__ import annotations

import pytest
import torch

from hdp.kernels.grouped_gemm import (
    GmmNamespace,
    GroupedGemmBackend,
    backend_for,
    gmm,
    grouped_linear,
    grouped_mm,
    grouped_mm_wgrad,
)

SIZES = (5, 0, 7, 1)  # an empty group and a one-row group


def _ref_mm(a: torch.Tensor, b: torch.Tensor, sizes) -> torch.Tensor:
    out, start = [], 0
    for g, n in enumerate(sizes):
        out.append(torch.mm(a[start:start + n], b[g]))
        start += n
    return torch.cat(out)


def _ref_wgrad(a: torch.Tensor, b: torch.Tensor, sizes) -> torch.Tensor:
    out, start = [], 0
    for n in sizes:
        out.append(torch.mm(a[start:start + n].t(), b[start:start + n]))
        start += n
    return torch.stack(out)


@pytest.mark.parametrize("dtype, k, backend", [
    (torch.float32, 16, GroupedGemmBackend.TORCH),
    (torch.bfloat16, 16, GroupedGemmBackend.TORCH),
    (torch.float32, 6, GroupedGemmBackend.LOOP),  # 24-byte rows: off grouped_mm's 16-byte rule
    (torch.float64, 16, GroupedGemmBackend.LOOP),  # a dtype torch's CPU grouped_mm does not take
])
def test_grouped_mm_and_wgrad_equal_per_group_mm(dtype: torch.dtype, k: int, backend: GroupedGemmBackend) -> None:
    g = torch.Generator().manual_seed(0)
    rows, n = sum(SIZES), 8
    a = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(len(SIZES), n, k, generator=g).to(dtype)  # per-group [N, K], used transposed
    b = w.transpose(1, 2)  # [L, K, N] column-major
    assert backend_for(a, b)[0] is backend
    assert torch.equal(grouped_mm(a, b, SIZES), _ref_mm(a, b, SIZES))
    dy = torch.randn(rows, n, generator=g).to(dtype)
    dw = grouped_mm_wgrad(dy, a, SIZES)
    assert torch.equal(dw, _ref_wgrad(dy, a, SIZES))
    assert torch.count_nonzero(dw[1]) == 0  # the empty group's gradient is zero
    # no rows at all (an EP rank that receives nothing)
    assert grouped_mm(a[:0], b, (0,) * len(SIZES)).shape == (0, n)
    assert torch.equal(grouped_mm_wgrad(dy[:0], a[:0], (0,) * len(SIZES)), torch.zeros(len(SIZES), n, k, dtype=dtype))


def test_backend_reasons_and_bad_sizes() -> None:
    a, b = torch.zeros(4, 16), torch.zeros(2, 16, 8)
    assert backend_for(a, b) == (GroupedGemmBackend.TORCH, "torch.nn.functional.grouped_mm")
    kind, why = backend_for(a, b.to(torch.bfloat16))
    assert kind is GroupedGemmBackend.LOOP and "dtypes" in why
    kind, why = backend_for(a[:, 1:13], b[:, 1:13])  # unaligned data pointer
    assert kind is GroupedGemmBackend.LOOP and "16 bytes" in why
    with pytest.raises(ValueError, match=r"do not add up to the 4 rows"):
        grouped_mm(a, b, (1, 2))
    with pytest.raises(ValueError, match=r"3 group sizes for 2 groups"):
        grouped_mm(a, b, (1, 2, 1))
    with pytest.raises(ValueError, match=r"expected a \[R, K\] and b \[L, K, N\]"):
        grouped_mm(a, b.transpose(1, 2), (2, 2))


@pytest.mark.parametrize("trans_b", [False, True])
def test_gmm_is_the_grouped_gemm_package_op_with_autograd(trans_b: bool) -> None:
    """gmm(a, b, batch_sizes, trans_b) (the grouped_gemm package's signature, which Megatron's GroupedMLP
    calls through the CPU shim): forward and both gradients against autograd through per-group matmuls."""
    g = torch.Generator().manual_seed(1)
    rows, k, n = sum(SIZES), 16, 8
    a = torch.randn(rows, k, generator=g, requires_grad=True)
    shape = (len(SIZES), n, k) if trans_b else (len(SIZES), k, n)
    b = torch.randn(*shape, generator=g, requires_grad=True)
    out = gmm(a, b, torch.tensor(SIZES), trans_b=trans_b)
    dy = torch.randn(rows, n, generator=g)
    out.backward(dy)
    a2, b2 = a.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
    ref = _ref_mm(a2, b2.transpose(1, 2) if trans_b else b2, SIZES)
    ref.backward(dy)
    assert torch.equal(out, ref)
    torch.testing.assert_close(a.grad, a2.grad, atol=0, rtol=1e-6)
    torch.testing.assert_close(b.grad, b2.grad, atol=0, rtol=1e-6)
    assert GmmNamespace.ops.gmm is gmm


def test_grouped_linear_gradients_reach_every_expert_weight() -> None:
    """grouped_linear (TE GroupedLinear's math) against nn.functional.linear per group."""
    g = torch.Generator().manual_seed(2)
    rows, k, n = sum(SIZES), 16, 8
    x = torch.randn(rows, k, generator=g, requires_grad=True)
    ws = [torch.randn(n, k, generator=g, requires_grad=True) for _ in SIZES]
    y = grouped_linear(x, ws, SIZES)
    dy = torch.randn(rows, n, generator=g)
    y.backward(dy)
    x2 = x.detach().clone().requires_grad_(True)
    ws2 = [w.detach().clone().requires_grad_(True) for w in ws]
    parts, start = [], 0
    for w, m in zip(ws2, SIZES):
        parts.append(torch.nn.functional.linear(x2[start:start + m], w))
        start += m
    ref = torch.cat(parts)
    ref.backward(dy)
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-6, rtol=1e-6)
    for w, w2 in zip(ws, ws2):
        torch.testing.assert_close(w.grad, w2.grad, atol=1e-6, rtol=1e-6)
    assert torch.count_nonzero(ws[1].grad) == 0
