"""Adapter from hdp's kernel signature to torch's own fused varlen flash attention (CUDA, no extra package).

NOT RUN ON HARDWARE: written against the schemas of ``torch.ops.aten._flash_attention_forward`` /
``_flash_attention_backward`` (the ops behind ``torch.nn.attention.varlen``) of torch 2.7 to 2.13 and
never executed on a GPU (the development machine had none).  ``hdp bench device`` checks it against
:mod:`hdp.kernels.reference` in fp64; trust it once that check has run on your GPU.

Schemas (positional part identical from torch 2.4 on; ``*`` keyword-only)::

    _flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
        is_causal, return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
        seqused_k=None, alibi_slopes=None[, block_table=None, num_splits=None])
        -> (output, softmax_logsumexp, rng_state, unused, debug_attn_mask)
    _flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
        max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale=None,
        window_size_left=None, window_size_right=None) -> (dq, dk, dv)

Before torch 2.7 the third and fourth outputs (and backward arguments) were ``philox_seed`` and
``philox_offset``: same positions, read only when ``dropout_p > 0`` (here always 0).  ``block_table``
and ``num_splits`` (torch 2.10+) are left at their defaults, and so are the window sizes (``None``:
no sliding window; the kernel sets the right window to 0 itself when ``is_causal``).

Differences bridged here:
  * the kernel takes fp16/bf16 only and a head dim that is a multiple of 8 and at most 256: other
    dtypes and head dims over 256 go to the reference kernel; a head dim that is not a multiple of 8
    is zero-padded (exact: the padded columns add 0 to every score, and their outputs are dropped);
  * ``cum_seq_q/k`` must be int32 on the device, ``max_q/max_k`` the longest sequence of each side
    (the kernel sizes its grid by them), computed here from the boundaries;
  * GQA is native (Hkv dividing Hq, query head h reads kv head h // G, as in the reference);
  * bottom-right causal alignment for ``m != n`` rows, as flash-attn 2 (the kernel torch vendors);
  * ``lse`` comes back as float32 ``[Hq, Tq]`` in the varlen path (``torch.nn.attention.varlen``'s
    docstring says ``[Tq, Hq]``; the kernel's meta function says ``[Hq, Tq]``): the layout is taken
    from the installed torch's meta kernel once (`lse_layout`), and ``[Tq, Hq]`` is transposed;
  * rows that see no key get ``lse = +inf`` from flash-attn 2 (non-split path); hdp uses ``-inf`` (so
    log-sum-exp merges treat them as empty) and gives the backward ``+inf`` back, so that
    ``exp(S - lse)`` is 0 rather than NaN;
  * the backward is called with ``out``/``lse`` as given: ring attention passes the merged ones
    (the kernel recomputes ``P = exp(S·scale - lse)`` and ``rowsum(dO ∘ O)`` from them).

`ReferenceFlashOps` stands in for the two aten ops on any device (CPU tests, ``hdp bench device
--dry-run``): the output layout from the installed torch's meta kernels, the values from the reference
kernel, and the CUDA kernel's input checks, so the conversions above are really exercised.

Layout legend: T tokens (packed THD), Hq/Hkv query/kv heads, D head dim (Dp: padded to 8), S sequences.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Protocol

import torch

from hdp import device as _device
from hdp.kernels import reference

__all__ = [
    "available", "unavailable_reason", "attn_fwd", "attn_bwd", "kernel_functions", "FlashOps", "AtenFlashOps",
    "ReferenceFlashOps", "lse_layout", "MAX_HEAD_DIM",
]

logger = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
"""Largest head dim the fused kernel takes (flash-attn 2); larger ones run on the reference kernel."""
_MIN_CAPABILITY = (8, 0)
"""Compute capability the fused kernel needs (Ampere and newer)."""


class FlashOps(Protocol):
    """The two ops the adapter calls, with the aten schemas' positional arguments (module docstring)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                max_q: int, max_k: int, dropout_p: float, is_causal: bool, return_debug_mask: bool, *,
                scale: float) -> tuple[torch.Tensor, ...]: ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int,
                 dropout_p: float, is_causal: bool, rng_state: torch.Tensor, unused: torch.Tensor, *,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class AtenFlashOps:
    """torch's own ops (``torch.ops.aten._flash_attention_forward`` / ``_backward``)."""

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale):
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, scale=scale)

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, *,
                 scale):
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, scale=scale)


