"""The cost-model file: a `CostModel` on disk (JSON), as ``hdp calibrate --out`` writes it.

Layout (``format`` and ``version`` are checked on load, ``parameters`` is the model; every other
key documents where the numbers come from)::

    {
      "format": "hdp-cost-model",
      "version": 3,
      "parameters": {                  # every CostModel field (hdp.packing.cost.PARAMETERS)
        "linear_coef": ...,            #   a, dimensionless
        "round_cost": ...,             #   beta, units per round
        "step_overhead": ...,          #   fixed cost per ring step, units
        "step_latency": ...,           #   K/V transfer latency per ring step (hideable), units
        "comm_per_token": ...,         #   K/V transfer per token per ring step (hideable), units
        "merge_per_token": ...,        #   per-token work per ring step after the first, units
        "cp_per_token": ...,           #   per-token work of a split sample (k >= 2), units
        "node_step_latency": ...,      #   the inter-node link's latency per ring step (a ring crossing nodes), units
        "node_comm_per_token": ...,    #   the inter-node link's transfer per token per ring step, units
        "unit_time_s": ...             #   seconds per unit
      },
      "fitted": ["unit_time_s", ...],  # parameters fitted from measured records
      "from_base": ["cp_per_token"],   # parameters kept from the base model
      "base": "dense-8b@h100-nvlink",  # the base preset ("model@profile"), or null
      "fit": {                         # fit quality, or null for a model not fitted
        "r2": ...,                     #   coefficient of determination over all records
        "median_rel_err": ...,         #   median |predicted - measured| / measured
        "rel_err_p90": ..., "max_rel_err": ...,
        "n_records": ..., "n_group_records": ..., "n_round_records": ...,
        "reasons": {"cp_per_token": "..."},   # why each from_base parameter was not fitted
        "warnings": [...]              #   e.g. too few records, a poor fit
      },
      "memory": {                      # optional: the per-rank memory model's fit (hdp.packing.memory)
        "coefficients": {              #   MemoryCoefficients: multipliers of the analytic terms
          "activation": ..., "expert": ..., "cp": ..., "logits": ...,   # dimensionless (1: as written)
          "headroom_bytes": ...        #   bytes added to every peak
        },
        "fit": {"median_rel_err": ..., "max_rel_err": ..., "n_records": ...}   # or null
      }
    }

Units are the token² units of `hdp.packing.cost` (one unit: ``6 * n_layers * d_attn`` FLOPs of
attention).  ``parameters`` must hold exactly the fields of `CostModel`; a missing or unknown field
is an error naming it, as is a file of another format or version.  Version 1 files (written before
the per-token ring terms existed) are read with ``merge_per_token = cp_per_token = 0``, which is
exactly the model they describe; version 1 and 2 files (written before the inter-node link existed)
with ``node_step_latency = node_comm_per_token = 0``: no slower link, the one-level model they describe.  The ``memory`` section is optional (absent or null: no fitted
memory model; `load_memory_coefficients` returns None); when present it is checked on load like
``parameters``: exactly the five coefficients, each a finite number >= 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from hdp.packing.cost import CostModel
from hdp.packing.memory import MemoryCoefficients

__all__ = ["FORMAT", "VERSION", "METADATA_KEYS", "cost_document", "save_cost_model", "load_cost_model", "read_cost_file",
           "resolve_cost", "AUTO", "memory_section", "load_memory_coefficients"]

FORMAT = "hdp-cost-model"
"""Value of the ``format`` key of a cost-model file."""
VERSION = 3
"""Version of the layout written by this hdp; a file of another version is rejected (versions 1 and 2 are read)."""
_ADDED_IN_2 = {"merge_per_token": 0.0, "cp_per_token": 0.0}
"""Parameters version 1 files lack, and the value that reproduces the model they describe."""
_ADDED_IN_3 = {"node_step_latency": 0.0, "node_comm_per_token": 0.0}
"""Parameters version 1 and 2 files lack (the inter-node link), and the value that reproduces their model."""


METADATA_KEYS = ("fitted", "from_base", "base", "fit")
"""Keys besides format/version/parameters (documentation of where the numbers come from)."""


def _finite_or_none(value: Any) -> Any:
    """``value`` with NaN/inf numbers (nested) replaced by None: JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    return value


MAX_FILE_BYTES = 1 << 20
"""Largest cost-model file read (a real one is ~2 KB)."""


