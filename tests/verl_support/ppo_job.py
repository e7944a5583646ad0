"""Files and overrides for a tiny GRPO run of ``python -m verl.trainer.main_ppo`` on CPU with the hdp engine.

:func:`prepare` writes a tiny Qwen3 (``save_pretrained``), a parquet set of arithmetic prompts in
verl's RLHF format and a reward function; :func:`command` returns the ``main_ppo`` command line
(2 steps, 2 ranks, GRPO with 2 samples per prompt, ``model_engine=hdp``, the ``hf_cpu`` test rollout)
and :func:`environment` the environment every Ray process needs.  Test-only.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["prepare", "command", "environment"]

_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """1.0 when the answer's digits appear in the response (a toy reward)."""
    return float(str(ground_truth) in solution_str.replace(" ", ""))
'''


def prepare(root: str | Path, *, n_prompts: int = 8) -> dict[str, str]:
    """Write model, data and reward under ``root``; returns their paths."""
    import pandas as pd

    from verl_support.tiny import build_tiny

    root = Path(root)
    model = build_tiny(root / "model")
    rows = []
    for i in range(n_prompts):
        a, b = i + 1, 2 * i + 3
        rows.append({
            "data_source": "toy_sum",
            "prompt": [{"role": "user", "content": f"what is {a} + {b} ?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"index": i},
        })
    data = root / "train.parquet"
    pd.DataFrame(rows).to_parquet(data)
    reward = root / "reward.py"
    reward.write_text(_REWARD)
    return {"model": str(model), "data": str(data), "reward": str(reward), "out": str(root / "out")}


def command(paths: dict[str, str], *, steps: int = 2, ranks: int = 2) -> list[str]:
    """``python -m verl.trainer.main_ppo`` with the overrides of the tiny CPU GRPO run."""
    budget = 256
    return [
        sys.executable, "-m", "verl.trainer.main_ppo",
        "algorithm.adv_estimator=grpo",
        "model_engine=hdp",
        f"data.train_files={paths['data']}",
        f"data.val_files={paths['data']}",
        "data.train_batch_size=4",
        "data.max_prompt_length=32",
        "data.max_response_length=16",
        "data.filter_overlong_prompts=False",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={paths['model']}",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={budget}",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={budget}",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.megatron.vanilla_mbridge=True",
        "actor_rollout_ref.actor.megatron.dtype=float32",
        "actor_rollout_ref.ref.megatron.dtype=float32",
        "actor_rollout_ref.actor.hdp.cost_model=cpu-tiny",
        "actor_rollout_ref.actor.hdp.hardware_profile=cpu-gloo",
        "actor_rollout_ref.rollout.name=hf_cpu",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"reward.custom_reward_function.path={paths['reward']}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.logger=['console']",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.total_training_steps={steps}",
        f"trainer.n_gpus_per_node={ranks}",
        "trainer.nnodes=1",
        f"trainer.default_local_dir={paths['out']}",
        "trainer.device=cpu",
        "ray_kwargs.ray_init.num_cpus=16",  # logical slots: TaskRunner, TransferQueue, workers, servers
        "+ray_kwargs.ray_init.include_dashboard=False",
        f"+ray_kwargs.ray_init.resources={{NPU:{ranks}}}",  # logical slots (see verl_support.platform)
    ]


def environment() -> dict[str, str]:
    """The driver's environment: Ray workers started from it inherit these (CPU platform, autoload)."""
    tests = str(Path(__file__).resolve().parents[1])
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]),
        "VERL_PLATFORM": "cpu",
        "VERL_USE_EXTERNAL_MODULES": "verl_support.autoload",
        "RAY_DEDUP_LOGS": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
    }
