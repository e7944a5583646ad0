"""Zigzag ring attention over a :class:`~hdp.groups.RingSpec` (any contiguous rank range).

Dimension legend:
    T       tokens held by this rank (THD layout); T_i tokens held by group position i
    Hq/Hkv  query / key-value heads (GQA: Hq % Hkv == 0); D query/key head dim, Dv value head dim
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

K and V travel as one buffer [T, Hkv, D + Dv] (concatenated on the last dim, so the value heads may
be narrower or wider than the query/key heads), and so do their gradient accumulators.  A sliding
window (``window``: ``left`` positions) passes each step's sample positions to the kernel; a step
whose keys all lie outside every local query's window (:func:`hdp.cp.metadata.step_sees_keys`)
computes nothing, and its K/V and accumulator still travel on.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from hdp.cp.autograd import CPAttentionFunction
from hdp.cp.metadata import RankLayout, StepCase, ring_schedule, step_sees_keys
from hdp.groups import RingSpec
from hdp.kernels import AttentionKernel, KeyWindow
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


def _window(left: int | None, q_pos: torch.Tensor, k_pos: torch.Tensor, dev: torch.device) -> KeyWindow | None:
    return None if left is None else KeyWindow(left, q_pos.to(dev), k_pos.to(dev))


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: RingSpec,
    layouts: tuple[RankLayout, ...],
    window: int | None,
    kernel: AttentionKernel,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zigzag ring attention forward: returns ``(out [T, Hq, Dv] in q.dtype, lse [Hq, T])``.

    ``layouts[i]`` is the layout of ring position i (:func:`hdp.cp.metadata.group_layouts`);
    ``window``: a sliding window of that many positions, ``None`` for none.
    """
    lay = _check(ring, layouts, q, k)
    dev = q.device
    n, j = ring.size, ring.position
    dk = k.shape[-1]
    acc_t = _acc_dtype(q.dtype)
    kv = torch.cat([k, v], dim=-1)  # [T, Hkv, D+Dv]
    out = torch.zeros((*q.shape[:2], v.shape[-1]), dtype=acc_t, device=dev)  # [T, Hq, Dv]
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc_t, device=dev)  # [Hq, T]
    back_idx = lay.back_index.to(dev)
    q_back = q.index_select(0, back_idx)  # [T_back, Hq, D]
    track(kv, out, lse, q_back)
    for step in ring_schedule(n, j):
        works: list[Any] = []
        if step.step < n - 1:
            nxt = layouts[(j - step.step - 1) % n]
            recv = torch.empty((nxt.num_tokens,) + tuple(kv.shape[1:]), dtype=kv.dtype, device=dev)
            track(recv)
            works = _exchange(kv, recv, ring, _TAG_KV)  # next step's K/V, overlapped with this one
        src = layouts[step.source]
        if not step_sees_keys(lay, src, step.case, window):
            pass  # every key of this source lies outside every local query's window
        elif step.case is StepCase.LOCAL_CAUSAL:
            win = _window(window, lay.positions, lay.positions, dev)
            o, l = kernel.forward(q, kv[..., :dk], kv[..., dk:], lay.cu_seqlens, lay.cu_seqlens, True, scale,
                                  window=win)
            out.copy_(o)
            lse.copy_(l)
        elif step.case is StepCase.FRONT_KEYS:
            fidx = src.front_index.to(dev)
            kf = kv.index_select(0, fidx)  # [T_front(src), Hkv, D+Dv]
            win = _window(window, lay.positions, src.positions.index_select(0, src.front_index), dev)
            o, l = kernel.forward(q, kf[..., :dk], kf[..., dk:], lay.cu_seqlens, src.cu_front, False, scale,
                                  window=win)
            merge_lse_(out, lse, o, l)
        else:  # BACK_QUERIES
            win = _window(window, lay.positions.index_select(0, lay.back_index), src.positions, dev)
            o, l = kernel.forward(q_back, kv[..., :dk], kv[..., dk:], lay.cu_back, src.cu_seqlens, False, scale,
                                  window=win)
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
    window: int | None,
    kernel: AttentionKernel,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zigzag ring attention backward from the merged ``out``/``lse``; returns ``(dq, dk, dv)``."""
    lay = _check(ring, layouts, q, k)
    dev = q.device
    n, j = ring.size, ring.position
    dk_dim = k.shape[-1]
    acc_t = _acc_dtype(q.dtype)
    kv = torch.cat([k, v], dim=-1)  # [T, Hkv, D+Dv]
    kv_tail = tuple(kv.shape[1:])  # (Hkv, D+Dv)
    dq = torch.zeros(q.shape, dtype=acc_t, device=dev)  # [T, Hq, D]
    back_idx = lay.back_index.to(dev)
    q_back = q.index_select(0, back_idx)  # [T_back, Hq, D]
    dout_back = dout.index_select(0, back_idx)  # [T_back, Hq, Dv]
    out_back = out.index_select(0, back_idx)  # [T_back, Hq, Dv]
    lse_back = lse.index_select(1, back_idx)  # [Hq, T_back]
    track(kv, dq, q_back, dout_back, out_back, lse_back)

    dkv_recv: torch.Tensor | None = None  # accumulator of this step's source, coming from prev
    dkv_works: list[Any] = []  # pending send/recv of accumulators
    for step in ring_schedule(n, j):
        kv_works: list[Any] = []
        if step.step < n - 1:
            nxt = layouts[(j - step.step - 1) % n]
            kv_recv = torch.empty((nxt.num_tokens,) + kv_tail, dtype=kv.dtype, device=dev)
            track(kv_recv)
            kv_works = _exchange(kv, kv_recv, ring, _TAG_KV)
        src = layouts[step.source]
        if not step_sees_keys(lay, src, step.case, window):
            dkv = torch.zeros((src.num_tokens,) + kv_tail, dtype=acc_t, device=dev)  # nothing seen: no gradient
        elif step.case is StepCase.LOCAL_CAUSAL:
            win = _window(window, lay.positions, lay.positions, dev)
            dq_i, dk_i, dv_i = kernel.backward(
                dout, q, kv[..., :dk_dim], kv[..., dk_dim:], out, lse, lay.cu_seqlens, lay.cu_seqlens, True, scale,
                window=win,
            )
            dq += dq_i
            dkv = torch.cat([dk_i, dv_i], dim=-1).to(acc_t)  # [T_src, Hkv, D+Dv]
        elif step.case is StepCase.FRONT_KEYS:
            fidx = src.front_index.to(dev)
            kf = kv.index_select(0, fidx)  # [T_front(src), Hkv, D+Dv]
            win = _window(window, lay.positions, src.positions.index_select(0, src.front_index), dev)
            dq_i, dk_i, dv_i = kernel.backward(
                dout, q, kf[..., :dk_dim], kf[..., dk_dim:], out, lse, lay.cu_seqlens, src.cu_front, False, scale,
                window=win,
            )
            dq += dq_i
            dkv = torch.zeros((src.num_tokens,) + kv_tail, dtype=acc_t, device=dev)  # [T_src, Hkv, D+Dv]
            # scatter [T_front(src), Hkv, D+Dv] into the source layout [T_src, Hkv, D+Dv]
            dkv.index_copy_(0, fidx, torch.cat([dk_i, dv_i], dim=-1).to(acc_t))
        else:  # BACK_QUERIES
            win = _window(window, lay.positions.index_select(0, lay.back_index), src.positions, dev)
            dq_i, dk_i, dv_i = kernel.backward(
                dout_back, q_back, kv[..., :dk_dim], kv[..., dk_dim:], out_back, lse_back, lay.cu_back,
                src.cu_seqlens, False, scale, window=win,
            )
            dq.index_add_(0, back_idx, dq_i.to(acc_t))
            dkv = torch.cat([dk_i, dv_i], dim=-1).to(acc_t)  # [T_src, Hkv, D+Dv]
        if step.step > 0:
            _wait(dkv_works)  # accumulator of this source from prev (and our previous send)
            assert dkv_recv is not None
            dkv += dkv_recv
        if n == 1:  # a ring of one: the accumulator is already home
            return (dq.to(q.dtype), dkv[..., :dk_dim].to(k.dtype).contiguous(),
                    dkv[..., dk_dim:].to(v.dtype).contiguous())
        # send this source's accumulator on; receive the next one (after the last step: our own)
        nxt_src = layouts[(j - step.step - 1) % n]
        dkv_recv = torch.empty((nxt_src.num_tokens,) + kv_tail, dtype=acc_t, device=dev)
        track(dkv, dkv_recv)
        dkv_works = _exchange(dkv, dkv_recv, ring, _TAG_DKV)
        dkv_sent = dkv  # keep the send buffer alive until its work completes
        if step.step < n - 1:
            _wait(kv_works)
            kv = kv_recv
    _wait(dkv_works)
    del dkv_sent
    assert dkv_recv is not None
    return (dq.to(q.dtype), dkv_recv[..., :dk_dim].to(k.dtype).contiguous(),
            dkv_recv[..., dk_dim:].to(v.dtype).contiguous())


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: RingSpec,
    layouts: tuple[RankLayout, ...],
    kernel: AttentionKernel,
    scale: float,
    *,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable zigzag ring attention: ``(out [T, Hq, Dv], lse [Hq, T])``; ``window``: a sliding
    window of that many positions; ``sink`` [Hq]: softmax sink logits (:mod:`hdp.kernels.variants`)."""
    return CPAttentionFunction.apply(q, k, v, sink, ring_forward, ring_backward, (ring, layouts, window), kernel,
                                     scale)
