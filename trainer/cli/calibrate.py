"""``hdp calibrate``: fit the cost model to the timing records and, when the records hold ``"kind": "memory"``
records, the per-rank memory model's coefficients (`hdp.packing.memory.fit_memory`); both go to one
cost-model file (`hdp.packing.cost_file`, the memory model as its ``memory`` section)."""

from __future__ import annotations

import argparse
from typing import Any

from hdp.trainer.cli.common import _console, _emit_json, _fmt_s, logger
from hdp.trainer.cli.output import atomic_output, check_output_file


def _cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit the cost model (and the memory model) to measured records; print them and write the cost-model
    file (--out)."""
    from hdp.packing import cost_model
    from hdp.packing.calibrate import calibrate, load_records
    from hdp.packing.cost import PARAMETERS
    from hdp.packing.cost_file import cost_document, save_cost_model

    from hdp.packing.profiles import DEFAULT_MODEL, DEFAULT_PROFILE

    model, profile = args.model or DEFAULT_MODEL, args.profile or DEFAULT_PROFILE
    base = cost_model(model, profile)
    base_name = f"{model}@{profile}"
    if args.out is not None:
        check_output_file("--out", args.out)  # before the fit
    records = load_records(args.records)
    timing = [r for r in records if r["kind"] != "memory"]
    memory = [r for r in records if r["kind"] == "memory"]
    notes: list[str] = []
    if memory and not any(r["kind"] == "group" for r in timing):
        # memory records alone: the memory model is fitted, the cost parameters stay the base preset's
        result, cost = None, base
        meta: dict[str, Any] = {"fitted": [], "from_base": list(PARAMETERS), "base": base_name, "fit": None}
        notes.append(f"no group timing records: the cost parameters are the base preset's ({base_name}), not fitted"
                     + (f"; {len(timing)} round record(s) need group records and were not used" if timing else ""))
    else:
        result = calibrate(timing, base=base)
        cost, meta = result.cost, result.metadata(base_name)
    mem_coef, mem_fit = _fit_memory(memory, args.memory_cover) if memory else (None, None)
    if args.out is not None:
        with atomic_output(args.out, "--out") as tmp:
            save_cost_model(cost, tmp, metadata=meta, memory=mem_coef, memory_fit=mem_fit)
        logger.info("wrote %s", args.out)
    doc = cost_document(cost, metadata=meta, memory=mem_coef, memory_fit=mem_fit)
    if args.json:
        _emit_json(doc)
        return 0
    from rich.table import Table

    con = _console()
    if result is not None:
        table = Table(title=f"calibrated cost model ({result.n_records} records; base {base_name})")
        for col in ("parameter", "value", "seconds", "source"):
            table.add_column(col, justify="left" if col in ("parameter", "source") else "right")
        per_unit = {"linear_coef": None, "unit_time_s": None}
        for n in PARAMETERS:
            v = float(getattr(cost, n))
            secs = "-" if n in per_unit else _fmt_s(v * cost.unit_time_s) + ("/token" if n.endswith("per_token") else "")
            src = "fitted" if n in result.fitted else f"base ({result.reasons.get(n, '')})"
            table.add_row(n, f"{v:.6g}", secs, src)
        con.print(table)
        con.print(f"R² {result.r2:.4f}; relative error median {result.median_rel_err:.2%}, p90 "
                  f"{result.rel_err_p90:.2%}, max {result.max_rel_err:.2%}")
        for w in result.warnings:
            con.print(f"[yellow]warning:[/yellow] {w}")
    for n in notes:
        con.print(f"[yellow]note:[/yellow] {n}")
    if mem_coef is not None:
        _print_memory_fit(con, mem_coef, mem_fit, memory)
    if args.out is not None:
        what = "cost-model file" + (" with its memory section" if mem_coef is not None else "")
        con.print(f"{what}: {args.out} (hdp plan / hdp simulate --cost-model {args.out})")
    return 0


def _fit_memory(records: list[dict[str, Any]], cover: bool) -> tuple[Any, dict[str, Any]]:
    """The memory coefficients of the memory records and the fit's quality (plus which terms the records
    exercised, and whether the fit covers every record)."""
    from hdp.packing.calibrate import MEMORY_FEATURES
    from hdp.packing.memory import fit_memory

    coef, quality = fit_memory(records, cover=cover)
    used = [n for i, n in enumerate(MEMORY_FEATURES) if any(float(r["features"][i]) > 0 for r in records)]
    return coef, {**quality, "fitted": used + ["headroom_bytes"], "cover": bool(cover)}


def _print_memory_fit(con: Any, coef: Any, fit: dict[str, Any], records: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title=f"calibrated memory model ({fit['n_records']} records)")
    for col in ("coefficient", "value", "source"):
        table.add_column(col, justify="right" if col == "value" else "left")
    for n, v in coef.to_dict().items():
        shown = f"{v / (1 << 30):.3f} GiB" if n == "headroom_bytes" else f"{v:.4g}"
        table.add_row(n, shown, "fitted" if n in fit["fitted"] else "base (no record exercises this term)")
    con.print(table)
    con.print(f"peak bytes: relative error median {fit['median_rel_err']:.2%}, max {fit['max_rel_err']:.2%} over "
              f"{len(records)} records" + (" (scaled to cover every record)" if fit["cover"] else ""))