_ATEN = AtenFlashOps()


def _ops_exist() -> bool:
    return hasattr(torch.ops.aten, "_flash_attention_forward") and hasattr(torch.ops.aten, "_flash_attention_backward")


def unavailable_reason(device: torch.device | None = None) -> str | None:
    """Why the fused kernel cannot run on ``device`` (the current CUDA device when ``None``); ``None`` when it can."""
    if not _ops_exist():
        return f"torch {torch.__version__} has no aten::_flash_attention_forward/_backward"
    if not _device.cuda_available():
        return "no CUDA device"
    if device is not None and not _device.is_cuda(device):
        return f"device {device} is not a CUDA device"
    if not _device.fused_flash_attention_built():
        return f"torch {torch.__version__} was built without its flash-attention kernels"
    cap = _device.compute_capability(device)
    if cap is not None and cap < _MIN_CAPABILITY:
        return f"compute capability {cap[0]}.{cap[1]} is below the kernel's {_MIN_CAPABILITY[0]}.{_MIN_CAPABILITY[1]}"
    return None


def available(device: torch.device | None = None) -> bool:
    """Whether torch's fused flash attention can run on ``device`` (see `unavailable_reason`)."""
    return unavailable_reason(device) is None


@functools.lru_cache(maxsize=1)
def lse_layout() -> str:
    """``"HT"`` or ``"TH"``: how the installed torch lays out the varlen ``lse`` (its meta kernel, no device)."""
    if not _ops_exist():
        return "HT"
    meta = torch.device("meta")
    q = torch.empty((5, 3, 8), dtype=torch.bfloat16, device=meta)  # Tq=5 != Hq=3 tells the layouts apart
    cu = torch.empty((2,), dtype=torch.int32, device=meta)
    try:
        res = torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 5, 5, 0.0, True, False, scale=1.0)
    except Exception as exc:  # no meta kernel in this build: keep the layout of torch 2.4-2.13
        logger.debug("torch_flash: meta kernel of _flash_attention_forward failed (%s); assuming lse [Hq, Tq]", exc)
        return "HT"
    shape = tuple(res[1].shape)
    if shape == (3, 5):
        return "HT"
    if shape == (5, 3):
        return "TH"
    raise ValueError(f"torch {torch.__version__}: varlen flash lse of shape {shape} for Tq=5, Hq=3; hdp knows "
                     "[Hq, Tq] and [Tq, Hq] only (use kernel='reference')")


def _max_len(cu: list[int]) -> int:
    return max((b - a for a, b in zip(cu, cu[1:])), default=0)


def _pad_dim(t: torch.Tensor, dp: int) -> torch.Tensor:
    """[T, H, D] -> [T, H, Dp] zero-padded, contiguous (the kernel needs a unit stride in D)."""
    d = t.shape[-1]
    if d == dp:
        return t.contiguous()
    return torch.nn.functional.pad(t, (0, dp - d)).contiguous()


