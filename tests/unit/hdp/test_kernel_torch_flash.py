"""The torch fused-flash adapter (hdp.kernels.torch_flash) on CPU, through a stand-in of the aten ops.

The stand-in (`ReferenceFlashOps`) takes the installed torch's output layout from its meta kernels, the
values from the reference kernel and checks its inputs as the CUDA kernel does (int32 boundaries on the
device, head dim a multiple of 8, exact max lengths, +inf lse into the backward), so these tests fail when
the adapter's conversions are wrong.  The fused CUDA kernel itself is not run here (no GPU).
"""

from __future__ import annotations

import math

import pytest
import torch

from hdp.kernels import AttentionKernel, KernelName, get_kernel, kernel_attention
from hdp.kernels import flash_attn as fa
from hdp.kernels import reference
from hdp.kernels import torch_flash as tf


def cu(lens, dtype=torch.int64):
    return torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()], dtype=dtype)


def inputs(lq, lk, hq, hkv, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lq), hq, d, generator=gen).to(dtype)
    k = torch.randn(sum(lk), hkv, d, generator=gen).to(dtype)
    v = torch.randn(sum(lk), hkv, d, generator=gen).to(dtype)
    dout = torch.randn(sum(lq), hq, d, generator=gen).to(dtype)
    return q, k, v, dout


CASES = [
    # q lengths, k lengths, causal, Hq, Hkv, D
    ([7, 0, 19], [7, 0, 19], True, 4, 2, 16),  # a zero-length sequence, GQA 2
    ([5, 9, 4], [2, 9, 11], True, 4, 1, 8),  # m != n: bottom-right, rows 0-2 of sample 0 see no key; MQA
    ([5, 9, 4], [2, 0, 11], False, 2, 2, 12),  # head dim 12: zero-padded to 16; sample 1 has no keys
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lq,lk,causal,hq,hkv,d", CASES)
def test_adapter_matches_the_reference_through_the_stand_in(dtype, lq, lk, causal, hq, hkv, d):
    ops = tf.ReferenceFlashOps()
    q, k, v, dout = inputs(lq, lk, hq, hkv, d, dtype, seed=len(lq) * d + hq)
    # int64 boundaries as hdp's metadata makes them: the stand-in raises unless the adapter converts them
    out, lse = tf.attn_fwd(q, k, v, cu(lq), cu(lk), causal, 0.31, ops=ops)
    want_out, want_lse = reference.attn_fwd(q, k, v, cu(lq), cu(lk), causal, 0.31)
    assert ops.calls == {"forward": 1, "backward": 0}
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (hq, sum(lq)) and lse.dtype == torch.float32
    exact = d % 8 == 0  # padded head dims change the matmul's blocking: equal to rounding only
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, want_out, **tol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))  # rows that see nothing: -inf, not +inf
    fin = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[fin], want_lse[fin], **(tol if exact else dict(rtol=1e-5, atol=1e-5)))
    got = tf.attn_bwd(dout, q, k, v, out, lse, cu(lq), cu(lk), causal, 0.31, ops=ops)
    want = reference.attn_bwd(dout, q, k, v, want_out, want_lse, cu(lq), cu(lk), causal, 0.31)
    assert ops.calls == {"forward": 1, "backward": 1}
    for name, a, b, src in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert a.shape == src.shape and a.dtype == src.dtype, name
        assert torch.isfinite(a.float()).all(), name
        torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_rows_without_keys_give_zero_output_and_neg_inf():
    ops = tf.ReferenceFlashOps()
    q, k, v, dout = inputs([3], [1], 2, 2, 8, torch.bfloat16, seed=3)
    out, lse = tf.attn_fwd(q, k, v, cu([3]), cu([1]), True, 1.0, ops=ops)
    # bottom-right causal with m=3, n=1: rows 0 and 1 see nothing, row 2 sees key 0
    assert torch.all(out[:2] == 0) and torch.isneginf(lse[:, :2]).all() and torch.isfinite(lse[:, 2]).all()
    dq, dk, dv = tf.attn_bwd(dout, q, k, v, out, lse, cu([3]), cu([1]), True, 1.0, ops=ops)
    assert torch.all(dq[:2] == 0) and torch.isfinite(dk.float()).all() and torch.isfinite(dv.float()).all()


