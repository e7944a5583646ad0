"""The verl rows of ``hdp bench faults``: one rank's failure inside verl's ``update_actor`` on the hdp engine.

Found by ``hdp bench faults`` through the ``hdp.faults`` entry point (the trainer never imports the
integrations).  2 CPU ranks run verl's own ``ActorRolloutRefWorker`` (tiny Qwen3, vanilla mbridge)
and, on rank 1 only, inject:

* ``verl-planning-runtime-error``: planning raises ``RuntimeError`` (not an input error);
* ``verl-loss-fn-raises``: verl's loss function raises in a round;
* ``verl-nan-loss``: verl's loss is NaN on rank 1's groups — as verl's FSDP engine, the update is skipped
  on every rank and ``grad_norm`` is NaN (nothing raises; ``ok`` also needs both).

Each row is :func:`hdp.trainer.bench.faults._row`'s, with ``state_unchanged`` from a sha256 of every
parameter and optimizer-state tensor before and after the call.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["verl_faults"]

_LENGTHS = [(5, 9), (3, 60), (7, 12), (4, 20), (6, 4), (2, 30)]
_BUDGET = 48


def _digest(engine: Any) -> str:
    h = hashlib.sha256()
    for chunk in engine.module:
        for name, p in chunk.named_parameters():
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for entry in opt.optimizer.state.values():
            for key in sorted(entry):
                v = entry[key]
                if isinstance(v, torch.Tensor):
                    h.update(v.detach().cpu().contiguous().reshape(-1).numpy().tobytes())
    return h.hexdigest()


def _worker(rank: int, world: int, workdir: str, timeout_s: float) -> dict[str, Any]:
    import sys

    sys.stdout.flush()
    os.dup2(2, 1)  # verl and mbridge print to stdout; ``hdp bench faults --json`` keeps stdout for its JSON
    from hdp.integrations.verl.cpu import install
    from hdp.integrations.verl.cpu.worker import actor_worker, compose, environment_for_rank

    environment_for_rank(rank, world)
    install()
    import logging

    from verl.utils import tensordict_utils as tu
    from verl.utils.metric.utils import reduce_metrics as verl_reduce_metrics

    from hdp.integrations.verl.cpu import batches as B
    from hdp.integrations.verl.cpu.tiny import VOCAB, build_tiny

    logging.getLogger("verl").setLevel(logging.ERROR)
    model = os.path.join(workdir, "model")
    if rank == 0:
        build_tiny(model)
    dist.barrier(group=dist.group.WORLD)
    cfg = compose(model, budget=_BUDGET, records=None, overrides=[
        f"actor_rollout_ref.actor.ppo_mini_batch_size={len(_LENGTHS)}",
        "actor_rollout_ref.actor.hdp.cost_model=cpu-tiny@cpu-gloo",
        f"actor_rollout_ref.actor.hdp.collective_timeout_s={timeout_s}",
    ])
    act = actor_worker(cfg)
    engine = act.actor.engine
    samples = B.random_samples(_LENGTHS, VOCAB, seed=1)
    padded = B.padded_batch(samples, pad_id=0)
    old = act.compute_log_prob(B.old_logp_batch(padded))
    objs = [B_logp(old, padded) if engine.is_mp_src_rank_with_outputs() else None]
    src = [None] * world
    dist.all_gather_object(src, engine.is_mp_src_rank_with_outputs(), group=dist.group.WORLD)
    dist.broadcast_object_list(objs, src=src.index(True), group=dist.group.WORLD)
    adv = torch.randn(padded["responses"].shape, generator=torch.Generator().manual_seed(3)) * padded["response_mask"]
    extra = {"old_log_probs": objs[0], "advantages": adv, "ref_log_prob": objs[0]}

    def update() -> Any:
        out = act.update_actor(B.update_batch(padded, extra, mini_batch_size=len(_LENGTHS)))
        return verl_reduce_metrics(tu.get(out, "metrics")) if out is not None else None

    update()  # a good step first: the optimizer holds state from here on

    def inject(kind: str) -> Callable[[], None]:
        def undo() -> None:
            engine.__dict__.pop("_make_plan", None)
            engine.__dict__.pop("train_batch", None)

        if rank != 1:
            return undo
        if kind == "planning":
            def broken(data: Any, train: bool = True) -> Any:
                raise RuntimeError("injected: planning crashed on rank 1")
            engine._make_plan = broken
            return undo
        real = type(engine).train_batch.__get__(engine)

        def train_batch(data: Any, loss_function: Callable) -> Any:
            def loss(*a: Any, **k: Any) -> Any:
                value, metrics = loss_function(*a, **k)
                if kind == "raises":
                    raise RuntimeError("injected: verl loss function bug on rank 1")
                return value * float("nan"), metrics
            return real(data, loss)

        engine.train_batch = train_batch
        return undo

    out: dict[str, Any] = {}
    for name, kind in (("verl-planning-runtime-error", "planning"), ("verl-loss-fn-raises", "raises"),
                       ("verl-nan-loss", "nan")):
        undo = inject(kind)
        before = _digest(engine)
        t0 = time.time()
        err, metrics = None, None
        try:
            metrics = update()
        except BaseException as exc:  # noqa: BLE001 - the report names every type
            err = exc
        finally:
            undo()
        out[name] = {"raised": err is not None, "seconds": time.time() - t0, "unchanged": _digest(engine) == before,
                     "error": None if err is None else f"{type(err).__name__}: {err}".splitlines()[0][:300],
                     "grad_norm": None if metrics is None else float(metrics.get("grad_norm", math.nan)),
                     "skipped": None if metrics is None else float(metrics.get("hdp/nonfinite_skipped", 0.0))}
    m = update()  # the engine is still usable and in step
    out["after"] = {"finite": m is None or math.isfinite(float(m["grad_norm"]))}
    return out


def B_logp(out: Any, padded: Any) -> torch.Tensor:
    """verl's padded old log-probs from a ``compute_log_prob`` output (the collect rank's)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from hdp.integrations.verl.cpu import batches as B

    return no_padding_2_padding(tu.get(out, "log_probs"), B.ref_batch(padded)).float()


