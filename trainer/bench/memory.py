"""``hdp bench memory``: the memory model's prediction of each round's measured peak, after calibration,
and a run planned to a memory limit that the token-budget plan exceeds.

**Prediction** (`bench_memory`): one configuration per (model, PP, recompute, zero-memory level), each
run on local gloo ranks through `HdpEngine.build` with ``calibration_path`` set, exactly as a user's
job: the engine measures every round's peak (`hdp.memory_meter`: on CPU the bytes autograd saves for
backward and hdp's CP buffers, on top of the parameters, gradient buffers and optimizer state the
engine holds) and writes ``"kind": "memory"`` records.  The first `CALIBRATION_STEPS` steps (the
planner's plans of seeded batches, plus one explicit plan with every group size) are the
calibration set: `hdp.packing.memory.fit_memory` fits the coefficients to their records.  The later
steps are held out: explicit plans on other lengths putting samples on groups of 1..N ranks; each
of their rounds' measured peak (the worst rank of each round and stage) is compared with the fitted
model's prediction.  A case per configuration: the worst round's predicted and measured bytes, the
largest relative error over all held-out rounds of the total peak (the check: ≤ 10%) and of the
part beyond the static bytes (reported, not checked: on a tiny CPU model it is the harder figure).

**Limit** (`bench_limit`): a dense model first calibrated as above; then the same batches trained
twice from the same weights: planned to the token budget alone, and planned to a memory limit set
between the two (``max_memory_gb``, the calibrated coefficients in ``memory_coefficients``).  Reports
each run's largest measured peak against the limit, the losses (equal: the update is exact whatever
the plan) and the step-time cost of the smaller rounds.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hdp.core.phases import median_phases

__all__ = ["MemoryCase", "CASES", "bench_memory", "bench_limit", "CALIBRATION_STEPS"]

CALIBRATION_STEPS = 4
"""Steps whose records fit the coefficients; the steps after them are held out."""
GB = float(1 << 30)


@dataclass(frozen=True, kw_only=True)
class MemoryCase:
    """One configuration of the prediction benchmark (picklable)."""

    name: str
    moe: bool = False
    pp: int = 1
    recompute: str = "none"
    zero_memory: str = "none"
    ranks: int = 4
    hidden_size: int = 128
    num_layers: int = 2
    vocab_size: int = 512

    @property
    def domain(self) -> int:
        return self.ranks // self.pp


CASES: tuple[MemoryCase, ...] = (
    MemoryCase(name="dense-pp1-recompute-none"),
    MemoryCase(name="dense-pp1-recompute-full", recompute="full"),
    MemoryCase(name="dense-pp2-recompute-none", pp=2),
    MemoryCase(name="dense-pp2-recompute-full", pp=2, recompute="full"),
    MemoryCase(name="moe-pp1-zero-memory-none", moe=True),
    MemoryCase(name="moe-pp1-zero-memory-level0", moe=True, zero_memory="level0"),
    MemoryCase(name="moe-pp1-zero-memory-level1", moe=True, zero_memory="level1"),
    MemoryCase(name="moe-pp2-zero-memory-level1", moe=True, pp=2, zero_memory="level1"),
)
"""Group sizes 1..4 at PP 1 (domain 4) and 1..2 at PP 2 (domain 2); recompute none/full; zero-memory
none/level0/level1 (MoE, 4 experts, top-2)."""

BUDGET = 256
"""Token budget of the calibration plans (tokens per rank per round)."""


def _engine_config(case: MemoryCase, records: str | None, **planning: Any):
    from hdp.trainer.config import EngineConfig, ParallelConfig, PlanningConfig
    from hdp.trainer.model import ModelConfig, OptimConfig

    moe = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=2 * case.hidden_size) if case.moe else {}
    return EngineConfig(
        model=ModelConfig(num_layers=case.num_layers, hidden_size=case.hidden_size, num_attention_heads=4,
                          vocab_size=case.vocab_size, max_sequence_length=8192, recompute=case.recompute,
                          activation="swiglu", **moe),
        optim=OptimConfig(lr=1e-4),
        planning=PlanningConfig(**{"max_tokens_per_rank": BUDGET, "auto_calibrate": False, "max_memory_gb": None,
                                   "cost_model": "cpu-tiny@cpu-gloo", "zero_memory": case.zero_memory,
                                   "calibration_path": records, **planning}),
        parallel=ParallelConfig(pp=case.pp),
    )


def _init(name: str, p: torch.Tensor) -> None:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=g) if p.dim() == 1 else 0.05 * torch.randn(p.shape, generator=g))


def _tokens(lengths: list[int], vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def _spread_plan(n: int, lengths: list[int]):
    """An explicit plan over a domain of ``n`` ranks putting the samples on groups of every size: round
    r holds one group of each width in a partition of n (n; n-1 + 1; ...; 1 x n)."""
    from hdp.packing import Plan

    widths = []
    for k in range(n, 0, -1):  # round with a group of k ranks and the rest single ranks
        widths.append([k] + [1] * (n - k))
    round_of, start, size, i = [], [], [], 0
    for r, ws in enumerate(widths):
        pos = 0
        for w in ws:
            round_of.append(r)
            start.append(pos)
            size.append(w)
            pos += w
            i += 1
    assert i == len(lengths), (i, len(lengths))
    return Plan.from_columns(num_ranks=n, max_tokens_per_rank=max(-(-L // k) for L, k in zip(lengths, size)) + 2,
                             policy="explicit", lengths=np.array(lengths), round_of=np.array(round_of),
                             group_start=np.array(start), group_size=np.array(size))


def _spread_lengths(n: int, per_rank: int, rng: np.random.Generator) -> list[int]:
    """Lengths for `_spread_plan`: a group of k ranks gets about k · per_rank tokens (± 30%)."""
    out = []
    for k in range(n, 0, -1):
        for w in [k] + [1] * (n - k):
            out.append(max(8, int(w * per_rank * rng.uniform(0.7, 1.3))))
    return out


def _worker(rank: int, world: int, case: MemoryCase, records: str, steps: int) -> dict[str, Any]:
    from hdp.trainer.engine import Batch, HdpEngine, nll_loss

    torch.set_num_threads(1)
    engine = HdpEngine.build(_engine_config(case, records), dist.group.WORLD, init_fn=_init)
    n = engine.num_ranks
    rng = np.random.default_rng(7)
    out: dict[str, Any] = {"domain": n, "loss": [], "steps": []}
    for s in range(steps):
        if s < CALIBRATION_STEPS - 1:  # the planner's own plans of seeded batches
            lengths = [int(x) for x in rng.integers(16, n * BUDGET, size=6 * n)]
            lengths = [min(x, n * BUDGET) for x in lengths]
            plan = None
        else:  # every group size: the last calibration step, then the held-out ones (other lengths)
            lengths = _spread_lengths(n, int(rng.integers(BUDGET // 4, BUDGET)), rng)
            plan = _spread_plan(n, lengths)
        m = engine.train_step(Batch(tokens=_tokens(lengths, case.vocab_size, 1000 + s)), nll_loss, plan=plan)
        out["loss"].append(m["loss"])
        out["steps"].append({k: v for k, v in m.items() if k.startswith("hdp/time/")})
    engine.close()
    return out


def _records(path: Path) -> list[dict[str, Any]]:
    return [r for r in (json.loads(line) for line in path.read_text().splitlines() if line.strip())
            if r.get("kind") == "memory"]


def _evaluate(case: MemoryCase, recs: list[dict[str, Any]]) -> dict[str, Any]:
    from hdp.packing.memory import fit_memory

    cal = [r for r in recs if r["step"] <= CALIBRATION_STEPS]
    held = [r for r in recs if r["step"] > CALIBRATION_STEPS]
    coef, fit = fit_memory(cal)
    c = [coef.activation, coef.expert, coef.cp, coef.logits]
    rows = []
    for r in held:
        pred = r["static_bytes"] + coef.headroom_bytes + sum(a * b for a, b in zip(c, r["features"]))
        meas = r["peak_bytes"]
        rows.append({"step": r["step"], "round": r["round"], "stage": r["stage"], "group_size": r["group_size"],
                     "tokens": r["tokens"], "predicted_bytes": pred, "measured_bytes": meas,
                     "rel_err": abs(pred - meas) / meas,
                     "dynamic_rel_err": abs(pred - meas) / max(meas - r["static_bytes"], 1.0)})
    worst = max(rows, key=lambda x: x["measured_bytes"])
    return {
        "name": case.name, "predicted_bytes": worst["predicted_bytes"], "measured_bytes": worst["measured_bytes"],
        "max_rel_err": max(x["rel_err"] for x in rows), "median_rel_err": statistics.median(x["rel_err"] for x in rows),
        "max_dynamic_rel_err": max(x["dynamic_rel_err"] for x in rows),
        "static_share": statistics.median(r["static_bytes"] / r["peak_bytes"] for r in held),
        "group_sizes": sorted({x["group_size"] for x in rows}), "pp": case.pp, "recompute": case.recompute,
        "zero_memory": case.zero_memory, "moe": case.moe, "held_out_rounds": len(rows),
        "calibration_records": len(cal), "coefficients": coef.to_dict(), "fit": fit,
        "passed": max(x["rel_err"] for x in rows) <= 0.10, "rounds": rows,
    }


def bench_memory(cases: tuple[MemoryCase, ...] = CASES, steps: int = CALIBRATION_STEPS + 3,
                 timeout: float = 900.0) -> dict[str, Any]:
    """Run every case (local gloo ranks) and compare predictions with measurements (module docstring)."""
    from hdp.trainer.launch import spawn

    out = []
    with tempfile.TemporaryDirectory(prefix="hdp-bench-memory-") as tmp:
        for case in cases:
            path = Path(tmp) / f"{case.name}.jsonl"
            t0 = time.perf_counter()
            ran = spawn(_worker, case.ranks, case, str(path), steps, timeout=timeout)
            res = _evaluate(case, _records(path))
            res["phases"] = median_phases(ran[0]["steps"])  # the slowest rank's seconds per phase
            res["seconds"] = time.perf_counter() - t0
            out.append(res)
    return {"cases": out, "passed": all(c["passed"] for c in out), "tolerance": 0.10,
            "measured": "CPU: bytes autograd saves for backward + hdp's CP buffers (hdp.memory_meter), on top of "
                        "the parameters, gradient buffers and optimizer state the engine holds"}


# ---- a run planned to a memory limit ---------------------------------------------------------------


def _limit_worker(rank: int, world: int, case: MemoryCase, records: str, coef: dict[str, float] | None,
                  limit_gb: float | None, batches: list[list[int]]) -> dict[str, Any]:
    from hdp.packing.memory import MemoryCoefficients
    from hdp.trainer.engine import Batch, HdpEngine, nll_loss

    torch.set_num_threads(1)
    extra: dict[str, Any] = {"max_tokens_per_rank": 4 * BUDGET}
    if limit_gb is not None:
        extra.update(max_memory_gb=limit_gb, memory_coefficients=MemoryCoefficients(**coef))
    engine = HdpEngine.build(_engine_config(case, records, **extra), dist.group.WORLD, init_fn=_init)
    out: dict[str, Any] = {"loss": [], "step_time": [], "peak_gb": [], "predicted_gb": [], "token_budget": [],
                           "rounds": []}
    for s, lengths in enumerate(batches):
        m = engine.train_step(Batch(tokens=_tokens(lengths, case.vocab_size, 2000 + s)), nll_loss)
        out["loss"].append(m["loss"])
        out["step_time"].append(m["perf/step_time"])
        out["peak_gb"].append(m.get("hdp/memory_peak_gb", math.nan))
        out["predicted_gb"].append(m.get("hdp/memory_predicted_gb", math.nan))
        out["token_budget"].append(m.get("hdp/token_budget", math.nan))
        out["rounds"].append(m["hdp/rounds"])
    engine.close()
    return out


def bench_limit(case: MemoryCase = MemoryCase(name="dense-pp1-limit"), steps: int = 4,
                timeout: float = 900.0) -> dict[str, Any]:
    """Calibrate ``case``, then train the same batches to the token budget alone and to a memory limit
    the token-budget plan exceeds (module docstring)."""
    from hdp.trainer.launch import spawn

    rng = np.random.default_rng(11)
    n = case.domain
    batches = [[int(x) for x in rng.integers(32, 4 * BUDGET, size=3 * n)] for _ in range(steps)]
    with tempfile.TemporaryDirectory(prefix="hdp-bench-limit-") as tmp:
        cal_path = Path(tmp) / "cal.jsonl"
        spawn(_worker, case.ranks, case, str(cal_path), CALIBRATION_STEPS, timeout=timeout)
        from hdp.packing.memory import fit_memory

        coef, fit = fit_memory(_records(cal_path), cover=True)
        free = spawn(_limit_worker, case.ranks, case, str(Path(tmp) / "free.jsonl"), None, None, batches,
                     timeout=timeout)[0]
        measured = max(free["peak_gb"])
        static = min(r["static_bytes"] for r in _records(Path(tmp) / "free.jsonl")) / GB
        limit = static + 0.6 * (measured - static)  # below what the token-budget plan needed
        capped = spawn(_limit_worker, case.ranks, case, str(Path(tmp) / "capped.jsonl"), coef.to_dict(), limit,
                       batches, timeout=timeout)[0]
    rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(free["loss"], capped["loss"]))
    t_free, t_cap = statistics.median(free["step_time"][1:]), statistics.median(capped["step_time"][1:])
    return {
        "name": case.name, "limit_gb": limit, "static_gb": static, "coefficients": coef.to_dict(), "fit": fit,
        "token_budget_run": {"max_peak_gb": measured, "over_limit": measured > limit, **free},
        "memory_limit_run": {"max_peak_gb": max(capped["peak_gb"]), "within_limit": max(capped["peak_gb"]) <= limit,
                             **capped},
        "loss_max_rel_diff": rel, "losses_equal": rel <= 1e-5,
        "step_time_cost": t_cap / t_free, "passed": measured > limit and max(capped["peak_gb"]) <= limit and rel <= 1e-5,
    }


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` without the per-round rows (what ``--json`` prints by default)."""
    cases = [{k: v for k, v in c.items() if k != "rounds"} for c in result.get("cases", [])]
    return {**result, "cases": cases}
