"""One autograd wrapper for every CP algorithm's pure forward/backward pair.

An algorithm supplies ``fwd(q, k, v, *meta, kernel, scale) -> (out [T, Hq, Dv], lse [Hq, T])`` and
``bwd(dout, q, k, v, out, lse, *meta, kernel, scale) -> (dq, dk, dv)``; ``meta`` holds its
non-tensor arguments (process group or ring, layouts or index, window).  lse gets no gradient.

Softmax sinks (``sink`` [Hq], :mod:`hdp.kernels.variants`) are merged here, once, after the
algorithm merged every key block: the saved ``out``/``lse`` include the sink, so the algorithm's
backward is unchanged, and the sink's gradient is computed here from them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hdp.kernels.variants import merge_sink, sink_grad

__all__ = ["CPAttentionFunction"]


class CPAttentionFunction(torch.autograd.Function):
    """``apply(q, k, v, sink, fwd, bwd, meta, kernel, scale) -> (out, lse)``; saves q, k, v, out, lse (and sink)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sink: torch.Tensor | None,
        fwd: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        bwd: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        meta: tuple[Any, ...],
        kernel: Any,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = fwd(q, k, v, *meta, kernel, scale)
        if sink is not None:
            out, lse = merge_sink(out, lse, sink)  # [T, Hq, Dv], [Hq, T]
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.bwd, ctx.meta, ctx.kernel, ctx.scale = bwd, meta, kernel, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor, _dlse: torch.Tensor | None) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse, sink = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = ctx.bwd(dout, q, k, v, out, lse, *ctx.meta, ctx.kernel, ctx.scale)
        dsink = sink_grad(dout, out, lse, sink) if sink is not None and ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsink, None, None, None, None, None
