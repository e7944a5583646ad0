"""The actor's old-log-prob pass, skipped when it is redundant (``actor_rollout_ref.actor.hdp.skip_old_log_prob``).

On an on-policy step — one mini-batch covering the whole batch, one PPO epoch — the policy that made the
"old" log-probs is the one the update starts from, so verl's separate forward over every sample
(``_compute_old_log_prob``) computes exactly what the update's own forward computes a moment later.  When
nothing reads the old log-probs between the two, the pass is skipped and the update uses its own forward's
log-probs, detached, as the old ones: the PPO ratio is exactly 1, the gradient the one the pass would have
given (to round-off).  The metrics the pass reports stay: ``actor/entropy`` is the update's entropy of the
same batch under the same weights (the update then computes the entropy even with ``entropy_coeff`` 0), and
``actor/hdp/old_log_prob_skipped`` says which way the step ran.

What reads the old log-probs before the update is read off verl's driver (verl 0.9.1's v1 trainer,
``trainer/ppo/v1/trainer_base.py``), one rule per reader, all in `needed_by` (the job's config) and
`needed_at_step` (what only the step knows); `VERL_READERS` names each of verl's functions that touches the
pass's outputs and the rule that covers it (a test fails when verl grows a reader nobody classified):

* ``_compute_advantage``: the KL in the reward (``algorithm.use_kl_in_reward``); rollout correction — its
  importance weights (``rollout_is``), rejection mask (``rollout_rs``) and ``rollout_corr/*`` metrics, computed
  whenever the rollout returned its log-probs (``rollout_log_probs`` in the batch, which verl's rollouts do
  when ``rollout.calculate_log_probs``); and the advantage estimator, when its function in verl's registry
  (``core_algos.ADV_ESTIMATOR_REGISTRY``) takes one of the pass's outputs, a value derived from them, or the
  whole batch (`estimator_reads_pass`: the optimal-token baselines today, GDPO's whole batch);
* ``_compute_old_log_prob``: the rollout-vs-actor metrics (``rollout.calculate_log_probs``), and
  ``actor/entropy``, which the update reports instead only on a step that updates the actor
  (``trainer.critic_warmup``);
* the worker's update, which must run as one on-policy update (``ppo_epochs``, ``ppo_mini_batch_size``) and
  reads the pass's outputs in distillation and R2 router replay (routes recorded in that pass);
* bypass mode (``rollout_correction.bypass_mode``) has no pass to skip, and verl's other trainers (the
  legacy v0 trainer, separate- and fully-async) keep theirs.

Driver side (verl's v1 trainer, ``trainer.use_v1=true``, sync mode): `parse_option` reads the option (the one
parser, used by the option's own check too), `resolve` turns it into the job's decision (``true`` with a
reason is a config error naming the keys), and each step `skip_step` either writes the stand-in —
``old_log_probs`` as NaN, so that a forward that did not substitute them fails loudly instead of training on a
placeholder — or, when `needed_at_step` names a reason, leaves the pass to run.  `SKIP_FLAG` rides on that
step's update.  Worker side: `check_update` before the update trains (one on-policy update, and nothing the
driver derived from the stand-ins: ``rollout_is_weights``, or a NaN in a field the driver wrote after the pass,
is an error naming the option), then `substitute` in hdp's loss adapter.  Installed by
:func:`hdp.integrations.verl.patches.skip_redundant_old_log_prob`.
"""

from __future__ import annotations

import enum
import inspect
from typing import Any, Iterable

__all__ = ["SKIP_FLAG", "OPTION", "PASS_OUTPUTS", "DERIVED", "VERL_READERS", "SkipOldLogProb", "parse_option",
           "needed_by", "needed_at_step", "estimator_reads_pass", "resolve", "skip_step", "check_update", "substitute"]

SKIP_FLAG = "hdp_old_log_probs_from_update"
"""Non-tensor key on the update's batch: the driver skipped the old-log-prob pass; use the update's own."""
OPTION = "actor_rollout_ref.actor.hdp.skip_old_log_prob"
"""The option's verl key."""


class SkipOldLogProb(str, enum.Enum):
    """The option's values (`parse_option` reads every spelling of them)."""

    AUTO = "auto"
    """Skip the pass exactly when it is redundant."""
    TRUE = "true"
    """Skip it; a config error naming the keys when the job needs it."""
    FALSE = "false"
    """Always run it."""


