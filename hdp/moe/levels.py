"""Zero-memory levels of MoE layers (defined in the planner package, shared with the runtime)."""

from hdp.packing.moe_memory import ZeroMemoryLevel, layer_levels

__all__ = ["ZeroMemoryLevel", "layer_levels"]
