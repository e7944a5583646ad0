"""Public names that moved or were renamed: one table per config class, consulted in one place.

Every public config class derives from `MovedFields` and lists, in its `_MOVED` class variable, the
keyword arguments it no longer takes (``{old name: Moved}``).  Before the dataclass's ``__init__`` runs,
`MovedFields.__new__` looks each keyword up in the tables of the class and its bases, so old code gets
a ``TypeError`` naming the new name, where it lives now, the date and how to pass it -- not Python's
bare "unexpected keyword argument".  Reading an old attribute (``config.moe_zero_memory``) raises an
``AttributeError`` with the same pointer.  Each entry has a line in CHANGES.md; the command line's moved
flags use the same `Moved` records (``hdp.trainer.cli.common.MOVED_FLAGS``).

A config named by verl's YAML keys (``_FIELD_PREFIX`` with a dot: ``actor_rollout_ref.actor.hdp``) is
named by its keys in the message, every other one by its keyword call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["Moved", "MovedFields", "moved_fields", "moved_message"]


@dataclass(frozen=True)
class Moved:
    """Where an old public name went."""

    new: str
    """The new name: a field of the same class (``zero_memory``), ``Class.field`` when it moved to another
    class (``PlanningConfig.collective_timeout_s``), or a flag (``--zero-memory``)."""
    on: str
    """The date of the change (its CHANGES.md section)."""
    how: str = ""
    """How to pass it now when that is not obvious from ``new``
    (``EngineConfig(planning=PlanningConfig(collective_timeout_s=...))``)."""
    note: str = ""
    """What else changed with the name, a clause (``it takes a SearchBudget, 'default' or 'off'``)."""
    read: str = ""
    """Where to read the value now when it left the class (``EngineConfig.planning.collective_timeout_s``)."""


class MovedFields:
    """Base of the public config classes: refuses a moved keyword (or attribute) by naming its new place."""

    _MOVED: ClassVar[Mapping[str, Moved]] = {}
    """The keywords this class no longer takes, by old name (the bases' tables apply too)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            table = moved_fields(cls)
            old = [k for k in kwargs if k in table]
            if old:
                raise TypeError("; ".join(moved_message(cls, k, table[k]) for k in old))
        return super().__new__(cls)

    def __getattr__(self, name: str) -> Any:  # only for names the instance does not have
        moved = moved_fields(type(self)).get(name) if not name.startswith("__") else None
        if moved is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise AttributeError(moved_message(type(self), name, moved, read=True))


def moved_fields(cls: type) -> dict[str, Moved]:
    """The moved names of ``cls`` and its bases (a subclass's entry wins)."""
    out: dict[str, Moved] = {}
    for klass in reversed(cls.__mro__):
        out.update(klass.__dict__.get("_MOVED", {}))
    return out


def moved_message(cls: type, old: str, moved: Moved, *, read: bool = False) -> str:
    """``EngineConfig(moe_zero_memory=...) is now PlanningConfig(zero_memory=...) (renamed and moved on
    2026-12-04, see CHANGES.md): pass EngineConfig(planning=PlanningConfig(zero_memory=...))``; ``read``: the
    attribute was read (``config.moe_zero_memory``)."""
    name = cls.__name__
    prefix = getattr(cls, "_FIELD_PREFIX", name)
    other, _, field = moved.new.rpartition(".")
    what = ("renamed" if field != old else "") if not other else ("moved" if field == old else "renamed and moved")
    note = f"; {moved.note}" if moved.note else ""
    when = f"({what} on {moved.on}, see CHANGES.md{note})"
    if "." in prefix:  # a YAML key of verl's config
        return (f"{prefix}.{old} is now {prefix}.{field} {when}: set {prefix}.{field}"
                + (f" ({moved.how})" if moved.how else ""))
    new = f"{other or name}({field}=...)"
    how = moved.how or f"{name}({field}=...)"
    if read:
        return f"{name}.{old} is now {other or name}.{field} {when}: read {moved.read or f'{name}.{field}'}"
    return f"{name}({old}=...) is now {new} {when}: pass {how}"
