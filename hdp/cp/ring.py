"""Zigzag ring attention over a :class:`~hdp.groups.RingSpec` (any contiguous rank range).

Dimension legend:
    T       tokens held by this rank (THD layout); T_i tokens held by group position i
    Hq/Hkv  query / key-value heads (GQA: Hq % Hkv == 0); D head dim
    k       ring size; j this rank's position

Each rank's K/V block travels once around the ring with point-to-point ops on the domain group
(peers are global ranks); the transfer for step s+1 is issued before step s is computed so the
two overlap.  Which rows/columns each step computes is fixed by :mod:`hdp.cp.metadata`.

Partial results are merged with the log-sum-exp rule (ring-flash-attention, "update_out_and_lse"):
    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) · out_a + exp(lse_b - lse) · out_b
Rows that see no key in either part have lse_a = lse_b = lse = -inf; they use 0 as the reference
so both weights are exp(-inf) = 0 and out stays 0 instead of NaN.

Backward (zigzag ring backward): every step recomputes its block from the *merged* out and lse,
dq accumulates locally, and a dK/dV accumulator for each source travels with that source's K/V;
after k steps it arrives back at its owner.  K/V sends are issued before the step's compute; the
accumulator of step s is received while step s computes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from hdp.cp.autograd import CPAttentionFunction
from hdp.cp.metadata import RankLayout, StepCase, ring_schedule
from hdp.groups import RingSpec
from hdp.kernels import AttentionKernel
from hdp.memory_meter import track

__all__ = ["ring_forward", "ring_backward", "ring_attention", "merge_lse_"]

logger = logging.getLogger(__name__)

_TAG_KV = 11
_TAG_DKV = 12


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_lse_(
    out: torch.Tensor,
    lse: torch.Tensor,
    out_i: torch.Tensor,
    lse_i: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> None:
    """Merge a partial result into ``(out [T, Hq, D], lse [Hq, T])`` in place.

    ``out_i [R, Hq, D]``/``lse_i [Hq, R]`` cover all rows, or the rows listed in ``rows [R]``.
    lse = logaddexp(lse, lse_i); out = exp(lse_old - lse)·out + exp(lse_i - lse)·out_i.
    """
    la = lse if rows is None else lse.index_select(1, rows)  # [Hq, R]
    oa = out if rows is None else out.index_select(0, rows)  # [R, Hq, D]
    li = lse_i.to(lse.dtype)  # [Hq, R]
    new = torch.logaddexp(la, li)  # [Hq, R]
    ref = new.masked_fill(torch.isneginf(new), 0.0)  # rows with nothing visible: weights exp(-inf) = 0
    wa = torch.exp(la - ref).t().unsqueeze(-1)  # [R, Hq, 1]
    wi = torch.exp(li - ref).t().unsqueeze(-1)  # [R, Hq, 1]
    merged = oa * wa + out_i.to(out.dtype) * wi  # [R, Hq, D]
    if rows is None:
        out.copy_(merged)
        lse.copy_(new)
    else:
        out.index_copy_(0, rows, merged)
        lse.index_copy_(1, rows, new)


def _exchange(send: torch.Tensor, recv: torch.Tensor, ring: RingSpec, tag: int) -> list[Any]:
    """Post send-to-next and receive-from-prev together; zero-size sides are skipped on both ends."""
    ops = []
    if send.numel() > 0:
        ops.append(dist.P2POp(dist.isend, send, ring.next_rank, ring.group, tag))
    if recv.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, recv, ring.prev_rank, ring.group, tag))
    if not ops:
        return []
    return list(dist.batch_isend_irecv(ops))


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def _check(ring: RingSpec, layouts: tuple[RankLayout, ...], q: torch.Tensor, k: torch.Tensor) -> RankLayout:
    if len(layouts) != ring.size:
        raise ValueError(f"layouts: got {len(layouts)} rank layouts for a ring of {ring.size} ranks")
    lay = layouts[ring.position]
    if q.shape[0] != lay.num_tokens or k.shape[0] != lay.num_tokens:
        raise ValueError(
            f"q has {q.shape[0]} and k has {k.shape[0]} tokens but the layout of ring position "
            f"{ring.position} holds {lay.num_tokens}"
        )
    return lay


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: RingSpec,
    layouts: tuple[RankLayout, ...],
    kernel: AttentionKernel,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zigzag ring attention forward: returns ``(out [T, Hq, D] in q.dtype, lse [Hq, T])``.

    ``layouts[i]`` is the layout of ring position i (:func:`hdp.cp.metadata.group_layouts`).
    """
    lay = _check(ring, layouts, q, k)
    dev = q.device
    n, j = ring.size, ring.position
    acc_t = _acc_dtype(q.dtype)
    kv = torch.stack([k, v])  # [2, T, Hkv, D]
    out = torch.zeros(q.shape, dtype=acc_t, device=dev)  # [T, Hq, D]
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc_t, device=dev)  # [Hq, T]
    back_idx = lay.back_index.to(dev)
    q_back = q.index_select(0, back_idx)  # [T_back, Hq, D]
    track(kv, out, lse, q_back)
    for step in ring_schedule(n, j):
        works: list[Any] = []
        if step.step < n - 1:
            nxt = layouts[(j - step.step - 1) % n]
            recv = torch.empty((2, nxt.num_tokens) + tuple(kv.shape[2:]), dtype=kv.dtype, device=dev)
            track(recv)
            works = _exchange(kv, recv, ring, _TAG_KV)  # next step's K/V, overlapped with this one
        src = layouts[step.source]
        if step.case is StepCase.LOCAL_CAUSAL:
            o, l = kernel.fwd(q, kv[0], kv[1], lay.cu_seqlens, lay.cu_seqlens, True, scale)
            out.copy_(o)
            lse.copy_(l)
        elif step.case is StepCase.FRONT_KEYS:
            fidx = src.front_index.to(dev)
            kf = kv.index_select(1, fidx)  # [2, T_front(src), Hkv, D]
            o, l = kernel.fwd(q, kf[0], kf[1], lay.cu_seqlens, src.cu_front, False, scale)
            merge_lse_(out, lse, o, l)
        else:  # BACK_QUERIES
            o, l = kernel.fwd(q_back, kv[0], kv[1], lay.cu_back, src.cu_seqlens, False, scale)
            merge_lse_(out, lse, o, l, rows=back_idx)
        if step.step < n - 1:
            _wait(works)
            kv = recv
    return out.to(q.dtype), lse


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    ring: RingSpec,
    layouts: tuple[RankLayout, ...],
    kernel: AttentionKernel,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zigzag ring attention backward from the merged ``out``/``lse``; returns ``(dq, dk, dv)``."""
    lay = _check(ring, layouts, q, k)
    dev = q.device
    n, j = ring.size, ring.position
    acc_t = _acc_dtype(q.dtype)
    kv_shape = tuple(k.shape[1:])  # (Hkv, D)
    kv = torch.stack([k, v])  # [2, T, Hkv, D]
    dq = torch.zeros(q.shape, dtype=acc_t, device=dev)  # [T, Hq, D]
    back_idx = lay.back_index.to(dev)
    q_back = q.index_select(0, back_idx)  # [T_back, Hq, D]
    dout_back = dout.index_select(0, back_idx)  # [T_back, Hq, D]
    out_back = out.index_select(0, back_idx)  # [T_back, Hq, D]
    lse_back = lse.index_select(1, back_idx)  # [Hq, T_back]
    track(kv, dq, q_back, dout_back, out_back, lse_back)

    dkv_recv: torch.Tensor | None = None  # accumulator of this step's source, coming from prev
    dkv_works: list[Any] = []  # pending send/recv of accumulators
    for step in ring_schedule(n, j):
        kv_works: list[Any] = []
        if step.step < n - 1:
            nxt = layouts[(j - step.step - 1) % n]
            kv_recv = torch.empty((2, nxt.num_tokens) + kv_shape, dtype=kv.dtype, device=dev)
            track(kv_recv)
            kv_works = _exchange(kv, kv_recv, ring, _TAG_KV)
        src = layouts[step.source]
        if step.case is StepCase.LOCAL_CAUSAL:
            dq_i, dk_i, dv_i = kernel.bwd(
                dout, q, kv[0], kv[1], out, lse, lay.cu_seqlens, lay.cu_seqlens, True, scale
            )
            dq += dq_i
            dkv = torch.stack([dk_i, dv_i]).to(acc_t)  # [2, T_src, Hkv, D]
        elif step.case is StepCase.FRONT_KEYS:
            fidx = src.front_index.to(dev)
            kf = kv.index_select(1, fidx)  # [2, T_front(src), Hkv, D]
            dq_i, dk_i, dv_i = kernel.bwd(
                dout, q, kf[0], kf[1], out, lse, lay.cu_seqlens, src.cu_front, False, scale
            )
            dq += dq_i
            dkv = torch.zeros((2, src.num_tokens) + kv_shape, dtype=acc_t, device=dev)  # [2, T_src, Hkv, D]
            # scatter [2, T_front(src), Hkv, D] into the source layout [2, T_src, Hkv, D]
            dkv.index_copy_(1, fidx, torch.stack([dk_i, dv_i]).to(acc_t))
        else:  # BACK_QUERIES
            dq_i, dk_i, dv_i = kernel.bwd(
                dout_back, q_back, kv[0], kv[1], out_back, lse_back, lay.cu_back, src.cu_seqlens, False, scale
            )
            dq.index_add_(0, back_idx, dq_i.to(acc_t))
            dkv = torch.stack([dk_i, dv_i]).to(acc_t)  # [2, T_src, Hkv, D]
        if step.step > 0:
            _wait(dkv_works)  # accumulator of this source from prev (and our previous send)
            assert dkv_recv is not None
            dkv += dkv_recv
        if n == 1:  # a ring of one: the accumulator is already home
            return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        # send this source's accumulator on; receive the next one (after the last step: our own)
        nxt_src = layouts[(j - step.step - 1) % n]
        dkv_recv = torch.empty((2, nxt_src.num_tokens) + kv_shape, dtype=acc_t, device=dev)
        track(dkv, dkv_recv)
        dkv_works = _exchange(dkv, dkv_recv, ring, _TAG_DKV)
        dkv_sent = dkv  # keep the send buffer alive until its work completes
        if step.step < n - 1:
            _wait(kv_works)
            kv = kv_recv
    _wait(dkv_works)
    del dkv_sent
    assert dkv_recv is not None
    return dq.to(q.dtype), dkv_recv[0].to(k.dtype), dkv_recv[1].to(v.dtype)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: RingSpec,
    layouts: tuple[RankLayout, ...],
    kernel: AttentionKernel,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable zigzag ring attention: ``(out [T, Hq, D], lse [Hq, T])``."""
    return CPAttentionFunction.apply(q, k, v, ring_forward, ring_backward, (ring, layouts), kernel, scale)
