"""Grouped GEMM of MoE experts: the matmuls of all local experts in one call (one seam, every device).

Dimension legend:
    R   rows (tokens of all local experts, grouped by expert: ``sizes[l]`` rows of expert l in a row)
    L   groups (local experts);  K, N  the GEMM's inner and output widths

Two forms, the three GEMMs of a linear layer's forward and backward:

* :func:`grouped_mm` ``(a [R, K], b [L, K, N], sizes) -> [R, N]``: ``out[rows of l] = a[rows of l] @ b[l]``
  (forward, and the input gradient with ``b`` transposed);
* :func:`grouped_mm_wgrad` ``(a [R, K], b [R, N], sizes) -> [L, K, N]``: ``out[l] = a[rows of l]ᵀ @
  b[rows of l]`` (the weight gradient; a group without rows gets zeros).

:func:`gmm` is the grouped_gemm package's ``ops.gmm`` signature (differentiable), which Megatron's
``GroupedMLP`` calls; the CPU shim of :mod:`hdp.megatron_compat` serves those calls with it.
:func:`grouped_linear` is TransformerEngine ``GroupedLinear``'s math over per-expert weights
(differentiable; the weights are stacked for each call, never saved stacked).

Backends (:func:`backend_for` says which one runs a call, and why):

* ``torch``: ``torch.nn.functional.grouped_mm`` (torch >= 2.8).  Serves CPU tensors of float32,
  bfloat16 or float16 (torch 2.13's CPU kernel: an ``at::mm`` per group, results equal to
  ``torch.mm``'s) and CUDA tensors of bfloat16 on compute capability >= 8.0 (torch's CUTLASS
  kernels; float32 is not taken there).  Its layout rules, checked before the call: each operand
  row- or column-major in its last two dimensions, the leading stride a multiple of 16 bytes (so
  the hidden and FFN widths a multiple of 4 elements in float32, 8 in bfloat16), 16-byte aligned
  data, ``int32`` offsets (built here from ``sizes``).
* ``npu``: ``torch_npu.npu_grouped_matmul`` (``group_type=0`` rows split, ``group_type=2`` for the
  weight gradient, ``group_list_type=1``: counts).  NOT RUN ON HARDWARE: written against the
  documented Ascend Extension for PyTorch API, never executed on an NPU.
* ``loop``: one ``torch.mm`` per group, wherever neither serves (another device or dtype, a
  width off the 16-byte rule, torch without ``grouped_mm``).  Same results, one call per expert.
"""

from __future__ import annotations

import enum
import functools
import itertools
import logging
from typing import Any, Sequence

import torch

from hdp import device as _device

__all__ = ["GroupedGemmBackend", "backend_for", "grouped_mm", "grouped_mm_wgrad", "gmm", "GmmNamespace",
           "grouped_linear"]

logger = logging.getLogger(__name__)

_ALIGN_BYTES = 16
_TORCH_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TORCH_CUDA_DTYPES = (torch.bfloat16,)


class GroupedGemmBackend(enum.Enum):
    """Which implementation runs a grouped GEMM (see the module docstring)."""

    TORCH = "torch"
    NPU = "npu"
    LOOP = "loop"


@functools.lru_cache(maxsize=1)
def _torch_npu() -> Any | None:
    """``torch_npu`` if it imports (guarded: without CANN its import raises anything), else ``None``."""
    try:
        import torch_npu
    except Exception as exc:  # any failure (missing CANN libs, ABI mismatch) means "no NPU kernel"
        logger.debug("torch_npu not usable: %s", exc)
        return None
    return torch_npu


def _torch_grouped_mm() -> Any | None:
    return getattr(torch.nn.functional, "grouped_mm", None)


def _layout_ok(t: torch.Tensor) -> bool:
    """torch's grouped_mm operand rule: row- or column-major in the last two dims, leading stride a
    multiple of 16 bytes, 16-byte aligned data (mirrors ``check_valid_strides`` of torch's checks)."""
    align = _ALIGN_BYTES // t.element_size()
    rows, cols = t.shape[-2], t.shape[-1]
    s_rows, s_cols = t.stride()[-2], t.stride()[-1]
    if s_cols == 1 and s_rows >= max(1, cols):
        lead = s_rows
    elif s_rows == 1 and s_cols >= max(1, rows):
        lead = s_cols
    else:
        return False
    return lead % align == 0 and t.data_ptr() % _ALIGN_BYTES == 0


