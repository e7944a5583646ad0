"""Adapter from hdp's kernel signature to ``torch_npu.npu_fusion_attention`` (Ascend, TND layout).

NOT RUN ON HARDWARE: written against the documented ``torch_npu.npu_fusion_attention`` /
``npu_fusion_attention_grad`` API (Ascend Extension for PyTorch), never executed on an NPU.

Mapping:
  * ``input_layout="TND"`` takes ``actual_seq_qlen`` / ``actual_seq_kvlen`` as *cumulative* end
    offsets without the leading 0 (i.e. ``cu_seqlens[1:]``) as Python lists.
  * bottom-right causal is ``sparse_mode=3`` ("rightDownCausal") with the fixed 2048x2048
    upper-triangular ``atten_mask`` (True = masked) the operator requires for that mode.
  * The operator returns ``softmax_max`` and ``softmax_sum`` of shape [T, N, 8] (value repeated
    8 times); ``lse = max + log(sum)``.  For the backward with a merged ``lse`` (ring attention),
    ``softmax_max = lse`` and ``softmax_sum = 1`` reproduce ``P = exp(S - lse)`` exactly (the
    trick MindSpeed's ring attention uses).
  * GQA: the operator accepts Hkv dividing Hq with ``head_num = Hq``.

Beside attention, the two elementwise kernels of :mod:`hdp.kernels.fusions` (also NOT RUN ON HARDWARE):
:func:`rotary_mul` (``torch_npu.npu_rotary_mul``, MindSpeed's fused RoPE) and :func:`swiglu`
(``torch_npu.npu_swiglu``, MindSpeed's fused SwiGLU); both differentiable through torch_npu's own backward.

Layout legend: T tokens (packed THD = TND), Hq/Hkv query/kv heads (N), D head dim.  lse is [Hq, Tq].
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from hdp.kernels import reference

__all__ = ["available", "attn_fwd", "attn_bwd", "rotary_mul", "swiglu"]

logger = logging.getLogger(__name__)

_MASK_SIZE = 2048  # sparse_mode 2/3/4 need a compressed 2048x2048 mask


@functools.lru_cache(maxsize=1)
def _torch_npu() -> Any | None:
    try:
        import torch_npu
    except Exception as exc:  # without CANN the import raises arbitrary errors
        logger.debug("torch_npu not usable: %s", exc)
        return None
    return torch_npu


def available() -> bool:
    """Whether ``torch_npu`` imports."""
    return _torch_npu() is not None


def _causal_mask(device: torch.device) -> torch.Tensor:
    return torch.triu(torch.ones((_MASK_SIZE, _MASK_SIZE), dtype=torch.bool, device=device), diagonal=1)


def _ends(cu: torch.Tensor) -> list[int]:
    return [int(x) for x in cu[1:].tolist()]


def attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_fusion_attention`` forward; returns ``(out [Tq, Hq, D], lse [Hq, Tq] float32)``."""
    reference.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    tnpu = _torch_npu()
    if tnpu is None:
        raise ValueError("kernel=npu: torch_npu is not importable; use the reference kernel")
    res = tnpu.npu_fusion_attention(
        q,
        k,
        v,
        q.shape[1],
        input_layout="TND",
        atten_mask=_causal_mask(q.device) if causal else None,
        scale=scale,
        keep_prob=1.0,
        pre_tockens=2147483647,
        next_tockens=0 if causal else 2147483647,
        actual_seq_qlen=_ends(cu_seqlens_q),
        actual_seq_kvlen=_ends(cu_seqlens_k),
        sparse_mode=3 if causal else 0,
    )
    out, softmax_max, softmax_sum = res[0], res[1], res[2]
    # softmax_max/sum: [Tq, Hq, 8] (replicated) -> lse [Hq, Tq]
    lse = (softmax_max[..., 0].float() + torch.log(softmax_sum[..., 0].float())).t().contiguous()  # [Hq, Tq]
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
    """``npu_fusion_attention_grad`` from (possibly merged) ``out``/``lse``; returns ``(dq, dk, dv)``."""
    tnpu = _torch_npu()
    if tnpu is None:
        raise ValueError("kernel=npu: torch_npu is not importable; use the reference kernel")
    # lse [Hq, Tq] -> softmax_max [Tq, Hq, 8]; softmax_sum = 1 so exp(S - max) / sum = exp(S - lse)
    smax = lse.float().t().unsqueeze(-1).expand(-1, -1, 8).contiguous()  # [Tq, Hq, 8]
    ssum = torch.ones_like(smax)  # [Tq, Hq, 8]
    res = tnpu.npu_fusion_attention_grad(
        q,
        k,
        v,
        dout,
        q.shape[1],
        "TND",
        atten_mask=_causal_mask(q.device) if causal else None,
        softmax_max=smax,
        softmax_sum=ssum,
        attention_in=out.to(q.dtype),
        scale_value=scale,
        keep_prob=1.0,
        pre_tockens=2147483647,
        next_tockens=0 if causal else 2147483647,
        actual_seq_qlen=_ends(cu_seqlens_q),
        actual_seq_kvlen=_ends(cu_seqlens_k),
        sparse_mode=3 if causal else 0,
    )
    return res[0], res[1], res[2]


def rotary_mul(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` [T, H, Dr] with ``cos``/``sin`` [T, 1, Dr] through ``torch_npu.npu_rotary_mul``
    (x·r1 + rotate_half(x)·r2, "half" mode), as MindSpeed calls it on [S, B, N, D] with tables [S, 1, 1, D]:
    here S = T tokens, B = 1."""
    tnpu = _torch_npu()
    if tnpu is None:
        raise ValueError("fused rotary: torch_npu is not importable; use the plain form")
    out = tnpu.npu_rotary_mul(x.unsqueeze(1), cos.unsqueeze(1), sin.unsqueeze(1))  # [T, 1, H, Dr]
    return out.squeeze(1)  # [T, H, Dr]


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(h[:, :F]) · h[:, F:] of ``h`` [n, 2F] through ``torch_npu.npu_swiglu(h, dim=-1)`` (the gate half first,
    Megatron's layout, as MindSpeed's fused SwiGLU)."""
    tnpu = _torch_npu()
    if tnpu is None:
        raise ValueError("fused swiglu: torch_npu is not importable; use the plain form")
    return tnpu.npu_swiglu(h, dim=-1)  # [n, F]
