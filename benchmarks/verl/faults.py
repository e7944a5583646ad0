"""The verl rows of ``python -m benchmarks faults``: one rank's failure inside verl's ``update_actor`` on the hdp engine.

Run by ``python -m benchmarks faults`` (`benchmarks.faults`) where verl is installed.  2 CPU ranks run verl's own ``ActorRolloutRefWorker`` (tiny Qwen3, vanilla mbridge)
and, on rank 1 only, inject:

* ``verl-planning-runtime-error``: planning raises ``RuntimeError`` (not an input error);
* ``verl-loss-fn-raises``: verl's loss function raises in a round;
* ``verl-nan-loss``: verl's loss is NaN on rank 1's groups — as verl's FSDP engine, the update is skipped
  on every rank and ``grad_norm`` is NaN (nothing raises; ``ok`` also needs both, and
  ``hdp/nonfinite_skipped`` = 1);
* ``verl-nan-gradient``: verl's loss stays finite on rank 1 but its gradient is NaN (``+ sqrt(0 · loss)``):
  skipped on every rank alike, ``grad_norm`` NaN, ``hdp/nonfinite_skipped`` = 1;
* ``verl-actor-checkpoint-into-critic``, ``verl-critic-checkpoint-into-actor``: a checkpoint of the other role
  loaded through verl's workers (the critic's ``TrainingWorker`` is built beside the actor): refused on every
  rank before anything is written (``hdp.core.checkpoint.check_fit``), naming the first differing tensor
  (``names_tensor``), nothing changed; ``usable_after``: the engine's own checkpoint loads and it trains on;
* ``verl-consecutive-skips-raise``: verl's loss is NaN on three updates in a row (``hdp.max_consecutive_skips``,
  3): the first two are skipped as above, the third raises ``SkippedUpdatesError`` on every rank, naming the
  count and the first skip's cause, with nothing applied (verl's own engines would skip on and exit 0);
* ``verl-rollout-correction-keeps-pass``: with ``algorithm.rollout_correction.rollout_is=token`` the driver's
  decision (`hdp.integrations.verl.old_log_prob.resolve`) keeps the old-log-prob pass, and the update it then
  sends — the pass's old log-probs and verl's own importance weights against the rollout's — is applied with a
  finite ``grad_norm`` (nothing raises; ``ok`` needs all of it);
* ``verl-skipped-pass-read-by-driver``: what that job did before the decision kept the pass — an update flagged
  as having skipped it whose batch carries ``rollout_is_weights`` computed from the NaN stand-ins — raises
  ``ValueError`` on every rank naming ``skip_old_log_prob``, with nothing applied (before: every update was
  skipped with ``grad_norm`` NaN and the job exited 0);
* ``verl-own-error-in-round`` (last: the engine is unusable after it): rank 1 raises inside a round's
  forward and its process lives on, as a Ray actor does; every rank raises naming it within seconds: the
  peer is blocked in a CP ring on hdp's copy of the domain group, which the failing rank frees.  (On gloo
  a peer blocked on one of Megatron's groups — a TP all-reduce, a pipeline send; none at this row's TP 1,
  PP 1 — would wait ``hdp.collective_timeout_s``: verl's worker holds the model and optimizer that hold
  those groups, so hdp cannot free them.)

Each row is :func:`benchmarks.faults.fault_row`'s, with ``state_unchanged`` from a sha256 of every
parameter and optimizer-state tensor before and after the call.
"""

from __future__ import annotations

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


def _held(engine: Any) -> list[tuple[str, torch.Tensor]]:
    from benchmarks.faults import state_tensors

    return state_tensors(engine.module, engine.optimizer)


def _digest(held: list[tuple[str, torch.Tensor]]) -> str:
    from benchmarks.faults import digest_of

    return digest_of(held)