def backend_for(*operands: torch.Tensor) -> tuple[GroupedGemmBackend, str]:
    """The backend that runs a grouped GEMM of these operands (as passed to torch's op), and why."""
    dev = operands[0].device
    dtype = operands[0].dtype
    if _device.is_npu(dev):
        if _torch_npu() is not None:
            return GroupedGemmBackend.NPU, "torch_npu.npu_grouped_matmul (not run on hardware)"
        return GroupedGemmBackend.LOOP, "NPU tensors but torch_npu does not import"
    if _torch_grouped_mm() is None:
        return GroupedGemmBackend.LOOP, f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    if dev.type == "cpu":
        if dtype not in _TORCH_CPU_DTYPES:
            return GroupedGemmBackend.LOOP, f"grouped_mm on CPU takes {_TORCH_CPU_DTYPES}, not {dtype}"
    elif _device.is_cuda(dev):
        if dtype not in _TORCH_CUDA_DTYPES:
            return GroupedGemmBackend.LOOP, f"grouped_mm on CUDA takes bfloat16, not {dtype}"
        cc = _device.compute_capability(dev)
        if cc is None or cc < (8, 0):
            return GroupedGemmBackend.LOOP, f"grouped_mm on CUDA needs compute capability >= 8.0, got {cc}"
    else:
        return GroupedGemmBackend.LOOP, f"no grouped GEMM kernel for device {dev.type!r}"
    if any(t.dtype != dtype for t in operands):
        return GroupedGemmBackend.LOOP, "operands of different dtypes"
    if not all(_layout_ok(t) for t in operands):
        return GroupedGemmBackend.LOOP, ("an operand breaks grouped_mm's layout rule (row/column-major, "
                                         "leading stride a multiple of 16 bytes, 16-byte aligned)")
    return GroupedGemmBackend.TORCH, "torch.nn.functional.grouped_mm"


def _check(a: torch.Tensor, sizes: Sequence[int], groups: int, what: str) -> tuple[int, ...]:
    sizes = tuple(int(n) for n in sizes)
    if len(sizes) != groups:
        raise ValueError(f"{what}: {len(sizes)} group sizes for {groups} groups")
    if any(n < 0 for n in sizes) or sum(sizes) != a.shape[0]:
        raise ValueError(f"{what}: group sizes {sizes} do not add up to the {a.shape[0]} rows of the input")
    return sizes


def _offsets(sizes: Sequence[int], device: torch.device) -> torch.Tensor:
    """[L] int32 end row of each group (torch's ``offs``)."""
    return torch.tensor(list(itertools.accumulate(sizes)), dtype=torch.int32, device=device)


def _counts(sizes: Sequence[int], device: torch.device) -> torch.Tensor:
    """[L] int64 rows of each group (torch_npu's ``group_list`` with ``group_list_type=1``)."""
    return torch.tensor(list(sizes), dtype=torch.int64, device=device)


