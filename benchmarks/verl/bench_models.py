"""``python -m benchmarks models``: every model family hdp computes exactly, against HF ``transformers`` on the same weights,
through both doors (CPU, 2 gloo ranks, about 10 s per family and door).

Each family (:data:`hdp.integrations.verl.scaffolding.families.CASES`: Llama 3.1's ``llama3`` RoPE, Qwen3 with
YaRN, Qwen2 / Mistral sliding windows, gpt-oss-style and off-by-one sinks, a custom ``softmax_scale``, DeepSeek-V3's
multi-latent attention and MoE under EP 2 and zero-memory) is a tiny
random checkpoint; the library door runs ``HdpEngine.build`` + ``forward`` + ``train_step``, the verl door verl's
``ActorRolloutRefWorker`` (mbridge-built, for the families mbridge knows) ``compute_log_prob`` + ``update_actor``;
both with a sample longer than the token budget on a CP group of 2.  A family is exact when every door it runs
matches HF (log-probs 2e-5 absolute, loss 1e-5 and grad norm 1e-4 relative); ``hdp bench regress --preset ci`` keeps one
flag per family (``models-<family>-exact``).
"""

from __future__ import annotations

import tempfile
import time
from typing import Any, Sequence

__all__ = ["bench_models", "add_arguments", "run_library", "run_verl"]


def run_library(rank: int, world: int, names: Sequence[str], root: str) -> dict[str, Any]:
    """Every family of ``names`` through the library door, one engine after the other in these ranks."""
    from hdp.integrations.verl.scaffolding.families import library_door

    return {name: library_door(rank, world, name, root) for name in names}


def run_verl(rank: int, world: int, name: str, root: str) -> dict[str, Any]:
    """One family through verl's worker (a fresh pair of ranks per family: verl's worker holds global state)."""
    from hdp.integrations.verl.scaffolding.families import verl_door

    return verl_door(rank, world, name, root)


def bench_models(families: str | None = None, doors: str = "library,verl") -> dict[str, Any]:
    """Run ``families`` (comma-separated row names; default all) through ``doors``; see the module docstring."""
    from hdp.integrations.verl.scaffolding.families import CASES
    from hdp.trainer.launch import check_local_capacity, spawn

    names = list(CASES) if families is None else [f.strip() for f in families.split(",") if f.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        raise ValueError(f"--families={families!r}: choose among {', '.join(CASES)}")
    which = {d.strip() for d in doors.split(",") if d.strip()}
    if not which or not which <= {"library", "verl"}:
        raise ValueError(f"--doors={doors!r}: choose library, verl or both (comma-separated)")
    check_local_capacity(2)
    out: dict[str, dict[str, Any]] = {n: {"what": CASES[n].what} for n in names}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hdp-bench-models-") as root:
        if "library" in which:
            lib = spawn(run_library, 2, names, root, timeout=120.0 + 60.0 * len(names))[0]
            for n in names:
                out[n]["library"] = lib[n]
        if "verl" in which:
            for n in names:
                out[n]["verl"] = (spawn(run_verl, 2, n, root, timeout=300.0)[0] if CASES[n].mbridge
                                  else "not run: mbridge has no bridge for this family")
    for row in out.values():
        ran = [v for k, v in row.items() if k in ("library", "verl") and isinstance(v, dict)]
        row["ok"] = bool(ran) and all(v["ok"] for v in ran)
    return {"families": out, "seconds": time.perf_counter() - t0, "passed": all(r["ok"] for r in out.values())}


def add_arguments(parser: Any) -> None:
    """The flags of ``python -m benchmarks models`` (the CLI adds ``--json``)."""
    parser.add_argument("--families", default=None, metavar="A,B",
                        help="families to run (default all: llama3.1, qwen3-yarn, qwen2-window, mistral-window, "
                             "mistral-sinks, qwen3-off-by-one, qwen3-scale, deepseek-v3)")
    parser.add_argument("--doors", default="library,verl", metavar="A,B",
                        help="library (HdpEngine.build), verl (the worker, mbridge-built), or both (default)")
