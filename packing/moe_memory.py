"""MoE zero-memory levels and the activation memory of MoE layers (pure, no torch): the planner's memory
model (`hdp.packing.memory`) and the runtime (`hdp.moe`) share them.

The planner's per-rank token budget B exists because activation memory is linear in tokens:
``memory = B · bytes_per_token``.  Zero-memory recomputation lowers ``bytes_per_token``, so the same
memory holds more tokens:  ``B' = floor(B · bytes_per_token(base) / bytes_per_token(level))``.
A larger B lets a long sample run on fewer ranks (k ≥ ceil(L / B)), e.g. CP8 -> CP4.

Bytes one token leaves saved for backward in one MoE transformer layer (b bytes per element,
k = topk rows per token, H hidden, F expert FFN width, F1 = 2F for gated units (SwiGLU) else F;
counted from what autograd saves on Megatron's non-fused local path, checked against
``python -m benchmarks moe``):

* expert path, ``none``:  k · b · (H + F1 + F_act + 2F) + k · (4 + 8)
    H: dispatched fc1 input; F1: fc1 output; F_act: activation internals (SwiGLU: silu(h_a) and
    h_b + offset, 2F; plain activations: 0); 2F: activation output (for the probs product) and the
    fc2 input; 4 + 8: the fp32 prob and the int64 permutation index of each row.
* ``level0``: k · b · F1 + k · (4 + 8)           (fc1 output, probs, indices)
* ``level1``: k · (4 + 8)                         (pre-dispatch probs, indices)
* ``full_recompute`` (Megatron ``recompute_modules=['moe']``): 0 (only the layer input, which is
  counted in ``other_bytes_per_token``).
* everything else of the layer (attention, norms, router, residuals): ``other_bytes_per_token``,
  default ``10 · H · b`` — a rough figure for a flash-attention layer; measure and override.

Example (Qwen3-235B-A22B-like: H = 4096, F = 1536, SwiGLU, k = 8, bf16):
``none`` 295,008 B/token/layer, ``level0`` 131,168, ``level1`` 82,016, so a budget of
B = 16,384 tokens becomes 36,849 (level0) or 58,932 (level1) in the same memory: a 128K-token
sample needs CP8 at B = 16K but only CP4 with level0.  In the planner (same memory, B = 8,192
-> 18,424 with level0)::

    B=$(python -c "from hdp.moe import *; print(token_budget_with_zero_memory(8192, 'level0',
        MoEShape(hidden_size=4096, moe_ffn_hidden_size=1536, topk=8)))")
    hdp simulate --workload rl-32k --samples 512 --ranks 64 -B 8192 --policies hdp,static-cp
    hdp simulate --workload rl-32k --samples 512 --ranks 64 -B $B --policies hdp,static-cp

static-cp goes from CP8 (11 rounds) to CP2 (5 rounds); hdp from 13 rounds to 5.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


__all__ = ["ZeroMemoryLevel", "layer_levels", "MoEShape", "ActivationMemoryModel", "token_budget_with_zero_memory",
           "MOE_SHAPES"]

class ZeroMemoryLevel(enum.Enum):
    """How much of the expert path's activations a MoE layer frees in forward."""

    NONE = "none"
    """Plain Megatron MoE layer (saves every activation autograd wants)."""
    LEVEL0 = "level0"
    """Free the dispatched expert input and the activation output; keep the fc1 output."""
    LEVEL1 = "level1"
    """Also free the fc1 output and the dispatched probs; re-dispatch and recompute fc1 in backward."""

    @classmethod
    def parse(cls, value: "ZeroMemoryLevel | str") -> "ZeroMemoryLevel":
        """The level named ``value`` (an enum member or its string value)."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError as exc:
            raise ValueError(
                f"zero-memory level {value!r}: choose one of {[m.value for m in cls]}"
            ) from exc


def layer_levels(
    level: ZeroMemoryLevel | str, num_moe_layers: int, first_n_layers: int | None = None
) -> list[ZeroMemoryLevel]:
    """Per-MoE-layer levels of one pipeline stage, in layer order.

    ``first_n_layers`` (only meaningful with ``level1``): the first n MoE layers use ``level1`` and
    the rest ``level0`` (MindSpeed's ``--moe-zero-memory-num-layers``); ``None``: all use ``level``.
    """
    level = ZeroMemoryLevel.parse(level)
    if first_n_layers is None:
        return [level] * num_moe_layers
    if first_n_layers < 0:
        raise ValueError(f"first_n_layers={first_n_layers}: must be >= 0 (or None for all layers)")
    if level is not ZeroMemoryLevel.LEVEL1:
        raise ValueError(
            f"first_n_layers={first_n_layers} with level={level.value!r}: only level1 can be limited to "
            "the first n layers (the others then use level0); drop first_n_layers"
        )
    return [ZeroMemoryLevel.LEVEL1 if i < first_n_layers else ZeroMemoryLevel.LEVEL0 for i in range(num_moe_layers)]


_PROB_BYTES = 4  # fp32 router prob per routed row
_INDEX_BYTES = 8  # int64 permutation index per routed row


@dataclass(frozen=True, kw_only=True)
class MoEShape:
    """Shape of the MoE transformer layers that matter for activation memory."""

    hidden_size: int
    """H: model width."""
    moe_ffn_hidden_size: int
    """F: expert FFN width."""
    topk: int
    """k: experts each token is routed to."""
    gated: bool = True
    """Gated expert MLP (SwiGLU): fc1 is 2F wide."""
    bytes_per_element: int = 2
    """b: activation element size (2 for bf16)."""
    other_bytes_per_token: int | None = None
    """Non-expert activation bytes per token and layer; ``None``: 10 · H · b (rough)."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "moe_ffn_hidden_size", "topk", "bytes_per_element"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEShape.{name}={getattr(self, name)}: must be >= 1")
        if self.other_bytes_per_token is not None and self.other_bytes_per_token < 0:
            raise ValueError(f"MoEShape.other_bytes_per_token={self.other_bytes_per_token}: must be >= 0")