def _note(kind: str, backend: GroupedGemmBackend, why: str) -> None:
    if backend is GroupedGemmBackend.LOOP:
        logger.debug("grouped GEMM (%s) runs as a loop of matmuls: %s", kind, why)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """[R, N]: rows of group l of ``a`` [R, K] times ``b[l]`` [K, N] (``b`` [L, K, N], any strides).

    ``sizes``: [L] host integers, rows of each group (summing to R).  Not differentiable (the
    callers own their backward; :func:`gmm` is the differentiable form).
    """
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
        raise ValueError(f"grouped_mm: expected a [R, K] and b [L, K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    sizes = _check(a, sizes, b.shape[0], "grouped_mm")
    if a.shape[0] == 0:
        return a.new_empty((0, b.shape[2]))
    a = a.contiguous()
    backend, why = backend_for(a, b)
    _note("grouped_mm", backend, why)
    if backend is GroupedGemmBackend.TORCH:
        return torch.nn.functional.grouped_mm(a, b, offs=_offsets(sizes, a.device))
    if backend is GroupedGemmBackend.NPU:
        npu = _torch_npu()
        return npu.npu_grouped_matmul([a], [b], bias=None, group_list=_counts(sizes, a.device), split_item=2,
                                      group_type=0, group_list_type=1)[0]
    out = a.new_empty((a.shape[0], b.shape[2]))
    start = 0
    for g, n in enumerate(sizes):
        if n:
            torch.mm(a[start:start + n], b[g], out=out[start:start + n])
        start += n
    return out


def grouped_mm_wgrad(a: torch.Tensor, b: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """[L, K, N]: ``a[rows of l]ᵀ @ b[rows of l]`` for ``a`` [R, K], ``b`` [R, N]; zeros for empty groups."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"grouped_mm_wgrad: expected a [R, K] and b [R, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    sizes = tuple(sizes)
    groups = len(sizes)
    sizes = _check(a, sizes, groups, "grouped_mm_wgrad")
    if a.shape[0] == 0:
        return a.new_zeros((groups, a.shape[1], b.shape[1]))
    a, b = a.contiguous(), b.contiguous()
    at = a.t()  # [K, R] column-major
    backend, why = backend_for(at, b)
    _note("grouped_mm_wgrad", backend, why)
    if backend is GroupedGemmBackend.TORCH:
        return torch.nn.functional.grouped_mm(at, b, offs=_offsets(sizes, a.device))
    if backend is GroupedGemmBackend.NPU:
        npu = _torch_npu()
        return npu.npu_grouped_matmul([at], [b], bias=None, group_list=_counts(sizes, a.device), split_item=3,
                                      group_type=2, group_list_type=1)[0]
    out = a.new_zeros((groups, a.shape[1], b.shape[1]))
    start = 0
    for g, n in enumerate(sizes):
        if n:
            torch.mm(at[:, start:start + n], b[start:start + n], out=out[g])
        start += n
    return out


class _Gmm(torch.autograd.Function):
    """Differentiable grouped GEMM with the grouped_gemm package's ``gmm`` semantics."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, sizes: tuple[int, ...], trans_b: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b)
        ctx.sizes, ctx.trans_b = sizes, trans_b
        return grouped_mm(a, b.transpose(1, 2) if trans_b else b, sizes)  # [R, N]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        a, b = ctx.saved_tensors
        sizes, trans_b = ctx.sizes, ctx.trans_b
        dy = dy.contiguous()
        da = db = None
        if ctx.needs_input_grad[0]:
            da = grouped_mm(dy, b if trans_b else b.transpose(1, 2), sizes)  # [R, K]
        if ctx.needs_input_grad[1]:
            # b [L, N, K] (trans_b): db[l] = dy_lᵀ a_l;  b [L, K, N]: db[l] = a_lᵀ dy_l
            db = grouped_mm_wgrad(dy, a, sizes) if trans_b else grouped_mm_wgrad(a, dy, sizes)
        return da, db, None, None


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: Any, trans_b: bool = False) -> torch.Tensor:
    """The grouped_gemm package's ``ops.gmm``: ``a`` [R, K] by ``b`` [L, K, N] (or [L, N, K] with
    ``trans_b``) per group of ``batch_sizes`` [L] rows; differentiable in ``a`` and ``b``."""
    sizes = tuple(int(n) for n in (batch_sizes.tolist() if torch.is_tensor(batch_sizes) else batch_sizes))
    return _Gmm.apply(a, b, sizes, bool(trans_b))


class GmmNamespace:
    """Stands in for the grouped_gemm package (``grouped_gemm.ops.gmm``) where it is not installed."""

    class ops:  # noqa: N801 (mirrors the package's module name)
        gmm = staticmethod(gmm)


class _GroupedLinear(torch.autograd.Function):
    """y_l = x_l W_lᵀ over per-expert weights W_l [N, K]; saves the weights themselves (no stacked copy)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sizes: tuple[int, ...], *weights: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, *weights)
        ctx.sizes = sizes
        w = torch.stack([t.t() for t in weights])  # [L, K, N] row-major (torch's CPU grouped_mm reads it faster)
        return grouped_mm(x, w, sizes)  # [R, N]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, *weights = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped_mm(dy, torch.stack(weights), ctx.sizes) if ctx.needs_input_grad[0] else None  # [R, K]
        dw = grouped_mm_wgrad(dy, x, ctx.sizes)  # [L, N, K]
        return (dx, None, *dw.unbind(0))


def grouped_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], sizes: Sequence[int]) -> torch.Tensor:
    """[R, N]: rows of group l of ``x`` [R, K] times ``weights[l]ᵀ`` (each [N, K], as ``nn.Linear``);
    differentiable in ``x`` and every weight (TransformerEngine ``GroupedLinear``'s math, bias-free)."""
    return _GroupedLinear.apply(x, tuple(int(n) for n in sizes), *weights)
