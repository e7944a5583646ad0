"""``python -m benchmarks verl-old-logprob``: verl's ``main_ppo`` twice, side by side on the same seed — the actor's
old-log-prob pass skipped (``actor_rollout_ref.actor.hdp.skip_old_log_prob=auto`` on an on-policy step) and
run (``=false``) — comparing the training metrics and the time.

Both runs are ``hdp demo --verl`` (:mod:`hdp.integrations.verl.demo`: verl's own trainer, Ray, rollout
through hdp's CPU HF server, whose sampling is seeded per prompt so that a run repeats its samples) with
``actor_rollout_ref.rollout.calculate_log_probs=False`` (verl's rollout-vs-actor metrics read the old
log-probs before the update: with them on, ``auto`` keeps the pass).  Reported per step: ``actor/pg_loss``,
``actor/kl_loss``, ``actor/entropy``, ``actor/grad_norm`` of both runs and their largest relative
difference, ``timing_s/old_log_prob`` and ``timing_s/step``; ``metrics``: every metric of both runs' step lines.  ``passed``: the skipped run skipped and the other
did not (the two sides differ), the metrics agree within ``TOLERANCE`` and the skipped pass takes under a
fifth of the time of the one that ran.  On this tiny model the step is mostly rollout; the pass's share of a
long-sequence job's step is much larger (see docs/verl.md).
"""

from __future__ import annotations

import contextlib
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["bench_verl_old_logprob", "add_arguments", "METRICS", "TOLERANCE"]

METRICS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")
"""The update's metrics compared between the runs."""
TOLERANCE = 1e-4
"""Largest relative difference allowed between the runs' metrics (fp32 round-off of two forward passes
against one: observed ~1e-6)."""
SCALE_FLOOR = 1e-3
"""The smallest scale a metric's difference is taken relative to."""
_TIMES = ("timing_s/old_log_prob", "timing_s/step", "actor/hdp/old_log_prob_skipped")


def _metrics(line: str) -> dict[str, float]:
    out = {}
    for m in re.finditer(r"([\w/]+):([-+\w.]+)", line):
        try:
            out[m.group(1)] = float(m.group(2))
        except ValueError:
            pass
    return out


def _rel(a: float, b: float) -> float:
    """|a - b| relative to the larger, with a floor of `SCALE_FLOOR` (a loss that sums to ~0, as GAE's
    normalised advantages make the policy loss, differs by round-off relative to its terms, not to itself)."""
    return abs(a - b) / max(abs(a), abs(b), SCALE_FLOOR)


def bench_verl_old_logprob(steps: int = 2, critic: bool = False, out: str | None = None) -> dict[str, Any]:
    """Run both ``main_ppo`` jobs (``steps`` steps each; ``critic``: PPO with GAE and the critic on hdp) and
    compare them (see the module docstring).  ``out``: keep each run's files (model, data, calibration records,
    verl's outputs) under ``out/skipped`` and ``out/run``; default temporary folders."""
    from hdp.integrations.verl.demo import run

    if steps < 1:
        raise ValueError(f"steps={steps}: must be >= 1")
    common = ["actor_rollout_ref.rollout.calculate_log_probs=False"]
    runs: dict[str, list[dict[str, float]]] = {}
    for name, value in (("skipped", "auto"), ("run", "false")):
        with contextlib.ExitStack() as scope:
            if out is None:
                root = scope.enter_context(tempfile.TemporaryDirectory(prefix=f"hdp-old-logprob-{name}-"))
            else:
                root = str(Path(out) / name)
                Path(root).mkdir(parents=True, exist_ok=True)
            code, lines = run(root, steps=steps, critic=critic,
                              overrides=[*common, f"actor_rollout_ref.actor.hdp.skip_old_log_prob={value}"])
            if code != 0 or len(lines) != steps:
                raise RuntimeError(f"main_ppo ({name}) exited with {code} after {len(lines)} of {steps} steps; run "
                                   f"hdp demo --verl --set actor_rollout_ref.actor.hdp.skip_old_log_prob={value} to see it")
            runs[name] = [_metrics(x) for x in lines]
    per_step = []
    for i, (a, b) in enumerate(zip(runs["skipped"], runs["run"]), 1):
        row: dict[str, Any] = {"step": i}
        for key in (*METRICS, *_TIMES):
            row[key] = {"skipped": a.get(key), "run": b.get(key)}
        row["max_rel_diff"] = max(_rel(a[k], b[k]) for k in METRICS if k in a and k in b)
        per_step.append(row)
    skipped_flags = [r["actor/hdp/old_log_prob_skipped"]["skipped"] for r in per_step]
    run_flags = [r["actor/hdp/old_log_prob_skipped"]["run"] for r in per_step]
    t_skip = statistics.median(r["timing_s/old_log_prob"]["skipped"] for r in per_step)
    t_run = statistics.median(r["timing_s/old_log_prob"]["run"] for r in per_step)
    later = per_step[1:] or per_step  # step 1 holds the runs' warm-up
    step_skip = statistics.median(r["timing_s/step"]["skipped"] for r in later)
    step_run = statistics.median(r["timing_s/step"]["run"] for r in later)
    max_diff = max(r["max_rel_diff"] for r in per_step)
    sides_differ = all(f == 1.0 for f in skipped_flags) and all(f == 0.0 for f in run_flags)
    return {
        "steps": per_step,
        "metrics": runs,  # every metric of every step line of both runs (verl's console logger)
        "sides_differ": sides_differ,
        "max_rel_diff": max_diff,
        "metrics_match": max_diff <= TOLERANCE,
        "old_log_prob_s": {"skipped": t_skip, "run": t_run},
        "step_s_after_first": {"skipped": step_skip, "run": step_run},
        "step_time_ratio": step_skip / step_run if step_run > 0 else float("nan"),
        "passed": bool(sides_differ and max_diff <= TOLERANCE and t_skip < 0.2 * t_run),
    }


def add_arguments(parser: Any) -> None:
    """The flags of ``python -m benchmarks verl-old-logprob`` (the CLI adds ``--json``)."""
    from hdp.trainer.cli.common import positive_int

    parser.add_argument("--steps", type=positive_int, default=2, help="training steps of each main_ppo run (default 2)")
    parser.add_argument("--critic", action="store_true", help="PPO with GAE, the critic on hdp too (default GRPO)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="keep each run's files under DIR/skipped and DIR/run (default temporary folders)")