_SPELLINGS = {"auto": SkipOldLogProb.AUTO, "true": SkipOldLogProb.TRUE, "1": SkipOldLogProb.TRUE,
              "false": SkipOldLogProb.FALSE, "0": SkipOldLogProb.FALSE}

PASS_OUTPUTS = ("old_log_probs", "entropy", "sum_pi_squared")
"""What verl's old-log-prob pass writes to the batch (``entropy`` and ``sum_pi_squared``: its by-products)."""
DERIVED = ("rollout_is_weights",)
"""What verl's driver derives from the pass's outputs before the update (rollout correction's weights)."""
_DRIVER_WRITES = ("advantages", "returns", "token_level_rewards", "rollout_is_weights")
"""The float fields verl's ``_compute_advantage`` writes back after the pass, the update's inputs that a reader
of the stand-ins would have made NaN (``response_mask`` too, but an integer mask holds no NaN)."""

VERL_READERS = {
    "verl.trainer.ppo.v1.trainer_base:_compute_old_log_prob": "the pass itself (its rollout-vs-actor metrics: "
    "rollout.calculate_log_probs; its actor/entropy: trainer.critic_warmup; bypass mode copies the rollout's)",
    "verl.trainer.ppo.v1.trainer_base:_compute_advantage": "algorithm.use_kl_in_reward, rollout correction "
    "(rollout_is, rollout_rs, rollout_log_probs in the batch) and the advantage estimator (estimator_reads_pass)",
    "verl.trainer.ppo.ray_trainer:apply_kl_penalty": "algorithm.use_kl_in_reward",
    "verl.trainer.ppo.ray_trainer:compute_advantage": "the advantage estimator (estimator_reads_pass)",
    "verl.trainer.ppo.ray_trainer:_compute_old_log_prob": "the legacy v0 trainer, which keeps the pass",
    "verl.trainer.ppo.ray_trainer:fit": "the legacy v0 trainer, which keeps the pass",
    "verl.trainer.ppo.metric_utils:compute_variance_proxy_metrics": "the legacy v0 trainer, which keeps the pass",
    "verl.trainer.ppo.rollout_corr_helper": "rollout correction (rollout_is, rollout_rs, rollout_log_probs in "
    "the batch; bypass mode)",
    "verl.trainer.ppo.core_algos": "the estimators (estimator_reads_pass) and the update's policy losses (on "
    "the substituted log-probs; rollout_is_weights only where rollout correction kept the pass)",
    "verl.trainer.distillation.losses:distillation_loss": "distillation.enabled",
    "verl.utils.debug.metrics:calculate_debug_metrics": "rollout.calculate_log_probs (the rollout-vs-actor metrics)",
}
"""Each function (``module:function``, or a whole module) of verl's ``trainer`` and ``utils`` packages that names a
field of `PASS_OUTPUTS` or `DERIVED` (a string key or a parameter), and the rule of `needed_by` /
`needed_at_step` that keeps the pass for it; tests/unit/verl/test_verl_old_log_prob.py
tests/slow/verl/test_verl_old_log_prob_slow.py reads verl's source and fails on
a reader missing here (the workers' engines and losses read them during the update, after `substitute`)."""


def parse_option(value: Any, field: str = OPTION) -> SkipOldLogProb:
    """The option's value as a `SkipOldLogProb`: ``auto``, ``true``/``false`` (any case), booleans and ``1``/``0``
    (numbers or strings, as Hydra's command line hands them); ValueError naming ``field`` otherwise."""
    if isinstance(value, SkipOldLogProb):
        return value
    if isinstance(value, bool):
        return SkipOldLogProb.TRUE if value else SkipOldLogProb.FALSE
    key = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if key not in _SPELLINGS:
        raise ValueError(f"{field}={value!r}: pass auto, true or false (1 and 0 read as true and false)")
    return _SPELLINGS[key]


def _get(config: Any, key: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, key, default=default) if OmegaConf.is_config(config) else default
    return default if value is None else value


def estimator_reads_pass(name: str) -> str | None:
    """Why verl's advantage estimator ``name`` reads the old-log-prob pass's outputs, or None when it does not:
    read off its function in verl's registry (``core_algos.get_adv_estimator_fn``), whose parameters are what
    verl's ``compute_advantage`` may hand it — one of `PASS_OUTPUTS` or `DERIVED`, or ``batch`` (the whole
    batch, the pass's outputs included).  An estimator verl's registry does not know is taken to read them."""
    try:
        from verl.trainer.ppo import core_algos

        fn = core_algos.get_adv_estimator_fn(name)
    except (ImportError, ValueError, KeyError):
        return "not in verl's advantage-estimator registry: hdp cannot tell whether it reads them"
    params = set(inspect.signature(fn).parameters)
    reads = sorted(params & {*PASS_OUTPUTS, *DERIVED})
    if reads:
        return f"its function {fn.__name__} takes {', '.join(reads)}"
    if "batch" in params:
        return f"its function {fn.__name__} takes the whole batch, the pass's outputs included"
    return None