def read_bounded_text(path: Path, limit: int, what: str, fix: str) -> str:
    """The text of regular file ``path`` of at most ``limit`` bytes; ValueError naming ``what`` otherwise
    (a device like /dev/zero, a directory, a huge file, binary data)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise ValueError(f"{what} {str(path)!r}: cannot read it ({exc.strerror or exc})") from exc
    import stat as stat_module

    if not stat_module.S_ISREG(st.st_mode):
        raise ValueError(f"{what} {str(path)!r} is not a regular file (a directory or a device); {fix}")
    if st.st_size > limit:
        raise ValueError(f"{what} {str(path)!r} has {st.st_size} bytes, more than the {limit} a {what} may have; {fix}")
    try:
        with path.open("rb") as fh:
            raw = fh.read(limit + 1)
    except OSError as exc:
        raise ValueError(f"{what} {str(path)!r}: cannot read it ({exc.strerror or exc})") from exc
    if len(raw) > limit:
        raise ValueError(f"{what} {str(path)!r} grew past {limit} bytes while read; {fix}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{what} {str(path)!r}: not a text file; {fix}") from None


def memory_section(coef: MemoryCoefficients, fit: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``memory`` section of a cost-model file: the coefficients and the fit quality (NaN -> null)."""
    if not isinstance(coef, MemoryCoefficients):
        raise TypeError(f"memory coefficients are {type(coef).__name__}; pass a hdp.packing.memory.MemoryCoefficients")
    return {"coefficients": coef.to_dict(), "fit": None if fit is None else _finite_or_none(dict(fit))}


def cost_document(cost: CostModel, *, metadata: Mapping[str, Any] | None = None,
                  memory: MemoryCoefficients | None = None, memory_fit: Mapping[str, Any] | None = None
                  ) -> dict[str, Any]:
    """The JSON document of a cost-model file for ``cost`` (what `save_cost_model` writes).

    ``metadata`` may set ``fitted``, ``from_base``, ``base`` and ``fit`` (`METADATA_KEYS`); NaN
    and infinite numbers in it become null.  ``memory`` (with its ``memory_fit`` quality) adds the
    optional ``memory`` section.
    """
    if not isinstance(cost, CostModel):
        raise TypeError(f"cost is {type(cost).__name__}; pass a hdp.packing.CostModel")
    meta = dict(metadata or {})
    clash = {"format", "version", "parameters"} & set(meta)
    if clash:
        raise ValueError(f"metadata may not set {sorted(clash)}: they describe the file itself")
    unknown = sorted(set(meta) - set(METADATA_KEYS))
    if unknown:
        raise ValueError(f"metadata keys {unknown} are not part of the file; use {', '.join(METADATA_KEYS)}")
    return {
        "format": FORMAT,
        "version": VERSION,
        "parameters": {f.name: float(getattr(cost, f.name)) for f in dataclasses.fields(CostModel)},
        "fitted": [],
        "from_base": [],
        "base": None,
        "fit": None,
        **{k: _finite_or_none(v) for k, v in meta.items()},
        **({"memory": memory_section(memory, memory_fit)} if memory is not None else {}),
    }


def save_cost_model(cost: CostModel, path: str | os.PathLike[str], *, metadata: Mapping[str, Any] | None = None,
                    memory: MemoryCoefficients | None = None, memory_fit: Mapping[str, Any] | None = None) -> Path:
    """Write ``cost`` to ``path`` as a cost-model file; ``metadata`` adds ``fitted``/``from_base``/``base``/``fit``,
    ``memory`` (and ``memory_fit``) the memory section."""
    doc = cost_document(cost, metadata=metadata, memory=memory, memory_fit=memory_fit)
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
    text = read_bounded_text(p, MAX_FILE_BYTES, "cost-model file", "pass the JSON written by hdp calibrate --out")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"cost-model file {str(p)!r}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    except RecursionError:
        raise ValueError(f"cost-model file {str(p)!r}: JSON nested too deeply to be a cost-model file; pass the JSON "
                         "written by hdp calibrate --out") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(
            f"cost-model file {str(p)!r}: format={got!r}, expected {FORMAT!r}; write it with "
            "`hdp calibrate --records R.jsonl --out COST.json` or CostModel.save"
        )
    version = doc.get("version")
    if isinstance(version, bool) or version not in (1, 2, VERSION):
        raise ValueError(
            f"cost-model file {str(p)!r}: version={version!r}, this hdp reads versions 1 to {VERSION}; "
            "re-run hdp calibrate with this hdp to rewrite it"
        )
    params = doc.get("parameters")
    if not isinstance(params, dict):
        raise ValueError(f"cost-model file {str(p)!r}: 'parameters' must be an object of CostModel fields")
    if version in (1, 2):
        params = {**(_ADDED_IN_2 if version == 1 else {}), **_ADDED_IN_3, **params}
        doc = {**doc, "parameters": params, "version": VERSION}
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
    _check_memory_section(doc.get("memory"), p)
    return doc


