"""Mixture-of-experts memory savings: zero-memory recomputation of the expert path.

:class:`ZeroMemoryMoELayer` is Megatron-core's ``MoELayer`` (all-to-all dispatcher) whose expert path
frees its activations in forward and recomputes them in backward, with the re-dispatch all-to-all
hidden behind the fc1 input-gradient GEMM (MindSpeed ``--moe-zero-memory`` behaviour), on every
expert kind Megatron builds (:class:`ExpertKind`: ``SequentialMLP``, ``GroupedMLP``, ``TEGroupedMLP``)
with the expert GEMMs as one grouped GEMM (:mod:`hdp.kernels.grouped_gemm`).  Apply it
with :func:`apply_zero_memory` on a built model (the spec is Megatron's own: the layers are swapped in place).
:mod:`hdp.moe.budget` turns the memory saved into a larger planner token budget.

The levels and the budget model are pure (importable by the planner without torch or Megatron);
the layer, the metadata and the spec helpers load Megatron-core on first use.
"""

from typing import Any

from hdp.moe.budget import ActivationMemoryModel, MoEShape, token_budget_with_zero_memory
from hdp.moe.levels import ZeroMemoryLevel, layer_levels

__all__ = [
    "ZeroMemoryLevel",
    "layer_levels",
    "MoEShape",
    "ActivationMemoryModel",
    "token_budget_with_zero_memory",
    "ZeroMemoryMoELayer",
    "ZeroMemoryTrace",
    "ExpertKind",
    "apply_zero_memory",
    "DispatchMeta",
    "dispatch_meta",
    "permutation_indices",
]

_LAZY = {
    "ZeroMemoryMoELayer": "hdp.moe.zero_memory",
    "ZeroMemoryTrace": "hdp.moe.zero_memory",
    "ExpertKind": "hdp.moe.zero_memory",
    "apply_zero_memory": "hdp.moe.zero_memory",
    "DispatchMeta": "hdp.moe.metadata",
    "dispatch_meta": "hdp.moe.metadata",
    "permutation_indices": "hdp.moe.metadata",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hdp.moe' has no attribute {name!r}")
