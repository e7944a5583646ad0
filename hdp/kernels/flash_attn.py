"""Adapter from hdp's kernel signature to flash-attn 2 varlen (CUDA only).

NOT RUN ON HARDWARE: this module was written against flash-attn 2.x's
``flash_attn.flash_attn_interface._flash_attn_varlen_forward/_backward`` and has never been
executed on a GPU (the development machine had none).  Check it against
:mod:`hdp.kernels.reference` before trusting it.

Differences bridged here:
  * flash-attn takes only fp16/bf16; other dtypes are routed to the reference kernel.
  * flash-attn marks rows that see no key with ``lse = +inf``; hdp uses ``-inf`` (so log-sum-exp
    merges treat them as empty).  The backward gets ``+inf`` back for such rows so that
    ``exp(S - lse)`` is 0 rather than NaN.
  * The private ``_flash_attn_varlen_*`` signature changed in 2.6 (softcap added) and 2.7 (window
    sizes split, fewer return values); the installed version picks the keyword arguments, the
    return arity picks the outputs.  Needs flash-attn >= 2.4 (varlen lse laid out as [Hq, Tq]).

Beside attention, :func:`rotary` adapts flash-attn's RoPE kernel (``flash_attn.layers.rotary.apply_rotary_emb``,
triton) to :mod:`hdp.kernels.fusions`' rotary contract.  Also NOT RUN ON HARDWARE.

Layout legend: T tokens (packed THD), Hq/Hkv query/kv heads, D head dim.  lse is [Hq, Tq].
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from hdp.kernels import reference

__all__ = ["available", "attn_fwd", "attn_bwd", "rotary_available", "rotary"]

logger = logging.getLogger(__name__)

_HALF = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _interface() -> Any | None:
    try:
        from flash_attn import flash_attn_interface
    except Exception as exc:  # ImportError or a broken CUDA extension build
        logger.debug("flash_attn not usable: %s", exc)
        return None
    return flash_attn_interface


def available() -> bool:
    """Whether flash-attn's varlen interface imports."""
    return _interface() is not None


def _max_len(cu: torch.Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0


def _version() -> tuple[int, int]:
    """(major, minor) of the installed flash-attn, (0, 0) when unknown."""
    try:
        import flash_attn

        parts = str(flash_attn.__version__).split(".")
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except Exception:  # no version attribute or an unparsable one
        return (0, 0)


def _window_kwargs() -> dict[str, Any]:
    """Keyword arguments for "no sliding window" in the installed private API.

    >= 2.7: ``window_size_left/right`` and ``softcap``; 2.6: ``window_size`` tuple and ``softcap``;
    2.4-2.5: ``window_size`` tuple only.  (The private functions are torch custom ops from 2.7, so
    their Python signature cannot be inspected reliably; the version decides.)
    """
    ver = _version()
    if ver >= (2, 7):
        return {"window_size_left": -1, "window_size_right": -1, "softcap": 0.0}
    if ver >= (2, 6):
        return {"window_size": (-1, -1), "softcap": 0.0}
    return {"window_size": (-1, -1)}


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn varlen forward with hdp's contract: returns ``(out [Tq, Hq, D], lse [Hq, Tq] float32)``."""
    if q.dtype not in _HALF:
        return reference.attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
    reference.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    fa = _interface()
    if fa is None:
        raise ValueError("kernel=flash_attn: flash_attn is not importable; use the reference kernel")
    fn = fa._flash_attn_varlen_forward
    cq = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
    ck = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
    res = fn(
        q=q.contiguous(),
        k=k.contiguous(),
        v=v.contiguous(),
        cu_seqlens_q=cq,
        cu_seqlens_k=ck,
        max_seqlen_q=_max_len(cq),
        max_seqlen_k=_max_len(ck),
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        alibi_slopes=None,
        return_softmax=False,
        **_window_kwargs(),
    )
    if len(res) == 4:  # >= 2.7: out, lse, S_dmask, rng_state
        out, lse = res[0], res[1]
    else:  # <= 2.6: out, q, k, v, out_padded, lse, S_dmask, rng_state
        out, lse = res[0], res[5]
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise ValueError(
            f"flash-attn {_version()} returned lse{tuple(lse.shape)}; hdp needs the varlen layout "
            f"[Hq, Tq] = {(q.shape[1], q.shape[0])} (flash-attn >= 2.4)"
        )
    lse = lse.float().masked_fill(torch.isposinf(lse), float("-inf"))  # [Hq, Tq], empty rows -> -inf
    return out, lse


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash-attn varlen backward from (possibly merged) ``out``/``lse``; returns ``(dq, dk, dv)``."""
    if q.dtype not in _HALF:
        return reference.attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale)
    fa = _interface()
    if fa is None:
        raise ValueError("kernel=flash_attn: flash_attn is not importable; use the reference kernel")
    fn = fa._flash_attn_varlen_backward
    cq = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
    ck = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    lse_fa = lse.float().masked_fill(torch.isneginf(lse), float("inf")).contiguous()  # [Hq, Tq]
    fn(
        dout=dout.contiguous(),
        q=q.contiguous(),
        k=k.contiguous(),
        v=v.contiguous(),
        out=out.to(q.dtype).contiguous(),
        softmax_lse=lse_fa,
        dq=dq,
        dk=dk,
        dv=dv,
        cu_seqlens_q=cq,
        cu_seqlens_k=ck,
        max_seqlen_q=_max_len(cq),
        max_seqlen_k=_max_len(ck),
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
        **_window_kwargs(),
    )
    return dq, dk, dv


@functools.lru_cache(maxsize=1)
def _rotary_module() -> Any | None:
    try:
        from flash_attn.layers import rotary as fa_rotary
    except Exception as exc:  # ImportError, or triton missing / broken
        logger.debug("flash_attn rotary not usable: %s", exc)
        return None
    return fa_rotary


def rotary_available() -> bool:
    """Whether flash-attn's rotary kernel (``flash_attn.layers.rotary.apply_rotary_emb``) imports."""
    return _rotary_module() is not None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` [T, H, Dr] with per-token ``cos``/``sin`` [T, 1, Dr] (``cat(angle, angle)`` halves, as
    :func:`hdp.rope.rope_cos_sin` builds them) through flash-attn's ``apply_rotary_emb``: differentiable.

    flash-attn indexes its cos/sin tables [S, Dr/2] by the token's row in a [B, S, H, Dr] batch; hdp's tokens sit
    at arbitrary sample positions (zigzag CP chunks), so ``x`` goes in as one batch row of T tokens and the tables
    are this micro-batch's own per-token rows (row t holds token t's angle): the same x·cos + rotate_half(x)·sin."""
    mod = _rotary_module()
    if mod is None:
        raise ValueError("fused rotary: flash_attn.layers.rotary is not importable; use the plain form")
    half = cos.shape[-1] // 2
    c = cos[:, 0, :half].contiguous()  # [T, Dr/2]: the first half (the second repeats it)
    s = sin[:, 0, :half].contiguous()  # [T, Dr/2]
    out = mod.apply_rotary_emb(x.unsqueeze(0), c, s, interleaved=False)  # [1, T, H, Dr]
    return out.squeeze(0)  # [T, H, Dr]