def _rollout_correction(config: Any) -> Any:
    return _get(config, "algorithm.rollout_correction")


def needed_by(config: Any) -> list[str]:
    """What in the job's config (verl's whole OmegaConf config) makes the old-log-prob pass necessary, each as
    ``key=value (why)``; empty when the step is on-policy and nothing reads the old log-probs before the update
    (the module docstring lists the readers; `needed_at_step` adds what only a step knows)."""
    reasons: list[str] = []
    epochs = int(_get(config, "actor_rollout_ref.actor.ppo_epochs", 1))
    if epochs != 1:
        reasons.append(f"actor_rollout_ref.actor.ppo_epochs={epochs} (later epochs train on a moved policy)")
    mini, batch = _get(config, "actor_rollout_ref.actor.ppo_mini_batch_size"), _get(config, "data.train_batch_size")
    if mini is not None and batch is not None and int(mini) < int(batch):
        reasons.append(f"actor_rollout_ref.actor.ppo_mini_batch_size={mini} < data.train_batch_size={batch} (later "
                       "mini-batches train on a moved policy)")
    rc = "algorithm.rollout_correction"
    if bool(_get(config, f"{rc}.bypass_mode", False)):
        reasons.append(f"{rc}.bypass_mode=True (the rollout's log-probs are the old ones: there is no pass to skip)")
    if _rollout_correction(config) is not None:
        is_level, rs = _get(config, f"{rc}.rollout_is"), _get(config, f"{rc}.rollout_rs")
        if is_level is not None:
            reasons.append(f"{rc}.rollout_is={is_level} (its importance weights read the old log-probs)")
        if rs is not None:
            reasons.append(f"{rc}.rollout_rs={rs} (its rejection mask reads the old log-probs)")
    if bool(_get(config, "algorithm.use_kl_in_reward", False)):
        reasons.append("algorithm.use_kl_in_reward=True (the reward's KL reads the old log-probs before the update)")
    if bool(_get(config, "actor_rollout_ref.rollout.calculate_log_probs", False)):
        reasons.append("actor_rollout_ref.rollout.calculate_log_probs=True (rollout correction and the "
                       "rollout-vs-actor metrics read the old log-probs before the update)")
    est = str(_get(config, "algorithm.adv_estimator", ""))
    why = estimator_reads_pass(est) if est else None
    if why is not None:
        reasons.append(f"algorithm.adv_estimator={est} ({why})")
    if bool(_get(config, "distillation.enabled", False)):
        reasons.append("distillation.enabled=True (the distillation loss reads the pass's outputs)")
    if str(_get(config, "actor_rollout_ref.actor.megatron.router_replay.mode", "disabled")) == "R2":
        reasons.append("actor_rollout_ref.actor.megatron.router_replay.mode=R2 (routes are recorded in that pass)")
    if not bool(_get(config, "trainer.use_v1", True)) or str(_get(config, "trainer.v1.trainer_mode", "sync")) != "sync":
        reasons.append(f"trainer.use_v1={_get(config, 'trainer.use_v1', True)}, trainer.v1.trainer_mode="
                       f"{_get(config, 'trainer.v1.trainer_mode', 'sync')} (hdp skips the pass in verl's v1 sync "
                       "trainer only)")
    return reasons


def needed_at_step(config: Any, fields: Iterable[str], global_steps: int) -> list[str]:
    """What only the step knows that makes its pass necessary (a job `resolve` lets skip it): the rollout
    returned its log-probs (``rollout_log_probs`` among the batch's ``fields``), from which verl's
    ``_compute_advantage`` computes rollout correction against the old log-probs outside bypass mode; or the
    step trains no actor (``trainer.critic_warmup`` > ``global_steps``), so ``actor/entropy`` comes from the pass."""
    reasons: list[str] = []
    if "rollout_log_probs" in set(fields) and _rollout_correction(config) is not None \
            and not bool(_get(config, "algorithm.rollout_correction.bypass_mode", False)):
        reasons.append("the rollout returned its log-probs (rollout_log_probs): verl's rollout correction reads the "
                       "old log-probs against them (rollout_corr/* metrics)")
    warmup = int(_get(config, "trainer.critic_warmup", 0))
    if warmup > int(global_steps):
        reasons.append(f"trainer.critic_warmup={warmup} (step {global_steps} trains no actor: actor/entropy comes "
                       "from the pass)")
    return reasons


