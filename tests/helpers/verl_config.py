"""Definitions more than one test module needs (a test module never imports another), moved out of
test_verl_config.py; used by tests/distributed/verl/test_verl_config_dist.py,
tests/unit/verl/test_verl_config.py."""

from __future__ import annotations

import os

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import open_dict  # noqa: E402

import verl.trainer.config as verl_trainer_config  # noqa: E402
from verl.trainer.ppo.utils import need_critic, need_reference_policy  # noqa: E402
from verl.utils.config import omega_conf_to_dataclass, validate_config  # noqa: E402

VERL_CONFIG_DIR = os.path.dirname(verl_trainer_config.__file__)

# what every GRPO run sets anyway (verl's ppo_trainer leaves micro-batch sizes unset)
BASE = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.actor.use_kl_loss=true",  # turns the reference model on
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
]


def _compose(config_name: str, overrides: list[str], config_path: str = VERL_CONFIG_DIR):
    with initialize_config_dir(config_dir=config_path, version_base=None):
        return compose(config_name, overrides=overrides)


def _ref_config(cfg):
    """The ref's dataclass exactly as ActorRolloutRefWorker.init_model builds it (engine_workers.py:546-560)."""
    ref = cfg.actor_rollout_ref.ref.copy()
    with open_dict(ref):
        ref.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
    return omega_conf_to_dataclass(ref)


def _engine_cls(engine_config):
    """The class verl's TrainingWorker would construct for this engine config (through the lazy entry)."""
    from verl.workers.engine import EngineRegistry

    cls = EngineRegistry.get_engine_cls("language_model", engine_config.strategy)
    return cls.resolve() if getattr(cls, "_hdp_lazy", False) else cls


def _validate(cfg) -> None:
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
