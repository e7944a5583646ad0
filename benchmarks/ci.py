"""This project's CI preset of ``hdp bench regress`` (``--preset ci``, from a checkout's root): every benchmark in a
short mode, each ratio or flag against the committed baseline ``benchmarks/ci_baseline.json``.

Each row is one figure a benchmark measures **side by side in the same run** -- a speedup over the
baseline policy (the paired median of steps' CPU-second ratios, `hdp.trainer.bench.stats`), an efficiency,
an exactness flag, the planner's time over a fixed reference computation timed in the same process, the
memory model's prediction error, a fault's seconds to exit over its collective timeout -- so a slower or
busier machine moves both sides alike and the figure stays comparable between runs.  The baseline was
measured on this project's CI machine (2 CPU cores, gloo, shared); the rows' tolerances where the file
states them come from measured spread (``--update --repeats``, `hdp.trainer.bench.regress.derive_tolerance`).

The short modes (`RUNNERS`) together take about ten minutes on 2 cores; rows select what runs (``--only``:
row or benchmark names), and each benchmark runs at most once per repeat.  ``python -m benchmarks regress``
is the same command.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hdp.trainer.bench.regress import RATIO, SHARE, Bounds, NoDevice, Preset, Row

__all__ = ["PRESET", "ROWS", "RUNNERS", "BASELINE_FILE", "MAY_SKIP", "TRAIN_STEPS", "reference_ms"]

BASELINE_FILE = Path(__file__).with_name("ci_baseline.json")
"""The committed baseline: the figures of this project's CI machine (2 CPU cores)."""

TRAIN_STEPS = 17
"""Steps per policy of the train rows (16 timed, paired): enough for a 95% interval of the paired speedup
narrower than the rows' spread between runs (benchmarks/2026-12-07-train-pp.md)."""


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
    from benchmarks.attention import bench_attention

    return bench_attention(ranks=2, tokens=8192, algo="ring", repeats=3)


def _train(ranks: int, tp: int, pp: int) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        from hdp.trainer.bench.train import TrainBenchSpec, bench_train

        return bench_train(TrainBenchSpec(ranks=ranks, tp=tp, pp=pp, steps=TRAIN_STEPS, samples=32, num_layers=2,
                                          vocab_size=512))

    return run


def _verl() -> dict[str, Any]:
    from benchmarks.verl.bench import bench_verl

    return bench_verl(ranks=4, steps=5)


def _verl_old_logprob() -> dict[str, Any]:
    from benchmarks.verl.bench_old_log_prob import bench_verl_old_logprob

    result = bench_verl_old_logprob(steps=2)
    t = result["old_log_prob_s"]
    return {**result, "pass_time_ratio": t["skipped"] / t["run"] if t["run"] > 0 else math.nan}


def _models() -> dict[str, Any]:
    from benchmarks.verl.bench_models import bench_models

    return bench_models()


def _moe() -> dict[str, Any]:
    from benchmarks.moe import bench_moe

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
    from benchmarks.faults import run_faults

    result = run_faults(timeout_s=10.0, only=("in-process", "sigkill-mid-step", "own-error-in-round"))

    def over(rows: list[dict[str, Any]]) -> float:  # seconds to exit / the row's collective timeout, the worst
        return max(r["seconds_to_exit"] / r.get("collective_timeout_s", result["collective_timeout_s"]) for r in rows)

    own = [r for r in result["faults"] if r["fault"].startswith("own-error")]
    return {**result, "worst_seconds_over_timeout": over(result["faults"]), "own_error_seconds_over_timeout": over(own)}


def _nodes() -> dict[str, Any]:
    from benchmarks.nodes import NodesBenchSpec, bench_nodes

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
"""Benchmarks that skip on a machine without a GPU or NPU (`NoDevice`)."""


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
        Row(f"{bench}-speedup", bench, f"hdp vs static-cp, paired median of steps' CPU-second ratios, {layout}", "higher",
            0.15, False, lambda r: r["paired"]["hdp_vs_static-cp"]["cpu"]["median"], RATIO, speed=True,
            spread=lambda r: r["paired"]["hdp_vs_static-cp"]["cpu"]["half_width"] / 1.96),
        Row(f"{bench}-exact", bench, "losses of both policies equal (rel 1e-4), their plans different", "true", 0.0,
            False, lambda r: bool(r["loss_match"] and r["plans_differ"])),
    )


