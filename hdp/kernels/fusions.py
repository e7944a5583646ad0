"""Fused elementwise kernels of hdp's own math: RoPE's rotation and the MoE experts' SwiGLU (one seam, every device).

hdp computes two things that Megatron (and MindSpeed's patches of Megatron) would otherwise fuse: RoPE, inside
hdp's core attention (``HdpCoreAttention``: Megatron's RoPE cannot express hdp's CP layout, so it never runs
under hdp), and the experts' SwiGLU under MoE zero-memory (:mod:`hdp.moe.zero_memory`: one autograd node from
dispatch to combine, so Megatron's activation never runs there either).  When a model asks for the fused kernels
(Megatron's ``apply_rope_fusion`` / ``bias_activation_fusion``, MindSpeed's ``use_fused_rotary_pos_emb`` /
``use_fused_swiglu``), these two call sites take the device's kernel where one exists:

==========  =========================================  ==============================================
fusion      NPU (:mod:`hdp.kernels.npu`)               CUDA (:mod:`hdp.kernels.flash_attn`)
==========  =========================================  ==============================================
``rotary``  ``torch_npu.npu_rotary_mul``               flash-attn's ``apply_rotary_emb`` (triton)
``swiglu``  ``torch_npu.npu_swiglu``                   none: the plain form
==========  =========================================  ==============================================

and the plain form everywhere else (CPU included), logged once per fusion, device kind and reason.  The NPU
and CUDA kernels are NOT RUN ON HARDWARE: written against the documented torch_npu / flash-attn APIs, never
executed on an NPU or a GPU.  On CPU the tests register a stand-in (:func:`registered`) and check that the call
sites take it and that it gives the plain form's values.

Dimension legend: T tokens (packed THD), H heads, Dr rotated dims (even); n rows, F the experts' FFN width.

Contracts (the same math in both forms; kernels are differentiable through their own backward):

* ``rotary``: ``(x [T, H, Dr], cos [T, 1, Dr], sin [T, 1, Dr]) -> x·cos + rotate_half(x)·sin`` [T, H, Dr], with
  ``rotate_half(x) = cat(-x[..., Dr/2:], x[..., :Dr/2])`` and per-token tables (each token's angle at its sample
  position, times YaRN's attention factor: :func:`hdp.rope.rope_cos_sin`);
* ``swiglu``: ``h [n, 2F] -> silu(h[:, :F]) · h[:, F:]`` [n, F] (Megatron's layout: the gate half first).
"""

from __future__ import annotations

import contextlib
import enum
import logging
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from hdp import device as _device
from hdp.rope import apply_rope

__all__ = ["Fusion", "FusedKernel", "kernel_for", "resolve", "register", "registered", "rotate", "swiglu"]

logger = logging.getLogger(__name__)


class Fusion(enum.Enum):
    """The elementwise fusions hdp's own math can take (module docstring)."""

    ROTARY = "rotary"
    """RoPE's rotation of q and k (hdp's core attention)."""
    SWIGLU = "swiglu"
    """The experts' SwiGLU under zero-memory."""


@dataclass(frozen=True)
class FusedKernel:
    """One device's fused kernel of one :class:`Fusion`."""

    fusion: Fusion
    """What it computes (the contract of the module docstring)."""
    name: str
    """Where it comes from, e.g. ``torch_npu.npu_rotary_mul`` (logs and metrics name it)."""
    fn: Callable[..., torch.Tensor]
    """The kernel: ``(x, cos, sin)`` for ``rotary``, ``(h)`` for ``swiglu``; differentiable."""


_REGISTERED: dict[tuple[Fusion, str], FusedKernel] = {}
_NOTED: set[tuple[Fusion, str, str]] = set()


def register(kernel: FusedKernel | None, device_type: str, fusion: Fusion | None = None) -> FusedKernel | None:
    """Make ``kernel`` the fused kernel of its fusion on devices of ``device_type`` (a torch device type, e.g.
    one of `hdp.device.DEVICE_KINDS`), ahead of the built-in adapters; ``None`` (with ``fusion``) removes the
    registration.  Returns the kernel it replaced (``None`` if there was none)."""
    if kernel is None and fusion is None:
        raise ValueError("register(None, ...): name the fusion whose registration to remove")
    key = (kernel.fusion if kernel is not None else fusion, str(device_type))  # type: ignore[union-attr]
    old = _REGISTERED.pop(key, None)
    if kernel is not None:
        _REGISTERED[key] = kernel
    return old


@contextlib.contextmanager
def registered(kernel: FusedKernel, device_type: str) -> Iterator[FusedKernel]:
    """:func:`register` ``kernel`` for the ``with`` block only (the previous registration comes back after)."""
    old = register(kernel, device_type)
    try:
        yield kernel
    finally:
        register(old, device_type, kernel.fusion)


