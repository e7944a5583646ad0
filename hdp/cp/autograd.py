"""One autograd wrapper for every CP algorithm's pure forward/backward pair.

An algorithm supplies ``fwd(q, k, v, *meta, kernel, scale) -> (out [T, Hq, D], lse [Hq, T])`` and
``bwd(dout, q, k, v, out, lse, *meta, kernel, scale) -> (dq, dk, dv)``; ``meta`` holds its
non-tensor arguments (process group or ring, layouts or index).  lse gets no gradient.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["CPAttentionFunction"]


class CPAttentionFunction(torch.autograd.Function):
    """``apply(q, k, v, fwd, bwd, meta, kernel, scale) -> (out, lse)``; saves q, k, v, out, lse."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fwd: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        bwd: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        meta: tuple[Any, ...],
        kernel: Any,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = fwd(q, k, v, *meta, kernel, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bwd, ctx.meta, ctx.kernel, ctx.scale = bwd, meta, kernel, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.bwd(dout.contiguous(), q, k, v, out, lse, *ctx.meta, ctx.kernel, ctx.scale)
        return dq, dk, dv, None, None, None, None, None