@dataclass(frozen=True)
class ActivationMemoryModel:
    """Saved-activation bytes per token of one MoE transformer layer, by zero-memory level."""

    shape: MoEShape
    """The layer shape."""

    def expert_bytes_per_token(self, level: ZeroMemoryLevel | str | None) -> int:
        """Bytes the expert path saves per token; ``level=None`` means Megatron's full ``moe`` recompute."""
        s = self.shape
        k, b, h, f = s.topk, s.bytes_per_element, s.hidden_size, s.moe_ffn_hidden_size
        f1 = 2 * f if s.gated else f
        f_act = 2 * f if s.gated else 0
        per_row_small = _PROB_BYTES + _INDEX_BYTES
        if level is None:
            return 0
        level = ZeroMemoryLevel.parse(level)
        if level is ZeroMemoryLevel.NONE:
            return k * b * (h + f1 + f_act + 2 * f) + k * per_row_small
        if level is ZeroMemoryLevel.LEVEL0:
            return k * b * f1 + k * per_row_small
        return k * per_row_small

    def other_bytes_per_token(self) -> int:
        """Non-expert bytes per token (attention, norms, router, residuals)."""
        s = self.shape
        if s.other_bytes_per_token is not None:
            return s.other_bytes_per_token
        return 10 * s.hidden_size * s.bytes_per_element

    def bytes_per_token(self, level: ZeroMemoryLevel | str | None) -> int:
        """Bytes per token of the whole layer (``None``: full ``moe`` recompute)."""
        return self.other_bytes_per_token() + self.expert_bytes_per_token(level)


def token_budget_with_zero_memory(
    base_budget: int,
    level: ZeroMemoryLevel | str,
    shape: MoEShape,
    *,
    base_level: ZeroMemoryLevel | str = ZeroMemoryLevel.NONE,
) -> int:
    """Token budget B' that fits in the memory ``base_budget`` tokens used at ``base_level``.

    ``base_budget`` is the planner's ``max_tokens_per_rank`` measured (or configured) for a run
    without zero-memory (``base_level``); the result is the budget to plan with at ``level``:
    ``floor(B · bytes_per_token(base_level) / bytes_per_token(level))``.  Never below ``base_budget``
    when ``level`` frees at least as much as ``base_level``.
    """
    if base_budget < 1:
        raise ValueError(f"base_budget={base_budget}: must be >= 1 token")
    model = ActivationMemoryModel(shape)
    return int(math.floor(base_budget * model.bytes_per_token(base_level) / model.bytes_per_token(level)))


MOE_SHAPES: dict[str, MoEShape] = {
    "qwen3-235b-a22b": MoEShape(hidden_size=4096, moe_ffn_hidden_size=1536, topk=8),
    "deepseek-v3": MoEShape(hidden_size=7168, moe_ffn_hidden_size=2048, topk=8),
}
"""MoE layer shapes of public models (config.json of each), for `token_budget_with_zero_memory`."""
