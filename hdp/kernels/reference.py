"""Pure-torch variable-length attention kernel (THD layout), blocked, with log-sum-exp output.

Dimension legend (used in every shape comment below):
    Tq, Tk  packed query / key tokens (all sequences concatenated, THD layout)
    Hq, Hkv query heads / key-value heads; G = Hq // Hkv query heads per kv head (GQA)
    D       query / key head dim; Dv value head dim (= D, or not: MLA)
    S       number of sequences (``len(cu_seqlens) - 1``)
    bq, bk  rows / columns of one block (``BLOCK_Q`` / ``BLOCK_K`` at most)

Query head ``h`` reads kv head ``h // G`` (the usual GQA grouping).  ``causal`` uses the
bottom-right alignment of flash-attn: query ``i`` of a query sequence of length ``m`` sees key
``j`` of the paired key sequence of length ``n`` iff ``j <= i + (n - m)``.  Rows that see no key
get ``out = 0`` and ``lse = -inf``.  An optional :class:`~hdp.kernels.variants.KeyWindow` narrows
each row's keys to a sliding window by sample position (the start of the visible range moves; the
causal end stays).

Forward: online softmax over key blocks (FlashAttention, Dao et al. 2022, alg. 1):
    m' = max(m, rowmax(S_b));  l' = l·e^(m-m') + rowsum(e^(S_b-m'));  acc' = acc·e^(m-m') + e^(S_b-m') V_b
    out = acc / l;  lse = m + log l
Backward (same paper, alg. 2) recomputes every block from ``lse``:
    P = exp(S - lse);  dV += Pᵀ dO;  dP = dO Vᵀ;  Drow = rowsum(dO ∘ O);  dS = P ∘ (dP - Drow)
    dQ += scale · dS K;  dK += scale · dSᵀ Q
Blocks are processed with batched matmuls over the kv heads, so no ``Tq × Tk`` score matrix is
ever built, and block pairs that the mask hides completely are skipped.  Accumulation is float32
for float32/bf16/fp16 inputs and float64 for float64 inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from hdp.kernels.variants import KeyWindow

__all__ = ["attn_fwd", "attn_bwd", "check_varlen", "BLOCK_Q", "BLOCK_K"]

BLOCK_Q = 256
"""Query rows per block."""
BLOCK_K = 512
"""Key columns per block."""

_SKIP, _FULL, _PARTIAL = 0, 1, 2


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_int_list(cu: torch.Tensor, name: str) -> list[int]:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise ValueError(f"{name}: expected a 1-D integer tensor of sequence boundaries, got {cu!r}")
    if cu.numel() < 1:
        raise ValueError(f"{name}: needs at least one entry (0); got an empty tensor")
    return [int(x) for x in cu.tolist()]


def check_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
) -> tuple[list[int], list[int]]:
    """Validate THD inputs and return the cu_seqlens as Python lists; ``ValueError`` names the bad field."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q/k/v: expected THD tensors [T, H, D]; got q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}"
        )
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k{tuple(k.shape)} and v{tuple(v.shape)} must have the same tokens and heads")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head dim: q has D={q.shape[2]}, k has D={k.shape[2]}; they must match")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"heads: Hq={q.shape[1]} must be a multiple of Hkv={k.shape[1]} (grouped-query attention)"
        )
    cq = _as_int_list(cu_seqlens_q, "cu_seqlens_q")
    ck = _as_int_list(cu_seqlens_k, "cu_seqlens_k")
    if len(cq) != len(ck):
        raise ValueError(
            f"cu_seqlens_q has {len(cq) - 1} sequences but cu_seqlens_k has {len(ck) - 1}; "
            "pass one boundary list per side with the same number of sequences"
        )
    for name, cu, total in (("cu_seqlens_q", cq, q.shape[0]), ("cu_seqlens_k", ck, k.shape[0])):
        if cu[0] != 0:
            raise ValueError(f"{name}[0]={cu[0]}: must start at 0")
        if any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"{name}={cu}: must be non-decreasing")
        if cu[-1] != total:
            raise ValueError(
                f"{name}[-1]={cu[-1]} does not match the tensor's {total} tokens; "
                "the boundaries must cover the packed tensor exactly"
            )
    return cq, ck


