"""The blocked reference kernel against a naive float64 attention (forward, lse and backward)."""

from __future__ import annotations

import math

import pytest
import torch

from hdp.kernels import KernelName, get_kernel, kernel_attention
from hdp.kernels.reference import attn_bwd, attn_fwd

TOL = {torch.float64: dict(rtol=0, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def naive(q, k, v, lq, lk, causal, scale):
    """Per-sequence dense attention in float64 with bottom-right causal mask; returns (out, lse)."""
    g = q.shape[1] // k.shape[1]
    outs, lses = [], []
    cq = [0, *torch.tensor(lq).cumsum(0).tolist()]
    ck = [0, *torch.tensor(lk).cumsum(0).tolist()]
    for s in range(len(lq)):
        qs = q[cq[s] : cq[s + 1]].double()
        ks = k[ck[s] : ck[s + 1]].double().repeat_interleave(g, 1)  # [n, Hq, D]
        vs = v[ck[s] : ck[s + 1]].double().repeat_interleave(g, 1)  # [n, Hq, D]
        m, n = qs.shape[0], ks.shape[0]
        sc = torch.einsum("ihd,jhd->hij", qs, ks) * scale  # [Hq, m, n]
        if causal:
            vis = torch.arange(n)[None, :] <= torch.arange(m)[:, None] + (n - m)  # [m, n]
            sc = sc.masked_fill(~vis, -math.inf)
        lse = torch.logsumexp(sc, -1)  # [Hq, m]
        p = torch.exp(sc - lse.masked_fill(torch.isneginf(lse), 0)[..., None])
        outs.append(torch.einsum("hij,jhd->ihd", p, vs))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


def cu(lens):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


CASES = [
    # (q lengths, k lengths, causal)
    ([5, 0, 1, 37, 3, 20], [5, 0, 1, 37, 3, 20], True),
    ([4, 9, 1, 30], [7, 9, 3, 12], True),  # q_len != k_len: bottom-right, incl. rows that see nothing
    ([4, 9, 0, 30], [7, 0, 3, 12], False),
    ([17], [40], True),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("lq,lk,causal", CASES)
@pytest.mark.parametrize("blocks", [(4, 8), (512, 1024)])
def test_reference_matches_naive(dtype, lq, lk, causal, blocks):
    gen = torch.Generator().manual_seed(hash((tuple(lq), tuple(lk), causal)) % 2**31)
    hq, hkv, d, scale = 4, 2, 8, 0.37
    q = torch.randn(sum(lq), hq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(sum(lk), hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(sum(lk), hkv, d, generator=gen, dtype=torch.float64)
    dout = torch.randn(sum(lq), hq, d, generator=gen, dtype=torch.float64)
    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref_out, ref_lse = naive(qr, kr, vr, lq, lk, causal, scale)
    ref_grads = torch.autograd.grad(ref_out, (qr, kr, vr), dout)

    bq, bk = blocks
    qx, kx, vx = (t.to(dtype) for t in (q, k, v))
    out, lse = attn_fwd(qx, kx, vx, cu(lq), cu(lk), causal, scale, block_q=bq, block_k=bk)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (hq, sum(lq))
    torch.testing.assert_close(out.double(), ref_out.detach(), **TOL[dtype])
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[fin], ref_lse.detach()[fin], **TOL[dtype])
    grads = attn_bwd(dout.to(dtype), qx, kx, vx, out, lse, cu(lq), cu(lk), causal, scale, block_q=bq, block_k=bk)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert got.dtype == dtype, name
        torch.testing.assert_close(got.double(), want, **TOL[dtype], msg=lambda m, n=name: f"{n}: {m}")


def test_empty_rows_give_zero_and_neg_inf():
    q = torch.randn(3, 2, 4)
    k = torch.randn(1, 2, 4)
    # bottom-right causal with m=3, n=1: rows 0 and 1 see nothing, row 2 sees key 0
    out, lse = attn_fwd(q, k, k, cu([3]), cu([1]), True, 1.0)
    assert torch.all(out[:2] == 0) and torch.all(torch.isneginf(lse[:, :2]))
    assert torch.isfinite(lse[:, 2]).all()
    dq, dk, dv = attn_bwd(torch.ones_like(out), q, k, k, out, lse, cu([3]), cu([1]), True, 1.0)
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.all(dq[:2] == 0)


def test_bf16_runs_close():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(40, 4, 16, generator=gen)
    k = torch.randn(40, 2, 16, generator=gen)
    v = torch.randn(40, 2, 16, generator=gen)
    ref, _ = naive(q, k, v, [15, 25], [15, 25], True, 0.25)
    out, lse = attn_fwd(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu([15, 25]), cu([15, 25]), True, 0.25)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-2)


def test_kernel_attention_autograd_and_get_kernel():
    kern = get_kernel(torch.device("cpu"))
    assert kern.name is KernelName.REFERENCE
    q = torch.randn(12, 4, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(12, 2, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(12, 2, 8, dtype=torch.float64, requires_grad=True)
    out, _ = kernel_attention(q, k, v, cu([5, 7]), cu([5, 7]), True, 0.3, kern)
    out.sum().backward()
    ref, _ = naive(q, k, v, [5, 7], [5, 7], True, 0.3)
    g = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip((q.grad, k.grad, v.grad), g):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="unknown kernel"):
        get_kernel(torch.device("cpu"), "nope")


@pytest.mark.parametrize(
    "cq,ck,match",
    [
        ([0, 5, 11], [0, 5, 12], r"cu_seqlens_q\[-1\]=11 does not match"),
        ([0, 5, 12], [0, 5, 11], r"cu_seqlens_k\[-1\]=11 does not match"),
        ([0, 12], [0, 5, 12], "same number of sequences"),
        ([0, 7, 5, 12], [0, 7, 5, 12], "non-decreasing"),
        ([1, 12], [1, 12], r"cu_seqlens_q\[0\]=1"),
    ],
)
def test_bad_cu_seqlens_raise(cq, ck, match):
    q = torch.randn(12, 4, 8)
    k = torch.randn(12, 2, 8)
    with pytest.raises(ValueError, match=match):
        attn_fwd(q, k, k, torch.tensor(cq), torch.tensor(ck), True, 1.0)


def test_bad_heads_raise():
    with pytest.raises(ValueError, match="multiple of Hkv"):
        attn_fwd(torch.randn(4, 3, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), cu([4]), cu([4]), True, 1.0)


def test_flash_attn_adapter_plumbing_with_a_fake_module(monkeypatch):
    """The flash-attn adapter's argument and lse conventions, checked against a stand-in module.

    The stand-in mimics flash-attn 2.7's private varlen API (keyword names, 4-tuple return, +inf
    lse for rows without keys) on top of the reference kernel; real flash-attn is not run here.
    """
    import sys
    import types

    from hdp.kernels import flash_attn as fa

    calls = {}

    def fwd(*, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
            causal, alibi_slopes, return_softmax, window_size_left, window_size_right, softcap):
        calls["fwd"] = (cu_seqlens_q.dtype, max_seqlen_q, max_seqlen_k, window_size_left, softcap)
        out, lse = attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale)
        return out, lse.masked_fill(torch.isneginf(lse), math.inf), None, None

    def bwd(*, dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, dropout_p, softmax_scale, causal, alibi_slopes, deterministic, rng_state,
            window_size_left, window_size_right, softcap):
        assert not torch.isneginf(softmax_lse).any()
        lse = softmax_lse.masked_fill(torch.isposinf(softmax_lse), -math.inf)
        for buf, g in zip((dq, dk, dv), attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                 causal, softmax_scale)):
            buf.copy_(g)

    iface = types.SimpleNamespace(_flash_attn_varlen_forward=fwd, _flash_attn_varlen_backward=bwd)
    pkg = types.ModuleType("flash_attn")
    pkg.__version__ = "2.7.4.post1"
    pkg.flash_attn_interface = iface
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    fa._interface.cache_clear()
    try:
        assert fa.available()
        gen = torch.Generator().manual_seed(5)
        lq, lk = [3, 6], [1, 6]  # first sequence: two query rows see no key (bottom-right causal)
        q = torch.randn(9, 4, 8, generator=gen).bfloat16()
        k = torch.randn(7, 2, 8, generator=gen).bfloat16()
        v = torch.randn(7, 2, 8, generator=gen).bfloat16()
        out, lse = fa.attn_fwd(q, k, v, cu(lq), cu(lk), True, 0.3)
        ref_out, ref_lse = attn_fwd(q, k, v, cu(lq), cu(lk), True, 0.3)
        assert calls["fwd"] == (torch.int32, 6, 6, -1, 0.0)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse) and torch.isneginf(lse[:, :2]).all()
        dout = torch.randn(9, 4, 8, generator=gen).bfloat16()
        got = fa.attn_bwd(dout, q, k, v, out, lse, cu(lq), cu(lk), True, 0.3)
        want = attn_bwd(dout, q, k, v, ref_out, ref_lse, cu(lq), cu(lk), True, 0.3)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        # float32 inputs never reach flash-attn
        calls.clear()
        fa.attn_fwd(q.float(), k.float(), v.float(), cu(lq), cu(lk), True, 0.3)
        assert "fwd" not in calls
    finally:
        fa._interface.cache_clear()


def test_device_module_on_cpu():
    """hdp.device: CPU selection, gloo backend, no-op stream/event helpers, RSS-based memory stats."""
    from hdp import device

    cpu = torch.device("cpu")
    assert device.select_device("cpu") == cpu
    assert device.backend_for(cpu) == "gloo"
    assert device.backend_for(torch.device("cuda", 0)) == "nccl"  # constructing a device needs no GPU
    assert device.current_stream(cpu) is None
    ev = device.new_event(cpu)
    ev.record()
    ev.wait()
    ev.synchronize()
    device.synchronize(cpu)
    stats = device.memory_stats(cpu)
    assert stats["peak_bytes"] >= stats["allocated_bytes"] > 0
    if not device.cuda_available():
        with pytest.raises(ValueError, match="device='cuda'"):
            device.select_device("cuda")
    if not device.npu_available():
        with pytest.raises(ValueError, match="device='npu'"):
            device.select_device("npu")
    with pytest.raises(ValueError, match="device='tpu'"):
        device.select_device("tpu")
