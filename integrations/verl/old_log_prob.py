"""The actor's old-log-prob pass, skipped when it is redundant (``actor_rollout_ref.actor.hdp.skip_old_log_prob``).

On an on-policy step — one mini-batch covering the whole batch, one PPO epoch — the policy that made the
"old" log-probs is the one the update starts from, so verl's separate forward over every sample
(``_compute_old_log_prob``) computes exactly what the update's own forward computes a moment later.  When
nothing reads the old log-probs between the two (KL in the reward, the rollout-vs-actor metrics and
rollout correction, optimal-token-baseline advantages, distillation, R2 router recording), the pass is
skipped and the update uses its own forward's log-probs, detached, as the old ones: the PPO ratio is
exactly 1, the gradient the one the pass would have given (to round-off).  The metrics the pass reports
stay: ``actor/entropy`` is the update's entropy of the same batch under the same weights (the update then
computes the entropy even with ``entropy_coeff`` 0), and ``actor/hdp/old_log_prob_skipped`` says which
way the step ran.

Driver side (verl's v1 trainer, ``trainer.use_v1=true``, sync mode): `needed_by` lists what makes the pass
necessary, `resolve` turns ``auto``/``true``/``false`` into a decision (``true`` with a reason is a config
error naming the keys), `skip_pass` stands in for the pass (``old_log_probs`` written as NaN: a forward that
did not substitute them fails loudly, never trains on a placeholder) and `SKIP_FLAG` rides on the update's
batch.  Worker side: `substitute` in hdp's loss adapter.  verl's other trainers (the legacy v0 trainer,
separate- and fully-async) keep the pass.  Installed by :func:`hdp.integrations.verl.compat.skip_redundant_old_log_prob`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SKIP_FLAG", "OPTION", "needed_by", "resolve", "skip_pass", "substitute", "check_mini_batch"]

SKIP_FLAG = "hdp_old_log_probs_from_update"
"""Non-tensor key on the update's batch: the driver skipped the old-log-prob pass; use the update's own."""
OPTION = "actor_rollout_ref.actor.hdp.skip_old_log_prob"
"""The option's verl key."""
_ESTIMATORS_READING_OLD = ("optimal_token_baseline", "tir_optimal_token_baseline")
"""verl 0.9.1's advantage estimators that read ``old_log_probs`` (and ``sum_pi_squared``) from the pass."""


def _get(config: Any, key: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, key, default=default) if OmegaConf.is_config(config) else default
    return default if value is None else value


def needed_by(config: Any) -> list[str]:
    """What in the job's config (verl's whole OmegaConf config) makes the old-log-prob pass necessary, each as
    ``key=value (why)``; empty when the step is on-policy and nothing reads the old log-probs before the update."""
    reasons: list[str] = []
    epochs = int(_get(config, "actor_rollout_ref.actor.ppo_epochs", 1))
    if epochs != 1:
        reasons.append(f"actor_rollout_ref.actor.ppo_epochs={epochs} (later epochs train on a moved policy)")
    mini, batch = _get(config, "actor_rollout_ref.actor.ppo_mini_batch_size"), _get(config, "data.train_batch_size")
    if mini is not None and batch is not None and int(mini) < int(batch):
        reasons.append(f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} < data.train_batch_size={batch} (later "
                       "mini-batches train on a moved policy)")
    if bool(_get(config, "algorithm.rollout_correction.bypass_mode", False)):
        reasons.append("algorithm.rollout_correction.bypass_mode=True (the rollout's log-probs are the old ones: "
                       "there is no pass to skip)")
    if bool(_get(config, "algorithm.use_kl_in_reward", False)):
        reasons.append("algorithm.use_kl_in_reward=True (the reward's KL reads the old log-probs before the update)")
    if bool(_get(config, "actor_rollout_ref.rollout.calculate_log_probs", False)):
        reasons.append("actor_rollout_ref.rollout.calculate_log_probs=True (rollout correction and the "
                       "rollout-vs-actor metrics read the old log-probs before the update)")
    est = str(_get(config, "algorithm.adv_estimator", ""))
    if est in _ESTIMATORS_READING_OLD:
        reasons.append(f"algorithm.adv_estimator={est} (its advantages read the old log-probs)")
    if bool(_get(config, "distillation.enabled", False)):
        reasons.append("distillation.enabled=True (the distillation loss reads the pass's outputs)")
    if str(_get(config, "actor_rollout_ref.actor.megatron.router_replay.mode", "disabled")) == "R2":
        reasons.append("actor_rollout_ref.actor.megatron.router_replay.mode=R2 (routes are recorded in that pass)")
    if not bool(_get(config, "trainer.use_v1", True)) or str(_get(config, "trainer.v1.trainer_mode", "sync")) != "sync":
        reasons.append(f"trainer.use_v1={_get(config, 'trainer.use_v1', True)}, trainer.v1.trainer_mode="
                       f"{_get(config, 'trainer.v1.trainer_mode', 'sync')} (hdp skips the pass in verl's v1 sync "
                       "trainer only)")
    return reasons