def _builtin(fusion: Fusion, device: torch.device) -> tuple[FusedKernel | None, str]:
    """The adapter hdp ships for ``fusion`` on ``device``, or ``None`` and why not."""
    kind = torch.device(device).type
    if _device.is_npu(device):
        from hdp.kernels import npu

        if not npu.available():
            return None, "torch_npu does not import"
        if fusion is Fusion.ROTARY:
            return FusedKernel(fusion, "torch_npu.npu_rotary_mul (not run on hardware)", npu.rotary_mul), ""
        return FusedKernel(fusion, "torch_npu.npu_swiglu (not run on hardware)", npu.swiglu), ""
    if _device.is_cuda(device):
        if fusion is Fusion.SWIGLU:
            return None, "hdp has no fused SwiGLU kernel for CUDA (silu(a)·b runs as torch's elementwise ops)"
        from hdp.kernels import flash_attn

        if not flash_attn.rotary_available():
            return None, "flash_attn.layers.rotary does not import"
        return FusedKernel(fusion, "flash_attn apply_rotary_emb (not run on hardware)", flash_attn.rotary), ""
    return None, f"no fused {fusion.value} kernel for device {kind!r}"


def kernel_for(fusion: Fusion, device: torch.device) -> tuple[FusedKernel | None, str]:
    """The fused kernel of ``fusion`` on ``device`` (a registered one first, else hdp's adapter), or ``None`` and
    why the plain form runs."""
    hit = _REGISTERED.get((fusion, torch.device(device).type))
    if hit is not None:
        return hit, ""
    return _builtin(fusion, device)


def _note_plain(fusion: Fusion, device: torch.device, why: str) -> None:
    """Log once per fusion, device kind and reason that a fused kernel was asked for and the plain form runs."""
    key = (fusion, torch.device(device).type, why)
    if key not in _NOTED:
        _NOTED.add(key)
        logger.info("fused %s asked for on %s: %s; the plain form runs (same math)", fusion.value,
                    torch.device(device).type, why)


def resolve(fusion: Fusion, device: torch.device, *, unfit: str | None = None) -> FusedKernel | None:
    """:func:`kernel_for` for a call site that was asked to fuse: the kernel, or ``None`` (the plain form runs;
    logged once per fusion, device kind and reason).  ``unfit``: why this call cannot take a kernel at all
    (the plain form runs, logged likewise)."""
    if unfit is not None:
        _note_plain(fusion, device, unfit)
        return None
    kernel, why = kernel_for(fusion, device)
    if kernel is None:
        _note_plain(fusion, device, why)
    return kernel


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, fused: bool, start: int = 0) -> torch.Tensor:
    """RoPE of dims ``start .. start+Dr`` of ``x`` [T, H, D] with ``cos``/``sin`` [T, 1, Dr] (the rest passes through):
    :func:`hdp.rope.apply_rope`, or with ``fused`` the device's fused kernel on the rotated dims where one exists."""
    if not fused or x.shape[0] == 0:
        return apply_rope(x, cos, sin, start=start)
    kernel = resolve(Fusion.ROTARY, x.device)
    if kernel is None:
        return apply_rope(x, cos, sin, start=start)
    rd = cos.shape[-1]
    if (x.dim() != 3 or cos.shape != sin.shape or tuple(cos.shape) != (x.shape[0], 1, rd) or rd % 2
            or not 0 <= start <= x.shape[-1] - rd):
        raise ValueError(f"fused rotary: x{tuple(x.shape)} with cos{tuple(cos.shape)}/sin{tuple(sin.shape)} and "
                         f"start={start}: expected x [T, H, D] and cos/sin [T, 1, Dr] with Dr even, start + Dr <= D")
    head, xr, tail = x[..., :start], x[..., start:start + rd], x[..., start + rd:]  # [T, H, *]
    out = kernel.fn(xr, cos.to(x.dtype), sin.to(x.dtype))  # [T, H, Dr]
    parts = [p for p in (head, out, tail) if p.shape[-1]]
    return torch.cat(parts, dim=-1) if len(parts) > 1 else out  # [T, H, D]


def swiglu(h: torch.Tensor, kernel: FusedKernel | None = None) -> torch.Tensor:
    """silu(h[:, :F]) · h[:, F:] of ``h`` [n, 2F]: ``kernel`` (a ``swiglu`` one, from :func:`resolve`) or the plain
    form (Megatron's unfused ops)."""
    if kernel is not None:
        return kernel.fn(h)  # [n, F]
    a, b = torch.chunk(h, 2, dim=-1)  # [n, F] each
    return F.silu(a) * b
