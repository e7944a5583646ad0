"""Local attention kernels returning (out, lse): pure-torch reference and adapters.

Every kernel has the signature of :mod:`hdp.kernels.reference` (THD layout, varlen cu_seqlens,
bottom-right causal, ``lse`` as ``[Hq, Tq]`` with ``-inf`` for rows that see no key); :func:`get_kernel`
picks one for a device.  One adapter module per third-party kernel: :mod:`.flash_attn` (the
flash-attn package), :mod:`.torch_flash` (torch's own fused varlen flash attention), :mod:`.npu`
(``torch_npu``).

Beside them, :mod:`hdp.kernels.grouped_gemm` is the one seam of MoE grouped GEMMs (torch's
``grouped_mm`` on CPU and CUDA, torch_npu's grouped matmul on NPU, a loop of matmuls elsewhere).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch

from hdp import device as _device
from hdp.kernels import reference

__all__ = ["KernelName", "AttentionKernel", "FwdFn", "BwdFn", "get_kernel", "kernel_attention"]


class KernelName(enum.Enum):
    """Names of the local attention kernels."""

    REFERENCE = "reference"
    FLASH_ATTN = "flash_attn"
    TORCH_FLASH = "torch_flash"
    NPU = "npu"


class FwdFn(Protocol):
    """``(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale) -> (out, lse)``."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class BwdFn(Protocol):
    """``(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale) -> (dq, dk, dv)``."""

    def __call__(
        self,
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class AttentionKernel:
    """A local varlen attention kernel: a forward returning (out, lse) and a backward from them."""

    name: KernelName
    """Which implementation this is."""
    fwd: FwdFn
    """Forward: see :func:`hdp.kernels.reference.attn_fwd`."""
    bwd: BwdFn
    """Backward: see :func:`hdp.kernels.reference.attn_bwd`."""


def _load(name: KernelName) -> AttentionKernel:
    if name is KernelName.REFERENCE:
        return AttentionKernel(name, reference.attn_fwd, reference.attn_bwd)
    if name is KernelName.FLASH_ATTN:
        from hdp.kernels import flash_attn as fa

        if not fa.available():
            raise ValueError("kernel=flash_attn: the flash_attn package is not importable here; use 'reference'")
        return AttentionKernel(name, fa.attn_fwd, fa.attn_bwd)
    if name is KernelName.TORCH_FLASH:
        from hdp.kernels import torch_flash as tf

        why = tf.unavailable_reason()
        if why is not None:
            raise ValueError(f"kernel=torch_flash: {why}; use 'reference'")
        return AttentionKernel(name, tf.attn_fwd, tf.attn_bwd)
    from hdp.kernels import npu

    if not npu.available():
        raise ValueError("kernel=npu: torch_npu is not importable here; use 'reference'")
    return AttentionKernel(name, npu.attn_fwd, npu.attn_bwd)


def get_kernel(device: torch.device, name: KernelName | str | None = None) -> AttentionKernel:
    """Kernel for ``device``: ``name`` if given, else on CUDA flash-attn when importable, else torch's
    fused flash attention when this torch and GPU have it (:mod:`.torch_flash`), else the reference;
    the reference on every other device.

    The NPU adapter is only chosen when asked for by name (it has not been run on hardware).
    """
    if name is not None:
        try:
            kname = KernelName(name)
        except ValueError as exc:
            choices = [n.value for n in KernelName]
            raise ValueError(f"kernel={name!r}: unknown kernel; choose one of {choices}") from exc
        return _load(kname)
    if _device.is_cuda(device):
        from hdp.kernels import flash_attn as fa

        if fa.available():
            return _load(KernelName.FLASH_ATTN)
        from hdp.kernels import torch_flash as tf

        if tf.available(device):
            return _load(KernelName.TORCH_FLASH)
    return _load(KernelName.REFERENCE)


class _KernelAttention(torch.autograd.Function):
    """Autograd wrapper of one kernel call; ``lse`` is returned without gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: object,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        causal: bool,
        scale: float,
        kernel: AttentionKernel,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = kernel.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)  # type: ignore[attr-defined]
        ctx.causal, ctx.scale, ctx.kernel = causal, scale, kernel  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(lse)  # type: ignore[attr-defined]
        return out, lse

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: object, dout: torch.Tensor, _dlse: torch.Tensor | None
    ) -> tuple[object, ...]:
        q, k, v, out, lse, cq, ck = ctx.saved_tensors  # type: ignore[attr-defined]
        dq, dk, dv = ctx.kernel.bwd(  # type: ignore[attr-defined]
            dout.contiguous(), q, k, v, out, lse, cq, ck, ctx.causal, ctx.scale  # type: ignore[attr-defined]
        )
        return dq, dk, dv, None, None, None, None, None


def kernel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
    kernel: AttentionKernel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable local varlen attention with ``kernel``: ``(out [Tq, Hq, D], lse [Hq, Tq])``."""
    return _KernelAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, kernel)
