"""The closed loop on a machine hdp's presets do not describe: measure, ``hdp calibrate``, ``hdp plan``.

A stand-in "hardware" whose every CP rank pays a large per-token cost (a `CostModel` of hdp's
family: deepseek-v3 on h100-nvlink with ``merge_per_token = cp_per_token = 5000``, i.e. about
5000 units per token of the sample on every rank of its group) produces measured records with
+-3% noise.  ``hdp calibrate --records R.jsonl --out COST.json`` fits them; ``hdp plan --cost-model
COST.json --json`` plans held-out batches (RL rollouts and Wikipedia document lengths) and every plan
is scored under the hardware itself, next to megatron-core's real ``BalancedCPScheduler``, our
``megatron-dcp`` port and the plans made with the unfitted preset.

    python examples/cost_closed_loop.py                      # N = 64, 1,024 samples per batch
    python examples/cost_closed_loop.py --ranks 16 --samples 256 --json
    python examples/cost_closed_loop.py --seeds 8     # also 8 more held-out batches per workload

Every figure is a simulated step time under the stand-in hardware's cost model (the only truth
here); efficiency is T*/T under that model, "tight" is T*_tight/T (``lower_bound_tight``: also what
tall samples force on every plan) and "best possible" T*/T*_tight, the most any plan can reach.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hdp.packing import CostModel, Plan, PlannerConfig, cost_model, plan, simulate
from hdp.packing.calibrate import group_seconds
from hdp.packing.workloads import get_workload, wikipedia
from hdp.trainer.cli import main as hdp

HARDWARE = dataclasses.replace(cost_model("deepseek-v3", "h100-nvlink"), merge_per_token=5000.0, cp_per_token=5000.0)
"""The stand-in machine: a large per-token CP overhead on every rank of a group."""


def measured_records(hardware: CostModel, budget: int, *, n: int = 300, seed: int = 0, noise: float = 0.03) -> list[dict]:
    """Records a calibration run would measure: random packed groups of 1-8 ranks within the budget
    (group records) and short rounds (round records), each time off by up to +-``noise``."""
    rng = np.random.default_rng(seed)
    recs = []
    for _ in range(n):
        k = int(rng.choice([1, 2, 3, 4, 5, 6, 8]))
        m = int(rng.integers(1, 5))
        lengths = np.exp(rng.uniform(np.log(64), np.log(0.95 * k * budget / m), m)).astype(int).tolist()
        t = group_seconds(hardware, lengths, k) * (1 + rng.uniform(-noise, noise))
        recs.append({"kind": "group", "lengths": lengths, "group_size": k, "seconds": t})
    for _ in range(n // 8):
        groups = [{"lengths": np.exp(rng.uniform(np.log(16), np.log(512), 2)).astype(int).tolist(),
                   "group_size": int(rng.choice([1, 2, 4]))} for _ in range(3)]
        t = max(group_seconds(hardware, g["lengths"], g["group_size"]) for g in groups)
        t += hardware.round_cost * hardware.unit_time_s
        recs.append({"kind": "round", "groups": groups, "seconds": t * (1 + rng.uniform(-noise, noise))})
    return recs


def _cli(argv: list[str]) -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = hdp(argv)
    if rc != 0:
        raise RuntimeError(f"hdp {' '.join(argv)} exited {rc}")
    return json.loads(out.getvalue())


def held_out_batches(samples: int, wikipedia_path: str | None = None, seed: int | None = None) -> dict[str, np.ndarray]:
    """RL rollouts (16K and 32K response caps) and Wikipedia document lengths, seeds unseen by the
    records (123, 7 and 5; or ``seed`` for all three)."""
    return {
        "rl": get_workload("rl")(n=samples, seed=123 if seed is None else seed),
        "rl-32k": get_workload("rl-32k")(n=samples, seed=7 if seed is None else seed),
        "wikipedia": wikipedia(n=samples, seed=5 if seed is None else seed, path=wikipedia_path),
    }


def run(ranks: int = 64, samples: int = 1024, budget: int = 8192, workdir: str | None = None,
        wikipedia_path: str | None = None, seeds: int = 0) -> dict[str, Any]:
    """records -> ``hdp calibrate`` -> ``hdp plan --cost-model`` on held-out batches, scored under the hardware."""
    from hdp.trainer.bench.peers import megatron_core_plan

    work = Path(workdir or tempfile.mkdtemp(prefix="hdp-closed-loop-"))
    records, cost_file = work / "records.jsonl", work / "cost.json"
    records.write_text("".join(json.dumps(r) + "\n" for r in measured_records(HARDWARE, budget)))
    doc = _cli(["calibrate", "--records", str(records), "--out", str(cost_file),
                "--model", "deepseek-v3", "--profile", "h100-nvlink", "--json"])
    fitted = CostModel.load(cost_file)
    preset = cost_model("deepseek-v3", "h100-nvlink")
    out: dict[str, Any] = {"calibration": {"fitted": doc["fitted"], "from_base": doc["from_base"], "fit": doc["fit"],
                                           "parameters": doc["parameters"],
                                           "hardware": dataclasses.asdict(HARDWARE)}, "batches": {}}
    for name, lengths in held_out_batches(samples, wikipedia_path).items():
        lengths_file = work / f"{name}.txt"
        lengths_file.write_text("\n".join(str(int(x)) for x in lengths) + "\n")
        planned = _cli(["plan", "--lengths", str(lengths_file), "--ranks", str(ranks),
                        "--max-tokens-per-rank", str(budget), "--cost-model", str(cost_file), "--json"])
        p = Plan.from_dict(planned)
        row: dict[str, Any] = {"hdp": _score(p, budget), "planner_ms": planned["stats"]["planner_ms"]}
        row["best_possible_efficiency"] = row["hdp"]["lower_bound"] / row["hdp"]["lower_bound_tight"]
        cfg = PlannerConfig(num_ranks=ranks, max_tokens_per_rank=budget, cost=fitted)
        row["hdp (unfitted preset)"] = _score(plan(lengths, dataclasses.replace(cfg, cost=preset)), budget)
        for policy in ("megatron-dcp", "static-cp", "ascend-hdp", "verl-kk"):
            row[policy] = _score(plan(lengths, dataclasses.replace(cfg, policy=policy)), budget)
        row["megatron-core"] = _score(megatron_core_plan(lengths, cfg), budget)
        out["batches"][name] = row
    if seeds:
        out["seeds"] = seed_sweep(fitted, ranks, samples, budget, seeds, wikipedia_path)
    return out


def seed_sweep(fitted: CostModel, ranks: int, samples: int, budget: int, seeds: int,
               wikipedia_path: str | None = None) -> dict[str, dict[str, list[float]]]:
    """hdp (planning with the fitted model) on ``seeds`` more held-out batches per workload (seeds
    100, 101, ...), scored under the hardware: efficiency, tight efficiency, best possible."""
    cfg = PlannerConfig(num_ranks=ranks, max_tokens_per_rank=budget, cost=fitted)
    batches = [held_out_batches(samples, wikipedia_path, seed=100 + i) for i in range(seeds)]
    out: dict[str, dict[str, list[float]]] = {}
    for name in batches[0] if batches else ():
        rows = [_score(plan(b[name], cfg), budget) for b in batches]
        out[name] = {"efficiency": [r["efficiency"] for r in rows],
                     "efficiency_tight": [r["efficiency_tight"] for r in rows],
                     "best_possible": [r["lower_bound"] / r["lower_bound_tight"] for r in rows],
                     "budget_ok": [r["budget_ok"] for r in rows]}
    return out


def _score(p: Plan, budget: int) -> dict[str, Any]:
    """The plan under the stand-in hardware: efficiency, step time, whether it keeps the token budget."""
    stats = simulate(p, HARDWARE, tight=True)
    return {"efficiency": stats.efficiency, "efficiency_tight": stats.efficiency_tight,
            "lower_bound": stats.lower_bound, "lower_bound_tight": stats.lower_bound_tight,
            "step_time_s": stats.step_time_s, "rounds": stats.rounds,
            "max_tokens_per_rank": stats.max_tokens_per_rank, "budget_ok": stats.max_tokens_per_rank <= budget}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--max-tokens-per-rank", type=int, default=8192, dest="budget")
    parser.add_argument("--wikipedia", default=None, help="document-length file (default: the 1M-document file bundled with hdp)")
    parser.add_argument("--seeds", type=int, default=0, help="also plan this many more held-out batches per workload")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args.ranks, args.samples, args.budget, wikipedia_path=args.wikipedia, seeds=args.seeds)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    cal = result["calibration"]
    print(f"calibrated: R² {cal['fit']['r2']:.4f}, median relative error {cal['fit']['median_rel_err']:.2%}; "
          f"from the base: {cal['from_base'] or 'nothing'}")
    for p in ("merge_per_token", "cp_per_token", "linear_coef", "unit_time_s"):
        print(f"  {p:16s} fitted {cal['parameters'][p]:.4g}  hardware {cal['hardware'][p]:.4g}")
    print(f"efficiency under the hardware (N={args.ranks}, {args.samples} samples, B={args.budget}); "
          "T(policy)/T(hdp) in brackets; * = over the token budget")
    for name, row in result["batches"].items():
        t_hdp = row["hdp"]["step_time_s"]
        cells = [f"{pol} {r['efficiency']:.3f} ({r['step_time_s'] / t_hdp:.2f}x){'' if r['budget_ok'] else '*'}"
                 for pol, r in row.items() if isinstance(r, dict)]
        print(f"  {name:10s} " + "; ".join(cells))
        print(f"  {'':10s} hdp tight {row['hdp']['efficiency_tight']:.3f}; best possible {row['best_possible_efficiency']:.3f}")
    for name, sweep in result.get("seeds", {}).items():
        e, t, b = (np.asarray(sweep[k]) for k in ("efficiency", "efficiency_tight", "best_possible"))
        print(f"  {name:10s} {e.size} more batches: hdp {e.min():.3f}-{e.max():.3f} (>= 0.95: {int((e >= 0.95).sum())}), "
              f"tight {t.min():.3f}-{t.max():.3f}, best possible {b.min():.3f}-{b.max():.3f} "
              f"(>= 0.95: {int((b >= 0.95).sum())}); budget kept on all: {all(sweep['budget_ok'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
