"""The cost-model file: a `CostModel` on disk (JSON), as ``hdp calibrate --out`` writes it.

Layout (``"format"`` and ``"version"`` are checked on load; every other key is documentation)::

    {
      "format": "hdp-cost-model",
      "version": 1,
      "parameters": {"linear_coef": ..., "round_cost": ..., ..., "unit_time_s": ...},
      "fitted": ["unit_time_s", "linear_coef", ...],      # parameters fitted from records
      "from_base": ["round_cost", ...],                   # parameters kept from the base model
      "base": "deepseek-v3@h100-nvlink",                  # the base preset (or null)
      "fit": {"r2": ..., "median_rel_err": ..., "n_records": ..., ...}   # fit quality (or null)
    }

``parameters`` must hold exactly the fields of `CostModel` (all in token² units except
``unit_time_s``, seconds per unit); a missing or unknown field is an error naming it, as is a file
of another format or version.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from hdp.packing.cost import CostModel

__all__ = ["FORMAT", "VERSION", "save_cost_model", "load_cost_model", "read_cost_file", "resolve_cost"]

FORMAT = "hdp-cost-model"
"""Value of the ``format`` key of a cost-model file."""
VERSION = 1
"""Version of the layout written by this hdp; a file of another version is rejected."""


def save_cost_model(cost: CostModel, path: str | os.PathLike[str], *, metadata: Mapping[str, Any] | None = None) -> Path:
    """Write ``cost`` to ``path`` as a cost-model file; ``metadata`` adds ``fitted``/``from_base``/``base``/``fit``."""
    if not isinstance(cost, CostModel):
        raise TypeError(f"cost is {type(cost).__name__}; pass a hdp.packing.CostModel")
    meta = dict(metadata or {})
    clash = {"format", "version", "parameters"} & set(meta)
    if clash:
        raise ValueError(f"metadata may not set {sorted(clash)}: they describe the file itself")
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "parameters": {f.name: float(getattr(cost, f.name)) for f in dataclasses.fields(CostModel)},
        "fitted": [],
        "from_base": [],
        "base": None,
        "fit": None,
        **meta,
    }
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"cost-model file {str(out)!r} is a directory; pass a file path such as cost.json")
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, out)  # never a half-written file under the final name
    return out


def read_cost_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The whole checked document of a cost-model file (parameters and metadata)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"cost-model file {str(p)!r}: cannot read it ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"cost-model file {str(p)!r}: not a text file; pass the JSON written by hdp calibrate --out") from exc
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"cost-model file {str(p)!r}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(
            f"cost-model file {str(p)!r}: format={got!r}, expected {FORMAT!r}; write it with "
            "`hdp calibrate --records R.jsonl --out COST.json` or CostModel.save"
        )
    if doc.get("version") != VERSION:
        raise ValueError(
            f"cost-model file {str(p)!r}: version={doc.get('version')!r}, this hdp reads version {VERSION}; "
            "re-run hdp calibrate with this hdp to rewrite it"
        )
    params = doc.get("parameters")
    if not isinstance(params, dict):
        raise ValueError(f"cost-model file {str(p)!r}: 'parameters' must be an object of CostModel fields")
    names = [f.name for f in dataclasses.fields(CostModel)]
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(
            f"cost-model file {str(p)!r}: parameters {missing} are missing; a cost-model file holds every "
            f"CostModel field ({', '.join(names)}); re-run hdp calibrate to rewrite it"
        )
    unknown = sorted(set(params) - set(names))
    if unknown:
        raise ValueError(
            f"cost-model file {str(p)!r}: unknown parameters {unknown} (this hdp's CostModel has {', '.join(names)}); "
            "was it written by another hdp version?"
        )
    for n in names:
        v = params[n]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"cost-model file {str(p)!r}: parameters.{n}={v!r} must be a finite number")
    try:
        CostModel(**{n: float(params[n]) for n in names})
    except ValueError as exc:
        raise ValueError(f"cost-model file {str(p)!r}: {exc}") from exc
    return doc


def load_cost_model(path: str | os.PathLike[str]) -> CostModel:
    """The `CostModel` stored in a cost-model file (ValueError naming the file and the field on bad input)."""
    params = read_cost_file(path)["parameters"]
    return CostModel(**{f.name: float(params[f.name]) for f in dataclasses.fields(CostModel)})


def resolve_cost(value: object, field_name: str) -> CostModel:
    """A `CostModel` from a `CostModel` or the path of a cost-model file; errors name ``field_name``."""
    if isinstance(value, CostModel):
        return value
    if isinstance(value, (str, os.PathLike)) and str(value):
        try:
            return load_cost_model(value)
        except ValueError as exc:
            raise ValueError(f"{field_name}: {exc}") from exc
    raise ValueError(
        f"{field_name}={value!r}: pass a hdp.packing.CostModel or the path of a cost-model file "
        "(hdp calibrate --records R.jsonl --out COST.json)"
    )