def _fused_ok(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether this call can go to the fused kernel (dtype, head dim, non-empty sides)."""
    return (q.dtype in _HALF and k.dtype == q.dtype and q.shape[-1] <= MAX_HEAD_DIM
            and q.shape[0] > 0 and k.shape[0] > 0)


def _padded_d(d: int) -> int:
    return -(-d // 8) * 8


def _placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward's ``rng_state`` / ``unused`` for dropout 0: what ``torch.nn.attention.varlen``'s own
    backward passes (a zero uint64 pair, an empty tensor); the kernel reads them only with dropout."""
    return torch.zeros((2,), dtype=torch.uint64, device=device), torch.empty((0,), device=device)


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
    *,
    ops: FlashOps | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused varlen forward with hdp's contract: ``(out [Tq, Hq, D] in q.dtype, lse [Hq, Tq] float32)``.

    ``ops``: the two ops to call (default torch's aten ops; `ReferenceFlashOps` on CPU).
    """
    if not _fused_ok(q, k):
        return reference.attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
    cq_l, ck_l = reference.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    ops = _ATEN if ops is None else ops
    tq, hq, d = q.shape
    dp = _padded_d(d)
    cq = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()  # [S+1]
    ck = cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()  # [S+1]
    res = ops.forward(_pad_dim(q, dp), _pad_dim(k, dp), _pad_dim(v, dp), cq, ck, _max_len(cq_l), _max_len(ck_l),
                      0.0, bool(causal), False, scale=float(scale))
    if len(res) < 2:
        raise ValueError(f"torch {torch.__version__}: _flash_attention_forward returned {len(res)} outputs; "
                         "expected (output, softmax_logsumexp, ...)")
    out, lse = res[0], res[1]
    out = out[..., :d] if dp != d else out  # [Tq, Hq, D]
    if tuple(lse.shape) == (tq, hq) and (tq != hq or lse_layout() == "TH"):
        lse = lse.t()  # [Tq, Hq] -> [Hq, Tq]
    if tuple(lse.shape) != (hq, tq):
        raise ValueError(f"torch {torch.__version__}: varlen flash lse{tuple(lse.shape)}; hdp needs [Hq, Tq] = "
                         f"{(hq, tq)} (use kernel='reference')")
    lse = lse.float().masked_fill(torch.isposinf(lse), -math.inf).contiguous()  # [Hq, Tq], empty rows -> -inf
    return out.contiguous(), lse


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
    ops: FlashOps | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused varlen backward from (possibly merged) ``out``/``lse [Hq, Tq]``; returns ``(dq, dk, dv)``."""
    if not _fused_ok(q, k):
        return reference.attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale)
    cq_l, ck_l = reference.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    tq, hq, d = q.shape
    if lse.shape != (hq, tq):
        raise ValueError(f"lse{tuple(lse.shape)}: expected [Hq, Tq] = {(hq, tq)}")
    ops = _ATEN if ops is None else ops
    dp = _padded_d(d)
    cq = cu_seqlens_q.to(device=q.device, dtype=torch.int32).contiguous()  # [S+1]
    ck = cu_seqlens_k.to(device=q.device, dtype=torch.int32).contiguous()  # [S+1]
    lse_k = lse.float().masked_fill(torch.isneginf(lse), math.inf)  # [Hq, Tq]: empty rows +inf for the kernel
    if lse_layout() == "TH":
        lse_k = lse_k.t()  # [Tq, Hq]
    rng_state, unused = _placeholders(q.device)
    dq, dk, dv = ops.backward(
        _pad_dim(dout.to(q.dtype), dp), _pad_dim(q, dp), _pad_dim(k, dp), _pad_dim(v, dp),
        _pad_dim(out.to(q.dtype), dp), lse_k.contiguous(), cq, ck, _max_len(cq_l), _max_len(ck_l), 0.0, bool(causal),
        rng_state, unused, scale=float(scale))[:3]
    if dp != d:
        dq, dk, dv = dq[..., :d], dk[..., :d], dv[..., :d]  # [T, H, Dp] -> [T, H, D]
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


def kernel_functions(ops: FlashOps) -> tuple[Any, Any]:
    """``(fwd, bwd)`` of this adapter calling ``ops`` (e.g. `ReferenceFlashOps` for a CPU check)."""
    return functools.partial(attn_fwd, ops=ops), functools.partial(attn_bwd, ops=ops)


class ReferenceFlashOps:
    """Stand-in for the two aten ops on any device: what they compute, from the reference kernel.

    Outputs: the shapes and dtypes of the installed torch's meta kernels for the same arguments (so the
    adapter sees the real op's layout), values from :mod:`hdp.kernels.reference` (fp32 accumulation),
    flash-attn 2's ``+inf`` lse for rows that see no key.  Inputs are checked as the CUDA kernel checks
    them (``mha_varlen_fwd``/``_bwd``): fp16/bf16 alike, int32 boundaries on the inputs' device, head dim
    a multiple of 8 and at most 256, unit stride in D, Hkv dividing Hq, ``max_q``/``max_k`` the longest
    sequences, ``dropout_p = 0``; the backward's ``lse`` float32 with no ``-inf``.  ``calls`` counts the
    calls by op name.
    """

    def __init__(self) -> None:
        self.calls: dict[str, int] = {"forward": 0, "backward": 0}

    @staticmethod
    def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               max_q: int, max_k: int, dropout_p: float) -> None:
        if q.dtype not in _HALF or k.dtype != q.dtype or v.dtype != q.dtype:
            raise RuntimeError(f"FlashAttention only supports fp16 and bf16 alike; got {q.dtype}, {k.dtype}, {v.dtype}")
        for name, t in (("query", q), ("key", k), ("value", v)):
            if t.stride(-1) != 1:
                raise RuntimeError(f"{name} must have contiguous last dimension")
        d = q.shape[-1]
        if d % 8 or d > MAX_HEAD_DIM or k.shape[-1] != d:
            raise RuntimeError(f"head_size must be a multiple of 8 and at most {MAX_HEAD_DIM}; got {d}")
        if q.shape[1] % k.shape[1]:
            raise RuntimeError("Number of heads in key/value must divide number of heads in query")
        for name, cu, t, mx in (("cu_seqlens_q", cu_q, q, max_q), ("cu_seqlens_k", cu_k, k, max_k)):
            if cu.dtype != torch.int32 or cu.device != t.device or not cu.is_contiguous():
                raise RuntimeError(f"{name} must be a contiguous int32 tensor on {t.device}; got {cu.dtype} on "
                                   f"{cu.device}")
            lens = (cu[1:] - cu[:-1]).tolist()
            if max(lens, default=0) != mx:
                raise RuntimeError(f"max_seqlen of {name} is {mx}; its longest sequence has {max(lens, default=0)}")
        if dropout_p != 0.0:
            raise RuntimeError("this stand-in computes dropout_p = 0 only")

    @staticmethod
    def _meta(fn: Any, *args: Any, **kw: Any) -> tuple[torch.Tensor, ...]:
        meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
        return tuple(fn(*meta, **kw))

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale):
        self._check(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p)
        self.calls["forward"] += 1
        layout = self._meta(torch.ops.aten._flash_attention_forward, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p,
                            is_causal, return_debug_mask, scale=scale)
        out, lse = reference.attn_fwd(q, k, v, cu_q, cu_k, is_causal, scale)  # [Tq, Hq, D], [Hq, Tq]
        lse = lse.masked_fill(torch.isneginf(lse), math.inf)  # flash-attn 2: rows without keys get +inf
        if tuple(layout[1].shape) == (q.shape[0], q.shape[1]) != (q.shape[1], q.shape[0]):
            lse = lse.t()  # the installed torch's layout [Tq, Hq]
        values = [out, lse]
        rest = [torch.zeros(m.shape, dtype=m.dtype, device=q.device) for m in layout[2:]]
        got = values + rest
        for i, (g, m) in enumerate(zip(got, layout)):
            assert tuple(g.shape) == tuple(m.shape) and g.dtype == m.dtype, (i, g.shape, m.shape, g.dtype, m.dtype)
        return tuple(t.contiguous() for t in got)

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, *,
                 scale):
        self._check(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p)
        if dout.dtype != q.dtype or out.dtype != q.dtype or dout.shape != q.shape or out.shape != q.shape:
            raise RuntimeError("grad_out and out must match query in shape and dtype")
        if lse.dtype != torch.float32 or not lse.is_contiguous() or torch.isneginf(lse).any():
            raise RuntimeError("softmax_lse must be contiguous float32, +inf (not -inf) for rows without keys")
        self.calls["backward"] += 1
        layout = self._meta(torch.ops.aten._flash_attention_backward, dout, q, k, v, out, lse, cu_q, cu_k, max_q,
                            max_k, dropout_p, is_causal, rng_state, unused, scale=scale)
        lse_ht = lse.t() if tuple(lse.shape) == (q.shape[0], q.shape[1]) != (q.shape[1], q.shape[0]) else lse
        lse_ht = lse_ht.masked_fill(torch.isposinf(lse_ht), -math.inf)  # back to the reference's convention
        grads = reference.attn_bwd(dout, q, k, v, out, lse_ht, cu_q, cu_k, is_causal, scale)
        for g, m in zip(grads, layout):
            assert tuple(g.shape) == tuple(m.shape) and g.dtype == m.dtype, (g.shape, m.shape, g.dtype, m.dtype)
        return grads
