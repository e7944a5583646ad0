"""Where `hdp bench train`'s batches come from: a built-in workload, a lengths file, or a run's recorded lengths.

* **Recorded** (``hdp bench train --lengths hdp_calibration/actor.lengths.jsonl``): both doors write, beside
  their calibration records, one JSON line per training step (`hdp.core.planning.lengths_path`):
  ``{"step", "policy", "num_ranks", "max_tokens_per_rank", "lengths": [...], "checksum"}`` -- the samples'
  lengths in the order the step planned them, and that plan's checksum.  Naming the records file itself
  (``actor.jsonl``) reads the lengths file beside it.  The replay trains those batches in that order; planned
  with the recorded policy, domain, token budget and the run's cost model, each step's plan is the recorded
  one (the result's ``replay``: the checksums compared).
* **A lengths file** (text): one batch per line, the sample lengths as integers separated by spaces or
  commas; blank lines and lines starting with ``#`` are skipped.  A JSON file holding a list of lists of
  integers is read the same way.
* **A built-in workload** (`hdp.trainer.bench.train.TRAIN_WORKLOADS`): synthetic batches sized for the domain.

Every error is a ValueError naming ``--lengths``, the file, the line and the fix, raised before any rank starts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RecordedBatch", "read_batches", "MAX_LENGTHS_BYTES"]

MAX_LENGTHS_BYTES = 256 << 20
"""Largest lengths file read (a regular file: a FIFO or a device is refused before any read)."""

_FLAG = "--lengths"


@dataclass(frozen=True)
class RecordedBatch:
    """One batch to train: its sample lengths in order, and, when a run recorded it, how that run planned it."""

    lengths: tuple[int, ...]
    """Sample lengths, in the order planned."""
    step: int | None = None
    """The recording run's step index (None: a lengths file)."""
    policy: str | None = None
    """The policy the recording run planned it with."""
    num_ranks: int | None = None
    """The recording run's domain size N."""
    max_tokens_per_rank: int | None = None
    """The recording run's token budget B."""
    checksum: str | None = None
    """The recording run's plan checksum (`hdp.packing.Plan.checksum`)."""


def _source(path: Path) -> Path:
    """The lengths file of ``path``: itself, or -- a calibration records file with a lengths file beside it -- that."""
    from hdp.core.planning import lengths_path

    beside = lengths_path(path)
    if path.is_file() and not path.name.endswith(f".lengths{path.suffix}") and beside.is_file():
        return beside
    return path


def _lengths(values: Any, where: str) -> tuple[int, ...]:
    from hdp.packing.validate import MAX_LENGTH

    if not isinstance(values, list) or not values:
        raise ValueError(f"{where}: expected a non-empty list of sample lengths, got {str(values)[:60]!r}")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_LENGTH:
            raise ValueError(f"{where}: length {v!r} is not an integer in [1, {MAX_LENGTH}]")
    return tuple(values)


def _recorded(obj: Any, where: str) -> RecordedBatch:
    if isinstance(obj, dict) and "kind" in obj:
        raise ValueError(f"{where}: a calibration record ({obj['kind']!r}), not a step's lengths; the engines write "
                         "those beside their records, as <records>.lengths.jsonl (hdp.core.planning.lengths_path): "
                         "pass that file, or the records file of a run that wrote one")
    if not isinstance(obj, dict) or "lengths" not in obj:
        raise ValueError(f"{where}: expected an object with 'lengths' (a line hdp's engines write beside their "
                         "calibration records)")
    lengths = _lengths(obj["lengths"], f"{where}.lengths")
    ints = {}
    for key in ("step", "num_ranks", "max_tokens_per_rank"):
        v = obj.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"{where}.{key}={v!r}: expected an integer >= 0")
        ints[key] = v
    policy, checksum = obj.get("policy"), obj.get("checksum")
    for key, v in (("policy", policy), ("checksum", checksum)):
        if v is not None and not isinstance(v, str):
            raise ValueError(f"{where}.{key}={v!r}: expected a string")
    return RecordedBatch(lengths=lengths, policy=policy, checksum=checksum, **ints)


def read_batches(path: str | os.PathLike[str]) -> list[RecordedBatch]:
    """The batches of a lengths file or of a run's recorded lengths (see the module docstring), in order."""
    from hdp.packing.cost_file import read_bounded_text

    p = _source(Path(path))
    fix = ("pass a file of one batch per line (integers), or the .lengths.jsonl file hdp's engines write beside "
           "their calibration records (calibration_path)")
    text = read_bounded_text(p, MAX_LENGTHS_BYTES, _FLAG, fix)  # stat first: a FIFO is never opened
    stripped = text.lstrip()
    batches: list[RecordedBatch] = []
    if stripped.startswith("["):  # one JSON list of lists
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{_FLAG}={str(p)!r}: not valid JSON ({exc}); {fix}") from None
        if not isinstance(doc, list):
            raise ValueError(f"{_FLAG}={str(p)!r}: expected a list of batches; {fix}")
        batches = [RecordedBatch(lengths=_lengths(b, f"{p}[{i}]")) for i, b in enumerate(doc)]
    else:
        for lineno, line in enumerate(text.splitlines(), start=1):
            s = line.strip()
            if not s or s.startswith("#"):
                continue
            where = f"{_FLAG}={str(p)!r} line {lineno}"
            if s.startswith("{"):
                try:
                    obj = json.loads(s)
                except (ValueError, RecursionError) as exc:
                    raise ValueError(f"{where}: not valid JSON ({exc}); {fix}") from None
                batches.append(_recorded(obj, where))
                continue
            try:
                values = [int(tok) for tok in s.replace(",", " ").split()]
            except ValueError:
                raise ValueError(f"{where}: {s[:60]!r} is not a list of integers; {fix}") from None
            batches.append(RecordedBatch(lengths=_lengths(values, where)))
    if not batches:
        raise ValueError(f"{_FLAG}={str(p)!r}: holds no batch; {fix}")
    return batches
