"""Calibration records: the measurements `hdp.packing.calibrate` fits the cost model to, their schema
and their checks.

Record schema (one JSON object per line of a ``.jsonl`` file):

* **group** record (``"kind": "group"``, the default when ``kind`` is absent)::

      {"kind": "group", "lengths": [L1, L2, ...], "group_size": k, "seconds": t}

  ``lengths`` are the samples one group of ``k`` ranks ran packed in one round (forward +
  backward), ``t`` the measured time of the slowest rank of that group for that work, without
  the fixed per-round cost.  k = 1 records fix a (linear coefficient) and the unit time; k >= 2
  records of at least two group sizes fix the ring-attention terms.  Optional ``"nodes": m``
  (default 1): the nodes the group's ranks spanned; records with m >= 2 fit the inter-node link
  (`hdp.packing.calibrate_nodes`), the others everything else.

* **round** record::

      {"kind": "round", "seconds": t, "groups": [{"lengths": [...], "group_size": k}, ...]}

  the wall time of one whole round in which the listed groups ran side by side; ``t - max over
  groups of the group time`` is the per-round cost beta.

* **memory** record (the per-rank memory model, `hdp.packing.memory.fit_memory`; the cost fit
  ignores them)::

      {"kind": "memory", "features": [activation, expert, cp, logits], "static_bytes": S,
       "peak_bytes": M, "tokens": T, "group_size": k, "stage": s, "window_tokens": W,
       "step": i, "round": r, "rank": j}

  one rank's measured peak ``M`` bytes in one round (``S`` of them static), the analytic bytes of each
  fitted term (`hdp.packing.memory.memory_features`), its local tokens, group size, pipeline stage
  and the local tokens of the rounds in flight with it; ``step``/``round``/``rank`` are optional.

Any record may carry ``"weight"``: how much it counts in the fit, a number > 0 (default 1; the
engine's self-calibration gives older rounds less, so the fit follows a machine that drifts).
Other extra keys (``"note"``, ``"rank"``, ...) are ignored.  Lengths are
integers in [1, `MAX_LENGTH`], group sizes in [1, `MAX_GROUP_SIZE`], seconds in
[`MIN_SECONDS`, `MAX_SECONDS`] (a time below a nanosecond is not a measurement, and such values
break the linear algebra).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from hdp.packing.memory import _FEATURES as _MEMORY_FEATURES  # one list of the memory model's fitted terms
from hdp.packing.validate import MAX_LENGTH

__all__ = [
    "load_records", "validate_record", "group_fields", "group_nodes", "record_weight", "MEMORY_FEATURES", "MAX_LENGTH",
    "MAX_GROUP_SIZE", "MIN_SECONDS", "MAX_SECONDS", "MAX_WEIGHT", "MAX_RECORDS_BYTES",
]

MAX_GROUP_SIZE = 1 << 20
"""Largest group size a record may hold."""
MAX_WEIGHT = 1e6
"""Largest weight a record may carry."""
MIN_SECONDS = 1e-9
"""Smallest measured time a record may hold (seconds)."""
MAX_SECONDS = 1e7
"""Largest measured time a record may hold (seconds, ~116 days)."""


def group_fields(rec: Mapping[str, Any], where: str) -> tuple[np.ndarray, int]:
    """(lengths, group size) of a group record (or a round record's group); ValueError naming the field."""
    lengths = rec.get("lengths")
    if not isinstance(lengths, (list, tuple)) or not lengths:
        raise ValueError(
            f"{where}.lengths: expected a non-empty list of sample lengths, got {lengths!r}; "
            "a record holds the lengths of the samples one group ran in one round"
        )
    for x in lengths:
        if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= MAX_LENGTH:
            raise ValueError(
                f"{where}.lengths: every length must be an integer in [1, {MAX_LENGTH}], got {x!r}"
            )
    k = rec.get("group_size")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_GROUP_SIZE:
        raise ValueError(
            f"{where}.group_size: expected the number of ranks of the group, an integer in "
            f"[1, {MAX_GROUP_SIZE}], got {k!r}"
        )
    return np.asarray(lengths, dtype=np.int64), k


def group_nodes(rec: Mapping[str, Any], where: str) -> int:
    """The nodes a group record's (or a round record's group's) ranks spanned, 1 when it does not
    say; ValueError naming the field."""
    m = rec.get("nodes", 1)
    k = rec.get("group_size")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1 or (isinstance(k, int) and m > k):
        raise ValueError(f"{where}.nodes={m!r}: the nodes the group's ranks spanned, an integer in [1, group_size]; "
                         "leave it out for 1 (a group inside one node)")
    return m


def _seconds(rec: Mapping[str, Any], where: str) -> float:
    """A record's measured seconds; ValueError naming the field."""
    t = rec.get("seconds")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not np.isfinite(t) or t <= 0:
        raise ValueError(f"{where}.seconds: expected a measured time > 0 in seconds, got {t!r}")
    if not MIN_SECONDS <= t <= MAX_SECONDS:
        raise ValueError(
            f"{where}.seconds={t!r}: outside [{MIN_SECONDS:g}, {MAX_SECONDS:g}] seconds; record times in "
            "seconds (not ms or us), measured, not derived"
        )
    return float(t)


def record_weight(rec: Mapping[str, Any], where: str) -> float:
    """A record's weight in the fit (1 when it carries none); ValueError naming the field."""
    w = rec.get("weight", 1.0)
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not np.isfinite(w) or not 0 < w <= MAX_WEIGHT:
        raise ValueError(
            f"{where}.weight={w!r}: pass a number in (0, {MAX_WEIGHT:g}] (how much the record counts in the "
            "fit; leave it out for 1)"
        )
    return float(w)


MEMORY_FEATURES: tuple[str, ...] = _MEMORY_FEATURES
"""The terms of a memory record's ``features``, in order (`hdp.packing.memory.memory_features`)."""


def _number(rec: Mapping[str, Any], name: str, where: str, what: str, *, integer: bool = False,
            optional: bool = False) -> None:
    """``rec[name]`` must be a finite number >= 0 (an integer with ``integer``); ValueError naming it."""
    if optional and name not in rec:
        return
    v = rec.get(name)
    ok = not isinstance(v, bool) and (isinstance(v, int) if integer else isinstance(v, (int, float)))
    if not ok or not np.isfinite(v) or v < 0:
        raise ValueError(f"{where}.{name}={v!r}: expected {what}, {'an integer' if integer else 'a number'} >= 0")


def _memory_fields(rec: Mapping[str, Any], where: str) -> None:
    """Check a ``"kind": "memory"`` record (see the module docstring)."""
    f = rec.get("features")
    if (not isinstance(f, (list, tuple)) or len(f) != len(MEMORY_FEATURES)
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not np.isfinite(x) or x < 0 for x in f)):
        raise ValueError(f"{where}.features={f!r}: expected the bytes of the {len(MEMORY_FEATURES)} terms "
                         f"[{', '.join(MEMORY_FEATURES)}], finite numbers >= 0 (hdp.packing.memory.memory_features)")
    _number(rec, "static_bytes", where, "the rank's static bytes (parameters, gradients, optimizer shard)")
    _number(rec, "peak_bytes", where, "the measured peak bytes of the rank in the round")
    if not rec["peak_bytes"] > rec["static_bytes"]:
        raise ValueError(f"{where}.peak_bytes={rec['peak_bytes']!r}: must exceed static_bytes={rec['static_bytes']!r} "
                         "(the peak includes the static part)")
    _number(rec, "tokens", where, "the rank's local tokens in the round")
    _number(rec, "window_tokens", where, "the local tokens of the rounds in flight with it")
    _number(rec, "stage", where, "the pipeline stage", integer=True)
    k = rec.get("group_size")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_GROUP_SIZE:
        raise ValueError(f"{where}.group_size={k!r}: expected the size of the rank's group, an integer in "
                         f"[1, {MAX_GROUP_SIZE}]")
    for name in ("step", "round", "rank"):
        _number(rec, name, where, f"the {name} index", integer=True, optional=True)


