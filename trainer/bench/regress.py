"""`hdp bench regress`: every benchmark in a short mode, each ratio or flag against a committed baseline.

Each row is one figure a benchmark measures **side by side in the same run** — a speedup over the
baseline policy, an efficiency, an exactness flag, the planner's time over a fixed reference
computation timed in the same process, the memory model's prediction error, a fault's seconds to
exit over its collective timeout — so a slower or busier machine moves both sides alike and the
figure stays comparable between runs.  Speedups and overheads are taken in CPU seconds of all ranks
(the benchmarks report both): other work on a shared machine stretches wall-clock steps unevenly
but leaves a rank's own CPU time nearly alone; each benchmark's own command prints the wall-clock
figures.  Every row states its tolerance (`Row.tolerance`, relative or
absolute) and the range its figure can take at all (`Row.bounds`: a time ratio is > 0 and at most
100, an efficiency at most 1, ...); `run_regress` compares the figures with the baseline file and
reports one verdict per row: ``ok``, ``REGRESSION``, ``missing from the baseline`` (a failure),
``error`` (the benchmark raised, or its figure lies outside the row's range) or ``skipped: no
device`` (a row that needs a GPU or NPU, on a machine without one).  ``hdp bench regress`` prints the
table and exits 1 naming every failed row; ``--update`` rewrites the baseline with this run's figures
(review it in the diff like code).

The baseline file is read and checked before anything runs (`load_baseline`): a regular file of at
most `MAX_BASELINE_BYTES` (1 MiB; the committed one has about 1 KB), a JSON object whose ``rows``
maps known row names to ``true``/``false`` (flags) or numbers inside their row's range, holding every
row the run will measure (`check_covered`; the rows of a benchmark that may skip for want of a
device are checked when they ran).  ``--update`` checks the file it will write before the run too.

The committed baseline (`BASELINE_FILE`) was measured on this project's CI machine (2 CPU cores,
gloo); on your own cluster record yours once (``hdp bench regress --update --baseline FILE``) and
run ``hdp bench regress --baseline FILE`` to guard your throughput.

The short modes (`RUNNERS`) together take a few minutes on 2 cores; rows select what runs (``--only``:
row or benchmark names), and each benchmark runs at most once per call.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["Row", "Bounds", "ROWS", "RUNNERS", "BASELINE_FILE", "MAX_BASELINE_BYTES", "MAY_SKIP", "run_regress",
           "load_baseline", "check_covered", "check_writable", "write_baseline", "reference_ms", "NoDevice"]

logger = logging.getLogger(__name__)

BASELINE_FILE = Path(__file__).with_name("regress_baseline.json")
"""The committed baseline: the figures of this project's CI machine (2 CPU cores)."""

MAX_BASELINE_BYTES = 1 << 20
"""Largest baseline file read (1 MiB; the committed one, every row, has about 1 KB)."""


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


@dataclass(frozen=True)
class Row:
    """One figure of one benchmark run, compared with its baseline value."""

    name: str
    """Row name (``--only`` takes it)."""
    bench: str
    """The short-mode runner in `RUNNERS` whose result it reads."""
    meaning: str
    """What the figure is, in a few words."""
    better: Literal["higher", "lower", "true"]
    """Which way is good: a larger figure, a smaller one, or a flag that must hold."""
    tolerance: float
    """How far from the baseline the figure may move the bad way before it is a regression."""
    absolute: bool
    """``tolerance`` in the figure's own units (True) or as a fraction of the baseline (False)."""
    get: Callable[[dict[str, Any]], Any]
    """The figure from the runner's result."""
    bounds: Bounds | None = None
    """The range the figure can take at all (None for a flag, ``better="true"``)."""

    def tolerance_text(self) -> str:
        """``-15%``, ``+0.05``, ``must hold``: how far the figure may move the bad way."""
        if self.better == "true":
            return "must hold"
        sign = "-" if self.better == "higher" else "+"
        return f"{sign}{self.tolerance:g}" if self.absolute else f"{sign}{self.tolerance:.0%}"

    def verdict(self, baseline: Any, now: Any) -> str:
        """``ok``, ``REGRESSION`` or ``missing from the baseline`` (a failure too)."""
        if self.better == "true":
            if now is not True:
                return "REGRESSION"
            return MISSING if baseline is None else "ok"
        if baseline is None:
            return MISSING
        now, baseline = float(now), float(baseline)
        if not math.isfinite(now):
            return "REGRESSION"
        if self.better == "higher":
            floor = baseline - self.tolerance if self.absolute else baseline * (1.0 - self.tolerance)
            return "ok" if now >= floor else "REGRESSION"
        ceiling = baseline + self.tolerance if self.absolute else baseline * (1.0 + self.tolerance)
        return "ok" if now <= ceiling else "REGRESSION"


