"""Activation memory of MoE layers by zero-memory level (defined in :mod:`hdp.packing.moe_memory`)."""

from hdp.packing.moe_memory import MOE_SHAPES, ActivationMemoryModel, MoEShape, token_budget_with_zero_memory

__all__ = ["MoEShape", "ActivationMemoryModel", "token_budget_with_zero_memory", "MOE_SHAPES"]
