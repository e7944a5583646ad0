"""The hdp training engine for any trainer, plus its command line and benchmarks.

    from hdp.trainer import Batch, EngineConfig, HdpEngine, ParallelConfig, PlanningConfig, nll_loss, spawn

The public names are imported lazily (PEP 562 ``__getattr__``): importing them pulls in
Megatron-core (about 5 s), which ``import hdp.trainer`` and the command line
(``hdp.trainer.cli``) must not pay.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hdp.trainer.config import EngineConfig, PlanningConfig
    from hdp.trainer.parallel import ParallelConfig
    from hdp.trainer.engine import Batch, HdpEngine, nll_loss
    from hdp.trainer.launch import spawn

__all__ = ["HdpEngine", "EngineConfig", "PlanningConfig", "ParallelConfig", "Batch", "nll_loss", "spawn"]

_WHERE = {
    "HdpEngine": "hdp.trainer.engine",
    "Batch": "hdp.trainer.engine",
    "nll_loss": "hdp.trainer.engine",
    "EngineConfig": "hdp.trainer.config",
    "PlanningConfig": "hdp.trainer.config",
    "ParallelConfig": "hdp.trainer.parallel",
    "spawn": "hdp.trainer.launch",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'hdp.trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
