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
    inv_freq[i] = base ** (-2i / Dr),  i = 0 .. Dr/2 - 1            (then scaled, see below)
    angle[t, i] = position_ids[t] * inv_freq[i];  emb = cat(angle, angle)          [T, Dr]
    rot(x) = x[..., s:s+Dr] * a·cos(emb) + rotate_half(x[..., s:s+Dr]) * a·sin(emb),
    rotate_half(x) = cat(-x[..., Dr/2:], x[..., :Dr/2]);  the other dims pass through (partial
    rotary; ``s`` = 0, or the start of a decoupled RoPE part such as MLA's); ``a`` the attention factor.
    Interleaved pairs (DeepSeek-V3's ``rope_interleave``, Megatron's MLA): the rotated part is first
    de-interleaved, x[..., s:s+Dr] -> cat(x[..., s:s+Dr:2], x[..., s+1:s+Dr:2]), then rotated as above.
inv_freq is evaluated in float64 and rounded; angles and cos/sin are computed in float64 for
float64 inputs and in float32 otherwise (as Megatron and ``transformers`` do), then cast to the
input dtype.

Frequency scaling (:class:`RopeScaling`, HF ``rope_parameters`` / ``rope_scaling`` names; formulas of
``transformers.modeling_rope_utils``, which Megatron's ``RotaryEmbedding`` / ``YarnRotaryEmbedding``
follow), with ``f`` the factor and ``L0`` the pretraining length (``original_max_position_embeddings``):

* ``default``: inv_freq as above, a = 1;
* ``linear`` (position interpolation; Megatron ``seq_len_interpolation_factor``): inv_freq / f;
* ``dynamic`` (dynamic NTK): HF rescales the base from the *longest sequence of the forward call*
  (and keeps the largest seen), ``base·(f·n/L0 - (f-1))^(Dr/(Dr-2))`` with n = max(length, L0): for
  every length up to L0 that is the plain base, so hdp computes it for samples of at most L0 tokens
  (:attr:`RopeScaling.max_positions`) and refuses longer ones — beyond L0 HF's frequencies depend on
  the batch and on the module's history, not on the token's position;
* ``llama3`` (Llama 3.1 / 3.2 / 3.3; Megatron ``rope_scaling=True``): wavelength λ = 2π / inv_freq;
  λ > L0/low: inv_freq / f; λ < L0/high: unchanged; between: (1-s)·inv_freq/f + s·inv_freq with
  s = (L0/λ - low) / (high - low);
* ``yarn`` (Qwen3 past 32K, DeepSeek-V3, Kimi-K2): per frequency a ramp between interpolation
  (inv_freq / f) and extrapolation (inv_freq) over the dims [lo, hi] where a dim turns
  ``beta_fast`` / ``beta_slow`` times over L0 (``truncate``: lo floored, hi ceiled); attention factor
  ``a = attention_factor`` if given, else mscale(f, mscale) / mscale(f, mscale_all_dim) when both are
  given, else mscale(f) = 0.1·ln f + 1 (1 for f <= 1).  HF multiplies cos and sin by ``a``, so every
  attention logit is scaled by a².
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

__all__ = [
    "RopeType",
    "RopeScaling",
    "rope_inv_freq",
    "rope_frequencies",
    "rope_cos_sin",
    "apply_rope",
    "apply_rope_packed",
]


class RopeType(enum.Enum):
    """RoPE frequency variants hdp computes (HF ``rope_type``)."""

    DEFAULT = "default"
    """Plain RoPE."""
    LINEAR = "linear"
    """Position interpolation: every frequency divided by ``factor``."""
    DYNAMIC = "dynamic"
    """Dynamic NTK, for samples up to its fixed length (see the module docstring)."""
    LLAMA3 = "llama3"
    """Llama 3.1 frequency smoothing."""
    YARN = "yarn"
    """YaRN: ramped interpolation plus an attention factor."""


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Which RoPE frequency variant, with its parameters (the names of HF's ``rope_parameters``)."""

    type: RopeType = RopeType.DEFAULT
    """The variant."""
    factor: float = 1.0
    """Scaling factor f (linear, dynamic, llama3, yarn)."""
    original_max_position_embeddings: int | None = None
    """L0: the pretraining context (llama3, yarn); for ``dynamic`` the fixed length (HF's
    ``max_position_embeddings``) up to which its frequencies are the plain ones."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above L0 / low_freq_factor are divided by f."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below L0 / high_freq_factor are kept."""
    beta_fast: float = 32.0
    """yarn: rotations bounding the extrapolated dims."""
    beta_slow: float = 1.0
    """yarn: rotations bounding the interpolated dims."""
    mscale: float | None = None
    """yarn: numerator mscale of the attention factor (DeepSeek)."""
    mscale_all_dim: float | None = None
    """yarn: denominator mscale of the attention factor (DeepSeek)."""
    attention_factor: float | None = None
    """yarn: the attention factor itself; ``None``: from f (and mscale / mscale_all_dim)."""
    truncate: bool = True
    """yarn: round the correction range to whole dims (HF ``truncate``, Megatron
    ``correction_range_round_to_int``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.type, RopeType):
            try:
                object.__setattr__(self, "type", RopeType(self.type))
            except ValueError as exc:
                raise ValueError(
                    f"RopeScaling.type={self.type!r}: choose one of {[t.value for t in RopeType]} "
                    "(mrope, longrope and others are not computed by hdp)"
                ) from exc
        kind = self.type.value
        if not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"RopeScaling.factor={self.factor!r}: must be a finite number > 0 (rope_type {kind})")
        if self.type in (RopeType.DYNAMIC, RopeType.LLAMA3, RopeType.YARN):
            orig = self.original_max_position_embeddings
            if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
                what = "max_position_embeddings" if self.type is RopeType.DYNAMIC else "original_max_position_embeddings"
                raise ValueError(
                    f"RopeScaling.original_max_position_embeddings={orig!r}: rope_type {kind} needs the model's "
                    f"{what} (a positive integer)"
                )
        if self.type is RopeType.LLAMA3 and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"RopeScaling.low_freq_factor={self.low_freq_factor}, high_freq_factor={self.high_freq_factor}: "
                "llama3 needs 0 < low_freq_factor < high_freq_factor (Llama 3.1: 1 and 4)"
            )
        if self.type is RopeType.YARN:
            if not self.beta_fast > 0 or not self.beta_slow > 0:
                raise ValueError(
                    f"RopeScaling.beta_fast={self.beta_fast}, beta_slow={self.beta_slow}: yarn needs both > 0"
                )
            if self.attention_factor is not None and not self.attention_factor > 0:
                raise ValueError(f"RopeScaling.attention_factor={self.attention_factor}: must be > 0 or None")

    @property
    def max_positions(self) -> int | None:
        """Samples longer than this are refused (``dynamic``: HF's frequencies then depend on the batch);
        ``None``: no limit."""
        return self.original_max_position_embeddings if self.type is RopeType.DYNAMIC else None

    @property
    def attention_scale(self) -> float:
        """The factor a HF multiplies cos and sin by (1 except yarn)."""
        if self.type is not RopeType.YARN:
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        f = self.factor
        if self.mscale and self.mscale_all_dim:
            return float(_yarn_mscale(f, self.mscale) / _yarn_mscale(f, self.mscale_all_dim))
        return _yarn_mscale(f)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


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
    """[Dr/2] inverse frequencies ``base ** (-arange(0, Dr, 2) / Dr)`` (plain RoPE)."""
    _check_rotary_dim(rotary_dim)
    if base <= 0:
        raise ValueError(f"base={base}: the RoPE base must be > 0 (e.g. 10000)")
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim  # [Dr/2]
    return (float(base) ** (-exponent)).to(dtype)


def _llama3(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 smoothing of float64 ``inv`` [Dr/2] (``transformers``' ``_compute_llama3_parameters``)."""
    old = float(s.original_max_position_embeddings)  # type: ignore[arg-type]
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv  # [Dr/2]
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)  # long wavelengths: / f
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)  # [Dr/2]
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv: torch.Tensor, rotary_dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    """YaRN ramp of float64 ``inv`` [Dr/2] (``transformers``' ``_compute_yarn_parameters``)."""
    orig = float(s.original_max_position_embeddings)  # type: ignore[arg-type]

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over L0
        return (rotary_dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64, device=inv.device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # [Dr/2]: 1 keeps the frequency, 0 interpolates it
    return (inv / s.factor) * (1 - extrapolation) + inv * extrapolation


def rope_frequencies(
    rotary_dim: int,
    *,
    base: float = 10000.0,
    scaling: RopeScaling | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [Dr/2] in dtype, attention factor a)`` of ``scaling`` (``None``: plain RoPE).

    The formulas of the module docstring, evaluated in float64 and rounded to ``dtype``.
    """
    inv = rope_inv_freq(rotary_dim, base=base, dtype=torch.float64, device=device)  # [Dr/2]
    s = scaling if scaling is not None else RopeScaling()
    if s.type is RopeType.LINEAR:
        inv = inv / s.factor
    elif s.type is RopeType.LLAMA3:
        inv = _llama3(inv, s)
    elif s.type is RopeType.YARN:
        inv = _yarn(inv, rotary_dim, float(base), s)
    # DYNAMIC: the plain frequencies up to its fixed length (RopeScaling.max_positions)
    return inv.to(dtype), s.attention_scale


def rope_cos_sin(
    position_ids: torch.Tensor,
    rotary_dim: int,
    *,
    base: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a·cos, a·sin)``, each [T, 1, Dr] in ``dtype``, for the packed ``position_ids`` [T].

    ``scaling`` picks the frequency variant and the attention factor ``a`` (``None``: plain RoPE).
    Build once per micro-batch and reuse for q and k of every layer.  Device follows ``position_ids``.
    A position beyond ``scaling.max_positions`` raises ``ValueError``.
    """
    if position_ids.dim() != 1:
        raise ValueError(f"position_ids.shape={tuple(position_ids.shape)}: expected [T] (one id per packed token)")
    limit = scaling.max_positions if scaling is not None else None
    if limit is not None and position_ids.numel() and int(position_ids.max()) >= limit:
        raise ValueError(
            f"a sample reaches position {int(position_ids.max())} but rope_type "
            f"{scaling.type.value} (max_position_embeddings={limit}) is exact only for samples of at most "  # type: ignore[union-attr]
            f"{limit} tokens (beyond, transformers' dynamic NTK depends on the batch); shorten the samples"
        )
    adt = _angle_dtype(dtype)
    inv, factor = rope_frequencies(rotary_dim, base=base, scaling=scaling, dtype=adt, device=position_ids.device)
    angle = position_ids.to(adt)[:, None] * inv[None, :]  # [T, Dr/2]
    emb = torch.cat([angle, angle], dim=-1)[:, None, :]  # [T, 1, Dr]
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, start: int = 0,
               interleaved: bool = False) -> torch.Tensor:
    """Rotate dims ``start .. start+Dr`` of ``x`` [T, H, D] with ``cos``/``sin`` [T, 1, Dr]; the rest passes
    through (``start`` > 0: a decoupled RoPE part at the end of the head, as MLA's).

    ``interleaved``: the rotated pairs are adjacent dims (2i, 2i+1) instead of (i, i + Dr/2); the part is
    de-interleaved first (evens, then odds) and rotated by halves, so it comes out in that de-interleaved
    order — ``transformers``' ``apply_rotary_pos_emb_interleave`` (DeepSeek-V3 ``rope_interleave``) and
    Megatron's MLA RoPE, exactly.  q and k are permuted alike, so every logit q·k is the interleaved
    rotation's."""
    if x.dim() != 3:
        raise ValueError(f"x.shape={tuple(x.shape)}: expected THD [T, H, D]")
    rd = cos.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] != x.shape[0] or cos.shape[1] != 1:
        raise ValueError(
            f"cos{tuple(cos.shape)}/sin{tuple(sin.shape)}: expected [T, 1, Dr] with T={x.shape[0]}; "
            "build them with rope_cos_sin from this micro-batch's position_ids"
        )
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start={start!r}: must be an integer >= 0")
    _check_rotary_dim(rd, x.shape[-1] - start)
    head, xr, tail = x[..., :start], x[..., start : start + rd], x[..., start + rd :]  # [T, H, *]
    if interleaved:
        xr = torch.cat([xr[..., 0::2], xr[..., 1::2]], dim=-1)  # [T, H, Dr]: pairs (2i, 2i+1) -> (i, i+Dr/2)
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2 :]  # [T, H, Dr/2] each
    rotated = torch.cat([-x2, x1], dim=-1)  # [T, H, Dr]
    out = xr * cos.to(x.dtype) + rotated * sin.to(x.dtype)  # [T, H, Dr]
    parts = [p for p in (head, out, tail) if p.shape[-1]]
    return torch.cat(parts, dim=-1) if len(parts) > 1 else out  # [T, H, D]


def apply_rope_packed(
    x: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    base: float = 10000.0,
    rotary_dim: int | None = None,
    scaling: RopeScaling | None = None,
) -> torch.Tensor:
    """RoPE of a whole packed micro-batch ``x`` [T, H, D] in one call; ``rotary_dim`` defaults to D.

    ``position_ids`` [T] are per-sample offsets (see the module docstring); dtype and device come
    from ``x``.
    """
    rd = x.shape[-1] if rotary_dim is None else rotary_dim
    cos, sin = rope_cos_sin(position_ids.to(x.device), rd, base=base, dtype=x.dtype, scaling=scaling)
    return apply_rope(x, cos, sin)
