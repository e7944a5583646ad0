"""verl's own ``ActorRolloutRefWorker`` on CPU ranks with the hdp engine: config and construction.

For the worker-path tests and ``hdp bench faults`` (the verl rows): the door a verl user takes —
verl's Hydra ``ppo_trainer`` config with ``model_engine=hdp``, ``omega_conf_to_dataclass`` and the
worker's ``init_model`` (vanilla mbridge building the model from an HF checkpoint) — on a tiny
model.  Call :func:`hdp.integrations.verl.scaffolding.install` first in the process.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

__all__ = ["prepare_rank", "compose", "actor_worker", "critic_worker", "environment_for_rank"]


def environment_for_rank(rank: int, world: int) -> None:
    """The environment variables verl's worker reads (torch.distributed is already initialised): every rank
    on this one machine, as verl's Ray worker group says it (``RAY_LOCAL_WORLD_SIZE``: ranks per node).
    Without it verl's ``Worker`` sets ``LOCAL_WORLD_SIZE=1``, which would put each rank on a node of its own."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="0", LOCAL_RANK="0",
                      RAY_LOCAL_WORLD_SIZE=str(world))


def prepare_rank(rank: int, world: int, root: str, *, moe: bool = False, layers: int = 2) -> str:
    """One rank of a verl worker run on CPU (tests, fault rows): verl's environment (`environment_for_rank`), the
    CPU scaffolding installed, verl's logger quiet, and the tiny model (`tiny.build_tiny`) saved under
    ``root/model`` by rank 0 while the others wait on the world group.  Returns the model's path."""
    import logging

    import torch.distributed as dist

    from hdp.integrations.verl.scaffolding import install
    from hdp.integrations.verl.scaffolding.tiny import build_tiny

    environment_for_rank(rank, world)
    install()
    logging.getLogger("verl").setLevel(logging.ERROR)
    path = os.path.join(root, "model")
    if rank == 0:
        build_tiny(path, moe=moe, layers=layers)
    dist.barrier(group=dist.group.WORLD)
    return path


def compose(model_path: str, *, budget: int, records: str | None, overrides: Sequence[str] = ()) -> Any:
    """verl's ``ppo_trainer`` with ``model_engine=hdp`` for a tiny fp32 model on CPU, plus ``overrides``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import verl.trainer.config as vtc

    base = [
        "algorithm.adv_estimator=grpo",
        "model_engine=hdp",
        f"actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={budget}",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={budget}",
        "actor_rollout_ref.actor.megatron.vanilla_mbridge=true",
        "actor_rollout_ref.actor.megatron.dtype=float32",
        "actor_rollout_ref.ref.megatron.dtype=float32",
        "actor_rollout_ref.actor.optim.total_training_steps=100",
        f"actor_rollout_ref.actor.hdp.calibration_path={records if records is not None else 'null'}",
    ]
    with initialize_config_dir(config_dir=os.path.dirname(vtc.__file__), version_base=None):
        return hydra_compose("ppo_trainer", overrides=[*base, *overrides])


def actor_worker(cfg: Any, role: str = "actor") -> Any:
    """verl's ``ActorRolloutRefWorker`` for ``role`` with its model built (collective over the world)."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role=role)
    worker.init_model()
    return worker


def critic_worker(cfg: Any) -> tuple[Any, Any]:
    """verl's critic: a ``TrainingWorker`` of ``model_type="value_model"`` built from ``cfg.critic`` as verl's
    v1 trainer builds it (``trainer/ppo/v1/trainer_base.py``: both token budgets from
    ``ppo_infer_max_token_len_per_gpu``, ``reset``, verl's ``value_loss``); returns (worker, critic config)."""
    from functools import partial

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import value_loss

    critic_cfg = omega_conf_to_dataclass(cfg.critic)
    critic_cfg.engine.infer_max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu
    critic_cfg.engine.max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu
    worker = TrainingWorker(TrainingWorkerConfig(
        model_type="value_model", model_config=critic_cfg.model, engine_config=critic_cfg.engine,
        optimizer_config=critic_cfg.optim, checkpoint_config=critic_cfg.checkpoint))
    worker.reset()
    worker.set_loss_fn(partial(value_loss, config=critic_cfg))
    return worker, critic_cfg