def _worker(rank: int, world: int, workdir: str, timeout_s: float) -> dict[str, Any]:
    import sys

    sys.stdout.flush()
    os.dup2(2, 1)  # verl and mbridge print to stdout; ``python -m benchmarks faults --json`` keeps stdout for its JSON
    from hdp.integrations.verl.scaffolding.worker import actor_worker, compose, critic_worker, prepare_rank

    model = prepare_rank(rank, world, workdir)
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric.utils import reduce_metrics as verl_reduce_metrics

    from hdp.integrations.verl import old_log_prob
    from hdp.integrations.verl.scaffolding import batches as B
    from hdp.integrations.verl.scaffolding.tiny import VOCAB

    cfg = compose(model, budget=_BUDGET, records=None, overrides=[
        f"actor_rollout_ref.actor.ppo_mini_batch_size={len(_LENGTHS)}",
        "actor_rollout_ref.actor.hdp.cost_model=cpu-tiny@cpu-gloo",
        f"actor_rollout_ref.actor.hdp.collective_timeout_s={timeout_s}",
        f"critic.model.path={model}", "critic.model.use_remove_padding=True", "critic.megatron.dtype=float32",
        f"critic.ppo_max_token_len_per_gpu={_BUDGET}", f"critic.ppo_mini_batch_size={len(_LENGTHS)}",
        "critic.optim.total_training_steps=10",
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
    batch_extra: dict[str, Any] = {}  # what the next update's batch carries besides (set by a row, then cleared)

    def update() -> Any:
        batch = B.update_batch(padded, {**extra, **batch_extra.get("tensors", {})}, mini_batch_size=len(_LENGTHS))
        if batch_extra.get("flag"):
            tu.assign_non_tensor(batch, **{old_log_prob.SKIP_FLAG: True})
        out = act.update_actor(batch)
        return verl_reduce_metrics(tu.get(out, "metrics")) if out is not None else None

    update()  # a good step first: the optimizer holds state from here on

    def inject(kind: str) -> Callable[[], None]:
        def undo() -> None:
            engine.planner.__dict__.pop("take", None)
            engine.__dict__.pop("train_batch", None)

        # verl's loss function runs on each group's first rank (the others of a CP group get its gradient):
        # the loss faults go on rank 0, which starts a group in every round here; the others on rank 1
        if rank != (0 if kind in ("raises", "detached", "nan", "nan-grad") else 1):
            return undo
        if kind == "forward":
            calls = {"n": 0}

            def hook(module: Any, args: Any) -> None:
                calls["n"] += 1
                if calls["n"] == 2:
                    raise RuntimeError("injected: out of memory in a round's forward on rank 1")

            from hdp.integrations.verl import compat

            compat.unwrap_model(engine.module[0]).decoder.layers[0].register_forward_pre_hook(hook)
            return undo
        if kind == "planning":  # the step's planning (made ahead or in line: DomainPlanner.take)
            def broken(*a: Any, **k: Any) -> Any:
                raise RuntimeError("injected: planning crashed on rank 1")
            engine.planner.take = broken
            return undo
        real = type(engine).train_batch.__get__(engine)

        def train_batch(data: Any, loss_function: Callable) -> Any:
            def loss(*a: Any, **k: Any) -> Any:
                value, metrics = loss_function(*a, **k)
                if kind == "raises":
                    raise RuntimeError(f"injected: verl loss function bug on rank {rank}")
                if kind == "detached":  # a loss built from .item() or under no_grad
                    return value.detach(), metrics
                if kind == "nan-grad":  # the loss stays finite (+ sqrt(0) = 0), its gradient is NaN (inf x 0)
                    return value + torch.sqrt(value * 0.0), metrics
                return value * float("nan"), metrics
            return real(data, loss)

        engine.train_batch = train_batch
        return undo

    def attempt(kind: str, call: Callable[[], Any] | None = None, on: Any = None) -> dict[str, Any]:
        undo = inject(kind) if call is None and kind else (lambda: None)
        held = _held(on if on is not None else engine)
        before = _digest(held)
        t0 = time.time()
        err, metrics = None, None
        try:
            metrics = update() if call is None else call()
        except BaseException as exc:  # noqa: BLE001 - the report names every type
            err = exc
        finally:
            undo()
        batch_extra.clear()
        return {"raised": err is not None, "seconds": time.time() - t0, "unchanged": _digest(held) == before,
                "error": None if err is None else f"{type(err).__name__}: {err}".splitlines()[0][:300],
                "grad_norm": None if metrics is None else float(metrics.get("grad_norm", math.nan)),
                "skipped": None if metrics is None else float(metrics.get("hdp/nonfinite_skipped", 0.0))}

    out: dict[str, Any] = {}
    for name, kind in (("verl-planning-runtime-error", "planning"), ("verl-loss-fn-raises", "raises"),
                       ("verl-loss-fn-detached", "detached"), ("verl-nan-loss", "nan"), ("verl-nan-gradient", "nan-grad")):
        out[name] = attempt(kind)
    m = update()  # the engine is still usable and in step
    out["after"] = {"finite": m is None or math.isfinite(float(m["grad_norm"]))}
    # a checkpoint of the other role: the critic (verl's value model) beside the actor, each saved after a step
    critic, _ = critic_worker(cfg)
    mask = padded["response_mask"].float()
    values = {"values": 0 * mask, "returns": torch.randn(mask.shape, generator=torch.Generator().manual_seed(4)) * mask}

    def critic_update() -> Any:
        return critic.train_mini_batch(B.critic_update_batch(padded, values, mini_batch_size=len(_LENGTHS)))

    critic_update()
    for name, worker in (("actor", act), ("critic", critic)):
        worker.save_checkpoint(str(Path(workdir, f"ckpt-{name}")), global_step=1)
    for row, worker, own, other, step in (
            ("verl-actor-checkpoint-into-critic", critic, "critic", "actor", critic_update),
            ("verl-critic-checkpoint-into-actor", act, "actor", "critic", update)):
        load = worker.load_checkpoint
        out[row] = attempt("", lambda: load(str(Path(workdir, f"ckpt-{other}")), del_local_after_load=False),
                           on=critic.engine if own == "critic" else engine)
        usable = _error_of(lambda: (load(str(Path(workdir, f"ckpt-{own}")), del_local_after_load=False), step()))
        out[row]["usable_after"] = usable is None
    # a run of NaN updates: the first ones skipped as verl's, the max_consecutive_skips-th raises on every rank
    limit = int(cfg.actor_rollout_ref.actor.hdp.max_consecutive_skips)
    for _ in range(limit - 1):
        attempt("nan")
    out["verl-consecutive-skips-raise"] = attempt("nan")
    m = update()
    out["verl-consecutive-skips-raise"]["usable_after"] = m is None or math.isfinite(float(m["grad_norm"]))
    out["verl-consecutive-skips-raise"]["limit"] = limit
    # rollout correction: the driver keeps the pass, and the update it sends (the pass's old log-probs, verl's
    # importance weights against the rollout's log-probs) is applied
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    corrected = compose(model, budget=_BUDGET, records=None, overrides=[
        f"actor_rollout_ref.actor.ppo_mini_batch_size={len(_LENGTHS)}", f"data.train_batch_size={len(_LENGTHS)}",
        "actor_rollout_ref.rollout.calculate_log_probs=false", "algorithm.rollout_correction.rollout_is=token"])
    rollout = objs[0] + 0.05 * torch.randn(objs[0].shape, generator=torch.Generator().manual_seed(4))
    weights, _, _ = compute_rollout_correction_and_rejection_mask(objs[0], rollout, padded["response_mask"],
                                                                  rollout_is="token", rollout_is_threshold=2.0)
    batch_extra["tensors"] = {"rollout_is_weights": weights.batch["rollout_is_weights"]}
    row = attempt("")
    row["pass_kept"] = old_log_prob.resolve(corrected) is False and any(
        "rollout_is=token" in r for r in old_log_prob.needed_by(corrected))
    out["verl-rollout-correction-keeps-pass"] = row
    # before that decision: the pass skipped (NaN stand-ins, the flag) and verl's weights computed from them
    nan = torch.full_like(objs[0], float("nan"))
    stand_in, _, _ = compute_rollout_correction_and_rejection_mask(nan, rollout, padded["response_mask"],
                                                                   rollout_is="token", rollout_is_threshold=2.0)
    batch_extra.update(flag=True, tensors={"old_log_probs": nan,
                                           "rollout_is_weights": stand_in.batch["rollout_is_weights"]})
    out["verl-skipped-pass-read-by-driver"] = attempt("")
    # last (the engine is unusable after it): rank 1 raises inside a round's forward, the shape an
    # out-of-memory takes, and its process (a Ray actor) lives on until rank 0 has left
    out["verl-own-error-in-round"] = attempt("forward")
    Path(workdir, f"left-{rank}").write_text("")
    deadline = time.time() + 2 * timeout_s + 30.0
    while rank == 1 and time.time() < deadline and not Path(workdir, "left-0").exists():
        time.sleep(0.05)
    return out


def _error_of(fn: Callable[[], Any]) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the report names it
        return exc
    return None


def B_logp(out: Any, padded: Any) -> torch.Tensor:
    """verl's padded old log-probs from a ``compute_log_prob`` output (the collect rank's)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from hdp.integrations.verl.scaffolding import batches as B

    return no_padding_2_padding(tu.get(out, "log_probs"), B.ref_batch(padded)).float()


def verl_faults(*, timeout_s: float = 10.0, workdir: str | None = None) -> list[dict[str, Any]]:
    """Run the verl fault rows (2 ranks); returns ``python -m benchmarks faults`` rows."""
    import tempfile

    from benchmarks.faults import fault_row
    from hdp.trainer.launch import spawn

    work = Path(workdir or tempfile.mkdtemp(prefix="hdp-verl-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    res = spawn(_worker, 2, str(work), timeout_s, timeout=600.0)
    rows = []
    for fault in ("verl-planning-runtime-error", "verl-loss-fn-raises", "verl-loss-fn-detached", "verl-nan-loss",
                  "verl-nan-gradient", "verl-actor-checkpoint-into-critic", "verl-critic-checkpoint-into-actor",
                  "verl-consecutive-skips-raise", "verl-rollout-correction-keeps-pass",
                  "verl-skipped-pass-read-by-driver", "verl-own-error-in-round"):
        per = {r: res[r][fault] for r in range(2)}
        if fault == "verl-rollout-correction-keeps-pass":  # nothing raises: the pass kept, the update applied
            row = fault_row(fault, 2, {r: {**v, "raised": True, "unchanged": True} for r, v in per.items()}, [], timeout_s)
            row["ranks_raised"] = sorted(r for r, v in per.items() if v["raised"])
            row["state_unchanged"] = all(v["unchanged"] for v in per.values())
            row["pass_kept"] = all(v["pass_kept"] for v in per.values())
            grad = [v["grad_norm"] for v in per.values() if v["grad_norm"] is not None]
            row["applied_with_finite_grad_norm"] = bool(grad) and all(math.isfinite(g) for g in grad) and not any(
                v["unchanged"] for v in per.values())
            row["ok"] = bool(not row["ranks_raised"] and row["pass_kept"] and row["applied_with_finite_grad_norm"])
        elif fault in ("verl-nan-loss", "verl-nan-gradient"):  # verl semantics: skipped everywhere, nothing raised
            row = fault_row(fault, 2, {r: {**v, "raised": True} for r, v in per.items()}, [], timeout_s)
            grad = [v["grad_norm"] for v in per.values() if v["grad_norm"] is not None]
            row["ranks_raised"] = sorted(r for r, v in per.items() if v["raised"])
            row["skipped_with_nan_grad_norm"] = bool(grad) and all(math.isnan(g) for g in grad)
            skipped = [v["skipped"] for v in per.values() if v["skipped"] is not None]
            row["nonfinite_skipped_metric"] = bool(skipped) and all(x == 1.0 for x in skipped)
            row["ok"] = bool(row["state_unchanged"] and not row["ranks_raised"] and row["skipped_with_nan_grad_norm"]
                             and row["nonfinite_skipped_metric"])
        else:
            row = fault_row(fault, 2, per, [], timeout_s)
        row["ok"] = bool(row["ok"] and row["seconds_to_exit"] <= 5.0)
        rows.append(row)
    by_name = {row["fault"]: row for row in rows}
    by_name["verl-nan-loss"]["usable_after"] = by_name["verl-nan-gradient"]["usable_after"] = all(
        res[r]["after"]["finite"] for r in range(2))
    for fault in ("verl-actor-checkpoint-into-critic", "verl-critic-checkpoint-into-actor"):
        row = by_name[fault]
        row["names_tensor"] = all("does not fit this engine" in (res[r][fault]["error"] or "")
                                  and "entry 'lm_head.weight'" in (res[r][fault]["error"] or "") for r in range(2))
        row["usable_after"] = all(res[r][fault]["usable_after"] for r in range(2))
        row["ok"] = bool(row["ok"] and row["names_tensor"] and row["usable_after"])
    runs = by_name["verl-consecutive-skips-raise"]
    runs["usable_after"] = all(res[r]["verl-consecutive-skips-raise"]["usable_after"] for r in range(2))
    runs["names_count_and_first_cause"] = all(
        "SkippedUpdatesError" in e and f"{res[0]['verl-consecutive-skips-raise']['limit']} updates in a row" in e
        and "max_consecutive_skips" in e and "The first skip, at step" in e
        for e in (v["error"] or "" for v in (res[r]["verl-consecutive-skips-raise"] for r in range(2))))
    runs["ok"] = bool(runs["ok"] and runs["usable_after"] and runs["names_count_and_first_cause"])
    read = by_name["verl-skipped-pass-read-by-driver"]
    read["names_option"] = all(
        "ValueError" in (e or "") and "skip_old_log_prob" in (e or "") and "rollout_is_weights" in (e or "")
        for e in (res[r]["verl-skipped-pass-read-by-driver"]["error"] for r in range(2)))
    read["ok"] = bool(read["ok"] and read["names_option"])
    own = by_name["verl-own-error-in-round"]
    own["names_rank_and_error"] = all("world rank 1" in (v["error"] or "") and "injected" in (v["error"] or "")
                                      for v in (res[r]["verl-own-error-in-round"] for r in range(2)))
    own["ok"] = bool(own["ok"] and own["names_rank_and_error"])
    return rows