def validate_record(rec: Any, where: str = "record") -> dict[str, Any]:
    """Check one record against the schema; return it normalised (``kind`` filled in)."""
    if not isinstance(rec, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    kind = rec.get("kind", "group")
    if kind == "memory":
        _memory_fields(rec, where)
        record_weight(rec, where)
        return {**rec, "kind": kind}
    if kind == "group":
        group_fields(rec, where)
        group_nodes(rec, where)
    elif kind == "round":
        groups = rec.get("groups")
        if not isinstance(groups, list) or not groups:
            raise ValueError(f"{where}.groups: a round record needs a non-empty list of groups")
        for i, g in enumerate(groups):
            if not isinstance(g, Mapping):
                raise ValueError(f"{where}.groups[{i}]: expected an object with lengths and group_size")
            group_fields(g, f"{where}.groups[{i}]")
            group_nodes(g, f"{where}.groups[{i}]")
    else:
        raise ValueError(f"{where}.kind={kind!r} is unknown; use 'group', 'round' or 'memory'")
    _seconds(rec, where)
    record_weight(rec, where)
    return {**rec, "kind": kind}


MAX_RECORDS_BYTES = 2 << 30
"""Largest records file read (a regular file: ``/dev/zero`` or a directory is refused before any read;
10^6 records of ~200 bytes are ~200 MB)."""


def load_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read and validate JSON-lines records (a regular file of at most `MAX_RECORDS_BYTES`); errors name
    the file and line."""
    from hdp.packing.cost_file import read_bounded_text

    p = Path(path)
    text = read_bounded_text(p, MAX_RECORDS_BYTES, "records file",
                             "pass the JSON-lines records written by the engine (EngineConfig.calibration_path)")
    out: list[dict[str, Any]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{p}:{lineno}"
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
            raise ValueError(f"{where}: not valid JSON ({msg}): {line.strip()[:80]!r}") from exc
        out.append(validate_record(rec, where))
    if not out:
        raise ValueError(f"records file {str(p)!r}: holds no records; write one JSON object per line")
    return out