MISSING = "missing from the baseline"
"""The verdict of a measured row the baseline file has no figure for (it fails: record it with ``--update``)."""


# ---- the short modes ------------------------------------------------------------------------------

REFERENCE_N = 1 << 20
"""Elements of the fixed reference computation the planner row is timed against."""
REFERENCE_PASSES = 32
"""Passes of the reference kernel over its elements (about 40 ms of CPU on the 2-core VM)."""


@functools.lru_cache(maxsize=None)
def _reference_kernel() -> Callable[[Any, int], float]:
    """The reference computation, compiled by numba as the planner's kernels are: scalar passes over the
    elements whose every step depends on the one before (a running value and 64 bins updated by a
    data-dependent branch), so no vector unit or SIMD library routine speeds it up — its time tracks the
    planner's kind of work from one CPU to another (a numpy sort, the earlier yardstick, ran 7x faster
    on CPUs whose numpy takes an AVX-512 sort path)."""
    import numba
    import numpy as np

    @numba.njit(cache=False)
    def kernel(x: Any, passes: int) -> float:  # x [n] float64 in [0, 1)
        bins = np.zeros(64)
        run = 0.0
        for _ in range(passes):
            for i in range(x.shape[0]):
                v = x[i]
                b = int(v * 64.0)
                if bins[b] > run:
                    run += v
                else:
                    bins[b] += v - run * 1e-6
        return run + bins.sum()

    return kernel