def test_backward_takes_a_merged_lse():
    """Ring attention's backward passes the merged (out, lse) of all key blocks for one block's keys."""
    ops = tf.ReferenceFlashOps()
    q, k, v, dout = inputs([12], [20], 4, 2, 8, torch.bfloat16, seed=7)
    full_out, full_lse = reference.attn_fwd(q, k, v, cu([12]), cu([20]), False, 0.5)
    kb, vb = k[:9], v[:9]  # one block of the keys
    got = tf.attn_bwd(dout, q, kb, vb, full_out, full_lse, cu([12]), cu([9]), False, 0.5, ops=ops)
    want = reference.attn_bwd(dout, q, kb, vb, full_out, full_lse, cu([12]), cu([9]), False, 0.5)
    own_lse = reference.attn_fwd(q, kb, vb, cu([12]), cu([9]), False, 0.5)[1]
    assert not torch.allclose(own_lse, full_lse)  # the block's own lse differs: the merged one is really used
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_scale_and_causal_flag_reach_the_kernel():
    ops = tf.ReferenceFlashOps()
    q, k, v, _ = inputs([6, 10], [6, 10], 2, 2, 8, torch.bfloat16, seed=11)
    a = tf.attn_fwd(q, k, v, cu([6, 10]), cu([6, 10]), True, 0.2, ops=ops)[1]
    b = tf.attn_fwd(q, k, v, cu([6, 10]), cu([6, 10]), True, 0.7, ops=ops)[1]
    c = tf.attn_fwd(q, k, v, cu([6, 10]), cu([6, 10]), False, 0.2, ops=ops)[1]
    assert not torch.allclose(a, b) and not torch.allclose(a, c)
    torch.testing.assert_close(c, reference.attn_fwd(q, k, v, cu([6, 10]), cu([6, 10]), False, 0.2)[1], rtol=0, atol=0)


def test_non_contiguous_inputs_are_made_contiguous():
    ops = tf.ReferenceFlashOps()
    base = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1)).bfloat16()
    q = base.transpose(0, 1)[..., :8]  # [9, 2, 8], D stride 1 but not contiguous
    kv = torch.randn(9, 8, 2, generator=torch.Generator().manual_seed(2)).bfloat16().transpose(1, 2)  # D stride 2
    out, lse = tf.attn_fwd(q, kv, kv, cu([9]), cu([9]), True, 0.4, ops=ops)
    want = reference.attn_fwd(q.contiguous(), kv.contiguous(), kv.contiguous(), cu([9]), cu([9]), True, 0.4)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


def test_dtypes_and_head_dims_the_kernel_lacks_go_to_the_reference():
    ops = tf.ReferenceFlashOps()
    for dtype, d in ((torch.float32, 8), (torch.float64, 8), (torch.bfloat16, tf.MAX_HEAD_DIM + 8)):
        q, k, v, dout = inputs([4], [4], 2, 2, d, dtype, seed=d)
        out, lse = tf.attn_fwd(q, k, v, cu([4]), cu([4]), True, 0.3, ops=ops)
        tf.attn_bwd(dout, q, k, v, out, lse, cu([4]), cu([4]), True, 0.3, ops=ops)
        assert torch.equal(out, reference.attn_fwd(q, k, v, cu([4]), cu([4]), True, 0.3)[0])
    assert ops.calls == {"forward": 0, "backward": 0}


def test_stand_in_layout_is_the_installed_torchs():
    """The meta kernels of this torch say [Hq, Tq] float32 lse, uint64 rng state; the stand-in returns that."""
    assert tf.lse_layout() == "HT"
    q = torch.empty((5, 3, 8), dtype=torch.bfloat16, device="meta")
    c = torch.empty((2,), dtype=torch.int32, device="meta")
    res = torch.ops.aten._flash_attention_forward(q, q, q, c, c, 5, 5, 0.0, True, False, scale=1.0)
    qq = torch.randn(5, 3, 8).bfloat16()
    got = tf.ReferenceFlashOps().forward(qq, qq, qq, cu([5], torch.int32), cu([5], torch.int32), 5, 5, 0.0, True,
                                         False, scale=1.0)
    assert len(got) == len(res) == 5
    assert [(tuple(t.shape), t.dtype) for t in got] == [(tuple(t.shape), t.dtype) for t in res]


