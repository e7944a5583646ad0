"""Rotary position embedding for packed, context-parallel-split samples (THD layout).

Dimension legend:
    T   local tokens of the packed micro-batch (all samples, front and back chunks)
    H   heads; D head dim; Dr rotary dims (even, <= D); Dr/2 frequencies

After the zigzag split a rank holds pieces of several samples, so the position of a token is its
offset inside its own sample, not its row in the packed tensor: ``position_ids`` [T] come from the
plan (:attr:`hdp.dispatch.LocalMeta.position_ids`).  One ``cos``/``sin`` table is built for the
whole packed micro-batch and applied to q and k in one call each ("batch RoPE for THD"), instead
of one call per sample.

Convention (Megatron / Llama "rotate half", non-interleaved):
    inv_freq[i] = base ** (-2i / Dr),  i = 0 .. Dr/2 - 1
    angle[t, i] = position_ids[t] * inv_freq[i];  emb = cat(angle, angle)          [T, Dr]
    rot(x) = x[..., :Dr] * cos(emb) + rotate_half(x[..., :Dr]) * sin(emb),
    rotate_half(x) = cat(-x[..., Dr/2:], x[..., :Dr/2]);  dims Dr..D pass through (partial rotary).
inv_freq is evaluated in float64 and rounded; angles and cos/sin are computed in float64 for
float64 inputs and in float32 otherwise (as Megatron does), then cast to the input dtype.
"""

from __future__ import annotations

import torch

__all__ = ["rope_inv_freq", "rope_cos_sin", "apply_rope", "apply_rope_packed"]


def _angle_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_rotary_dim(rotary_dim: int, head_dim: int | None = None) -> None:
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim={rotary_dim!r}: must be a positive even integer")
    if head_dim is not None and rotary_dim > head_dim:
        raise ValueError(f"rotary_dim={rotary_dim}: larger than the head dim D={head_dim}; pass rotary_dim <= D")


def rope_inv_freq(
    rotary_dim: int, *, base: float = 10000.0, dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> torch.Tensor:
    """[Dr/2] inverse frequencies ``base ** (-arange(0, Dr, 2) / Dr)``."""
    _check_rotary_dim(rotary_dim)
    if base <= 0:
        raise ValueError(f"base={base}: the RoPE base must be > 0 (e.g. 10000)")
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim  # [Dr/2]
    return (float(base) ** (-exponent)).to(dtype)


def rope_cos_sin(
    position_ids: torch.Tensor,
    rotary_dim: int,
    *,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each [T, 1, Dr] in ``dtype``, for the packed ``position_ids`` [T].

    Build once per micro-batch and reuse for q and k of every layer.  Device follows ``position_ids``.
    """
    if position_ids.dim() != 1:
        raise ValueError(f"position_ids.shape={tuple(position_ids.shape)}: expected [T] (one id per packed token)")
    adt = _angle_dtype(dtype)
    inv = rope_inv_freq(rotary_dim, base=base, dtype=adt, device=position_ids.device)  # [Dr/2]
    angle = position_ids.to(adt)[:, None] * inv[None, :]  # [T, Dr/2]
    emb = torch.cat([angle, angle], dim=-1)[:, None, :]  # [T, 1, Dr]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first Dr dims of ``x`` [T, H, D] with ``cos``/``sin`` [T, 1, Dr]; the rest passes through."""
    if x.dim() != 3:
        raise ValueError(f"x.shape={tuple(x.shape)}: expected THD [T, H, D]")
    rd = cos.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] != x.shape[0] or cos.shape[1] != 1:
        raise ValueError(
            f"cos{tuple(cos.shape)}/sin{tuple(sin.shape)}: expected [T, 1, Dr] with T={x.shape[0]}; "
            "build them with rope_cos_sin from this micro-batch's position_ids"
        )
    _check_rotary_dim(rd, x.shape[-1])
    xr, xp = x[..., :rd], x[..., rd:]  # [T, H, Dr], [T, H, D-Dr]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]  # [T, H, Dr/2] each
    rotated = torch.cat([-x2, x1], dim=-1)  # [T, H, Dr]
    out = xr * cos.to(x.dtype) + rotated * sin.to(x.dtype)  # [T, H, Dr]
    return torch.cat([out, xp], dim=-1) if xp.shape[-1] else out  # [T, H, D]


def apply_rope_packed(
    x: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    base: float = 10000.0,
    rotary_dim: int | None = None,
) -> torch.Tensor:
    """RoPE of a whole packed micro-batch ``x`` [T, H, D] in one call; ``rotary_dim`` defaults to D.

    ``position_ids`` [T] are per-sample offsets (see the module docstring); dtype and device come
    from ``x``.
    """
    rd = x.shape[-1] if rotary_dim is None else rotary_dim
    cos, sin = rope_cos_sin(position_ids.to(x.device), rd, base=base, dtype=x.dtype)
    return apply_rope(x, cos, sin)