def verl_faults(*, timeout_s: float = 10.0, workdir: str | None = None) -> list[dict[str, Any]]:
    """Run the verl fault rows (2 ranks); returns ``hdp bench faults`` rows."""
    import tempfile

    from hdp.trainer.bench.faults import _row
    from hdp.trainer.launch import spawn

    work = Path(workdir or tempfile.mkdtemp(prefix="hdp-verl-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    res = spawn(_worker, 2, str(work), timeout_s, timeout=600.0)
    rows = []
    for fault in ("verl-planning-runtime-error", "verl-loss-fn-raises", "verl-nan-loss"):
        per = {r: res[r][fault] for r in range(2)}
        if fault == "verl-nan-loss":  # verl semantics: skipped everywhere, nothing raised
            row = _row(fault, 2, {r: {**v, "raised": True} for r, v in per.items()}, [], timeout_s)
            grad = [v["grad_norm"] for v in per.values() if v["grad_norm"] is not None]
            row["ranks_raised"] = sorted(r for r, v in per.items() if v["raised"])
            row["skipped_with_nan_grad_norm"] = bool(grad) and all(math.isnan(g) for g in grad)
            row["ok"] = bool(row["state_unchanged"] and not row["ranks_raised"] and row["skipped_with_nan_grad_norm"])
        else:
            row = _row(fault, 2, per, [], timeout_s)
        row["ok"] = bool(row["ok"] and row["seconds_to_exit"] <= 5.0)
        rows.append(row)
    rows[-1]["usable_after"] = all(res[r]["after"]["finite"] for r in range(2))
    return rows
