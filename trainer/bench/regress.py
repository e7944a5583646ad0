"""`hdp bench regress`: a preset's rows measured on this machine, each against its baseline with a tolerance.

A **preset** (`Preset`) is a set of rows and the benchmark runs they read.  Each row is one figure:
tokens/s, a speedup measured **side by side in the same run** (paired steps: `hdp.trainer.bench.stats`),
peak memory, an efficiency, an exactness flag.  The wheel's preset is **the user's job** (`job_preset`, the
default): ``hdp bench regress`` takes the flags of ``hdp bench train`` (model, layout, device, lengths,
policies) and guards that job's rows -- each policy's tokens/s per device and peak memory, hdp's paired
speedup over every other policy (CPU-seconds of all ranks on CPU, wall seconds on an accelerator) and the
losses being equal (a must-hold row).  Another preset is a Python file defining ``PRESET`` (``--preset
FILE.py``); ``--preset NAME`` reads ``benchmarks/NAME.py`` under the working directory -- this project's CI
preset is ``ci`` (``benchmarks/ci.py`` of a checkout: every benchmark in a short mode, with its committed
baseline).

**Baselines per environment** (`write_baseline`): ``--update --baseline FILE`` records the machine and the job at
hand -- hardware, versions, the commit, the preset's configuration -- and every row's figure, the median of
``--repeats`` runs.  ``regress`` compares with the file and exits 1 naming each row past its tolerance.
**Tolerances come from measured spread** (`derive_tolerance`, stated per row in the file with the rule): a
row's spread is the larger of the relative standard deviation of its figure over the repeats and, for a
paired figure, its run's own 95% interval (half width / 1.96); the tolerance is ``max(floor, 3 x spread x
sqrt(1 + 1/R))`` -- about three standard deviations of the difference between a new run and the median of R
recorded ones, so a noisy row does not flap, and a quiet row's tolerance stays tight enough to catch a real
loss.  Rows without a derived tolerance use their default (`Row.tolerance`).  ``--update`` refuses to write a
speed row's figure worse than the one the file holds (``Row.speed``) unless ``--allow-lower``: a regression
cannot be blessed by accident.

Every row states the range its figure can take at all (`Row.bounds`); a figure outside is an ``error`` of
its row, never compared or recorded.  Verdicts: ``ok``, ``REGRESSION``, ``missing from the baseline`` (a
failure), ``error`` (the benchmark raised, or its figure lies outside the row's range) or ``skipped: no
device`` (a row that needs a GPU or NPU, on a machine without one).

The baseline file is read and checked before anything runs (`load_baseline`): a regular file of at most
`MAX_BASELINE_BYTES`, a JSON object whose ``rows`` maps the preset's row names to ``true``/``false``
(flags) or numbers inside their row's range, holding every row the run will measure (`check_covered`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["Row", "Bounds", "RATIO", "SHARE", "Preset", "Baseline", "MAX_BASELINE_BYTES", "TOLERANCE_RULE",
           "NoDevice", "job_preset", "load_preset", "run_regress", "load_baseline", "check_covered", "check_writable",
           "write_baseline", "derive_tolerance", "select_rows", "MISSING"]

logger = logging.getLogger(__name__)

MAX_BASELINE_BYTES = 1 << 20
"""Largest baseline file read (1 MiB; the CI preset's, every row, has a few KB)."""

FORMAT = "hdp-regress-baseline"
"""``format`` of a baseline file (files without it -- the first format, rows only -- are read too)."""


class NoDevice(Exception):
    """Raised by a runner whose rows need a GPU or NPU on a machine without one."""


@dataclass(frozen=True)
class Bounds:
    """The values a row's figure can take at all: a baseline figure outside is refused when the file is
    read, a measured one is an error of its row (a broken benchmark, never a figure to compare or record)."""

    low: float
    high: float
    low_open: bool = False
    """``low`` itself excluded (a ratio of two times is > 0)."""

    def __contains__(self, value: object) -> bool:
        """Whether ``value`` is a number (not a bool) inside; NaN and the infinities never are, nor is an
        integer too large for a float."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        above = value > self.low if self.low_open else value >= self.low  # int compared exactly: no overflow
        return bool(above and value <= self.high)

    def text(self) -> str:
        """``(0, 100]``."""
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"


RATIO = Bounds(0.0, 100.0, low_open=True)
"""A ratio of two times or two rates (a speedup, an overhead): positive, and no benchmark moves one 100x."""
SHARE = Bounds(0.0, 100.0)
"""A non-negative figure relative to a reference (an error, seconds over a timeout): 0 allowed."""
RATE = Bounds(0.0, 1e12, low_open=True)
"""A rate (tokens per second)."""
GIGABYTES = Bounds(0.0, 1e6)
"""A memory figure in GB."""

TOLERANCE_RULE = "max(floor, 3 x spread x sqrt(1 + 1/R))"
"""How `derive_tolerance` turns a row's measured spread over R repeats into its tolerance."""


@dataclass(frozen=True)
class Row:
    """One figure of one benchmark run, compared with its baseline value."""

    name: str
    """Row name (``--only`` takes it)."""
    bench: str
    """The runner in its preset's ``runners`` whose result it reads."""
    meaning: str
    """What the figure is, in a few words."""
    better: Literal["higher", "lower", "true"]
    """Which way is good: a larger figure, a smaller one, or a flag that must hold."""
    tolerance: float
    """How far from the baseline the figure may move the bad way before it is a regression (the default; a
    baseline file's derived tolerance replaces it)."""
    absolute: bool
    """``tolerance`` in the figure's own units (True) or as a fraction of the baseline (False)."""
    get: Callable[[dict[str, Any]], Any]
    """The figure from the runner's result."""
    bounds: Bounds | None = None
    """The range the figure can take at all (None for a flag, ``better="true"``)."""
    speed: bool = False
    """A speed figure: ``--update`` refuses to record a worse one without ``--allow-lower``."""
    spread: Callable[[dict[str, Any]], float] | None = None
    """The run's own relative spread of the figure (a paired figure's 95% half width / 1.96), when it has one."""
    floor: float | None = None
    """Smallest derived tolerance; None: 0.02 for a relative row, a fifth of ``tolerance`` for an absolute one."""

    def tolerance_text(self, tolerance: float | None = None) -> str:
        """``-15%``, ``+0.05``, ``must hold``: how far the figure may move the bad way."""
        if self.better == "true":
            return "must hold"
        t = self.tolerance if tolerance is None else tolerance
        sign = "-" if self.better == "higher" else "+"
        return f"{sign}{t:.3g}" if self.absolute else f"{sign}{t:.1%}"

    def min_tolerance(self) -> float:
        """The floor of a derived tolerance."""
        if self.floor is not None:
            return self.floor
        return self.tolerance / 5 if self.absolute else 0.02

    def worse(self, new: Any, old: Any) -> bool:
        """Whether figure ``new`` is worse than ``old`` (a flag: false after true)."""
        if self.better == "true":
            return bool(old) and not bool(new)
        return float(new) < float(old) if self.better == "higher" else float(new) > float(old)

    def verdict(self, baseline: Any, now: Any, tolerance: float | None = None) -> str:
        """``ok``, ``REGRESSION`` or ``missing from the baseline`` (a failure too)."""
        if self.better == "true":
            if now is not True:
                return "REGRESSION"
            return MISSING if baseline is None else "ok"
        if baseline is None:
            return MISSING
        t = self.tolerance if tolerance is None else tolerance
        now, baseline = float(now), float(baseline)
        if not math.isfinite(now):
            return "REGRESSION"
        if self.better == "higher":
            floor = baseline - t if self.absolute else baseline * (1.0 - t)
            return "ok" if now >= floor else "REGRESSION"
        ceiling = baseline + t if self.absolute else baseline * (1.0 + t)
        return "ok" if now <= ceiling else "REGRESSION"


MISSING = "missing from the baseline"
"""The verdict of a measured row the baseline file has no figure for (it fails: record it with ``--update``)."""


@dataclass(frozen=True)
class Preset:
    """A named set of rows and the runs they read."""

    name: str
    """``job``, ``ci``, ... (recorded in the baseline file)."""
    about: str
    """One line: what it measures."""
    rows: tuple[Row, ...]
    """Every row, in table order."""
    runners: Mapping[str, Callable[[], dict[str, Any]]]
    """Each benchmark's run (the rows read their results); each runs at most once per repeat."""
    may_skip: frozenset[str] = frozenset()
    """Benchmarks that skip on a machine without a GPU or NPU (`NoDevice`): their rows need a baseline figure
    only when they ran (`check_covered` leaves them to the run's verdicts)."""
    baseline: Path | None = None
    """The default baseline file (None: ``--baseline`` is required)."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """What the preset runs (the job's spec), recorded in the baseline file."""


# ---- the user's job -------------------------------------------------------------------------------------


def job_preset(spec: Any) -> Preset:
    """The rows of the job ``spec`` (a `hdp.trainer.bench.train.TrainBenchSpec`): per policy tokens/s per device
    (higher) and peak memory (lower); hdp's paired speedup over each other policy (CPU-seconds of all ranks on
    CPU, wall seconds on an accelerator); losses equal (and plans different, with several policies)."""
    from hdp.trainer.bench.train import bench_train

    clock = "cpu" if spec.device == "cpu" else "wall"
    unit = "per CPU-second of all ranks" if clock == "cpu" else "wall seconds"
    rows: list[Row] = []
    for p in spec.policies:
        rows.append(Row(f"job-{p}-tokens-per-s", "job", f"{p}: tokens/s per device (timed steps' wall seconds)",
                        "higher", 0.10, False, lambda r, p=p: r["results"][p]["tokens_per_s"], RATE, speed=True))
    for q in spec.policies:
        if q != "hdp" and "hdp" in spec.policies:
            rows.append(Row(
                f"job-speedup-vs-{q}", "job", f"hdp over {q}: paired median of steps' {unit} ratios", "higher", 0.10,
                False, lambda r, q=q: r["paired"][f"hdp_vs_{q}"][clock]["median"], RATIO, speed=True,
                spread=lambda r, q=q: r["paired"][f"hdp_vs_{q}"][clock]["half_width"] / 1.96))
    for p in spec.policies:
        rows.append(Row(f"job-{p}-peak-memory", "job", f"{p}: largest per-rank peak memory (GB)", "lower", 0.05, False,
                        lambda r, p=p: r["results"][p]["peak_memory_gb"], GIGABYTES))
    several = len(spec.policies) > 1
    rows.append(Row("job-exact", "job", "losses of every policy equal (rel 1e-4)" + (", plans different" if several else ""),
                    "true", 0.0, False, lambda r: bool(r["loss_match"] and (r["plans_differ"] or not several))))
    return Preset(name="job", about="the job the flags describe (hdp bench train's)", rows=tuple(rows),
                  runners={"job": lambda: bench_train(spec)}, config=spec.config())


def load_preset(name: str) -> Preset:
    """The preset defined by a Python file (``PRESET``): ``name`` a path to it, or a name read from
    ``benchmarks/NAME.py`` under the working directory (a checkout's root: the CI preset lives outside the
    wheel).  The file's folder's parent goes on ``sys.path`` first, so the file may import its siblings as
    a package (``benchmarks.faults``) -- in this process and in every rank it spawns.  ValueError naming
    ``--preset`` and the fix."""
    path = Path(name) if name.endswith(".py") else Path("benchmarks") / f"{name}.py"
    where = f"--preset={name!r}"
    if not path.is_file():
        raise ValueError(f"{where}: no preset file {str(path)!r}; pass job (the default: the job the flags describe), "
                         "the path of a preset file, or a name of benchmarks/NAME.py in a checkout (run from its root: "
                         "the ci preset is outside the wheel)")
    root = str(path.resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    package = path.resolve().parent.name
    modname = f"{package}.{path.stem}" if (path.parent / "__init__.py").is_file() else path.stem
    module = sys.modules.get(modname)
    if module is None or Path(getattr(module, "__file__", "") or "").resolve() != path.resolve():
        spec = importlib.util.spec_from_file_location(modname, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[modname] = module
        spec.loader.exec_module(module)
    preset = getattr(module, "PRESET", None)
    if not isinstance(preset, Preset):
        raise ValueError(f"{where}: {str(path)!r} defines no PRESET (a hdp.trainer.bench.regress.Preset)")
    return preset


# ---- the baseline file ----------------------------------------------------------------------------------


_FIX = "write one with hdp bench regress --update --baseline FILE"


@dataclass(frozen=True)
class Baseline:
    """A baseline file's figures and derived tolerances."""

    rows: Mapping[str, Any]
    """Row name -> figure (a bool for a flag)."""
    tolerances: Mapping[str, Mapping[str, Any]]
    """Row name -> ``{"tolerance", "spread", "repeats", "rule"}`` (`derive_tolerance`); rows without one use their
    default."""
    doc: Mapping[str, Any]
    """The whole file."""

    def tolerance(self, row: Row) -> float | None:
        """The row's derived tolerance, or None (its default applies)."""
        t = self.tolerances.get(row.name)
        return None if t is None else float(t["tolerance"])


def load_baseline(path: str | Path, preset: Preset) -> Baseline:
    """The baseline file ``path`` of ``preset``, checked whole; ValueError naming ``--baseline``, the file and the
    field: not a regular file (a FIFO, a device such as ``/dev/zero``, a directory), over `MAX_BASELINE_BYTES`,
    not JSON, another preset's, an unknown row, a flag that is not true/false, a figure outside its row's range
    (`Row.bounds`), a tolerance that is not a number >= 0."""
    from hdp.packing.cost_file import read_bounded_text

    p = Path(path)
    where = f"--baseline={str(p)!r}"
    try:
        text = read_bounded_text(p, MAX_BASELINE_BYTES, "--baseline", _FIX)  # stat first: a FIFO is never opened
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{where}: cannot read a JSON baseline ({exc}); {_FIX}") from exc
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply to be a baseline; {_FIX}") from None
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not isinstance(rows, dict):
        raise ValueError(f"{where}: field 'rows' is {rows!r}; it must map row names to figures")
    recorded = doc.get("preset")
    if recorded is not None and recorded != preset.name:
        raise ValueError(f"{where}: it holds preset {recorded!r}'s baseline, not {preset.name!r}'s; pass that preset "
                         f"(--preset {recorded}) or another file")
    known = {r.name: r for r in preset.rows}
    out: dict[str, Any] = {}
    for name, value in rows.items():
        row = known.get(name)
        if row is None:
            raise ValueError(f"{where}: row {name!r} is unknown; rows of preset {preset.name!r} are {', '.join(known)}")
        if row.better == "true":
            if not isinstance(value, bool):
                raise ValueError(f"{where}: field 'rows.{name}' is {value!r}; it must be true or false")
            out[name] = value
            continue
        assert row.bounds is not None, row.name
        if value not in row.bounds:
            shown = value if not isinstance(value, int) or abs(value) < 10**20 else f"an integer of {len(str(value))} digits"
            raise ValueError(f"{where}: field 'rows.{name}' is {shown!r}; it must be a number in {row.bounds.text()} "
                             f"({row.meaning}); {_FIX}")
        out[name] = float(value)
    tols = doc.get("tolerances", {})
    if not isinstance(tols, dict):
        raise ValueError(f"{where}: field 'tolerances' is {tols!r}; it must map row names to their derived tolerance")
    for name, t in tols.items():
        value = t.get("tolerance") if isinstance(t, dict) else None
        if name not in known or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}: field 'tolerances.{name}' is {t!r}; it must be an object whose 'tolerance' is "
                             "a number >= 0, for a row of the preset")
    return Baseline(rows=out, tolerances=tols, doc=doc)


def check_covered(rows: Sequence[Row], base: Baseline, path: str | Path, preset: Preset) -> None:
    """ValueError naming every row of ``rows`` the run will measure that ``base`` has no figure for (the rows of
    ``preset.may_skip`` benchmarks are judged after the run: ``missing from the baseline``, a failure)."""
    missing = [r.name for r in rows if r.name not in base.rows and r.bench not in preset.may_skip]
    if missing:
        raise ValueError(f"--baseline={str(path)!r}: no figure for row(s) {', '.join(missing)}, which this run "
                         f"measures; record them with hdp bench regress --update --baseline {path} --only "
                         f"{','.join(missing)} (or leave them out with --only)")


def check_writable(path: str | Path) -> None:
    """ValueError, before the run, when ``--update`` could not write ``path``: its folder missing, or the path
    something other than a regular file (a directory, a FIFO, a device)."""
    p = Path(path)
    where = f"--baseline={str(p)!r}"
    real = Path(os.path.realpath(p))
    if real.exists() and not real.is_file():
        raise ValueError(f"{where} is not a regular file (a directory or a device); name a new or existing JSON file")
    if not real.parent.is_dir():
        raise ValueError(f"{where}: the folder {str(real.parent)!r} does not exist; create it first, or name a file in "
                         "an existing folder")


def derive_tolerance(row: Row, figures: Sequence[float], spreads: Sequence[float]) -> dict[str, Any] | None:
    """``{"tolerance", "spread", "repeats", "rule"}`` of a row measured ``len(figures)`` times (`TOLERANCE_RULE`):
    spread = the larger of the figures' standard deviation (relative to their median for a relative row) and
    the runs' own spreads (``spreads``, relative); None for a flag, or one run without a spread of its own."""
    if row.better == "true":
        return None
    r = len(figures)
    med = statistics.median(figures)
    between = statistics.stdev(figures) if r >= 2 else 0.0
    if not row.absolute:
        between = between / abs(med) if med else math.inf
    within = max(spreads, default=0.0)
    if within and row.absolute:
        within = within * abs(med)
    if r < 2 and not spreads:
        return None
    spread = max(between, within)
    tol = max(row.min_tolerance(), 3.0 * spread * math.sqrt(1.0 + 1.0 / r))
    return {"tolerance": tol, "spread": spread, "repeats": r, "absolute": row.absolute,
            "rule": f"{TOLERANCE_RULE}, floor {row.min_tolerance():g}"}


def write_baseline(path: str | Path, preset: Preset, figures: Mapping[str, Any], note: Mapping[str, Any], *,
                   tolerances: Mapping[str, Mapping[str, Any]] | None = None, repeats: int = 1,
                   command: str = "hdp bench regress --update") -> None:
    """Write ``figures`` and their derived ``tolerances`` (merged over the file's existing rows), ``note`` (the
    machine, `hdp.trainer.bench.train.environment`) and the preset's configuration to ``path``, atomically (a
    temporary file in the same folder, renamed over it)."""
    p = Path(path)
    check_writable(p)
    rows: dict[str, Any] = {}
    tols: dict[str, Any] = {}
    if p.exists():
        old = load_baseline(p, preset)
        rows.update(old.rows)
        tols.update(old.tolerances)
    rows.update(figures)
    for name in figures:
        tols.pop(name, None)
    tols.update(tolerances or {})
    order = [r.name for r in preset.rows]
    doc = {"format": FORMAT, "preset": preset.name, "rows": {k: rows[k] for k in order if k in rows},
           "tolerances": {k: tols[k] for k in order if k in tols},
           "tolerance_rule": f"{TOLERANCE_RULE}: spread = the larger of the figure's standard deviation over the R "
                             "repeats (relative to their median for a relative row) and the run's own 95% interval "
                             "half width / 1.96 (paired figures); rows without an entry use their default",
           "repeats": repeats, "measured_on": dict(note), "config": dict(preset.config), "command": command}
    real = Path(os.path.realpath(p))
    fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(doc, indent=1, sort_keys=False, allow_nan=False, default=str) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# ---- the run --------------------------------------------------------------------------------------------


def select_rows(preset: Preset, only: Sequence[str] | None) -> tuple[Row, ...]:
    """The rows ``only`` names (row names or benchmark names), in table order; all without it."""
    if not only:
        return preset.rows
    names = {r.name for r in preset.rows} | set(preset.runners)
    unknown = [x for x in only if x not in names]
    if unknown:
        raise ValueError(f"--only={','.join(only)}: {', '.join(map(repr, unknown))} unknown; rows: "
                         f"{', '.join(r.name for r in preset.rows)}; benchmarks: {', '.join(preset.runners)}")
    return tuple(r for r in preset.rows if r.name in only or r.bench in only)


def _judge(row: Row, got: Any, baseline: Any, tolerance: float | None) -> dict[str, Any]:
    """``{"now", "verdict"}`` of a figure ``got`` a benchmark measured: a flag as a bool; a number inside its
    row's range (outside: an ``error`` verdict naming the range), compared with ``baseline``."""
    if row.better == "true":
        now = bool(got)
        return {"now": now, "verdict": row.verdict(baseline, now)}
    try:
        now = float(got)
    except (TypeError, ValueError, OverflowError):
        return {"now": None, "verdict": f"error: the figure is {got!r}, not a number"[:160]}
    assert row.bounds is not None, row.name
    if now not in row.bounds:
        return {"now": now, "verdict": f"error: the figure {now:.4g} lies outside the row's range {row.bounds.text()}"}
    return {"now": now, "verdict": row.verdict(baseline, now, tolerance)}


def _run_once(preset: Preset, rows: Sequence[Row], runners: Mapping[str, Callable[[], dict[str, Any]]],
              seconds: dict[str, float]) -> dict[str, Any]:
    """Run every benchmark ``rows`` read, once each; results by benchmark (an exception where it raised)."""
    results: dict[str, Any] = {}
    for bench in dict.fromkeys(r.bench for r in rows):
        t0 = time.perf_counter()
        try:
            results[bench] = runners[bench]()
        except NoDevice as exc:
            results[bench] = exc
        except Exception as exc:  # noqa: BLE001 - a crashing benchmark is a failed row, named in the table
            logger.exception("bench regress: %s raised", bench)
            results[bench] = exc
        seconds[bench] = seconds.get(bench, 0.0) + time.perf_counter() - t0
        logger.info("bench regress: %s took %.1f s", bench, time.perf_counter() - t0)
    return results


def _figure(row: Row, got: Any) -> tuple[Any, float | None, str | None]:
    """(the row's figure, the run's own spread of it, None) or (None, None, why not: an error / skip verdict)."""
    if isinstance(got, NoDevice):
        return None, None, "skipped: no device"
    if isinstance(got, Exception):
        return None, None, f"error: {type(got).__name__}: {str(got).splitlines()[0] if str(got) else ''}"[:160]
    try:
        now = row.get(got)
        spread = row.spread(got) if row.spread is not None else None
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
        return None, None, f"error: the result has no figure ({type(exc).__name__}: {exc})"
    return now, spread, None


def run_regress(*, preset: Preset, baseline: str | Path | None = None, only: Sequence[str] | None = None,
                update: bool = False, repeats: int = 1, allow_lower: bool = False,
                runners: Mapping[str, Callable[[], dict[str, Any]]] | None = None,
                note: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run the benchmarks the rows need (each once per repeat) and compare with ``baseline`` (default the
    preset's); with ``update``, write this run's figures -- the median of ``repeats`` runs, with tolerances
    derived from their spread -- instead of judging them (RuntimeError when a flag row fails in any repeat or a
    figure lies outside its row's range; without ``allow_lower``, a speed row's figure worse than the file's
    writes nothing and fails those rows, ``refused`` naming them).
    Before anything runs (ValueError naming ``--baseline``): the rows are known, the baseline file is read and
    checked whole (`load_baseline`) and holds every row the run will measure (`check_covered`); with
    ``update`` the file may be new, and its folder must exist (`check_writable`).

    Under torchrun every rank runs the benchmarks and world rank 0 alone judges and writes (``judged``).

    Returns ``{"preset", "rows": [{"row", "bench", "meaning", "baseline", "now", "tolerance", "verdict"}, ...],
    "failed": [row names], "seconds": {bench: s}, "baseline_file", "updated", "repeats", "judged"}``.
    """
    rows = select_rows(preset, only)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"--repeats={repeats!r}: pass a whole number >= 1")
    path = baseline if baseline is not None else preset.baseline
    if path is None:
        raise ValueError(f"--baseline: preset {preset.name!r} has no default baseline; record one with hdp bench "
                         "regress --update --baseline FILE (and the same job flags), then pass --baseline FILE")
    run_with = dict(preset.runners if runners is None else runners)
    if update:
        check_writable(path)
    elif not os.path.lexists(path):
        raise ValueError(f"--baseline={str(path)!r}: no such file; record one with hdp bench regress --update "
                         f"--baseline {path}")
    base = load_baseline(path, preset) if os.path.lexists(path) else Baseline(rows={}, tolerances={}, doc={})
    if not update:
        check_covered(rows, base, path, preset)
    seconds: dict[str, float] = {}
    runs = [_run_once(preset, rows, run_with, seconds) for _ in range(repeats)]
    if "WORLD_SIZE" in os.environ and os.environ.get("RANK", "0") != "0":  # torchrun: rank 0 judges and writes
        return {"preset": preset.name, "rows": [], "failed": [], "seconds": seconds, "baseline_file": str(path),
                "updated": False, "repeats": repeats, "judged": False}
    table, failed, figures, tolerances = [], [], {}, {}
    for row in rows:
        tol = base.tolerance(row)
        entry = {"row": row.name, "bench": row.bench, "meaning": row.meaning, "baseline": base.rows.get(row.name),
                 "tolerance": row.tolerance_text(tol)}
        measured, spreads, why = [], [], None
        for results in runs:
            now, spread, why = _figure(row, results[row.bench])
            if why is not None:
                break
            judged = _judge(row, now, base.rows.get(row.name), tol)
            if judged["verdict"].startswith("error"):
                why = judged["verdict"]
                break
            measured.append(judged["now"])
            if spread is not None and math.isfinite(spread):
                spreads.append(float(spread))
        if why is not None:
            entry.update(now=None, verdict=why)
            if not why.startswith("skipped"):
                failed.append(row.name)
            table.append(entry)
            continue
        if row.better == "true":
            now = all(measured)
        else:
            now = statistics.median(measured)
            entry["repeats"] = measured
            if spreads:
                entry["spread"] = max(spreads)
                entry["spreads"] = spreads
        entry.update(_judge(row, now, base.rows.get(row.name), tol))
        figures[row.name] = entry["now"]
        if update:
            derived = derive_tolerance(row, measured, spreads)
            if derived is not None:
                tolerances[row.name] = derived
                entry["tolerance"] = row.tolerance_text(derived["tolerance"])
        if entry["verdict"] in ("REGRESSION", MISSING):
            failed.append(row.name)
        table.append(entry)
    out = {"preset": preset.name, "rows": table, "failed": failed, "seconds": seconds, "baseline_file": str(path),
           "updated": update, "repeats": repeats, "judged": True}
    if update:
        broken = [r["row"] for r in table if r["row"] in failed and (r["verdict"].startswith("error")
                                                                     or r["now"] is False)]
        if broken:
            raise RuntimeError(f"bench regress --update: rows {', '.join(broken)} failed (a flag does not hold, the "
                               "benchmark raised or its figure lies outside the row's range); fix them before "
                               "recording a baseline")
        worse = [r.name for r in rows if r.speed and r.name in figures and r.name in base.rows
                 and r.worse(figures[r.name], base.rows[r.name])]
        lower = [f"{n} ({base.rows[n]:.4g} -> {figures[n]:.4g})" for n in worse]
        if worse and not allow_lower:  # nothing written; the table shows what was measured, the rows say why
            for r in table:
                if r["row"] in worse:
                    r["verdict"] = "not recorded: worse than the baseline (--allow-lower records it)"
            out.update(failed=worse, refused=lower, updated=False)
            return out
        if note is None:
            from hdp.trainer.bench.train import environment

            note = environment()
        write_baseline(path, preset, figures, note, tolerances=tolerances, repeats=repeats,
                       command=f"hdp bench regress --update --preset {preset.name} --repeats {repeats}"
                               + (" --allow-lower" if allow_lower and lower else ""))
        for r in table:
            r["verdict"] = "updated" if r["row"] in figures else r["verdict"]
        out["lowered"] = lower
        out["failed"] = []
    return out
