"""What every rank of a job must share before an engine is built, agreed in one collective.

Both doors compare named fields across the job before they build anything that depends on them: the
library door its whole `hdp.trainer.config.EngineConfig` and the launcher's topology variables
(`hdp.core.planning.launcher_topology`: ``RAY_LOCAL_WORLD_SIZE``, ``LOCAL_WORLD_SIZE``), the verl door
the topology variables (its config is verl's).  `agree_fields` takes a ``{field: text}`` map: one
all-reduce (MAX of the map's digest and of its negation) over the job tells whether every rank holds
the same; only when they differ does every rank gather every rank's map (a diagnostic
``all_gather_object``, on every rank alike) and raise ``ValueError`` naming the first field that differs
and its value on each rank.  So a value bad on one rank only is named on every rank, instead of
breaking a later collective on its peers (gloo: "Connection closed by peer") or surfacing as a
plan mismatch; a value bad on every rank alike passes the agreement and is then refused by the same
pure check on every rank.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch
import torch.distributed as dist

from hdp.checksum import text_digest

__all__ = ["agree_fields", "Topic"]

Topic = tuple[str, str]
"""What a group of fields is (``"the EngineConfig"``) and how to mend a difference in it (a sentence)."""


def _topic(field: str, topics: Mapping[str, Topic]) -> Topic:
    """The topic of ``field``: the longest key of ``topics`` that is the field or a dotted prefix of it."""
    best = max((k for k in topics if field == k or field.startswith(k + ".")), key=len, default=None)
    return topics[best] if best is not None else ("the config", "every rank must pass the same")


def agree_fields(fields: Mapping[str, str], group: dist.ProcessGroup, device: torch.device, *, where: str,
                 topics: Mapping[str, Topic]) -> None:
    """One all-reduce over ``group`` comparing ``fields`` (``{name: text}``, in the order a difference is
    reported) across its ranks; when they differ, every rank gathers every rank's fields and raises
    ``ValueError``: ``"{where}: {what} differs across the job: {field}: {value} on world rank 0, {value} on
    world rank 1 (and n more field(s): ...); {fix}"``, where ``what`` and ``fix`` are the first differing
    field's `Topic` in ``topics`` (keyed by a field name or a dotted prefix of it)."""
    fields = dict(fields)
    digest = text_digest(json.dumps(fields))
    mine = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
    if int(mine[0]) == -int(mine[1]):
        return
    every: list[dict[str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, fields, group=group)
    names = list(dict.fromkeys(k for f in every if f for k in f))  # rank 0's order first
    differ = [k for k in names if len({(f or {}).get(k, "<missing>") for f in every}) > 1]
    first = differ[0] if differ else next(iter(fields), "the fields")
    ranks = dist.get_process_group_ranks(group)
    by_value: dict[str, list[int]] = {}
    for r, f in enumerate(every):
        by_value.setdefault((f or {}).get(first, "<missing>"), []).append(ranks[r])
    values = ", ".join(f"{v} on world rank{'s' if len(rs) > 1 else ''} {rs if len(rs) > 1 else rs[0]}"
                       for v, rs in by_value.items())
    more = f" (and {len(differ) - 1} more field(s): {', '.join(differ[1:4])}{', ...' if len(differ) > 4 else ''})" \
        if len(differ) > 1 else ""
    what, fix = _topic(first, topics)
    raise ValueError(f"{where}: {what} differs across the job: {first}: {values}{more}; {fix}")
