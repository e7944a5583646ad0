"""How a public call of the library engine is described to its agreement: the call and its arguments as
every rank spells them (`describe_call`, `callable_name`), and the config fields `HdpEngine.build` agrees on
(`compared_fields`, `BUILD_TOPICS`).  Pure: nothing here communicates."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from hdp.core.agreement import Topic
from hdp.core.optim_state import CheckpointFormat
from hdp.core.planning import RANKS_PER_NODE_KEYS, TOPOLOGY_FIX
from hdp.trainer.config import EngineConfig

__all__ = ["callable_name", "check_path", "describe_call", "compared_fields", "BUILD_TOPICS"]


def _config_fields(obj: Any, prefix: str) -> dict[str, str]:
    """Dotted field -> ``repr`` of every leaf of a (nested) config dataclass, in declaration order."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out: dict[str, str] = {}
        for f in dataclasses.fields(obj):
            out.update(_config_fields(getattr(obj, f.name), f"{prefix}.{f.name}"))
        return out
    return {prefix: repr(obj)}


def compared_fields(config: EngineConfig) -> dict[str, str]:
    """The fields of ``config`` every rank of a job must share: all of them, the device by its kind only
    (``cuda:0`` on one rank and ``cuda:1`` on another is one job)."""
    fields = _config_fields(config, "EngineConfig")
    fields["EngineConfig.device"] = repr(str(config.device).split(":", 1)[0])
    return fields


BUILD_TOPICS: dict[str, Topic] = {
    "EngineConfig": ("the EngineConfig", "every rank must build the engine with the same config (nothing was built)"),
    **{key: ("the launcher's topology", f"{TOPOLOGY_FIX} (nothing was built)") for key in RANKS_PER_NODE_KEYS},
}
"""What differs and how to mend it, for the fields `HdpEngine.build` agrees on (`hdp.core.agreement`)."""


def callable_name(fn: Any) -> str:
    """A loss function's name as every rank of a job spells it (module and qualified name)."""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or type(fn).__module__}.{name}"


def check_path(path: Any, what: str) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what}(path={path!r}): pass the checkpoint directory as a str or os.PathLike")


def describe_call(name: str, step: int, **args: Any) -> str:
    """The description of a public call that its agreement compares across the job (``path`` as given)."""
    parts = [f"step={step}"]
    for key, value in args.items():
        if key == "path" and isinstance(value, (str, os.PathLike)):
            value = os.fspath(value)
        elif isinstance(value, CheckpointFormat):
            value = value.value
        parts.append(f"{key}={value!r}")
    return f"{name}({', '.join(parts)})"