def resolve(config: Any) -> bool:
    """Whether this job skips the actor's old-log-prob pass (`OPTION`: ``auto``, ``true``, ``false``); ValueError
    naming the keys when ``true`` but the pass is needed.  False when the actor does not run on hdp."""
    if str(_get(config, "actor_rollout_ref.actor.strategy", "")) != "hdp":
        return False
    want = _get(config, OPTION, "auto")
    if want is False or str(want).lower() == "false":
        return False
    reasons = needed_by(config)
    if want is True or str(want).lower() == "true":
        if reasons:
            raise ValueError(f"{OPTION}=true, but this job needs the old-log-prob pass: {'; '.join(reasons)}. Set "
                             f"{OPTION}=auto (skip it only when it is redundant) or false, or change those keys")
        return True
    return not reasons


def skip_pass(batch: Any) -> Any:
    """verl's v1 ``_compute_old_log_prob`` when the pass is skipped: ``old_log_probs`` written to the
    TransferQueue as NaN (the update replaces them by its own; a forward that did not would fail its
    non-finite check instead of training on a placeholder).  Returns ``batch`` like verl's method."""
    import torch
    import transfer_queue as tq

    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["response_mask"])
    mask = data["response_mask"]  # nested [S, response_i]
    if getattr(mask, "is_nested", False):
        old = torch.nested.nested_tensor_from_jagged(torch.full_like(mask.values(), float("nan"), dtype=torch.float32),
                                                     mask.offsets())
    else:
        old = torch.full_like(mask, float("nan"), dtype=torch.float32)
    data["old_log_probs"] = old
    return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=data.select("old_log_probs"))


def check_mini_batch(data: Any, mini_batch_size: int, epochs: int) -> None:
    """When the update's batch carries `SKIP_FLAG`, the worker's loop must train it as one on-policy update:
    one mini-batch covering the batch, one epoch (what the driver decided from the config; a batch padded past
    the mini-batch size would train a second one on a moved policy).  ValueError naming the option otherwise."""
    from verl.utils import tensordict_utils as tu

    if not tu.get_non_tensor_data(data, key=SKIP_FLAG, default=False):
        return
    n = int(data.batch_size[0])
    if int(epochs) != 1 or int(mini_batch_size) < n:
        raise ValueError(f"{OPTION}: the old-log-prob pass was skipped, but this update trains {epochs} epoch(s) of "
                         f"mini-batches of {mini_batch_size} over {n} samples (off-policy after the first); set "
                         f"{OPTION}=false")


def substitute(sub: Any, log_probs: Any) -> None:
    """Put the update's own log-probs, detached, in place of the skipped pass's ``old_log_probs`` of ``sub`` (a
    group's rows of the batch), in the layout verl's loss pads them from.  ``log_probs``: the group's nested
    [S, L_i] input-aligned log-probs (verl's ``model_output["log_probs"]``)."""
    import torch

    from verl.workers.utils.padding import no_padding_2_padding

    lp = no_padding_2_padding(log_probs, sub).detach()  # [S, R]: what verl's loss compares them with
    old = sub["old_log_probs"]
    if getattr(old, "is_nested", False):  # per-sample responses
        sizes = old.offsets().diff().tolist()
        rows = [lp[i, :n].to(old.dtype) for i, n in enumerate(sizes)]
        sub["old_log_probs"] = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    else:
        new = torch.zeros_like(old)
        width = min(new.shape[1], lp.shape[1])
        new[:, :width] = lp[:, :width].to(new.dtype)
        sub["old_log_probs"] = new
