"""Attention variants every kernel call may carry: a key window by sample position, and softmax sinks.

Dimension legend: Tq/Tk query/key tokens (THD), Hq query heads, Dv value head dim.

**Sliding window** (:class:`KeyWindow`; Megatron ``window_size=(left, 0)``, HF ``sliding_window =
left + 1``): a query at position p of its sample sees the keys of the same sample at positions
[p - left, p].  The window is given by *sample positions*, not packed rows: after the zigzag split a
rank's front and back chunks of one sample are adjacent rows but far apart in the sample, so a
window counted in rows would be wrong.  Inside each key sequence of a call the key positions must be
non-decreasing (true for every layout hdp builds), so the visible keys of a row stay one contiguous
range; the kernel's own causal rule (bottom-right, by rows) still decides where the range ends.

**Sinks** (Megatron ``softmax_type``; gpt-oss ``sinks``): one extra logit per head, with no value,
in the softmax denominator — ``off-by-one`` a constant 0 (``+1``), ``learnable`` a parameter
``s_h``.  It is merged once, after all key blocks of a row (every ring step, the all-gather, or the
local kernel) were merged by log-sum-exp (:func:`merge_sink`):

    lse' = logaddexp(lse, s_h);   out' = exp(lse - lse') · out

The kernels' backward is unchanged when given ``out'`` and ``lse'`` (``P = exp(S - lse')`` is the
final probability of each key and ``dS = P ∘ (dP - rowsum(dO ∘ O'))`` holds with the sink in the
denominator), and the sink's own gradient is (:func:`sink_grad`)

    d s_h = -Σ_t exp(s_h - lse'_{h,t}) · rowsum(dO ∘ O')_{t,h}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KeyWindow", "merge_sink", "sink_grad"]


@dataclass(frozen=True, eq=False)
class KeyWindow:
    """A sliding window by sample position: a query at position p sees keys at positions [p - left, p]."""

    left: int
    """Positions before the query that stay visible (Megatron ``window_size[0]``; HF ``sliding_window - 1``)."""
    q_pos: torch.Tensor
    """[Tq] int64: sample position of every query row."""
    k_pos: torch.Tensor
    """[Tk] int64: sample position of every key row (non-decreasing inside each key sequence)."""

    def __post_init__(self) -> None:
        if isinstance(self.left, bool) or not isinstance(self.left, int) or self.left < 0:
            raise ValueError(f"KeyWindow.left={self.left!r}: must be an integer >= 0")
        for name in ("q_pos", "k_pos"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point:
                raise ValueError(f"KeyWindow.{name}: expected a 1-D integer tensor of sample positions, got {t!r}")


def merge_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add one value-less logit ``sink`` [Hq] to the softmax of ``(out [T, Hq, Dv], lse [Hq, T])``.

    Returns ``(out' in out.dtype, lse' in lse.dtype)``; rows without keys (``lse = -inf``) get
    ``out' = 0`` and ``lse' = sink``.
    """
    s = sink.to(lse.dtype)[:, None]  # [Hq, 1]
    new = torch.logaddexp(lse, s)  # [Hq, T]
    weight = torch.exp(lse - new).t().unsqueeze(-1)  # [T, Hq, 1]; exp(-inf) = 0 for empty rows
    return (out.to(lse.dtype) * weight).to(out.dtype), new


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """[Hq] gradient of the sink logits from ``dout``/``out`` [T, Hq, Dv] and ``lse`` [Hq, T] after :func:`merge_sink`."""
    acc = lse.dtype
    drow = (dout.to(acc) * out.to(acc)).sum(-1).t()  # [Hq, T]  rowsum(dO ∘ O')
    p_sink = torch.exp(sink.to(acc)[:, None] - lse)  # [Hq, T]  the sink's probability
    return -(p_sink * drow).sum(-1).to(sink.dtype)  # [Hq]