def reference_ms(repeats: int = 5) -> float:
    """Median CPU milliseconds of a fixed single-threaded computation (`_reference_kernel` over 1M floats,
    compiled before the timing): the yardstick the planner's CPU time is divided by, timed in the same
    process."""
    import numpy as np

    kernel = _reference_kernel()
    data = np.random.default_rng(0).random(REFERENCE_N)
    kernel(data[:64], 1)  # compiled outside the timing
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        kernel(data, REFERENCE_PASSES)
        times.append((time.process_time() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _attention() -> dict[str, Any]:
    from hdp.trainer.bench.attention import bench_attention

    return bench_attention(ranks=2, tokens=8192, algo="ring", repeats=3)


def _train(ranks: int, tp: int, pp: int) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        from hdp.trainer.bench.train import TrainBenchSpec, bench_train

        return bench_train(TrainBenchSpec(ranks=ranks, tp=tp, pp=pp, steps=4, samples=32, num_layers=2,
                                          vocab_size=512))

    return run


def _entry_point(name: str) -> Callable[..., dict[str, Any]]:
    """The bench another package registers as ``hdp.benchmarks`` entry point ``name`` (the trainer never imports
    the verl integration)."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="hdp.benchmarks") if ep.name == name]
    if not found:
        raise RuntimeError(f"no 'hdp.benchmarks' entry point {name!r}: install hdp-engine with the verl extra")
    return found[0].load()


def _verl() -> dict[str, Any]:
    return _entry_point("verl")(ranks=4, steps=5)


def _verl_old_logprob() -> dict[str, Any]:
    result = _entry_point("verl-old-logprob")(steps=2)
    t = result["old_log_prob_s"]
    return {**result, "pass_time_ratio": t["skipped"] / t["run"] if t["run"] > 0 else math.nan}


def _models() -> dict[str, Any]:
    return _entry_point("models")()


def _moe() -> dict[str, Any]:
    from hdp.trainer.bench.moe import bench_moe

    # 30 paired steps: on the shared 2-core VM the level1 row's paired median spread over 0.09 in three runs of
    # 12 steps (and 0.036-0.095 in full runs: half over the row's tolerance) and over 0.03 in three of 30
    return bench_moe(ep=2, tokens=1024, seq_length=512, num_experts=32, topk=4, iters=30, layer_iters=3,
                     experts=("sequential",))


def _memory() -> dict[str, Any]:
    from hdp.trainer.bench.memory import CASES, bench_limit, bench_memory, summary

    cases = tuple(c for c in CASES if c.name in ("dense-pp1-recompute-none", "moe-pp1-zero-memory-level1"))
    result = summary(bench_memory(cases))
    result["limit"] = bench_limit()
    return result


def _planner() -> dict[str, Any]:
    import statistics

    from hdp.trainer.bench.planner import FAMILIES, bench_planner

    chosen = [f for f in FAMILIES if f.name in ("lognormal", "bimodal", "short-reasoning")]
    ref = reference_ms()
    result = bench_planner(chosen, repeats=7, peers=False)  # a median of 7: the row sits within 30% of run-to-run noise
    ref = min(ref, reference_ms())  # before and after: the quieter of the two
    ms = [r["median_cpu_ms"] for r in result["planner"]]
    return {**result, "reference_ms": ref, "planner_over_reference": statistics.median(ms) / ref,
            "efficiency_mean": statistics.mean(r["efficiency"] for r in result["planner"])}


def _faults() -> dict[str, Any]:
    from hdp.trainer.bench.faults import run_faults

    result = run_faults(timeout_s=10.0, only=("in-process", "sigkill-mid-step", "own-error-in-round"))

    def over(rows: list[dict[str, Any]]) -> float:  # seconds to exit / the row's collective timeout, the worst
        return max(r["seconds_to_exit"] / r.get("collective_timeout_s", result["collective_timeout_s"]) for r in rows)

    own = [r for r in result["faults"] if r["fault"].startswith("own-error")]
    return {**result, "worst_seconds_over_timeout": over(result["faults"]), "own_error_seconds_over_timeout": over(own)}


def _nodes() -> dict[str, Any]:
    from hdp.trainer.bench.nodes import NodesBenchSpec, bench_nodes

    return bench_nodes(NodesBenchSpec(steps=7))["nodes"]


def _device() -> dict[str, Any]:
    """`hdp bench device`'s kernel and engine rows on this machine's accelerator."""
    from hdp import device as _dev
    from hdp.trainer.bench.device import bench_device

    if _dev.select_device(None).type == "cpu":
        raise NoDevice("no GPU or NPU")
    result = bench_device(rows=("kernel_exactness", "kernel_speed", "engine_pp1"))
    rows = {r["row"]: r for r in result["rows"]}
    speeds = [max(v for k, v in length.items() if k.endswith("_speed_over_sdpa"))
              for length in rows["kernel_speed"].get("figures", {}).get("lengths", [])
              if any(k.endswith("_speed_over_sdpa") for k in length)]
    return {**result, "by_row": rows, "kernel_speed_over_sdpa": min(speeds) if speeds else math.nan}


RUNNERS: dict[str, Callable[[], dict[str, Any]]] = {
    "attention": _attention,
    "train-pp1": _train(4, 1, 1),
    "train-pp2": _train(4, 1, 2),
    "train-tp2-pp2": _train(8, 2, 2),
    "verl": _verl,
    "verl-old-logprob": _verl_old_logprob,
    "models": _models,
    "moe": _moe,
    "memory": _memory,
    "planner": _planner,
    "faults": _faults,
    "nodes": _nodes,
    "device": _device,
}
"""Each benchmark's short mode (the rows read their results)."""

MAY_SKIP = frozenset({"device"})
"""Benchmarks that skip on a machine without a GPU or NPU (`NoDevice`): their rows need a baseline figure
only when they ran (`check_covered` leaves them to the run's verdicts)."""


MODEL_FAMILIES: tuple[tuple[str, str], ...] = (
    ("llama3.1", "Llama 3.1 (rope_type llama3)"),
    ("qwen3-yarn", "Qwen3 with YaRN"),
    ("qwen2-window", "Qwen2, per-layer sliding window"),
    ("mistral-window", "Mistral sliding window (library door only: no mbridge bridge)"),
    ("mistral-sinks", "gpt-oss-style learned sinks + window (library door only)"),
    ("qwen3-off-by-one", "Qwen3 with off-by-one sinks"),
    ("qwen3-scale", "Qwen3 with a custom softmax_scale"),
    ("deepseek-v3", "DeepSeek-V3: multi-latent attention, DeepSeek MoE under EP 2 and zero-memory level1"),
)
"""`hdp bench models`' families (the verl plugin's scaffolding `families.CASES`) with a row each."""


def _model_rows() -> tuple[Row, ...]:
    return tuple(
        Row(f"models-{name}-exact", "models", f"{what}: log-probs, loss, grad norm = HF on both doors, CP group",
            "true", 0.0, False, lambda r, name=name: bool(r["families"][name]["ok"]))
        for name, what in MODEL_FAMILIES
    )


def _train_rows(bench: str, layout: str) -> tuple[Row, ...]:
    return (
        Row(f"{bench}-speedup", bench, f"hdp vs static-cp tokens per CPU-second, {layout}", "higher", 0.15, False,
            lambda r: r["speedup_cpu_time"]["hdp_vs_static-cp"], RATIO),
        Row(f"{bench}-exact", bench, "losses of both policies equal (rel 1e-4), their plans different", "true", 0.0,
            False, lambda r: bool(r["loss_match"] and r["plans_differ"])),
    )


ROWS: tuple[Row, ...] = (
    Row("attention-efficiency", "attention", "ring CP2 fwd+bwd of 8K tokens, T1 / (2 T2) in CPU seconds", "higher",
        0.25, False, lambda r: r["cpu_efficiency"], Bounds(0.0, 2.0, low_open=True)),
    Row("attention-exact", "attention", "CP output and grads vs one process, max abs err <= 1e-4", "true", 0.0, False,
        lambda r: r["max_abs_err"] <= 1e-4),
    *_train_rows("train-pp1", "4 ranks, domain 4"),
    *_train_rows("train-pp2", "PP 2, domain 2"),
    *_train_rows("train-tp2-pp2", "TP 2 x PP 2, domain 2"),
    Row("verl-speedup", "verl", "verl door: hdp vs stock scheduling (verl-kk, static CP), per CPU-second", "higher",
        0.15, False, lambda r: r["speedup_cpu_time"], RATIO),
    Row("verl-exact", "verl", "both paths' gradients equal (rtol 1e-4)", "true", 0.0, False,
        lambda r: bool(r["grad_match"])),
    Row("verl-plans-differ", "verl", "the two paths ran different plans", "true", 0.0, False,
        lambda r: bool(r["plans_differ"])),
    Row("verl-door-overhead", "verl", "verl door step / library door step, same plan and model, CPU seconds",
        "lower", 0.10, False, lambda r: r["doors"]["verl_over_library_cpu"], RATIO),
    Row("verl-doors-same-plan", "verl", "both doors ran one plan, losses equal", "true", 0.0, False,
        lambda r: bool(r["doors"]["same_plan"] and r["doors"]["loss_match"])),
    Row("verl-old-logprob-exact", "verl-old-logprob", "main_ppo with the old-log-prob pass skipped vs run, same seed: "
        "pg/kl loss, entropy, grad norm equal (1e-4), the runs differ in the pass", "true", 0.0, False,
        lambda r: bool(r["metrics_match"] and r["sides_differ"])),
    Row("verl-old-logprob-time", "verl-old-logprob", "timing_s/old_log_prob skipped / run (median of the steps)",
        "lower", 0.1, True, lambda r: r["pass_time_ratio"], SHARE),  # a skipped pass may take 0 s
    *_model_rows(),
    Row("moe-level1-freed", "moe", "zero-memory level1: activation bytes freed / full recompute's", "higher",
        0.02, True, lambda r: r["freed_fraction_of_full"]["level1"], Bounds(0.0, 2.0)),
    Row("moe-level1-overhead", "moe", "zero-memory level1 step CPU time over none - 1 (paired median)", "lower",
        0.05, True, lambda r: r["step_cpu_overhead_paired_median"]["level1"],
        Bounds(-1.0, 100.0, low_open=True)),  # a time ratio - 1
    Row("memory-prediction-error", "memory", "largest held-out round's |predicted - measured| / measured",
        "lower", 0.03, True, lambda r: max(c["max_rel_err"] for c in r["cases"]), SHARE),
    Row("memory-limit-holds", "memory", "a plan to a memory limit stays within it, losses equal", "true", 0.0, False,
        lambda r: bool(r["limit"]["passed"])),
    Row("planner-time", "planner", "planner median CPU ms / a fixed scalar numba kernel's (same process)", "lower",
        0.30, False, lambda r: r["planner_over_reference"], Bounds(0.0, 1e4, low_open=True)),
    Row("planner-efficiency", "planner", "mean planned efficiency T*/T over the batches", "higher", 0.005, True,
        lambda r: r["efficiency_mean"], Bounds(0.0, 1.0 + 1e-9, low_open=True)),  # T*/T, T* a lower bound
    Row("faults-ok", "faults", "every rank raises, state unchanged, nothing hangs", "true", 0.0, False,
        lambda r: bool(r["ok"])),
    Row("faults-time", "faults", "slowest fault's seconds to exit / its collective timeout", "lower", 0.25, True,
        lambda r: r["worst_seconds_over_timeout"], SHARE),
    Row("faults-own-error-time", "faults", "a rank's own error: peers' seconds to exit / the 300 s timeout", "lower",
        0.02, True, lambda r: r["own_error_seconds_over_timeout"], SHARE),
    Row("nodes-speedup", "nodes", "two emulated nodes: node-blind / node-aware timed steps' wall seconds (the slow "
        "link is a wait, no CPU)", "higher", 0.2, False, lambda r: r["blind_over_aware"], RATIO),
    Row("nodes-exact", "nodes", "node-aware and node-blind losses equal (rel 1e-5)", "true", 0.0, False,
        lambda r: bool(r["max_loss_rel_diff"] <= 1e-5)),
    Row("device-kernel-exact", "device", "each accelerator attention kernel vs fp64 reference (hdp bench device)",
        "true", 0.0, False, lambda r: r["by_row"]["kernel_exactness"]["status"] == "ok"),
    Row("device-kernel-speed", "device", "fastest hdp kernel / torch SDPA, the slowest length's (4K-32K)", "higher",
        0.15, False, lambda r: r["kernel_speed_over_sdpa"], RATIO),
    Row("device-engine", "device", "the engine on the device (bf16) vs CPU fp32: losses, peak memory", "true",
        0.0, False, lambda r: r["by_row"]["engine_pp1"]["status"] == "ok"),
)
"""Every row, in table order."""


# ---- the baseline file ----------------------------------------------------------------------------


_FIX = "write one with hdp bench regress --update --baseline FILE"


def load_baseline(path: str | Path) -> dict[str, Any]:
    """``{row name: figure}`` of a baseline file (``{"rows": {...}, ...}``), checked whole; ValueError
    naming ``--baseline``, the file and the field: not a regular file (a FIFO, a device such as
    ``/dev/zero``, a directory), over `MAX_BASELINE_BYTES`, not JSON, an unknown row, a flag that is not
    true/false, a figure outside its row's range (`Row.bounds`)."""
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
    known = {r.name: r for r in ROWS}
    out: dict[str, Any] = {}
    for name, value in rows.items():
        row = known.get(name)
        if row is None:
            raise ValueError(f"{where}: row {name!r} is unknown; rows are {', '.join(known)}")
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
    return out


def check_covered(rows: Sequence[Row], base: Mapping[str, Any], path: str | Path) -> None:
    """ValueError naming every row of ``rows`` the run will measure that ``base`` has no figure for (the rows of
    `MAY_SKIP` benchmarks are judged after the run: ``missing from the baseline``, a failure)."""
    missing = [r.name for r in rows if r.name not in base and r.bench not in MAY_SKIP]
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


def write_baseline(path: str | Path, figures: Mapping[str, Any], note: Mapping[str, Any]) -> None:
    """Write ``figures`` (merged over the file's existing rows) and ``note`` (the machine) to ``path``, atomically
    (a temporary file in the same folder, renamed over it)."""
    p = Path(path)
    check_writable(p)
    rows: dict[str, Any] = {}
    if p.exists():
        rows.update(load_baseline(p))
    rows.update(figures)
    order = [r.name for r in ROWS]
    doc = {"rows": {k: rows[k] for k in order if k in rows}, "measured_on": dict(note),
           "command": "hdp bench regress --update"}
    real = Path(os.path.realpath(p))
    fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(doc, indent=1, sort_keys=False, allow_nan=False) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _machine() -> dict[str, Any]:
    import os
    import platform

    import torch

    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}


# ---- the run --------------------------------------------------------------------------------------


def select_rows(only: Sequence[str] | None) -> tuple[Row, ...]:
    """The rows ``only`` names (row names or benchmark names), in table order; all without it."""
    if not only:
        return ROWS
    names = {r.name for r in ROWS} | set(RUNNERS)
    unknown = [x for x in only if x not in names]
    if unknown:
        raise ValueError(f"--only={','.join(only)}: {', '.join(map(repr, unknown))} unknown; rows: "
                         f"{', '.join(r.name for r in ROWS)}; benchmarks: {', '.join(RUNNERS)}")
    return tuple(r for r in ROWS if r.name in only or r.bench in only)


def _judge(row: Row, got: Any, baseline: Any) -> dict[str, Any]:
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
    return {"now": now, "verdict": row.verdict(baseline, now)}


def run_regress(*, baseline: str | Path = BASELINE_FILE, only: Sequence[str] | None = None, update: bool = False,
                runners: Mapping[str, Callable[[], dict[str, Any]]] | None = None) -> dict[str, Any]:
    """Run the benchmarks the rows need (each once) and compare with ``baseline``; with ``update``,
    write this run's figures to it instead of judging them (refused when a flag row fails or a figure lies
    outside its row's range).  Before anything runs (ValueError naming ``--baseline``): the rows are known,
    the baseline file is read and checked whole (`load_baseline`) and holds every row the run will measure
    (`check_covered`); with ``update`` the file may be new, and its folder must exist (`check_writable`).

    Returns ``{"rows": [{"row", "bench", "meaning", "baseline", "now", "tolerance", "verdict"}, ...],
    "failed": [row names], "seconds": {bench: s}, "baseline_file", "updated"}``.
    """
    rows = select_rows(only)
    run_with = dict(RUNNERS if runners is None else runners)
    if update:
        check_writable(baseline)
    elif not os.path.lexists(baseline):
        raise ValueError(f"--baseline={str(baseline)!r}: no such file; record one with hdp bench regress --update "
                         f"--baseline {baseline}")
    base = load_baseline(baseline) if os.path.lexists(baseline) else {}
    if not update:
        check_covered(rows, base, baseline)
    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for bench in dict.fromkeys(r.bench for r in rows):
        t0 = time.perf_counter()
        try:
            results[bench] = run_with[bench]()
        except NoDevice as exc:
            results[bench] = exc
        except Exception as exc:  # noqa: BLE001 - a crashing benchmark is a failed row, named in the table
            logger.exception("bench regress: %s raised", bench)
            results[bench] = exc
        seconds[bench] = time.perf_counter() - t0
        logger.info("bench regress: %s took %.1f s", bench, seconds[bench])
    table, failed, figures = [], [], {}
    for row in rows:
        got = results[row.bench]
        entry = {"row": row.name, "bench": row.bench, "meaning": row.meaning, "baseline": base.get(row.name),
                 "tolerance": row.tolerance_text()}
        if isinstance(got, NoDevice):
            entry.update(now=None, verdict="skipped: no device")
        elif isinstance(got, Exception):
            entry.update(now=None, verdict=f"error: {type(got).__name__}: {str(got).splitlines()[0] if str(got) else ''}"[:160])
            failed.append(row.name)
        else:
            try:
                now = row.get(got)
            except (KeyError, TypeError, ValueError) as exc:
                entry.update(now=None, verdict=f"error: the result has no figure ({type(exc).__name__}: {exc})")
                failed.append(row.name)
            else:
                entry.update(_judge(row, now, base.get(row.name)))
                if entry["verdict"].startswith("error"):
                    failed.append(row.name)
                else:
                    figures[row.name] = entry["now"]
                    if entry["verdict"] in ("REGRESSION", MISSING):
                        failed.append(row.name)
        table.append(entry)
    if update:
        broken = [r["row"] for r in table if r["row"] in failed and (r["verdict"].startswith("error")
                                                                     or (r["now"] is False))]
        if broken:
            raise RuntimeError(f"bench regress --update: rows {', '.join(broken)} failed (a flag does not hold, the "
                               "benchmark raised or its figure lies outside the row's range); fix them before "
                               "recording a baseline")
        write_baseline(baseline, figures, _machine())
        for r in table:
            r["verdict"] = "updated" if r["row"] in figures else r["verdict"]
        failed = []
    return {"rows": table, "failed": failed, "seconds": seconds, "baseline_file": str(baseline), "updated": update}