ROWS: tuple[Row, ...] = (
    Row("attention-efficiency", "attention", "ring CP2 fwd+bwd of 8K tokens, T1 / (2 T2) in CPU seconds", "higher",
        0.25, False, lambda r: r["cpu_efficiency"], Bounds(0.0, 2.0, low_open=True), speed=True),
    Row("attention-exact", "attention", "CP output and grads vs one process, max abs err <= 1e-4", "true", 0.0, False,
        lambda r: r["max_abs_err"] <= 1e-4),
    *_train_rows("train-pp1", "4 ranks, domain 4"),
    *_train_rows("train-pp2", "PP 2, domain 2"),
    *_train_rows("train-tp2-pp2", "TP 2 x PP 2, domain 2"),
    Row("verl-speedup", "verl", "verl door: hdp vs stock scheduling (verl-kk, static CP), per CPU-second", "higher",
        0.15, False, lambda r: r["speedup_cpu_time"], RATIO, speed=True),
    Row("verl-exact", "verl", "both paths' gradients equal (rtol 1e-4)", "true", 0.0, False,
        lambda r: bool(r["grad_match"])),
    Row("verl-plans-differ", "verl", "the two paths ran different plans", "true", 0.0, False,
        lambda r: bool(r["plans_differ"])),
    Row("verl-door-overhead", "verl", "verl door step / library door step, same plan and model, CPU seconds",
        "lower", 0.10, False, lambda r: r["doors"]["verl_over_library_cpu"], RATIO, speed=True),
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
        Bounds(-1.0, 100.0, low_open=True), speed=True),  # a time ratio - 1
    Row("memory-prediction-error", "memory", "largest held-out round's |predicted - measured| / measured",
        "lower", 0.03, True, lambda r: max(c["max_rel_err"] for c in r["cases"]), SHARE),
    Row("memory-limit-holds", "memory", "a plan to a memory limit stays within it, losses equal", "true", 0.0, False,
        lambda r: bool(r["limit"]["passed"])),
    Row("planner-time", "planner", "planner median CPU ms / a fixed scalar numba kernel's (same process)", "lower",
        0.30, False, lambda r: r["planner_over_reference"], Bounds(0.0, 1e4, low_open=True), speed=True),
    Row("planner-efficiency", "planner", "mean planned efficiency T*/T over the batches", "higher", 0.005, True,
        lambda r: r["efficiency_mean"], Bounds(0.0, 1.0 + 1e-9, low_open=True)),  # T*/T, T* a lower bound
    Row("faults-ok", "faults", "every rank raises, state unchanged, nothing hangs", "true", 0.0, False,
        lambda r: bool(r["ok"])),
    Row("faults-time", "faults", "slowest fault's seconds to exit / its collective timeout", "lower", 0.25, True,
        lambda r: r["worst_seconds_over_timeout"], SHARE),
    Row("faults-own-error-time", "faults", "a rank's own error: peers' seconds to exit / the 300 s timeout", "lower",
        0.02, True, lambda r: r["own_error_seconds_over_timeout"], SHARE),
    Row("nodes-speedup", "nodes", "two emulated nodes: node-blind / node-aware timed steps' wall seconds (the slow "
        "link is a wait, no CPU)", "higher", 0.2, False, lambda r: r["blind_over_aware"], RATIO, speed=True),
    Row("nodes-exact", "nodes", "node-aware and node-blind losses equal (rel 1e-5)", "true", 0.0, False,
        lambda r: bool(r["max_loss_rel_diff"] <= 1e-5)),
    Row("device-kernel-exact", "device", "each accelerator attention kernel vs fp64 reference (hdp bench device)",
        "true", 0.0, False, lambda r: r["by_row"]["kernel_exactness"]["status"] == "ok"),
    Row("device-kernel-speed", "device", "fastest hdp kernel / torch SDPA, the slowest length's (4K-32K)", "higher",
        0.15, False, lambda r: r["kernel_speed_over_sdpa"], RATIO, speed=True),
    Row("device-engine", "device", "the engine on the device (bf16) vs CPU fp32: losses, peak memory", "true",
        0.0, False, lambda r: r["by_row"]["engine_pp1"]["status"] == "ok"),
)
"""Every row, in table order."""


PRESET = Preset(name="ci", about="this project's CI: every benchmark in a short mode", rows=ROWS, runners=RUNNERS,
                may_skip=MAY_SKIP, baseline=BASELINE_FILE,
                config={"train": {"steps": TRAIN_STEPS, "samples": 32, "num_layers": 2, "vocab_size": 512}})
"""The CI preset (``hdp bench regress --preset ci``)."""
