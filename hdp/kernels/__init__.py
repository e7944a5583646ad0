"""Local attention kernels returning (out, lse): pure-torch reference and adapters.

Every kernel has the signature of :mod:`hdp.kernels.reference` (THD layout, varlen cu_seqlens,
bottom-right causal, ``lse`` as ``[Hq, Tq]`` with ``-inf`` for rows that see no key); :func:`get_kernel`
picks one for a device.  One adapter module per third-party kernel: :mod:`.flash_attn` (the
flash-attn package), :mod:`.torch_flash` (torch's own fused varlen flash attention), :mod:`.npu`
(``torch_npu``).

Beside them, :mod:`hdp.kernels.grouped_gemm` is the one seam of MoE grouped GEMMs (torch's
``grouped_mm`` on CPU and CUDA, torch_npu's grouped matmul on NPU, a loop of matmuls elsewhere), and
:mod:`hdp.kernels.fusions` the seam of the fused elementwise kernels of hdp's own RoPE and the experts'
SwiGLU (torch_npu's ``npu_rotary_mul`` / ``npu_swiglu``, flash-attn's rotary; the plain form elsewhere).

Variants (:mod:`.variants`): a sliding window by sample position (:class:`KeyWindow`) and value
heads wider or narrower than query/key heads (Dv != D, as MLA) are computed by the reference kernel;
an adapter declares what it computes itself (:attr:`AttentionKernel.native_window`,
:attr:`AttentionKernel.distinct_value_dim`), and :meth:`AttentionKernel.forward` /
:meth:`AttentionKernel.backward` take the rest:

* a window the adapter does not take: the reference kernel runs that call (logged once per kernel);
* Dv != D on an adapter of one head dim (flash-attn 2, torch-flash, NPU): the narrower side is zero-padded to
  ``max(D, Dv)`` (exact: zero key dims add nothing to a logit — the scale is passed, not derived from the
  width — and zero value dims give zero output columns, dropped; in the backward the padded ``dout`` / ``out``
  columns are zero, so ``dq``/``dk``/``dv`` of the real dims are unchanged).  The adapter's own limits then
  apply to the padded width (torch-flash: at most 256, else its reference fallback).  MLA's DeepSeek-V3 heads
  (D = 192, Dv = 128) run the fused kernel with V padded to 192.

Softmax sinks need nothing from a kernel: they are merged after the kernels' log-sum-exp
(:func:`merge_sink`), in :func:`kernel_attention` and in every CP algorithm.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from hdp import device as _device
from hdp.kernels import reference
from hdp.kernels.variants import KeyWindow, merge_sink, sink_grad

__all__ = ["KernelName", "AttentionKernel", "FwdFn", "BwdFn", "KeyWindow", "get_kernel", "kernel_attention",
           "merge_sink", "sink_grad"]

logger = logging.getLogger(__name__)
_FALLBACK_LOGGED: set[tuple[str, str]] = set()


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
    """A local varlen attention kernel: a forward returning (out, lse) and a backward from them.

    Call it through :meth:`forward` / :meth:`backward`: they take the variants (``window``, Dv != D)
    and run the reference kernel for what this kernel does not compute itself.
    """

    name: KernelName
    """Which implementation this is."""
    fwd: FwdFn
    """Forward: see :func:`hdp.kernels.reference.attn_fwd`."""
    bwd: BwdFn
    """Backward: see :func:`hdp.kernels.reference.attn_bwd`."""
    native_window: bool = False
    """``fwd``/``bwd`` take ``window=`` (a :class:`KeyWindow`) themselves."""
    distinct_value_dim: bool = False
    """``fwd``/``bwd`` take value heads of another width than query/key heads (Dv != D); else :meth:`forward` /
    :meth:`backward` zero-pad the narrower side to one width."""

    def _needs_reference(self, window: KeyWindow | None) -> bool:
        if window is None or self.native_window:
            return False
        why = "a sliding window by sample position"
        if (self.name.value, why) not in _FALLBACK_LOGGED:
            _FALLBACK_LOGGED.add((self.name.value, why))
            logger.warning("attention kernel %s does not compute %s: those calls run the reference kernel",
                           self.name.value, why)
        return True

    def _padded_width(self, q: torch.Tensor, v: torch.Tensor) -> int | None:
        """``max(D, Dv)`` when this kernel needs the head dims equal and they are not (module docstring)."""
        if v.shape[-1] == q.shape[-1] or self.distinct_value_dim:
            return None
        return max(q.shape[-1], v.shape[-1])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, causal: bool, scale: float, *,
                window: KeyWindow | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``fwd`` with the variants: ``(out [Tq, Hq, Dv], lse [Hq, Tq])``."""
        if self._needs_reference(window):
            return reference.attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window=window)
        if window is not None:
            return self.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window=window)  # type: ignore[call-arg]
        width = self._padded_width(q, v)
        if width is None:
            return self.fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale)
        out, lse = self.fwd(_pad(q, width), _pad(k, width), _pad(v, width), cu_seqlens_q, cu_seqlens_k, causal,
                            scale)  # [Tq, Hq, W]: columns past Dv are zero
        return out[..., : v.shape[-1]].contiguous(), lse  # [Tq, Hq, Dv]

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, causal: bool,
                 scale: float, *, window: KeyWindow | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``bwd`` with the variants: ``(dq, dk, dv)``."""
        if self._needs_reference(window):
            return reference.attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale,
                                      window=window)
        if window is not None:
            return self.bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale,  # type: ignore[call-arg]
                            window=window)
        width = self._padded_width(q, v)
        if width is None:
            return self.bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, causal, scale)
        dq, dk, dv = self.bwd(_pad(dout, width), _pad(q, width), _pad(k, width), _pad(v, width), _pad(out, width),
                              lse, cu_seqlens_q, cu_seqlens_k, causal, scale)  # [T, H, W] each
        d, d_v = q.shape[-1], v.shape[-1]
        return dq[..., :d].contiguous(), dk[..., :d].contiguous(), dv[..., :d_v].contiguous()


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` [..., d] with zero columns up to [..., width] (itself when d == width)."""
    return t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def _load(name: KernelName) -> AttentionKernel:
    if name is KernelName.REFERENCE:
        return AttentionKernel(name, reference.attn_fwd, reference.attn_bwd, native_window=True,
                               distinct_value_dim=True)
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
    """Autograd wrapper of one kernel call (plus the sink merge); ``lse`` is returned without gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: object,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sink: torch.Tensor | None,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        causal: bool,
        scale: float,
        kernel: AttentionKernel,
        window: KeyWindow | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = kernel.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window=window)
        if sink is not None:
            out, lse = merge_sink(out, lse, sink)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sink)  # type: ignore[attr-defined]
        ctx.causal, ctx.scale, ctx.kernel, ctx.window = causal, scale, kernel, window  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(lse)  # type: ignore[attr-defined]
        return out, lse

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: object, dout: torch.Tensor, _dlse: torch.Tensor | None
    ) -> tuple[object, ...]:
        q, k, v, out, lse, cq, ck, sink = ctx.saved_tensors  # type: ignore[attr-defined]
        dout = dout.contiguous()
        dq, dk, dv = ctx.kernel.backward(  # type: ignore[attr-defined]
            dout, q, k, v, out, lse, cq, ck, ctx.causal, ctx.scale, window=ctx.window  # type: ignore[attr-defined]
        )
        dsink = sink_grad(dout, out, lse, sink) if sink is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsink, None, None, None, None, None, None


def kernel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
    kernel: AttentionKernel,
    *,
    window: KeyWindow | None = None,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable local varlen attention with ``kernel``: ``(out [Tq, Hq, Dv], lse [Hq, Tq])``.

    ``window``: a sliding window by sample position; ``sink`` [Hq]: one value-less logit per head in
    the softmax denominator (differentiable), see :mod:`hdp.kernels.variants`.
    """
    return _KernelAttention.apply(q, k, v, sink, cu_seqlens_q, cu_seqlens_k, causal, scale, kernel, window)
