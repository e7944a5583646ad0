"""The distributed tier (other processes) of the tests tests/unit/verl/test_verl_loss_kinds.py describes: its docstring says what they check and how."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

"""verl 0.9.0 (the other supported release differs in one loss: its GSPO aggregates with seq-mean-token-mean)."""


# ---- config time: verl's validate_config in the driver ------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "match"), [
    (["actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean"], None),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov"], r"actor_rollout_ref\.actor\.policy_loss\.loss_mode=kl_cov"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov"], r"actor_rollout_ref\.actor\.policy_loss\.loss_mode=clip_cov"),
    (["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"], r"Set actor_rollout_ref\.actor\.loss_scale_factor"),
    (["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm", "actor_rollout_ref.actor.loss_scale_factor=512"], None),
    # verl's legacy trainer turns bypass mode into the bypass_mode policy loss, whose batch normalisation all-reduces
    (["trainer.use_v1=false", "actor_rollout_ref.rollout.calculate_log_probs=true",
      "algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=token",
      "algorithm.rollout_correction.rollout_is_batch_normalize=true"], r"rollout_is_batch_normalize=True.*refused"),
    (["trainer.use_v1=false", "actor_rollout_ref.rollout.calculate_log_probs=true",
      "algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=token"], None),
])
def test_the_driver_refuses_losses_that_depend_on_the_plan(overrides, match):
    """verl's own ``validate_config`` (as ``main_ppo`` calls it, before Ray starts), with the plugin's checks."""
    import os

    from hydra import compose, initialize_config_dir

    import verl.trainer.config as vtc
    from hdp.integrations.verl import plugin  # noqa: F401  (registers hdp, as `import verl` would)
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    with initialize_config_dir(config_dir=os.path.dirname(vtc.__file__), version_base=None):
        cfg = compose("ppo_trainer", overrides=[
            "algorithm.adv_estimator=grpo", "model_engine=hdp", "actor_rollout_ref.model.path=/tmp/none",
            "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096", "trainer.n_gpus_per_node=2",
            "actor_rollout_ref.actor.megatron.vanilla_mbridge=true", *overrides])
    run = lambda: validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))  # noqa: E731
    if match is None:
        run()
    else:
        with pytest.raises(ValueError, match=match):
            run()