def _check_memory_section(section: Any, p: Path) -> MemoryCoefficients | None:
    """The coefficients of a ``memory`` section (None when absent); ValueError naming the file and field."""
    if section is None:
        return None
    where = f"cost-model file {str(p)!r}: memory"
    if not isinstance(section, dict):
        raise ValueError(f"{where} must be an object {{'coefficients': {{...}}, 'fit': ...}} or null, got "
                         f"{type(section).__name__}; re-run hdp calibrate to rewrite it")
    unknown = sorted(set(section) - {"coefficients", "fit"})
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; the section holds 'coefficients' and 'fit'")
    fit = section.get("fit")
    if fit is not None and not isinstance(fit, dict):
        raise ValueError(f"{where}.fit must be an object or null, got {type(fit).__name__}")
    return MemoryCoefficients.from_dict(section.get("coefficients"), f"{where}.coefficients")


def load_memory_coefficients(path: str | os.PathLike[str]) -> MemoryCoefficients | None:
    """The `MemoryCoefficients` of a cost-model file's ``memory`` section, or None when it has none
    (ValueError naming the file and the field on bad input)."""
    doc = read_cost_file(path)
    return _check_memory_section(doc.get("memory"), Path(path))


def load_cost_model(path: str | os.PathLike[str]) -> CostModel:
    """The `CostModel` stored in a cost-model file (ValueError naming the file and the field on bad input)."""
    params = read_cost_file(path)["parameters"]
    return CostModel(**{f.name: float(params[f.name]) for f in dataclasses.fields(CostModel)})


AUTO = "auto"
"""`resolve_cost` spec: the engine's own model shape on its device's hardware profile."""


def resolve_cost(value: object, field_name: str, *, auto: "Callable[[], CostModel] | None" = None) -> CostModel:
    """The `CostModel` a ``cost_model`` option names; the one meaning of that option in every door.

    * a `CostModel`: itself;
    * ``"MODEL@PROFILE"``: the presets (`hdp.packing.MODELS` @ `hdp.packing.PROFILES`), e.g.
      ``"dense-8b@h100-nvlink"``;
    * ``"auto"``: ``auto()`` — an engine's own model shape on its device's profile
      (`hdp.core.planning.auto_cost_model`); only engines can resolve it;
    * anything else: the path of a cost-model file (``hdp calibrate --records R.jsonl --out COST.json``),
      read once here.

    Errors name ``field_name``, the value and the forms it may take.
    """
    if isinstance(value, CostModel):
        return value
    forms = ("a hdp.packing.CostModel, 'auto', a preset 'MODEL@PROFILE' (e.g. 'dense-8b@h100-nvlink') or the "
             "path of a cost-model file (hdp calibrate --records R.jsonl --out COST.json)")
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ValueError(f"{field_name}={value!r}: pass {forms}")
    text = str(value)
    if text == AUTO:
        if auto is None:
            raise ValueError(f"{field_name}='auto' needs an engine (it reads the model and the device); "
                             "pass a preset 'MODEL@PROFILE' or a cost-model file here")
        return auto()
    if "@" in text and not Path(text).exists():
        from hdp.packing.profiles import cost_model

        model, _, profile = text.partition("@")
        try:
            return cost_model(model, profile)
        except ValueError as exc:
            raise ValueError(f"{field_name}={text!r}: {exc}") from exc
    if not Path(text).exists():
        raise ValueError(f"{field_name}: cost-model file {text!r}: cannot read it (no such file), and it is not a "
                         f"preset 'MODEL@PROFILE'; pass {forms}")
    try:
        return load_cost_model(text)
    except ValueError as exc:
        raise ValueError(f"{field_name}: {exc}") from exc
