#!/usr/bin/env python3
"""Where the verl door's step goes beside the library door's: per-function wall and CPU time per step.

The setup of ``python -m benchmarks verl``'s doors row (`benchmarks.verl.bench`: the tiny Megatron GPT, the
short-tailed verl update batch, verl's ``ppo_loss`` on the verl door, `library_ppo_loss` on the library
door, one model, optimizer and plan), the doors alternating step by step.  Each named function is wrapped
with wall-clock and ``time.process_time`` counters (CPU of the whole process, so background threads
count too), no profiler, so the figures are a step's own; Megatron's forward (with the loss) and backward
steps and the garbage collector's passes (by generation) are timed the same way.  Prints, for each rank, the doors' median step
and each function's milliseconds per step on each door.  Usage::

    python tools/doors_profile.py                  # 4 gloo ranks, 10 steps per door
    python tools/doors_profile.py --ranks 2 --steps 3 --json
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import logging
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:  # the checkout's root: benchmarks/ (outside the wheel), in this process and its ranks
    sys.path.insert(0, ROOT)

Timers = dict[str, float]


def _wrap(owner: Any, name: str, label: str, acc: Timers, door: list[str]) -> None:
    """Replace ``owner.name`` by a wrapper adding its wall and CPU seconds and its calls to ``acc``."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[f"{door[0]}|{label}|wall"] += time.perf_counter() - t0
            acc[f"{door[0]}|{label}|cpu"] += time.process_time() - c0
            acc[f"{door[0]}|{label}|calls"] += 1

    setattr(owner, name, timed)


def _rank(rank: int, world: int, steps: int) -> dict[str, Any]:
    import torch.distributed as dist
    from verl.workers.utils.losses import ppo_loss

    import hdp.integrations.verl.engine as verl_engine
    import hdp.trainer.engine as lib_engine
    from hdp import megatron_compat as mc
    from benchmarks.verl import bench
    from hdp.integrations.verl import batch, compat, loss
    from hdp.core import planning, rounds, step

    logging.getLogger("verl").setLevel(logging.ERROR)
    acc: Timers = collections.defaultdict(float)
    door = ["-"]
    wraps: list[tuple[Any, str, str]] = [
        (loss.VerlLoss, "__init__", "loss adapter: init"), (loss.VerlLoss, "__call__", "loss adapter: call"),
        (loss.VerlLoss, "local", "log-probs"), (loss, "group_to_leader", "exchange"),
        (loss, "leader_to_group", "exchange"),
        (batch.SampleRows, "select", "sub-batch (select)"), (compat, "nested_from_flat", "nested tensors"),
        (batch, "gather_whole_samples", "collect: gather"), (verl_engine, "verl_outputs", "collect"),
        (rounds.RoundCore, "_round_loss", "round losses"), (rounds.RoundCore, "run", "rounds"),
        (rounds.RoundCore, "reduce", "reduce"), (rounds.RoundCore, "agree", "agree"), (step.Steps, "optimizer_step", "optimizer step"),
        (planning.DomainPlanner, "take", "plan"), (verl_engine, "batch_digest", "digest"),
        (lib_engine, "batch_digest", "digest")]
    from megatron.core.pipeline_parallel import schedules

    wraps += [(schedules, "forward_step", "model forward (+loss)"), (schedules, "backward_step", "model backward")]
    for owner, name, label in wraps:
        _wrap(owner, name, label, acc, door)
    budget = 512
    lengths = bench.short_tail_lengths(world, budget, 0)
    data = bench.verl_update_batch(lengths, 0, max_token_len_per_gpu=budget)

    losses = types.SimpleNamespace(ppo_loss=ppo_loss)
    _wrap(losses, "ppo_loss", "verl's ppo_loss", acc, door)
    loss_fn = functools.partial(losses.ppo_loss, bench.actor_config("token-mean"))
    mc.initialize_megatron(device="cpu", seed=1234)
    lib, eng = bench.doors_engines(budget)
    lib_batch = bench.library_batch(lengths, data)
    doors: dict[str, Callable[[], Any]] = {
        "verl": lambda: eng.train_batch(data.clone(recurse=False), loss_fn),
        "library": lambda: lib.train_step(lib_batch, bench.library_ppo_loss)}
    for run in doors.values():  # untimed: first calls, the optimizer's state
        run()
    gc_start: list[float] = [0.0, 0.0]

    def gc_timer(phase: str, info: dict[str, Any]) -> None:  # the garbage collector's time, by generation
        if phase == "start":
            gc_start[:] = [time.perf_counter(), time.process_time()]
            return
        label = f"gc gen{info['generation']}"
        acc[f"{door[0]}|{label}|wall"] += time.perf_counter() - gc_start[0]
        acc[f"{door[0]}|{label}|cpu"] += time.process_time() - gc_start[1]
        acc[f"{door[0]}|{label}|calls"] += 1

    gc.callbacks.append(gc_timer)
    acc.clear()
    times: dict[str, list[float]] = {k: [] for k in doors}
    for i in range(steps):
        for name in (list(doors) if i % 2 == 0 else list(doors)[::-1]):
            door[0] = name
            dist.barrier(group=dist.group.WORLD)
            t0, c0 = time.perf_counter(), time.process_time()
            doors[name]()
            times[name].append(time.perf_counter() - t0)
            acc[f"{name}|step|cpu"] += time.process_time() - c0
    gc.callbacks.remove(gc_timer)
    lib.close()
    per_step: dict[str, dict[str, dict[str, float]]] = {}
    for key, value in acc.items():
        name, label, kind = key.split("|")
        scale = 1.0 / steps if kind == "calls" else 1000.0 / steps
        per_step.setdefault(label, {}).setdefault(name, {})[kind] = value * scale
    return {"step_s_median": {k: statistics.median(v) for k, v in times.items()}, "per_step": per_step}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, choices=(2, 4))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per door (default 10)")
    parser.add_argument("--json", action="store_true", help="print one JSON list (one entry per rank)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be >= 1")
    from hdp.trainer.launch import spawn

    ranks = spawn(_rank, args.ranks, args.steps, timeout=900)
    if args.json:
        print(json.dumps(ranks))
        return 0
    for r, res in enumerate(ranks):
        med = res["step_s_median"]
        print(f"rank {r}: median step verl {med['verl']:.4f} s, library {med['library']:.4f} s "
              f"({med['verl'] / med['library']:.3f}x); ms per step, wall (CPU), calls per step:")
        for label, by_door in sorted(res["per_step"].items()):
            cells = [f"{d} {v.get('wall', 0.0):7.1f} ({v.get('cpu', 0.0):6.1f}) x{v.get('calls', 0.0):4.1f}"
                     if (v := by_door.get(d)) else f"{d} {'-':>22}" for d in ("verl", "library")]
            print(f"  {label:22s} " + "   ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