class _TokenMajorLse(tf.ReferenceFlashOps):
    """A torch whose varlen lse is [Tq, Hq] (as torch.nn.attention.varlen's docstring states)."""

    def forward(self, *args, **kw):
        out, lse, *rest = super().forward(*args, **kw)
        return (out, lse.t().contiguous(), *rest)


def test_token_major_lse_is_transposed():
    q, k, v, _ = inputs([6, 5], [6, 5], 4, 2, 8, torch.float16, seed=4)
    out, lse = tf.attn_fwd(q, k, v, cu([6, 5]), cu([6, 5]), True, 0.3, ops=_TokenMajorLse())
    assert torch.equal(lse, reference.attn_fwd(q, k, v, cu([6, 5]), cu([6, 5]), True, 0.3)[1])


def test_stand_in_rejects_what_the_cuda_kernel_rejects():
    ops = tf.ReferenceFlashOps()
    q, k, v, _ = inputs([4], [4], 2, 2, 8, torch.bfloat16, seed=0)
    c32 = cu([4], torch.int32)
    with pytest.raises(RuntimeError, match="int32"):
        ops.forward(q, k, v, cu([4]), c32, 4, 4, 0.0, True, False, scale=1.0)
    with pytest.raises(RuntimeError, match="max_seqlen"):
        ops.forward(q, k, v, c32, c32, 3, 4, 0.0, True, False, scale=1.0)
    q12, k12, v12, _ = inputs([4], [4], 2, 2, 12, torch.bfloat16, seed=0)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ops.forward(q12, k12, v12, c32, c32, 4, 4, 0.0, True, False, scale=1.0)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        ops.forward(q.float(), k.float(), v.float(), c32, c32, 4, 4, 0.0, True, False, scale=1.0)
    out, lse = reference.attn_fwd(q, k, v, c32, c32, True, 1.0)
    rng, unused = torch.zeros(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64)
    with pytest.raises(RuntimeError, match=r"\+inf"):
        ops.backward(q, q, k, v, out, torch.full_like(lse, -math.inf), c32, c32, 4, 4, 0.0, True, rng, unused,
                     scale=1.0)


def test_kernel_attention_autograd_with_the_adapter():
    fwd, bwd = tf.kernel_functions(tf.ReferenceFlashOps())
    kern = AttentionKernel(KernelName.TORCH_FLASH, fwd, bwd)
    q, k, v, dout = inputs([5, 11], [5, 11], 4, 2, 16, torch.bfloat16, seed=9)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = kernel_attention(*leaves, cu([5, 11]), cu([5, 11]), True, 0.25, kern)
    out.backward(dout)
    ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out, _ = kernel_attention(*ref_leaves, cu([5, 11]), cu([5, 11]), True, 0.25, get_kernel(torch.device("cpu")))
    ref_out.backward(dout)
    assert torch.equal(out, ref_out)
    for a, b in zip(leaves, ref_leaves):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("have_fa,have_tf,want", [
    (True, True, KernelName.FLASH_ATTN),  # flash-attn first when importable
    (False, True, KernelName.TORCH_FLASH),  # no flash-attn: torch's own kernel
    (False, False, KernelName.REFERENCE),  # neither (an old GPU, a torch built without it)
])
def test_selection_on_cuda(monkeypatch, have_fa, have_tf, want):
    monkeypatch.setattr(fa, "available", lambda: have_fa)
    monkeypatch.setattr(tf, "unavailable_reason", lambda device=None: None if have_tf else "no kernel")
    assert get_kernel(torch.device("cuda", 0)).name is want
    assert get_kernel(torch.device("cpu")).name is KernelName.REFERENCE  # CPU: always the reference


def test_selection_on_cpu_by_name_names_the_reason():
    assert tf.unavailable_reason(torch.device("cpu")) is not None
    with pytest.raises(ValueError, match="kernel=torch_flash: .*use 'reference'"):
        get_kernel(torch.device("cpu"), "torch_flash")
    assert not tf.available(torch.device("cpu"))
