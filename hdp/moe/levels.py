"""Zero-memory levels of MoE layers and their per-layer assignment (pure: no torch, no Megatron)."""

from __future__ import annotations

import enum

__all__ = ["ZeroMemoryLevel", "layer_levels"]


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