@dataclass(frozen=True)
class _Visibility:
    """Per query row, the half-open range [start, end) of packed key indices it may attend."""

    start: np.ndarray  # [Tq] int64
    end: np.ndarray  # [Tq] int64 (end <= start: the row sees nothing)
    start_t: torch.Tensor  # [Tq] int64 on the device
    end_t: torch.Tensor  # [Tq] int64 on the device

    def key_range(self, i0: int, i1: int) -> tuple[int, int] | None:
        s, e = self.start[i0:i1], self.end[i0:i1]
        live = e > s
        if not live.any():
            return None
        return int(s[live].min()), int(e[live].max())

    def block_kind(self, i0: int, i1: int, j0: int, j1: int) -> int:
        s, e = self.start[i0:i1], self.end[i0:i1]
        if s.max() <= j0 and e.min() >= j1:
            return _FULL
        if not np.any((s < j1) & (e > j0) & (e > s)):
            return _SKIP
        return _PARTIAL

    def mask(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """Boolean [bq, bk]: True where query row i may attend key column j."""
        cols = torch.arange(j0, j1, device=self.start_t.device)  # [bk]
        return (cols[None, :] >= self.start_t[i0:i1, None]) & (cols[None, :] < self.end_t[i0:i1, None])


def _window_start(
    start: np.ndarray, end: np.ndarray, seq: np.ndarray, ck_a: np.ndarray, window: KeyWindow
) -> np.ndarray:
    """[Tq] first key index at sample position >= q_pos - left, inside each row's sequence."""
    q_pos = window.q_pos.detach().cpu().numpy().astype(np.int64)  # [Tq]
    k_pos = window.k_pos.detach().cpu().numpy().astype(np.int64)  # [Tk]
    if q_pos.shape[0] != start.shape[0] or k_pos.shape[0] != int(ck_a[-1]):
        raise ValueError(
            f"window: q_pos has {q_pos.shape[0]} and k_pos {k_pos.shape[0]} positions for {start.shape[0]} query "
            f"and {int(ck_a[-1])} key rows; pass one sample position per row"
        )
    # one sorted key axis: sequence s's keys at s·span + position (positions ascend inside a sequence)
    span = int(max(k_pos.max(initial=0), q_pos.max(initial=0))) + window.left + 2
    kseq = np.repeat(np.arange(len(ck_a) - 1, dtype=np.int64), np.diff(ck_a))  # [Tk]
    keys = kseq * span + k_pos  # [Tk]
    if keys.size > 1 and np.any(np.diff(keys) < 0):
        raise ValueError("window: key positions must be non-decreasing inside each key sequence")
    first = np.searchsorted(keys, seq * span + (q_pos - window.left), side="left")  # [Tq]
    return np.minimum(np.maximum(first, start), np.maximum(end, start))


def _visibility(
    cq: list[int], ck: list[int], causal: bool, device: torch.device, window: KeyWindow | None = None
) -> _Visibility:
    cq_a = np.asarray(cq, dtype=np.int64)
    ck_a = np.asarray(ck, dtype=np.int64)
    lq = np.diff(cq_a)  # [S]
    lk = np.diff(ck_a)  # [S]
    seq = np.repeat(np.arange(len(lq), dtype=np.int64), lq)  # [Tq] sequence id of each query row
    row = np.arange(int(cq_a[-1]), dtype=np.int64) - cq_a[seq]  # [Tq] row inside its sequence
    start = ck_a[seq]
    if causal:
        # bottom-right alignment: row i of an m-row sequence sees keys j <= i + (n - m)
        vis = np.clip(row + (lk[seq] - lq[seq]) + 1, 0, lk[seq])
    else:
        vis = lk[seq]
    end = start + vis
    if window is not None:
        start = _window_start(start, end, seq, ck_a, window)
    return _Visibility(
        start=start,
        end=end,
        start_t=torch.from_numpy(start).to(device),
        end_t=torch.from_numpy(end).to(device),
    )


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
    *,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    window: KeyWindow | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length attention forward.

    q: [Tq, Hq, D], k: [Tk, Hkv, D], v: [Tk, Hkv, Dv], cu_seqlens_*: [S + 1] integer boundaries;
    ``window``: a sliding window by sample position (:class:`~hdp.kernels.variants.KeyWindow`).
    Returns ``(out [Tq, Hq, Dv] in q.dtype, lse [Hq, Tq] in float32, or float64 for float64 inputs)``.
    """
    cq, ck = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    vis = _visibility(cq, ck, causal, q.device, window)
    acc_t = _acc_dtype(q.dtype)
    tq, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    g = hq // hkv
    neg_inf = -math.inf

    qh = (q.to(acc_t) * scale).view(tq, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, Tq, D] (view)
    kh = k.to(acc_t).permute(1, 0, 2).contiguous()  # [Hkv, Tk, D]
    vh = v.to(acc_t).permute(1, 0, 2).contiguous()  # [Hkv, Tk, D]
    out = torch.zeros((hkv, g, tq, dv), dtype=acc_t, device=q.device)  # [Hkv, G, Tq, Dv]
    lse = torch.full((hkv, g, tq), neg_inf, dtype=acc_t, device=q.device)  # [Hkv, G, Tq]

    for i0 in range(0, tq, block_q):
        i1 = min(i0 + block_q, tq)
        nb = i1 - i0
        krange = vis.key_range(i0, i1)
        if krange is None:
            continue
        qb = qh[:, :, i0:i1].reshape(hkv, g * nb, d)  # [Hkv, G*bq, D]
        m = torch.full((hkv, g * nb), neg_inf, dtype=acc_t, device=q.device)  # running row max
        l = torch.zeros((hkv, g * nb), dtype=acc_t, device=q.device)  # running row sum
        acc = torch.zeros((hkv, g * nb, dv), dtype=acc_t, device=q.device)  # [Hkv, G*bq, Dv]
        for j0 in range(krange[0], krange[1], block_k):
            j1 = min(j0 + block_k, krange[1])
            kind = vis.block_kind(i0, i1, j0, j1)
            if kind == _SKIP:
                continue
            s = torch.bmm(qb, kh[:, j0:j1].transpose(1, 2))  # [Hkv, G*bq, bk]
            if kind == _PARTIAL:
                hide = ~vis.mask(i0, i1, j0, j1)  # [bq, bk]
                s.view(hkv, g, nb, j1 - j0).masked_fill_(hide, neg_inf)  # [Hkv, G, bq, bk] view
            m_new = torch.maximum(m, s.amax(dim=-1))  # [Hkv, G*bq]
            m_safe = m_new.masked_fill(m_new == neg_inf, 0.0)  # rows with nothing visible yet
            p = s.sub_(m_safe.unsqueeze(-1)).exp_()  # [Hkv, G*bq, bk], in place over s
            alpha = torch.exp(m - m_safe)  # [Hkv, G*bq]; exp(-inf) = 0 for empty history
            l = l.mul_(alpha).add_(p.sum(dim=-1))
            acc = acc.mul_(alpha.unsqueeze(-1)).add_(torch.bmm(p, vh[:, j0:j1]))  # [Hkv, G*bq, Dv]
            m = m_new
        seen = l > 0
        lse_b = torch.where(seen, m + torch.log(torch.where(seen, l, torch.ones_like(l))), neg_inf)
        out_b = acc / torch.where(seen, l, torch.ones_like(l)).unsqueeze(-1)  # [Hkv, G*bq, Dv]
        out[:, :, i0:i1] = out_b.view(hkv, g, nb, dv)  # [Hkv, G, bq, Dv]
        lse[:, :, i0:i1] = lse_b.view(hkv, g, nb)  # [Hkv, G, bq]

    out_thd = out.permute(2, 0, 1, 3).reshape(tq, hq, dv).to(q.dtype)  # [Tq, Hq, Dv]
    return out_thd, lse.reshape(hq, tq)  # lse: [Hq, Tq]


def attn_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
    *,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    window: KeyWindow | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Variable-length attention backward from the saved ``out`` and ``lse``.

    ``out``/``lse`` may come from a larger computation (ring attention passes the merged output
    and log-sum-exp); the formulas stay exact because ``P = exp(S - lse)`` uses them as given.
    Returns ``(dq [Tq, Hq, D], dk [Tk, Hkv, D], dv [Tk, Hkv, Dv])`` in the dtypes of q, k, v.
    """
    cq, ck = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    want = (*q.shape[:2], v.shape[2])
    if tuple(dout.shape) != want or tuple(out.shape) != want:
        raise ValueError(f"dout{tuple(dout.shape)} and out{tuple(out.shape)} must be [Tq, Hq, Dv] = {want}")
    if lse.shape != (q.shape[1], q.shape[0]):
        raise ValueError(f"lse{tuple(lse.shape)}: expected [Hq, Tq] = {(q.shape[1], q.shape[0])}")
    vis = _visibility(cq, ck, causal, q.device, window)
    acc_t = _acc_dtype(q.dtype)
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    dv = v.shape[2]
    g = hq // hkv

    qh = (q.to(acc_t) * scale).view(tq, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, G, Tq, D] (view)
    doh = dout.to(acc_t).reshape(tq, hkv, g, dv).permute(1, 2, 0, 3)  # [Hkv, G, Tq, Dv] (view if contiguous)
    kh = k.to(acc_t).permute(1, 0, 2).contiguous()  # [Hkv, Tk, D]
    vh = v.to(acc_t).permute(1, 0, 2).contiguous()  # [Hkv, Tk, Dv]
    drow = (dout.to(acc_t) * out.to(acc_t)).sum(-1)  # [Tq, Hq]  Drow = rowsum(dO ∘ O)
    drow = drow.t().reshape(hkv, g, tq)  # [Hkv, G, Tq]
    lse_h = lse.to(acc_t).reshape(hkv, g, tq)  # [Hkv, G, Tq]
    # rows with lse = -inf see no key: every score of theirs is masked (-inf), so exp(-inf - 0) = 0
    lse_h = lse_h.masked_fill(torch.isneginf(lse_h), 0.0)

    dq = torch.zeros((hkv, g, tq, d), dtype=acc_t, device=q.device)  # [Hkv, G, Tq, D]
    dk = torch.zeros((hkv, tk, d), dtype=acc_t, device=q.device)  # [Hkv, Tk, D]
    dvv = torch.zeros((hkv, tk, dv), dtype=acc_t, device=q.device)  # [Hkv, Tk, Dv]

    for i0 in range(0, tq, block_q):
        i1 = min(i0 + block_q, tq)
        nb = i1 - i0
        krange = vis.key_range(i0, i1)
        if krange is None:
            continue
        qb = qh[:, :, i0:i1].reshape(hkv, g * nb, d)  # [Hkv, G*bq, D]
        dob = doh[:, :, i0:i1].reshape(hkv, g * nb, dv)  # [Hkv, G*bq, Dv]
        lse_b = lse_h[:, :, i0:i1].reshape(hkv, g * nb, 1)  # [Hkv, G*bq, 1]
        drow_b = drow[:, :, i0:i1].reshape(hkv, g * nb, 1)  # [Hkv, G*bq, 1]
        dq_b = torch.zeros((hkv, g * nb, d), dtype=acc_t, device=q.device)  # [Hkv, G*bq, D]
        for j0 in range(krange[0], krange[1], block_k):
            j1 = min(j0 + block_k, krange[1])
            kind = vis.block_kind(i0, i1, j0, j1)
            if kind == _SKIP:
                continue
            kb = kh[:, j0:j1]  # [Hkv, bk, D]
            vb = vh[:, j0:j1]  # [Hkv, bk, Dv]
            s = torch.bmm(qb, kb.transpose(1, 2))  # [Hkv, G*bq, bk]
            if kind == _PARTIAL:
                hide = ~vis.mask(i0, i1, j0, j1)  # [bq, bk]
                s.view(hkv, g, nb, j1 - j0).masked_fill_(hide, -math.inf)  # [Hkv, G, bq, bk] view
            p = s.sub_(lse_b).exp_()  # [Hkv, G*bq, bk]  P = exp(S - lse)
            dvv[:, j0:j1] += torch.bmm(p.transpose(1, 2), dob)  # [Hkv, bk, Dv]
            dp = torch.bmm(dob, vb.transpose(1, 2))  # [Hkv, G*bq, bk]
            ds = dp.sub_(drow_b).mul_(p)  # [Hkv, G*bq, bk]  dS = P ∘ (dP - Drow)
            dq_b += torch.bmm(ds, kb)  # [Hkv, G*bq, D]  (scale applied below)
            dk[:, j0:j1] += torch.bmm(ds.transpose(1, 2), qb)  # [Hkv, bk, D]  (qb carries scale)
        dq[:, :, i0:i1] = (dq_b * scale).view(hkv, g, nb, d)  # [Hkv, G, bq, D]

    dq_thd = dq.permute(2, 0, 1, 3).reshape(tq, hq, d).to(q.dtype)  # [Tq, Hq, D]
    dk_thd = dk.permute(1, 0, 2).to(k.dtype)  # [Tk, Hkv, D]
    dv_thd = dvv.permute(1, 0, 2).to(v.dtype)  # [Tk, Hkv, Dv]
    return dq_thd, dk_thd.contiguous(), dv_thd.contiguous()