def resolve(config: Any) -> bool:
    """Whether this job skips the actor's old-log-prob pass (`OPTION`, read by `parse_option`) on the steps that
    allow it (`needed_at_step`); ValueError naming the keys when ``true`` but the job needs the pass (`needed_by`).
    False when the actor does not run on hdp."""
    if str(_get(config, "actor_rollout_ref.actor.strategy", "")) != "hdp":
        return False
    want = parse_option(_get(config, OPTION, "auto"))
    if want is SkipOldLogProb.FALSE:
        return False
    reasons = needed_by(config)
    if want is SkipOldLogProb.TRUE and reasons:
        raise ValueError(f"{OPTION}=true, but this job needs the old-log-prob pass: {'; '.join(reasons)}. Set "
                         f"{OPTION}=auto (skip it only when it is redundant) or false, or change those keys")
    return not reasons


def skip_step(batch: Any, config: Any, global_steps: int) -> list[str]:
    """verl's v1 ``_compute_old_log_prob`` on a step of a job that skips the pass (`resolve`): the reasons this
    step needs the pass after all (`needed_at_step`; nothing written: the caller runs it), or none once
    ``old_log_probs`` is written to the TransferQueue as NaN (the update replaces them by its own; a forward
    that did not would fail its non-finite check instead of training on a placeholder)."""
    import torch
    import transfer_queue as tq

    # a field the batch lacks is left out (verl's own _compute_advantage asks for optional ones alike)
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                           select_fields=["response_mask", "rollout_log_probs"])
    reasons = needed_at_step(config, data.keys(), global_steps)
    if reasons:
        return reasons
    mask = data["response_mask"]  # nested [S, response_i]
    if getattr(mask, "is_nested", False):
        old = torch.nested.nested_tensor_from_jagged(torch.full_like(mask.values(), float("nan"), dtype=torch.float32),
                                                     mask.offsets())
    else:
        old = torch.full_like(mask, float("nan"), dtype=torch.float32)
    data["old_log_probs"] = old
    tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=data.select("old_log_probs"))
    return []


def check_update(data: Any, mini_batch_size: int, epochs: int) -> None:
    """Before the worker's loop trains a batch that carries `SKIP_FLAG`: it must train as one on-policy update —
    one mini-batch covering the batch, one epoch (what the driver decided from the config; a batch padded past
    the mini-batch size would train a second one on a moved policy) — and nothing in it may come from the
    skipped pass's NaN stand-ins: ``rollout_is_weights`` (rollout correction read them) or a NaN in a float
    field the driver writes after the pass (``advantages``, ``returns``, ...: some reader hdp did not foresee).
    ValueError naming the option otherwise, on every rank alike (each holds the whole batch), before any
    collective of the update."""
    import torch

    from verl.utils import tensordict_utils as tu

    if not tu.get_non_tensor_data(data, key=SKIP_FLAG, default=False):
        return
    n = int(data.batch_size[0])
    if int(epochs) != 1 or int(mini_batch_size) < n:
        raise ValueError(f"{OPTION}: the old-log-prob pass was skipped, but this update trains {epochs} epoch(s) of "
                         f"mini-batches of {mini_batch_size} over {n} samples (off-policy after the first); set "
                         f"{OPTION}=false")
    keys = set(data.keys())
    found = [f"{k} (computed from them)" for k in DERIVED if k in keys]
    for key in _DRIVER_WRITES:
        if key in keys and key not in DERIVED:
            t = data[key]
            values = t.values() if getattr(t, "is_nested", False) else t
            if torch.is_tensor(values) and values.is_floating_point() and bool(torch.isnan(values).any()):
                found.append(f"NaN in {key}")
    if found:
        raise ValueError(f"{OPTION}: the old-log-prob pass was skipped (its old_log_probs are NaN stand-ins), but the "
                         f"update's batch carries {', '.join(found)}: something in verl's driver read the stand-ins "
                         f"that hdp's decision (old_log_prob.needed_by, needed_at_step) missed; set {OPTION}=false")

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
